"""Memory readings for the exporter and the memory check: host-side, never a device sync.

On CUDA: the caching allocator's counters (``memory_allocated``, ``max_memory_allocated``)
and the device's total memory. On CPU: the process's resident set, its peak, and the
limit the process lives under (the cgroup's memory limit, else the machine's RAM).
"""

from __future__ import annotations

import functools
import math
import resource
import sys
from typing import NamedTuple

__all__ = ["MemoryReading", "read_memory"]

class MemoryReading(NamedTuple):
    device: str
    """``cuda:N`` or ``cpu``: the ``device`` label."""
    allocated: float
    """Bytes allocated by tensors (CUDA) or resident (CPU)."""
    peak: float
    """Peak of ``allocated`` since the start (never below it)."""
    limit: float | None
    """Bytes the device has (CUDA) or the process may use (CPU); None when unknown."""


def read_memory(cuda_device: int | None) -> MemoryReading:
    """The reading for ``cuda_device`` (the device of the observed tensors), or the process's."""
    torch = sys.modules.get("torch")  # never import torch here: the collector runs without it
    if cuda_device is not None and torch is not None and torch.cuda.is_initialized():
        allocated = float(torch.cuda.memory_allocated(cuda_device))
        peak = float(torch.cuda.max_memory_allocated(cuda_device))
        return MemoryReading(f"cuda:{cuda_device}", allocated, max(peak, allocated), _cuda_total(cuda_device))
    allocated, peak = _cpu_memory()
    return MemoryReading("cpu", allocated, peak, _cpu_limit())


@functools.lru_cache(maxsize=16)
def _cuda_total(device: int) -> float:
    import torch

    return float(torch.cuda.get_device_properties(device).total_memory)


_cpu_peak_seen = 0.0  # the highest resident size read so far in this process


def _cpu_memory() -> tuple[float, float]:
    """(resident, peak resident) bytes of this process. The kernel's high-water mark (``ru_maxrss``,
    VmHWM) is only updated at some events and can read below the live RSS, and drop back to its
    stale value once memory is freed: the peak is the highest of it and every RSS read so far."""
    global _cpu_peak_seen
    current = peak = math.nan
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            status = fh.read()  # one read and two finds: a line-by-line scan costs several times more
        current = _status_kib(status, "\nVmRSS:") * 1024
        peak = _status_kib(status, "\nVmHWM:") * 1024
    except (OSError, ValueError, IndexError):
        pass
    if math.isnan(peak):  # not Linux: the rusage peak (bytes on macOS, KiB elsewhere)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = float(maxrss if sys.platform == "darwin" else maxrss * 1024)
    if math.isnan(current):
        current = peak
    _cpu_peak_seen = max(_cpu_peak_seen, current, peak)  # a race between scrapes only loses a read
    return current, _cpu_peak_seen


def _status_kib(status: str, key: str) -> float:
    """The kB value of ``key`` (``"\\nVmRSS:"``) in /proc/self/status; NaN when absent."""
    at = status.find(key)
    if at < 0:
        return math.nan
    return float(status[at + len(key):status.index("\n", at + 1)].split()[0])


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
