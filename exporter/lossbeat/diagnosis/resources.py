"""Checks on the run's resources: memory that grows or nears the device's limit, and
throughput that falls below the run's own level (the article's daily checklist, items 7-8).

Pure and torch-free: the monitor samples memory (host-side allocator counters) and step
times, and these functions judge the samples.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from ..thresholds import MemoryThresholds, ThroughputThresholds
from .findings import Finding, Status

__all__ = ["check_memory", "check_throughput"]


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def check_memory(
    allocated: Sequence[float], peak: float | None, limit: float | None, t: MemoryThresholds
) -> Finding:
    """``allocated``: memory samples (bytes), one per diagnosis, oldest first, the run's
    first ``t.warmup_samples`` already dropped by the caller; ``peak``: peak allocated bytes;
    ``limit``: the device's (or the process's) memory limit in bytes."""
    check = "memory"
    if not allocated or not limit or not limit > 0:
        return Finding.unknown(check, "no memory samples or no known limit")
    current = allocated[-1]
    top = max(current, peak or 0.0)
    if top > t.near_limit * limit:
        return Finding(
            check, Status.DANGER,
            f"peak memory {_gib(top)} is {top / limit:.0%} of the {_gib(limit)} limit: an out-of-memory error is near",
            "lower the micro-batch size and raise gradient accumulation, enable activation checkpointing, "
            "or free cached tensors (torch.cuda.empty_cache() only hides fragmentation)",
        )
    if len(allocated) < max(6, t.samples // 2):
        return Finding(check, Status.GOOD, f"memory {_gib(current)} ({current / limit:.0%} of the limit)", known=True)
    # Medians of the window's first and last thirds: robust to one eval's or one step's bump.
    third = len(allocated) // 3
    first = statistics.median(allocated[:third])
    middle = statistics.median(allocated[third:-third])
    last = statistics.median(allocated[-third:])
    growth = last - first
    if growth > t.growth_fraction * limit and first < middle < last:
        return Finding(
            check, Status.WARNING,
            f"memory keeps growing: {_gib(first)} -> {_gib(last)} over the last {len(allocated)} samples "
            f"(+{growth / limit:.1%} of the limit): a leak",
            "look for tensors kept across steps (losses appended without .item() or .detach(), "
            "growing caches, a graph retained by retain_graph=True)",
        )
    return Finding(check, Status.GOOD, f"memory stable at {_gib(current)} ({current / limit:.0%} of the limit)")


def check_throughput(durations: Sequence[float], t: ThroughputThresholds) -> Finding:
    """``durations``: seconds per training step (steps that spanned an evaluation or a
    checkpoint excluded), oldest first, after the run's first ``t.warmup_steps``."""
    check = "throughput"
    finite = [d for d in durations if math.isfinite(d) and d > 0]
    if len(finite) < 2 * t.steps:
        return Finding.unknown(check, "not enough timed steps yet")
    recent = statistics.median(finite[-t.steps:])
    baseline = statistics.median(finite[:-t.steps])
    ratio = baseline / recent  # steps/s now over steps/s before
    if ratio < t.drop_fraction:
        return Finding(
            check, Status.WARNING,
            f"throughput fell to {ratio:.0%} of the run's own level ({1 / recent:.3g} steps/s, was {1 / baseline:.3g})",
            "look for a slow node (thermal throttling, a failing GPU), a data-loader stall (workers, storage), "
            "or checkpoint I/O inside the step; mark evaluations and checkpoints with monitor.phase()",
        )
    return Finding(check, Status.GOOD, f"{1 / recent:.3g} steps/s ({ratio:.0%} of the run's own level)")
