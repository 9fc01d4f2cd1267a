"""How a watched run ended, where the log does not say: the training command's exit status.

A log format without an end marker (nanoGPT, Lightning's ``metrics.csv``, OLMo-core, nanochat)
cannot tell a run that finished from one that died. Whoever started the training step can:

- ``lossbeat watch LOG -- CMD ...``: the watcher runs the command itself and takes its status;
- ``--end-file F``: a file the launcher writes once the command exited, holding its status
  (``srun ... ; echo $? > F``, or a container's ``sh -c 'train ...; echo $? > /logs/status'``);
- ``--pid PID``: the run ends when that process does; a process that is not the watcher's child
  cannot tell its exit status, so without an end file the run is closed as not completed.

Torch-free.
"""

from __future__ import annotations

import os
import subprocess
import time

__all__ = ["RunEnd", "UNKNOWN"]

UNKNOWN = -1
"""The status of a run whose process ended without telling how (``--pid`` without an end file)."""
_END_FILE_GRACE = 10.0
"""Seconds ``--pid`` waits, once the process is gone, for the end file its launcher writes."""


class RunEnd:
    """The end of the training step, polled by the watchers: :meth:`status` is None while it runs."""

    def __init__(self, command: list[str] | None = None, pid: int | None = None, end_file: str | None = None) -> None:
        self.child = subprocess.Popen(command) if command else None
        self.pid = pid
        self.end_file = end_file
        self._gone_at: float | None = None

    @property
    def watched(self) -> bool:
        return bool(self.child or self.pid or self.end_file)

    def _file_status(self) -> int | None:
        if not self.end_file:
            return None
        try:
            with open(self.end_file, encoding="utf-8") as fh:
                text = fh.read().strip()
        except OSError:
            return None
        try:
            return int(text)
        except ValueError:
            return None  # being written, or not a status: not yet

    def _pid_alive(self, pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's process: it exists
        return True

    def status(self) -> int | None:
        """The exit status once the training step ended (0: it ended well; :data:`UNKNOWN`: it
        ended without telling), None while it runs."""
        if self.child is not None:
            code = self.child.poll()
            return None if code is None else code
        found = self._file_status()
        if found is not None:
            return found
        if self.pid is not None and not self._pid_alive(self.pid):
            self._gone_at = self._gone_at or time.monotonic()
            if not self.end_file or time.monotonic() - self._gone_at > _END_FILE_GRACE:
                return UNKNOWN
        return None

    def stop(self) -> None:
        """The watcher is interrupted: leave the command running (it is the job, not the watcher's)."""
