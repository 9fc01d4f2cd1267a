"""The ``lossbeat stack`` folder: this user's own, never a shared, predictable name in /tmp.

A folder in a world-writable /tmp that another user made first, or a symlink planted where the
stack would write, would let one user create or clobber another's files (``targets.tmp`` ->
``~victim/...``). :func:`private_dir` refuses both before anything is read or written there.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["UnsafeDirError", "private_dir", "default_dir"]


class UnsafeDirError(RuntimeError):
    """The stack folder is not this user's own: the message says why and what to do."""


def private_dir(path: Path, *, create: bool = True) -> Path:
    """``path`` as a folder only this user can write: created with mode 0700 if absent (never
    through a symlink), else it must be a real directory (not a symlink), owned by this user and
    writable by no one else. Anything else raises :class:`UnsafeDirError`: in a shared /tmp a
    folder someone else made, or a symlink planted there, would redirect the stack's writes."""
    path = Path(path)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)  # fails on anything already there, a dangling symlink included
        except FileExistsError:
            pass
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        if create:
            raise
        return path
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirError(
            f"{path} is {'a symlink' if stat.S_ISLNK(info.st_mode) else 'not a directory'}; "
            "pass --dir with a folder of your own"
        )
    if info.st_uid != os.getuid():
        raise UnsafeDirError(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); pass --dir with a folder of your own"
        )
    if info.st_mode & 0o022:
        raise UnsafeDirError(
            f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"chmod 700 {path} or pass --dir with a folder of your own"
        )
    return path


def default_dir() -> Path:
    """``$XDG_RUNTIME_DIR/lossbeat-stack`` (a per-user 0700 folder) when it is set and safe,
    else ``<tmp>/lossbeat-stack-<uid>``: never one name shared by every user."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            info = os.lstat(runtime)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
                return Path(runtime) / "lossbeat-stack"
        except OSError:
            pass
    return Path(tempfile.gettempdir()) / f"lossbeat-stack-{os.getuid()}"
