"""Per-step overhead of each variant, interleaved in one process.

Each round runs one block of steps per variant, in an order rotated every
round, on the same model, optimizer and batches. On CPU a block is one step:
variants alternate step by step, so a burst of load from the machine's other
users lands on all of them alike. On CUDA a block is ten steps with a
synchronize at its end only (one per step would hide the syncs being measured).

Rounds are grouped into windows of at least ten steps per variant: one window
holds exactly one per-layer step of ``layer_every=10``, which a median of
single steps would hide. Two estimates per variant:

- ``paired``: window mean step time over the baseline's in the same window,
  median over windows. Catches indirect costs (cache, allocator) but carries
  the machine's noise.
- ``direct``: the time in the section that differs (clip + monitoring), minus
  the baseline's, over the baseline step. Precise; misses indirect costs and
  work done in backward hooks.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .counting import StepCounts, count_host_reads
from .models import Workload
from .variants import Variant

__all__ = ["WindowTimes", "VariantResult", "train_step", "measure_overhead", "count_variant"]


def train_step(workload: Workload, variant: Variant, step: int) -> float:
    """One training step; returns the seconds spent in ``after_backward`` (clip + monitoring)."""
    workload = variant.workload_for(workload)
    tokens, targets = workload.batch(step)
    loss = workload.model(tokens, targets)
    loss.backward()
    start = time.perf_counter()
    variant.after_backward(workload, loss)
    section = time.perf_counter() - start
    workload.optimizer.step()
    workload.optimizer.zero_grad(set_to_none=True)
    return section


@dataclass
class WindowTimes:
    step_ms: list[float] = field(default_factory=list)
    """Mean step time in each window."""
    section_ms: list[float] = field(default_factory=list)
    """Mean time in after_backward in each window (launch time only on CUDA)."""


@dataclass
class VariantResult:
    name: str
    title: str
    available: bool
    reason: str | None = None
    step_ms: float | None = None
    section_ms: float | None = None
    paired_ratio: float | None = None
    paired_ratio_p25: float | None = None
    paired_ratio_p75: float | None = None
    step_ratio_median: float | None = None
    """Median over rounds of single-block ratios: finer, but blind to periodic work."""
    direct_overhead_pct: float | None = None
    work_in_backward: bool = False
    windows: WindowTimes | None = None

    @property
    def paired_overhead_pct(self) -> float | None:
        return None if self.paired_ratio is None else (self.paired_ratio - 1.0) * 100.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["paired_overhead_pct"] = self.paired_overhead_pct
        return d


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _sync(workload: Workload) -> None:
    if workload.device.type == "cuda":
        torch.cuda.synchronize(workload.device)


def measure_overhead(
    workload: Workload,
    variants: list[Variant],
    rounds: int,
    block: int = 1,
    window_steps: int = 10,
    warmup_steps: int = 2,
) -> dict[str, VariantResult]:
    """Interleaved timing; ``variants[0]`` is the baseline. Unavailable variants are skipped."""
    active = [v for v in variants if v.unavailable is None]
    per_round: dict[str, list[tuple[float, float]]] = {v.name: [] for v in active}
    step = 0
    for v in active:  # untimed warm-up: layer groupings, caches, wandb's first histograms
        v.setup(workload)
        for _ in range(warmup_steps):
            train_step(workload, v, step)
            step += 1
    for round_index in range(rounds):
        shift = round_index % len(active)
        for v in active[shift:] + active[:shift]:
            _sync(v.workload_for(workload))
            sections = 0.0
            start = time.perf_counter()
            for _ in range(block):
                sections += train_step(workload, v, step)
                step += 1
            _sync(v.workload_for(workload))
            per_round[v.name].append(((time.perf_counter() - start) / block, sections / block))
    window_rounds = max(1, -(-window_steps // block))
    return _summarise(variants, per_round, window_rounds)


def _windows(rounds: list[tuple[float, float]], window_rounds: int) -> WindowTimes:
    w = WindowTimes()
    for i in range(0, len(rounds) - window_rounds + 1, window_rounds):
        chunk = rounds[i : i + window_rounds]
        w.step_ms.append(sum(r[0] for r in chunk) / len(chunk) * 1e3)
        w.section_ms.append(sum(r[1] for r in chunk) / len(chunk) * 1e3)
    if not w.step_ms:  # fewer rounds than a window: one short window
        w.step_ms.append(sum(r[0] for r in rounds) / len(rounds) * 1e3)
        w.section_ms.append(sum(r[1] for r in rounds) / len(rounds) * 1e3)
    return w


def _summarise(
    variants: list[Variant], per_round: dict[str, list[tuple[float, float]]], window_rounds: int
) -> dict[str, VariantResult]:
    base_rounds = per_round[variants[0].name]
    base = _windows(base_rounds, window_rounds)
    base_step = statistics.median(base.step_ms)
    base_section = statistics.median(base.section_ms)
    results = {}
    for v in variants:
        if v.unavailable is not None:
            results[v.name] = VariantResult(v.name, v.title, False, v.unavailable)
            continue
        w = _windows(per_round[v.name], window_rounds)
        ratios = [a / b for a, b in zip(w.step_ms, base.step_ms)]
        section = statistics.median(w.section_ms)
        results[v.name] = VariantResult(
            v.name,
            v.title,
            True,
            step_ms=statistics.median(w.step_ms),
            section_ms=section,
            paired_ratio=statistics.median(ratios),
            paired_ratio_p25=_quantile(ratios, 0.25),
            paired_ratio_p75=_quantile(ratios, 0.75),
            step_ratio_median=statistics.median(a[0] / b[0] for a, b in zip(per_round[v.name], base_rounds)),
            direct_overhead_pct=(section - base_section) / base_step * 100.0,
            work_in_backward=v.work_in_backward,
            windows=w,
        )
    return results


def count_variant(workload: Workload, variant: Variant, steps: int, warmup: int = 2) -> dict:
    """Ops and host reads per step of one variant, counted (not timed) over ``steps`` steps."""
    for i in range(warmup):
        train_step(workload, variant, i)
    counts = StepCounts()
    transfers_before = variant.host_transfers
    waits_before = variant.blocking_waits
    with count_host_reads(counts):
        for i in range(steps):
            train_step(workload, variant, warmup + i)
    transfers_after = variant.host_transfers
    return {
        "steps": steps,
        "ops_per_step": counts.ops / steps,
        "compute_ops_per_step": (counts.ops - counts.view_ops) / steps,
        "host_reads_per_step": counts.host_reads / steps,
        "scalar_reads_per_step": counts.scalar_reads / steps,
        "method_reads_per_step": counts.method_reads / steps,
        "list_reads_per_step": counts.list_reads / steps,
        "device_syncs_per_step": (
            counts.scalar_reads + counts.device_method_reads + counts.device_list_reads + counts.device_waits
        )
        / steps
        if workload.device.type != "cpu"
        else None,
        "lossbeat_blocking_waits_per_step": None
        if waits_before is None
        else (variant.blocking_waits - waits_before) / steps,
        "lossbeat_host_transfers_per_step": None
        if transfers_before is None
        else (transfers_after - transfers_before) / steps,
        "top_ops": dict(counts.op_names.most_common(8)),
    }


def count_variants(workload: Workload, variants: list[Variant], steps: int) -> dict[str, dict]:
    """Counts for every available variant, with the baseline's subtracted (``*_delta``)."""
    counted = {}
    for v in variants:
        if v.unavailable is None:
            v.setup(workload)
            counted[v.name] = count_variant(workload, v, steps)
    base = counted[variants[0].name]
    for c in counted.values():
        c["ops_delta_per_step"] = c["ops_per_step"] - base["ops_per_step"]
        c["compute_ops_delta_per_step"] = c["compute_ops_per_step"] - base["compute_ops_per_step"]
        c["host_reads_delta_per_step"] = c["host_reads_per_step"] - base["host_reads_per_step"]
        if c["device_syncs_per_step"] is not None:
            c["device_syncs_delta_per_step"] = c["device_syncs_per_step"] - base["device_syncs_per_step"]
    return counted
