"""Checks on the run's resources: memory that grows or nears the device's limit, and
throughput that falls below the run's own level (the article's daily checklist, items 7-8).

Pure and torch-free: the monitor samples memory (host-side allocator counters) and step
times, and these judge the samples.
"""

from __future__ import annotations

import math
from typing import Sequence

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.thresholds import MemoryThresholds, ThroughputThresholds
from lossbeat.diagnosis.window import Ring, median  # the same float as statistics.median, a tenth of its cost

__all__ = ["check_memory", "ThroughputTracker"]


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def check_memory(
    allocated: Sequence[float], peak: float | None, limit: float | None, t: MemoryThresholds, every: int = 1
) -> Finding:
    """``allocated``: memory samples (bytes), one per diagnosis (``every`` steps apart), oldest first, the
    run's first ``t.warmup_samples`` already dropped by the caller; ``peak``: peak allocated bytes;
    ``limit``: the device's (or the process's) memory limit in bytes."""
    check = "memory"
    if allocated and not (limit and limit > 0):  # a log's samples: no limit, the trend alone
        return _steady_growth(allocated, None, t, every) or Finding.unknown(check, "no known memory limit")
    if not allocated or not limit or not limit > 0:
        return Finding.unknown(check, "no memory samples or no known limit")
    current = allocated[-1]
    top = max(current, peak or 0.0)
    if top > t.near_limit * limit:
        return Finding(
            check,
            DANGER,
            f"peak memory {_gib(top)} is {top / limit:.0%} of the {_gib(limit)} limit: an out-of-memory error is near",
            "lower the micro-batch size and raise gradient accumulation, enable activation checkpointing, "
            "or free cached tensors (torch.cuda.empty_cache() only hides fragmentation)",
        )
    leak = _steady_growth(allocated, limit, t, every)
    if leak is not None:
        return leak
    if len(allocated) < max(6, t.samples // 2):
        return Finding(check, GOOD, f"memory {_gib(current)} ({current / limit:.0%} of the limit)", known=True)
    # Medians of the window's first and last thirds: robust to one eval's or one step's bump.
    third = len(allocated) // 3
    first = median(allocated[:third])
    last = median(allocated[-third:])
    growth = last - first
    # The middle third only where the growth is large enough to ask whether it is steady.
    if growth > t.growth_fraction * limit and first < median(allocated[third:-third]) < last:
        return Finding(
            check,
            WARNING,
            f"memory keeps growing: {_gib(first)} -> {_gib(last)} over the last {len(allocated)} samples "
            f"(+{growth / limit:.1%} of the limit): a leak",
            _LEAK_FIX,
        )
    return Finding(check, GOOD, f"memory stable at {_gib(current)} ({current / limit:.0%} of the limit)")


_LEAK_FIX = (
    "look for tensors kept across steps (losses appended without .item() or .detach(), "
    "growing caches, a graph retained by retain_graph=True)"
)


def _steady_growth(allocated: Sequence[float], limit: float | None, t: MemoryThresholds, every: int) -> Finding | None:
    """A leak by its trend, whatever fraction of the limit it holds now: the medians of the samples' three
    thirds each higher than the one before, the last third still climbing at least half as fast as the
    first two did (no plateau: a cache that fills and stops is not a leak), and the growth at least
    ``t.leak_growth`` of the first third's level. At that rate it reaches the limit: the message says when."""
    n = len(allocated)
    if n < t.leak_min_samples:
        return None
    third = n // 3
    first, middle, last = median(allocated[:third]), median(allocated[third:-third]), median(allocated[-third:])
    if not (0 < first < middle < last) or last - middle < 0.5 * (middle - first) or last < (1 + t.leak_growth) * first:
        return None
    per_sample = (last - first) / max(1, n - third)  # the centres of the first and last thirds, n - third apart
    if limit is not None:
        steps = max(0.0, limit - allocated[-1]) / per_sample * max(1, every)
        projection = f"at this rate it reaches the {_gib(limit)} limit in about {steps:,.0f} more steps"
    else:
        projection = "at a constant rate it reaches any limit"
    return Finding(
        "memory",
        DANGER,
        f"memory grows steadily with no plateau: {_gib(first)} -> {_gib(last)} over the last {n} samples "
        f"(+{(last - first) / first:.0%}, {per_sample / max(1, every) / 2**20:.3g} MiB a step): a leak; {projection}",
        _LEAK_FIX,
    )


class ThroughputTracker:
    """Step times in blocks of ``t.steps``; each block's median is compared with the run's
    own level, the median of the last ``t.baseline_blocks`` normal blocks.

    A slow block does not enter the level (a drop must not become its own reference) until
    ``t.baseline_blocks`` slow blocks came in a row: then the slower pace is the run's new
    normal (a longer sequence length on purpose) and the level restarts from them.
    Bounded: one block of floats and a ring of block medians.
    """

    def __init__(self, t: ThroughputThresholds) -> None:
        self.t = t
        self._block: list[float] = []
        self._level = Ring(t.baseline_blocks)
        self._slow = Ring(t.baseline_blocks)
        self._recent: float | None = None
        self._seen = 0
        self._finding: Finding | None = None  # finding(), until the next block closes (nothing else moves it)

    def add(self, seconds: float) -> None:
        """One training step's wall time (steps that spanned an evaluation excluded)."""
        self.extend((seconds,))

    def extend(self, times: Sequence[float]) -> None:
        """Training steps' wall times, in order, as ``add`` does each."""
        warmup, steps, seen = self.t.warmup_steps, self.t.steps, self._seen
        for seconds in times:
            seen += 1
            if seen <= warmup or not (seconds > 0 and seconds < math.inf):  # NaN, 0, negative, inf: skipped
                continue
            self._block.append(seconds)
            if len(self._block) >= steps:
                self._close_block()
        self._seen = seen

    def _close_block(self) -> None:
        self._finding = None
        block, self._block = median(self._block), []
        self._recent = block
        level = self.level()
        if level is not None and level / block < self.t.drop_fraction:
            self._slow.push(block)
            if len(self._slow) == self._slow.capacity:  # the new normal
                self._level.clear()
                for value in self._slow:
                    self._level.push(value)
                self._slow.clear()
            return
        self._slow.clear()
        self._level.push(block)

    def level(self) -> float | None:
        """The run's own step time (median of its normal blocks), once two blocks are in."""
        return median(self._level) if len(self._level) >= 2 else None

    def finding(self) -> Finding:
        if self._finding is None:
            self._finding = self._judge()
        return self._finding

    def _judge(self) -> Finding:
        check = "throughput"
        level, recent = self.level(), self._recent
        if level is None or recent is None:
            return Finding.unknown(check, "not enough timed steps yet")
        ratio = level / recent  # steps/s now over the run's own steps/s
        slow = self._slow.last(len(self._slow))  # the slow blocks in a row, the latest one among them
        if len(slow) >= self.t.danger_blocks and all(
            level / b < self.t.danger_fraction for b in slow[-self.t.danger_blocks :]
        ):
            return Finding(
                check,
                DANGER,
                f"throughput fell to {ratio:.0%} of the run's own level and stayed there for {len(slow)} blocks of "
                f"{self.t.steps} steps ({1 / recent:.3g} steps/s, was {1 / level:.3g}): each step now costs "
                f"{1 / ratio:.1f}x what it did",
                "find the slow part: a throttled or failing GPU (nvidia-smi -q -d PERFORMANCE,CLOCK), a node swapping, "
                "a data-loader stall (workers, storage); if the run must go on, restart it on healthy nodes from its "
                "last checkpoint",
            )
        if ratio < self.t.drop_fraction:
            return Finding(
                check,
                WARNING,
                f"throughput fell to {ratio:.0%} of the run's own level ({1 / recent:.3g} steps/s, was {1 / level:.3g})",
                "look for a slow node (thermal throttling, a failing GPU), a data-loader stall (workers, storage), "
                "or checkpoint I/O inside the step; mark evaluations and checkpoints with monitor.phase()",
            )
        return Finding(check, GOOD, f"{1 / recent:.3g} steps/s ({ratio:.0%} of the run's own level)")
