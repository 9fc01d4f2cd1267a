"""Self-registration for batch schedulers: each rank writes its own Prometheus file_sd entry.

With ``LOSSBEAT_FILE_SD_DIR`` (or ``MonitorConfig.file_sd_dir``) set to a folder that
Prometheus watches (``file_sd_configs: [{files: ["DIR/*.json"]}]``), every serving rank
writes ``lossbeat-<host>-<pid>-<port>.json`` there: one target group with its *real* address
(the fallback port when its base port was taken) and the labels ``job``, ``node`` and
``slurm_job_id``. The rank, the owning process (host, pid, process start time) and the
start wall time ride along as ``__meta_lossbeat_*`` labels: visible to relabelling, never
stored as series labels (a pid label would make new series at every restart; a ``rank``
target label would rename the exporter's own ``rank`` to ``exported_rank``).

The entry is written atomically (a temporary file renamed over it) and removed on
``close()``, at normal interpreter exit (atexit) and on SIGTERM (any handler installed
before is called after, and the default action still ends the process). A process that
dies without cleanup (SIGKILL, OOM kill, node crash) leaves its entry: the owner fields
make it recognisable, and :func:`prune` (``lossbeat targets prune DIR``, also run by every
rank when it registers) removes entries of this host whose process is gone or whose pid
now belongs to another process, and with ``slurm_job_id`` every entry of a finished job.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = ["ENV_DIR", "Owner", "Registration", "register", "read_entries", "prune", "add_arguments", "run"]

log = logging.getLogger("lossbeat")

ENV_DIR = "LOSSBEAT_FILE_SD_DIR"
ENV_HOST = "LOSSBEAT_FILE_SD_HOST"
"""The host name Prometheus should scrape (default: the bound address, or this host's name)."""
ENV_JOB = "LOSSBEAT_JOB"
"""The ``job`` label (default: the run name, else ``SLURM_JOB_NAME``)."""
PREFIX = "lossbeat-"
META = "__meta_lossbeat_"
_STALE_TMP_S = 60.0  # a temporary file older than this was left by a writer that died
_WILDCARD = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Owner:
    """The process that wrote an entry: enough to tell a live writer from a dead or reused pid."""

    host: str
    pid: int
    start_ticks: int | None
    """The process start time in clock ticks since boot (/proc/PID/stat field 22), or None."""

    @classmethod
    def current(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), process_start_ticks(os.getpid()))

    def alive(self) -> bool | None:
        """Whether the process still runs; None when it lives on another host (unknowable here)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by another user
        if self.start_ticks is None:
            return True
        return process_start_ticks(self.pid) == self.start_ticks  # a different start: the pid was reused


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        # Field 2 (comm) may contain spaces and parentheses: count from the last ')'.
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _entry_path(directory: Path, owner: Owner, port: str) -> Path:
    # The port too: two serving monitors in one process must not share (and remove) one entry.
    return directory / f"{PREFIX}{_safe(owner.host)}-{owner.pid}-{_safe(port)}.json"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:100]


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # Prometheus never reads half a file
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Registration:
    """One rank's file_sd entry; removed by :meth:`remove` (idempotent), atexit and SIGTERM."""

    def __init__(self, directory: str | os.PathLike, target: str, labels: dict[str, str],
                 rank: int, *, handle_sigterm: bool = True) -> None:
        self.directory = Path(directory)
        self.owner = Owner.current()
        self.path = _entry_path(self.directory, self.owner, target.rsplit(":", 1)[-1])
        self.target = target
        meta = {
            f"{META}rank": str(rank),
            f"{META}host": self.owner.host,
            f"{META}pid": str(self.owner.pid),
            f"{META}start_ticks": "" if self.owner.start_ticks is None else str(self.owner.start_ticks),
            f"{META}started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.entry = [{"targets": [target], "labels": {**labels, **meta}}]
        self._lock = threading.Lock()
        self._removed = False
        self._previous_sigterm: Any = None
        self._sigterm_installed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.path, json.dumps(self.entry, indent=2) + "\n")
        atexit.register(self.remove)
        if handle_sigterm:
            self._install_sigterm()

    def remove(self) -> None:
        """Delete the entry (only in the process that wrote it: never in a forked child)."""
        if os.getpid() != self.owner.pid:
            return
        with self._lock:
            if self._removed:
                return
            self._removed = True
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("lossbeat: cannot remove the file_sd entry %s (%s)", self.path, exc.strerror or exc)
        atexit.unregister(self.remove)
        self._restore_sigterm()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit and close() still clean up
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if not self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        # Only if ours is still the handler: one installed after us chains to us and stays.
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._sigterm_installed = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        previous = self._previous_sigterm
        self.remove()  # a no-op in a forked child that inherited the handler
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or a handler set outside Python): end the process as the signal would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _target_host(addr: str) -> str:
    host = os.environ.get(ENV_HOST) or (socket.gethostname() if addr in _WILDCARD else addr)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def register(directory: str | os.PathLike | None, *, addr: str, port: int, rank: int,
             job: str = "", on_error: Callable[[], None] | None = None) -> Registration | None:
    """Register this rank in ``directory`` (default: ``$LOSSBEAT_FILE_SD_DIR``); None when unset.

    Prunes this host's entries of dead processes first. A failure (a read-only or missing
    shared filesystem) is logged once and reported through ``on_error``: training goes on.
    """
    directory = directory or os.environ.get(ENV_DIR) or None
    if directory is None:
        return None
    labels = {}
    job = os.environ.get(ENV_JOB) or job or os.environ.get("SLURM_JOB_NAME", "")
    if job:
        labels["job"] = job
    labels["node"] = socket.gethostname()
    if os.environ.get("SLURM_JOB_ID"):
        labels["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    try:
        prune(directory)
        registration = Registration(directory, f"{_target_host(addr)}:{port}", labels, rank)
    except OSError as exc:
        log.warning("lossbeat: cannot register rank %d in %s (%s); Prometheus will not discover it",
                    rank, directory, exc.strerror or exc)
        if on_error is not None:
            on_error()
        return None
    log.info("lossbeat: registered %s for Prometheus in %s", registration.target, registration.path)
    return registration


def read_entries(directory: str | os.PathLike) -> list[tuple[Path, Owner | None, dict]]:
    """(path, owner or None when unreadable, labels) of every lossbeat entry in ``directory``."""
    out = []
    for path in sorted(Path(directory).glob(f"{PREFIX}*.json")):
        try:
            groups = json.loads(path.read_text(encoding="utf-8"))
            labels = groups[0]["labels"]
            ticks = labels.get(f"{META}start_ticks", "")
            owner = Owner(labels[f"{META}host"], int(labels[f"{META}pid"]), int(ticks) if ticks else None)
        except FileNotFoundError:
            continue  # removed meanwhile
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            out.append((path, None, {}))
            continue
        out.append((path, owner, labels))
    return out


def prune(directory: str | os.PathLike, *, slurm_job_id: str | None = None) -> list[Path]:
    """Remove entries whose process is gone: this host's dead or reused pids, leftover
    temporary files, and with ``slurm_job_id`` every entry of that (finished) job.
    Entries of live processes on other hosts are kept. Returns the removed paths."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path, owner, labels in read_entries(directory):
        if owner is None:
            continue  # not ours to judge: a half-copied file, or written by someone else
        if (slurm_job_id and labels.get("slurm_job_id") == slurm_job_id) or owner.alive() is False:
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
    now = time.time()
    for tmp in directory.glob(f".{PREFIX}*.tmp"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
                removed.append(tmp)
        except FileNotFoundError:
            pass
    return removed


# --- `lossbeat targets` --------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="list the registered ranks and whether their process lives")
    listing.add_argument("directory", help="the file_sd folder (LOSSBEAT_FILE_SD_DIR)")
    pruning = sub.add_parser("prune", help="remove entries of processes that died without cleanup")
    pruning.add_argument("directory", help="the file_sd folder (LOSSBEAT_FILE_SD_DIR)")
    pruning.add_argument("--slurm-job-id", help="also remove every entry of this finished Slurm job (any host)")


def _describe(entries: Iterable[tuple[Path, Owner | None, dict]]) -> Iterable[str]:
    states = {True: "alive", False: "dead", None: "other host"}
    for path, owner, labels in entries:
        if owner is None:
            yield f"{path.name}: unreadable"
            continue
        yield (f"{path.name}: job={labels.get('job', '-')} rank={labels.get(META + 'rank', '-')} "
               f"host={owner.host} pid={owner.pid} {states[owner.alive()]}")


def run(args: argparse.Namespace) -> int:
    if not Path(args.directory).is_dir():
        print(f"lossbeat targets: {args.directory}: not a directory", file=sys.stderr)
        return 2
    if args.action == "list":
        for line in _describe(read_entries(args.directory)):
            print(line)
        return 0
    for path in prune(args.directory, slurm_job_id=args.slurm_job_id):
        print(f"removed {path}")
    return 0
