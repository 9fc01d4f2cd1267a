"""Following a growing file: the bytes written since the last read, split into whole lines.

The file is never read twice: the follower keeps its offset, holds a half-written last line
until its newline arrives, and bounds what it holds (a line longer than
:data:`~lossbeat.logs.source.MAX_LINE_CHARS` is dropped and counted). A file that does not
exist yet is waited for; a file replaced under the same name (``logrotate``, a job that
recreates its log) or cut shorter than what was read (``copytruncate``, a restarted job
overwriting it) is read again from its start, and the reset is reported to the caller.
Torch-free.
"""

from __future__ import annotations

import os
import re
from typing import BinaryIO

from lossbeat.logs.source import MAX_LINE_CHARS

__all__ = ["Follower", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 20
"""Bytes read per call: a long backlog is replayed in bounded pieces."""
_HEAD_BYTES = 4096
"""The file's first bytes, kept to see it rewritten from its start (truncated, then grown past the offset;
a CSV rewritten whole with a wider header, as stable-baselines3 does: its header line is in them)."""
_SPLIT = re.compile(rb"\r\n|\r|\n")  # as iter_lines: \n, \r\n and progress bars' bare \r


class Follower:
    """Reads ``path`` as it grows. :meth:`poll` returns the whole lines written since the last call.

    ``from_start=False`` (``--tail``) skips what the file holds when it is first opened.
    ``resets`` counts reopenings from the start (rotation, truncation); ``overlong`` the
    lines dropped for their length; ``replay_until`` is the size the file had when first
    opened (the lines before it are the backlog, replayed, not live).
    """

    def __init__(self, path: str | os.PathLike, *, from_start: bool = True) -> None:
        self.path = os.fspath(path)
        self.from_start = from_start
        self._fh: BinaryIO | None = None
        self._inode: tuple[int, int] | None = None
        self.offset = 0
        """Bytes of the current file consumed (whole lines plus the held partial line)."""
        self._partial = b""
        self._dropping = False  # inside an overlong line: skip to its end
        self._head = b""
        self.resets = 0
        self.overlong = 0
        self.replay_until: int | None = None
        self.last_growth: float | None = None
        """st_mtime of the file when bytes were last read (None before any)."""

    @property
    def opened(self) -> bool:
        return self._fh is not None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _open(self, first: bool) -> bool:
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return False
        st = os.fstat(fh.fileno())
        self._fh, self._inode = fh, (st.st_dev, st.st_ino)
        self._partial, self._dropping = b"", False
        self.offset = 0
        self._head = b""
        if first:
            self.replay_until = st.st_size if self.from_start else 0
            if not self.from_start:
                self.offset = st.st_size
                fh.seek(st.st_size)
        return True

    def poll(self) -> tuple[list[str], bool]:
        """``(lines, reset)``: the whole lines written since the last call (at most about
        :data:`CHUNK_BYTES`), and whether the file was reopened from its start before them."""
        reset = False
        if self._fh is None:
            if not self._open(first=self.replay_until is None):
                return [], False
        else:
            try:
                st = os.stat(self.path)
                moved = (st.st_dev, st.st_ino) != self._inode
            except FileNotFoundError:  # rotated away, the new file not created yet: finish the old one
                st, moved = None, False
            if moved:
                lines = self._read()  # what the old file still held after the last read
                if lines:
                    return lines, False
                self.close()
                if not self._open(first=False):
                    return [], False
                reset = True
            elif st is not None and (st.st_size < self.offset or not self._same_start()):
                # cut shorter than what was read, or cut and rewritten past it between two reads
                self._fh.seek(0)
                self.offset, self._partial, self._dropping, self._head = 0, b"", False, b""
                reset = True
        if reset:
            self.resets += 1
        return self._read(), reset

    def _same_start(self) -> bool:
        """Whether the file still begins with the bytes read from its start (one small read)."""
        if not self._head:
            return True
        assert self._fh is not None  # poll() reads only an open file
        try:
            return os.pread(self._fh.fileno(), len(self._head), 0) == self._head
        except OSError:
            return True

    def _read(self) -> list[str]:
        fh = self._fh
        assert fh is not None  # poll() reads only an open file
        data = fh.read(CHUNK_BYTES)
        if not data:
            return []
        if len(self._head) < _HEAD_BYTES and self.offset == len(self._head):
            self._head += data[: _HEAD_BYTES - len(self._head)]
        self.offset += len(data)
        try:
            self.last_growth = os.fstat(fh.fileno()).st_mtime
        except OSError:
            pass
        parts = _SPLIT.split(self._partial + data)
        self._partial = parts.pop()  # after the last newline: half written (b"" when none)
        lines = []
        for raw in parts:
            if self._dropping:  # the end of an overlong line
                self._dropping = False
                continue
            lines.append(raw.decode("utf-8", errors="replace"))
        if len(self._partial) > 4 * MAX_LINE_CHARS:  # bounded: an endless line is no record
            self._partial, self._dropping = b"", True
            self.overlong += 1
        return [line for line in lines if len(line) <= MAX_LINE_CHARS or self._count_overlong()]

    def _count_overlong(self) -> bool:
        self.overlong += 1
        return False
