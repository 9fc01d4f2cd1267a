"""observe() alone: Python time per call, and memory over a long run."""

from __future__ import annotations

import gc
import os
import statistics
import time
import tracemalloc

import torch

from lossbeat.monitor import Monitor, MonitorConfig

__all__ = ["measure_observe_us", "measure_memory", "resident_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


def _monitor() -> Monitor:
    return Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False)


def _loss_at(step: int) -> float:
    # A slowly falling, slightly noisy loss: keeps the diagnosis on its ordinary path.
    return 2.0 / (1.0 + step * 1e-4) + 0.01 * ((step * 7919) % 13) / 13


def measure_observe_us(calls: int, repeats: int = 5) -> dict:
    """Median over repeats of the mean µs per scalars-only observe(); floats and 0-d CPU tensors."""
    results = {}
    inputs = {
        "float": lambda i: (_loss_at(i), 0.5),
        "tensor_0d": lambda i: (torch.tensor(_loss_at(i)), torch.tensor(0.5)),
    }
    for kind, make in inputs.items():
        monitor = _monitor()
        args = [make(i) for i in range(calls)]  # built up front: input creation is not observe()'s cost
        per_call = []
        step = 0
        for _ in range(repeats):
            start = time.perf_counter()
            for loss, grad_norm in args:
                monitor.observe(step, loss=loss, grad_norm=grad_norm, learning_rate=1e-3)
                step += 1
            per_call.append((time.perf_counter() - start) / calls * 1e6)
        monitor.close()
        results[kind] = {"us": statistics.median(per_call), "us_min": min(per_call), "calls": calls * repeats}
    return results


def measure_memory(steps: int, traced_steps: int) -> dict:
    """RSS over ``steps`` float observe() calls, then tracemalloc growth over ``traced_steps`` more.

    The tracemalloc part is separate because tracing makes every allocation several times slower.
    """
    monitor = _monitor()
    warm = min(10_000, steps // 10)
    for step in range(warm):  # windows fill up: later growth is what would grow forever
        monitor.observe(step, loss=_loss_at(step), grad_norm=0.5, learning_rate=1e-3)
    gc.collect()
    rss_start = resident_bytes()
    start = time.perf_counter()
    checkpoints = []
    for step in range(warm, steps):
        monitor.observe(step, loss=_loss_at(step), grad_norm=0.5, learning_rate=1e-3)
        if (step + 1) % (steps // 4) == 0:
            checkpoints.append({"step": step + 1, "rss_mb": resident_bytes() / 2**20})
    elapsed = time.perf_counter() - start
    gc.collect()
    rss_end = resident_bytes()

    tracemalloc.start()
    traced_before = tracemalloc.get_traced_memory()[0]
    for step in range(steps, steps + traced_steps):
        monitor.observe(step, loss=_loss_at(step), grad_norm=0.5, learning_rate=1e-3)
    gc.collect()
    traced_after = tracemalloc.get_traced_memory()[0]
    top = tracemalloc.take_snapshot().statistics("lineno")[:3]
    tracemalloc.stop()
    monitor.close()
    return {
        "steps": steps,
        "seconds": elapsed,
        "us_per_observe": elapsed / (steps - warm) * 1e6,
        "rss_start_mb": rss_start / 2**20,
        "rss_end_mb": rss_end / 2**20,
        "rss_growth_mb": (rss_end - rss_start) / 2**20,
        "rss_checkpoints": checkpoints,
        "traced_steps": traced_steps,
        "tracemalloc_growth_kb": (traced_after - traced_before) / 1024,
        "tracemalloc_top": [str(s) for s in top],
    }
