"""Memory readings for the exporter and the memory check: host-side, never a device sync.

On CUDA: the caching allocator's counters (``memory_allocated``, ``max_memory_allocated``)
and the device's total memory. On CPU: the process's resident set, its peak, and the
limit the process lives under (the cgroup's memory limit, else the machine's RAM).
"""

from __future__ import annotations

import functools
import os
import resource
import sys
from typing import NamedTuple

__all__ = ["MemoryReading", "read_memory"]

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
    allocated = _resident_bytes()
    # ru_maxrss is sampled by the kernel at its own times: it can trail the current RSS.
    return MemoryReading("cpu", allocated, max(_peak_resident_bytes(), allocated), _cpu_limit())


@functools.lru_cache(maxsize=16)
def _cuda_total(device: int) -> float:
    import torch

    return float(torch.cuda.get_device_properties(device).total_memory)


def _resident_bytes() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return float(int(fh.read().split()[1]) * _PAGE_SIZE)
    except (OSError, ValueError, IndexError):
        return _peak_resident_bytes()


def _peak_resident_bytes() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


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
