"""What ``observe(expert_load=...)`` costs at 64 MoE layers x 128 experts: host reads and aten ops
per step, Python time per observe() with and without it, the judgment's time per diagnosis, the
series a scrape adds (per layer, never per expert) and the device memory it keeps.

    PYTHONPATH=exporter python -m benchmarks.moe_cost [--steps 200] [--write]

``--write`` stores the figures in benchmarks/moe_cost_results.json (docs/performance.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from prometheus_client import generate_latest

from benchmarks.counting import StepCounts, count_host_reads
from lossbeat.diagnosis.moe import check_moe_router
from lossbeat.exposition.moe import moe_families
from lossbeat.monitor import Monitor, MonitorConfig

__all__ = ["measure", "LAYERS", "EXPERTS"]

LAYERS, EXPERTS, TOP_K, TOKENS = 64, 128, 8, 4096
COUNTED = 20
RESULTS = Path(__file__).with_name("moe_cost_results.json")


def _loads(steps: int, device: str) -> list[dict[str, torch.Tensor]]:
    """Per step, each layer's tokens per expert (TOKENS tokens, top-k): built up front, not measured."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        counts = torch.multinomial(torch.ones(EXPERTS), TOKENS * TOP_K, replacement=True, generator=gen)
        per = torch.bincount(counts, minlength=EXPERTS).float().to(device)
        out.append({f"model.layers.{i}.mlp": per for i in range(LAYERS)})
    return out


def _monitor() -> Monitor:
    return Monitor(MonitorConfig(log_status_changes=False), serve=False)


def _run(steps: int, loads: list | None, device: str) -> tuple[float, StepCounts, Monitor]:
    """Mean µs per observe() over the steps (timed alone), then the counts of 20 more (counted alone:
    the dispatch mode that counts slows every op)."""
    monitor = _monitor()
    loss = torch.tensor(2.0, device=device)
    for step in range(5):  # warm-up: the meter's first step allocates its window
        monitor.observe(step, loss=loss, expert_load=loads[step] if loads else None)
    start = time.perf_counter()
    for step in range(5, steps):
        monitor.observe(step, loss=loss, expert_load=loads[step] if loads else None)
    monitor.flush()
    us = (time.perf_counter() - start) / (steps - 5) * 1e6
    counts = StepCounts()
    with count_host_reads(counts):
        for step in range(steps, steps + COUNTED):
            monitor.observe(step, loss=loss, expert_load=loads[step % steps] if loads else None)
        monitor.flush()
    return us, counts, monitor


def measure(steps: int = 200, device: str = "cpu", repeats: int = 3) -> dict:
    loads = _loads(steps, device)
    base_us, with_us = [], []
    for _ in range(repeats):
        us, base_counts, _ = _run(steps, None, device)
        base_us.append(us)
        us, counts, monitor = _run(steps, loads, device)
        with_us.append(us)
    n = steps - 5
    track = monitor.history.moe
    start = time.perf_counter()
    for _ in range(100):
        check_moe_router(track, monitor.thresholds.moe)
    judge_us = (time.perf_counter() - start) / 100 * 1e6
    body = generate_latest(monitor.registry).decode()
    moe_series = sum(1 for line in body.splitlines() if line.startswith("training_moe_"))
    start = time.perf_counter()
    for _ in range(20):
        generate_latest(monitor.registry)
    scrape_ms = (time.perf_counter() - start) / 20 * 1e3
    start = time.perf_counter()
    for _ in range(100):
        list(moe_families(monitor.state))
    render_us = (time.perf_counter() - start) / 100 * 1e6
    base = _run(20, None, device)[2]
    start = time.perf_counter()
    for _ in range(20):
        generate_latest(base.registry)
    scrape_ms_without = (time.perf_counter() - start) / 20 * 1e3
    window = monitor._experts.meter._last_seen
    return {
        "device": device,
        "torch": torch.__version__,
        "layers": LAYERS,
        "experts": EXPERTS,
        "steps": n,
        "host_reads_per_step": counts.host_reads / COUNTED,
        "host_reads_per_step_without": base_counts.host_reads / COUNTED,
        "device_reads_per_step": (counts.device_method_reads + counts.device_list_reads) / COUNTED,
        "ops_per_step_added": (counts.ops - base_counts.ops) / COUNTED,
        "kernel_ops_per_step_added": (counts.ops - counts.view_ops - base_counts.ops + base_counts.view_ops) / COUNTED,
        "observe_us": statistics.median(with_us),
        "observe_us_without": statistics.median(base_us),
        "moe_router_check_us": judge_us,
        "moe_series_per_rank": moe_series,
        "moe_families_us": render_us,
        "scrape_ms_with_moe": scrape_ms,
        "scrape_ms_without": scrape_ms_without,
        "window_bytes": window.numel() * window.element_size(),
        "packed_values_per_step": 2 * LAYERS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.steps, args.device)
    print(json.dumps(result, indent=2))
    if args.write:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
