"""Memory readings for the exporter and the memory check: host-side, never a device sync.

The peak is *windowed*: the highest value since the same reader's previous reading (a scrape,
or a diagnosis), not since the process started, so one transient spike (the first compiled
step, a long eval batch) is seen once and then ages out instead of holding an alert for the
rest of the run. Each reading takes the device's peak since the last reading by anyone and
resets it (``torch.cuda.reset_peak_memory_stats``, a host-side counter reset in the caching
allocator; on Linux, writing ``5`` to ``/proc/self/clear_refs`` resets the resident peak),
and folds it into every reader's pending peak, so the scrape and the diagnosis never steal
each other's spikes. (A training script's own ``torch.cuda.max_memory_allocated()`` then
reads the peak since lossbeat's last reading, not the lifetime peak.)

On CUDA the peak is what would run out: the allocator's peak allocated bytes plus the memory
outside the allocator (the CUDA context, NCCL buffers, other processes: the device's total
minus its free memory, ``torch.cuda.mem_get_info``, a driver query without a device sync,
minus the allocator's reserved bytes). On CPU: the memory the process allocated itself that is
resident (its anonymous pages: heap, tensors), its windowed peak, and the limit the process lives
under (the cgroup's memory limit, else the machine's RAM). The file pages it maps are left out: a
memory-mapped dataset (nanoGPT's ``np.memmap``, HF datasets' Arrow files, safetensors weights)
grows the resident set by every page an epoch touches, page cache the kernel reclaims at will,
which would read as a leak. Shared memory is left out with them (``statm`` counts both as shared).
"""

from __future__ import annotations

import functools
import math
import os
import resource
import sys
import threading
from typing import NamedTuple

__all__ = ["MemoryReading", "read_memory", "anonymous_resident_bytes"]


class MemoryReading(NamedTuple):
    device: str
    """``cuda:N`` or ``cpu``: the ``device`` label."""
    allocated: float
    """Bytes allocated by tensors (CUDA), or resident and allocated by the process (CPU: its
    anonymous pages, not the files it maps)."""
    peak: float
    """Peak in use since this reader's previous reading (never below ``allocated``); on CUDA
    including the memory outside the allocator (context, NCCL, other processes)."""
    limit: float | None
    """Bytes the device has (CUDA) or the process may use (CPU); None when unknown."""


READERS = ("scrape", "diagnosis")
_lock = threading.Lock()
_pending: dict[tuple[str, str], float] = {}  # (device, reader) -> peak since that reader's last reading


def _windowed(device: str, reader: str, device_peak: float) -> float:
    """Fold the peak since the last reset into every reader's pending peak; take this reader's."""
    with _lock:
        for other in READERS:
            key = (device, other)
            pending = _pending.get(key, 0.0)
            _pending[key] = device_peak if device_peak > pending else pending  # max(), without its call
        return _pending.pop((device, reader), device_peak)


def read_memory(cuda_device: int | None, reader: str = "scrape") -> MemoryReading:
    """The reading for ``cuda_device`` (the device of the observed tensors), or the process's;
    ``reader`` (one of :data:`READERS`) owns the window the peak covers."""
    if reader not in READERS:
        raise ValueError(f"reader: expected one of {', '.join(READERS)}, got {reader!r}")
    torch = sys.modules.get("torch")  # never import torch here: the collector runs without it
    if cuda_device is not None and torch is not None and torch.cuda.is_initialized():
        allocated = float(torch.cuda.memory_allocated(cuda_device))
        with _lock:  # read and reset together: host-side allocator counters, no device sync
            device_peak = float(torch.cuda.max_memory_allocated(cuda_device))
            torch.cuda.reset_peak_memory_stats(cuda_device)
        total = _cuda_total(cuda_device)
        outside = 0.0
        try:
            free, total = (float(v) for v in torch.cuda.mem_get_info(cuda_device))  # driver query, no sync
            outside = max(0.0, total - free - float(torch.cuda.memory_reserved(cuda_device)))
        except RuntimeError:
            pass
        device = f"cuda:{cuda_device}"
        peak = _windowed(device, reader, max(device_peak, allocated))
        return MemoryReading(device, allocated, peak + outside, total)
    allocated, peak = _cpu_memory()
    peak = _windowed("cpu", reader, peak)
    return MemoryReading("cpu", allocated, peak if peak > allocated else allocated, _cpu_limit())  # max()


@functools.lru_cache(maxsize=16)
def _cuda_total(device: int) -> float:
    import torch

    return float(torch.cuda.get_device_properties(device).total_memory)


def _cpu_memory() -> tuple[float, float]:
    """(resident, peak resident since the last reset) bytes this process allocated (its file-backed
    and shared pages left out: see the module). The kernel's high-water mark (VmHWM) is reset after
    each read (``5`` > /proc/self/clear_refs); it is only updated at some events and can read below
    the live RSS, so the peak is at least the resident size."""
    current = peak = math.nan
    with _lock:
        try:
            current, peak = _PROC.read()
            _PROC.reset_peak()
        except (OSError, ValueError, IndexError):
            pass
    if math.isnan(peak):  # not Linux: the rusage peak (bytes on macOS, KiB elsewhere), a lifetime one
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = float(maxrss if sys.platform == "darwin" else maxrss * 1024)
    if math.isnan(current):
        current = peak
    return current, (peak if peak > current else current)  # max(), without its call


class _ProcFiles:
    """This process's resident memory and its peak, read cheaply (under ``_lock``).

    A diagnosis reads memory every ``diagnose_every`` steps. /proc/self/status, which the kernel
    renders whole at each read, costs tens of µs; so the resident size comes from
    /proc/self/statm (one line) and the peak from ``getrusage`` (the same high-water mark,
    VmHWM, which ``clear_refs`` resets), unless ``getrusage`` carries a larger peak from before
    the process's exec (a launcher's fork), checked at the first reading: then the status it is.
    Descriptors stay open (``pread`` at offset 0 reads afresh) and are reopened after a fork."""

    def __init__(self) -> None:
        self._pid = -1
        self._status = self._statm = self._clear = -1
        self._rusage_peak: bool | None = None  # None: not checked yet

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        for fd in (self._status, self._statm, self._clear):  # the parent's, inherited across a fork
            if fd >= 0:
                os.close(fd)
        self._status = self._statm = self._clear = -1
        self._pid = os.getpid()
        self._rusage_peak = None
        self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self._clear = -1  # without it (Linux < 4.0, a sandbox) the peak stays a lifetime one

    def read(self) -> tuple[float, float]:
        """(resident, peak resident) bytes the process allocated: anonymous pages. statm's third
        field counts the resident file-backed and shared pages; the kernel keeps no high-water
        mark of anonymous pages alone, so the peak is the resident one less today's shared pages
        (the mapped files are what moves slowly, the spikes are allocations)."""
        resident, shared = self.statm()
        if self._rusage_peak:
            return resident - shared, resident_peak_kib() * 1024.0 - shared
        status = os.pread(self._status, 8192, 0)
        current, peak = resident - shared, _status_kib(status, b"\nVmHWM:") * 1024 - shared
        if self._rusage_peak is None and self._clear >= 0:
            # Just after a reset VmHWM is the resident size; getrusage's peak, if it is the same
            # mark, is no higher (a page or two of growth since aside).
            self.reset_peak()
            status = os.pread(self._status, 8192, 0)
            hwm = _status_kib(status, b"\nVmHWM:")
            self._rusage_peak = math.isfinite(hwm) and resident_peak_kib() <= hwm + 1024
        return current, peak

    def statm(self) -> tuple[float, float]:
        """(resident, resident file-backed and shared) bytes, from /proc/self/statm's one line."""
        self._open()
        fields = os.pread(self._statm, 256, 0).split()
        return float(fields[1]) * _PAGE, float(fields[2]) * _PAGE

    def reset_peak(self) -> None:
        """Reset VmHWM to the current RSS (Linux >= 4.0); without it the peak stays a lifetime one."""
        if self._clear >= 0:
            try:
                os.write(self._clear, b"5")
            except OSError:
                pass


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anonymous_resident_bytes() -> float:
    """The resident memory the process allocated (what the CPU reading takes as allocated), with
    no peak reset and no reader's window; NaN where /proc is not there."""
    with _lock:
        try:
            resident, shared = _PROC.statm()
        except (OSError, ValueError, IndexError):
            return math.nan
    return resident - shared


def resident_peak_kib() -> float:
    """``getrusage``'s peak resident size in KiB (Linux; bytes on macOS are not read here)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


_PROC = _ProcFiles()


def _status_kib(status: bytes, key: bytes) -> float:
    """The kB value of ``key`` (``b"\\nVmRSS:"``) in /proc/self/status; NaN when absent."""
    at = status.find(key)
    if at < 0:
        return math.nan
    return float(status[at + len(key) : status.index(b"\n", at + 1)].split()[0])


@functools.lru_cache(maxsize=1)
def _cpu_limit() -> float | None:
    """The cgroup v2 (or v1) memory limit when one is set, else MemTotal; None when unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                raw = fh.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 2**60:  # v1 writes a huge number for "no limit"
            return float(raw)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
