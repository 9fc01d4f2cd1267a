"""Self-registration for batch schedulers: each rank writes its own Prometheus file_sd entry.

With ``LOSSBEAT_FILE_SD_DIR`` (or ``MonitorConfig.file_sd_dir``) set to a folder that
Prometheus watches (``file_sd_configs: [{files: ["DIR/*.json"]}]``), every serving rank
writes ``lossbeat-<host>-<boot>-<pidns>-<pid>-<start>-<port>.json`` there: one target group with its *real* address
(the fallback port when its base port was taken) and the labels ``job``, ``node`` and
``slurm_job_id``. The rank, the owning process (host, pid, process start time) and the
start wall time ride along as ``__meta_lossbeat_*`` labels: visible to relabelling, never
stored as series labels (a pid label would make new series at every restart; a ``rank``
target label would rename the exporter's own ``rank`` to ``exported_rank``).

The entry is written atomically (a temporary file, made readable through its open file
descriptor, renamed over it) and removed on ``close()`` and at interpreter exit (atexit,
which also runs on ``sys.exit()`` from a signal handler the application installs). lossbeat
installs no signal handler. A process that dies without cleanup (SIGKILL, Python's default
SIGTERM, OOM kill, node crash) leaves its entry, and :func:`prune` removes it later.

A pid means something only inside one kernel boot and one PID namespace, so the owner is
(host, boot id, PID namespace, pid, process start time), and liveness is judged only where
all but the pid match this process's: an entry of another container with the same host name
(``hostNetwork`` pods, ``docker --network host``) or of another boot is "unknowable here"
and kept. The owner fields are in the file name, so a registering rank prunes the dead
entries of its own host and namespace from the folder listing alone, without opening any
other rank's file (no O(N^2) opens on a shared filesystem at a job's start).
``lossbeat targets prune DIR`` does the same for every entry, and with ``--slurm-job-id``
removes every entry of a finished job (it reads the entries; run it from the job's trap or
epilog). The folder is not trusted: an entry is opened with ``O_NOFOLLOW | O_NONBLOCK``, must
be a regular file and is read up to :data:`_MAX_ENTRY_BYTES` (a FIFO, a device or a symlink
is reported unreadable and never blocks).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import socket
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

__all__ = [
    "ENV_DIR",
    "Owner",
    "Registration",
    "register",
    "read_entries",
    "prune",
    "prune_own_namespace",
    "add_arguments",
    "run",
]

log = logging.getLogger("lossbeat")

ENV_DIR = "LOSSBEAT_FILE_SD_DIR"
ENV_HOST = "LOSSBEAT_FILE_SD_HOST"
"""The host name Prometheus should scrape (default: the bound address, or this host's name)."""
ENV_JOB = "LOSSBEAT_JOB"
"""The ``job`` label (default: the run name, else ``SLURM_JOB_NAME``)."""
PREFIX = "lossbeat-"
META = "__meta_lossbeat_"
_STALE_TMP_S = 60.0  # a temporary file older than this was left by a writer that died
_MAX_ENTRY_BYTES = 64 * 1024  # an entry is a few hundred bytes; more is not ours
_NO_TICKS = "x"  # the start time field of a file name when /proc has none
_WILDCARD = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Owner:
    """The process that wrote an entry: enough to tell a live writer from a dead or reused pid."""

    host: str
    pid: int
    start_ticks: int | None
    """The process start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    boot_id: str | None = None
    """The kernel's boot id (/proc/sys/kernel/random/boot_id), or None (unknown, an old entry)."""
    pid_ns: int | None = None
    """The inode of the writer's PID namespace (/proc/self/ns/pid), or None."""

    @classmethod
    def current(cls) -> Owner:
        return cls(socket.gethostname(), os.getpid(), process_start_ticks(os.getpid()), boot_id(), pid_namespace())

    def comparable(self) -> bool:
        """Whether this owner's pid can be looked up here: same host, same boot, same PID namespace."""
        return (
            self.host == socket.gethostname()
            and self.boot_id is not None
            and self.pid_ns is not None
            and self.boot_id == boot_id()
            and self.pid_ns == pid_namespace()
        )

    def alive(self) -> bool | None:
        """Whether the process still runs; None when that is unknowable here: another host,
        another boot or PID namespace (a container with this host name), or an entry without them."""
        if not self.comparable():
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


def boot_id() -> str | None:
    """This kernel's boot id (shared by every container on the node), or None."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip().replace("-", "")[:32] or None
    except (OSError, ValueError):
        return None


def pid_namespace() -> int | None:
    """The inode of this process's PID namespace, or None (no /proc)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        # Field 2 (comm) may contain spaces and parentheses: count from the last ')'.
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _entry_path(directory: Path, owner: Owner, port: str) -> Path:
    # The port too: two serving monitors in one process must not share (and remove) one entry.
    # The owner fields too: a registering rank judges entries from their names alone.
    ticks = _NO_TICKS if owner.start_ticks is None else str(owner.start_ticks)
    return directory / (
        f"{PREFIX}{_safe(owner.host)}-{(owner.boot_id or 'x')[:12]}-{owner.pid_ns or 'x'}-"
        f"{owner.pid}-{ticks}-{_safe(port)}.json"
    )


def _owner_from_name(name: str) -> Owner | None:
    """The owner a file name written by :func:`_entry_path` encodes (host as in the name,
    boot id shortened), or None for any other name."""
    if not (name.startswith(PREFIX) and name.endswith(".json")):
        return None
    parts = name[len(PREFIX) : -len(".json")].rsplit("-", 5)
    if len(parts) != 6:
        return None
    host, boot, ns, pid, ticks, _port = parts
    try:
        return Owner(
            host,
            int(pid),
            None if ticks == _NO_TICKS else int(ticks),
            None if boot == "x" else boot,
            None if ns == "x" else int(ns),
        )
    except ValueError:
        return None


def _name_is_comparable(owner: Owner, mine: Owner) -> bool:
    """:meth:`Owner.comparable` for an owner parsed from a file name (safe host, short boot id)."""
    return (
        owner.host == _safe(mine.host)
        and owner.boot_id is not None
        and mine.boot_id is not None
        and owner.boot_id == mine.boot_id[:12]
        and owner.pid_ns is not None
        and owner.pid_ns == mine.pid_ns
    )


def prune_own_namespace(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the entries of dead processes of this host, boot and PID namespace, judged from
    the file names alone (no entry is opened). What a rank runs when it registers."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    now, mine = time.time(), Owner.current()
    for name in names:
        if name.startswith(f".{PREFIX}") and name.endswith(".tmp"):
            _remove_stale_tmp(Path(directory) / name, now, removed)
            continue
        owner = _owner_from_name(name)
        if owner is None or not _name_is_comparable(owner, mine):
            continue
        full = Owner(mine.host, owner.pid, owner.start_ticks, mine.boot_id, mine.pid_ns)
        if full.alive() is False:
            path = Path(directory) / name
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:100]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, mode 0644 set on the open descriptor (file_sd readers)."""
    # mkstemp opens O_EXCL with mode 0600; the mode is set on that descriptor, never by path
    # (a path could be swapped for a symlink between the write and a chmod).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o644)  # Prometheus may run as another user
            f.write(text)
        os.replace(tmp, path)  # Prometheus never reads half a file
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Registration:
    """One rank's file_sd entry; removed by :meth:`remove` (idempotent) and atexit.

    No signal handler: a Python handler runs only between bytecodes, so a rank blocked in a C
    call (an NCCL wait) would no longer die on SIGTERM. An entry left by a killed process is
    removed by :func:`prune` (by the next rank registering on this host and namespace, or by
    ``lossbeat targets prune --slurm-job-id`` in the job's trap or epilog)."""

    def __init__(self, directory: str | os.PathLike[str], target: str, labels: dict[str, str], rank: int) -> None:
        self.directory = Path(directory)
        self.owner = Owner.current()
        self.path = _entry_path(self.directory, self.owner, target.rsplit(":", 1)[-1])
        self.target = target
        meta = {
            f"{META}rank": str(rank),
            f"{META}host": self.owner.host,
            f"{META}pid": str(self.owner.pid),
            f"{META}start_ticks": "" if self.owner.start_ticks is None else str(self.owner.start_ticks),
            f"{META}boot_id": self.owner.boot_id or "",
            f"{META}pid_ns": "" if self.owner.pid_ns is None else str(self.owner.pid_ns),
            f"{META}started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.entry = [{"targets": [target], "labels": {**labels, **meta}}]
        self._lock = threading.Lock()
        self._removed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self.entry, indent=2) + "\n")
        atexit.register(self.remove)

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


def _target_host(addr: str) -> str:
    host = os.environ.get(ENV_HOST) or (socket.gethostname() if addr in _WILDCARD else addr)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def register(
    directory: str | os.PathLike[str] | None,
    *,
    addr: str,
    port: int,
    rank: int,
    job: str = "",
    on_error: Callable[[], None] | None = None,
) -> Registration | None:
    """Register this rank in ``directory`` (default: ``$LOSSBEAT_FILE_SD_DIR``); None when unset.

    Prunes the entries of dead processes of this host and PID namespace first, from the file
    names alone (no other rank's entry is opened). A failure (a read-only or missing
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
        prune_own_namespace(directory)
        registration = Registration(directory, f"{_target_host(addr)}:{port}", labels, rank)
    except OSError as exc:
        log.warning(
            "lossbeat: cannot register rank %d in %s (%s); Prometheus will not discover it",
            rank,
            directory,
            exc.strerror or exc,
        )
        if on_error is not None:
            on_error()
        return None
    log.info("lossbeat: registered %s for Prometheus in %s", registration.target, registration.path)
    return registration


def _read_entry(path: Path) -> str:
    """The text of one entry, opened without following a symlink or blocking on a FIFO; a
    non-regular or oversized file raises ValueError (unreadable, never ours)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name}: not a regular file")
        data = os.read(fd, _MAX_ENTRY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_ENTRY_BYTES:
        raise ValueError(f"{path.name}: over {_MAX_ENTRY_BYTES} bytes")
    return data.decode("utf-8")


def read_entries(directory: str | os.PathLike[str]) -> list[tuple[Path, Owner | None, dict[str, str]]]:
    """(path, owner or None when unreadable, labels) of every lossbeat entry in ``directory``."""
    out: list[tuple[Path, Owner | None, dict[str, str]]] = []
    for path in sorted(Path(directory).glob(f"{PREFIX}*.json")):
        try:
            groups = json.loads(_read_entry(path))
            labels = groups[0]["labels"]
            ticks = labels.get(f"{META}start_ticks", "")
            ns = labels.get(f"{META}pid_ns", "")
            owner = Owner(
                labels[f"{META}host"],
                int(labels[f"{META}pid"]),
                int(ticks) if ticks else None,
                labels.get(f"{META}boot_id") or None,
                int(ns) if ns else None,
            )
        except FileNotFoundError:
            continue  # removed meanwhile
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            out.append((path, None, {}))  # ValueError covers bad UTF-8 and JSON
            continue
        out.append((path, owner, labels))
    return out


def prune(directory: str | os.PathLike[str], *, slurm_job_id: str | None = None) -> list[Path]:
    """Remove entries whose process is gone: dead or reused pids of this host, boot and PID
    namespace, leftover temporary files, and with ``slurm_job_id`` every entry of that
    (finished) job. Entries whose liveness is unknowable here (other hosts, other containers
    with this host name) are kept. Reads every entry: the command line's, not a rank's."""
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
        _remove_stale_tmp(tmp, now, removed)
    return removed


def _remove_stale_tmp(tmp: Path, now: float, removed: list[Path]) -> None:
    try:
        if now - tmp.lstat().st_mtime > _STALE_TMP_S:  # lstat: a symlink is judged, not followed
            tmp.unlink()
            removed.append(tmp)
    except FileNotFoundError:
        pass


# --- `lossbeat targets` --------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="list the registered ranks and whether their process lives")
    listing.add_argument("directory", help="the file_sd folder (LOSSBEAT_FILE_SD_DIR)")
    pruning = sub.add_parser("prune", help="remove entries of processes that died without cleanup")
    pruning.add_argument("directory", help="the file_sd folder (LOSSBEAT_FILE_SD_DIR)")
    pruning.add_argument("--slurm-job-id", help="also remove every entry of this finished Slurm job (any host)")


def _describe(entries: Iterable[tuple[Path, Owner | None, dict[str, str]]]) -> Iterable[str]:
    states = {True: "alive", False: "dead", None: "unknowable here (other host, boot or PID namespace)"}
    for path, owner, labels in entries:
        if owner is None:
            yield f"{path.name}: unreadable"
            continue
        yield (
            f"{path.name}: job={labels.get('job', '-')} rank={labels.get(META + 'rank', '-')} "
            f"host={owner.host} pid={owner.pid} {states[owner.alive()]}"
        )


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
