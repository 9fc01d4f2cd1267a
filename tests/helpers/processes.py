"""Stopping a child process with everything it started: torchrun's ranks run in sessions of their
own (torch.distributed.elastic starts each with ``start_new_session``), so neither killing the
launcher nor its process group stops them, and a stalled job would leave its ranks running and
holding the cores for the rest of the suite."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["descendants", "kill_tree"]


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, read from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        ppid = int(stat.rpartition(")")[2].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it, then reap ``proc``."""
    below = descendants(proc.pid)  # read before the kill: orphans are re-parented to init
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
