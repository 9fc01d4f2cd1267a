"""What ``pipeline_group`` adds to a gradient measurement: one all-reduce of one float64 scalar.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/pipeline_cost.py

Each rank is one stage (a stack of Linear layers with gradients). Interleaved round by round,
the same stage's ``compute_grad_norms`` (per-layer and global) is timed with and without the
pipeline group, and the bare scalar all-reduce alone; rank 0 prints the medians as JSON. On
gloo/CPU this is the gloo round trip; under NCCL the all-reduce is enqueued on the stream (no
host wait), so the host-side cost is the launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

import torch
import torch.distributed as dist

from lossbeat.measure.gradients import LayerGrouping, compute_grad_norms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    stage = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    stage(torch.randn(4, args.width)).square().mean().backward()
    group = dist.new_group(list(range(dist.get_world_size())))
    plain, piped = LayerGrouping(stage), LayerGrouping(stage, pipeline_group=group)
    scalar = torch.zeros((), dtype=torch.float64)
    timings: dict[str, list[float]] = {"stage_only_us": [], "with_pipeline_group_us": [], "scalar_all_reduce_us": []}
    compute_grad_norms(piped)  # the first-time handshake, outside the timing
    for _ in range(args.rounds):
        for key, run in (
            ("stage_only_us", lambda: compute_grad_norms(plain)),
            ("with_pipeline_group_us", lambda: compute_grad_norms(piped)),
            ("scalar_all_reduce_us", lambda: dist.all_reduce(scalar, group=group)),
        ):
            dist.barrier(group=group)
            started = time.perf_counter()
            run()
            timings[key].append((time.perf_counter() - started) * 1e6)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in stage.parameters())
        print(
            json.dumps(
                {
                    "stage_parameters": params,
                    "tensors": len(plain.params),
                    "ranks": dist.get_world_size(),
                    **{k: round(statistics.median(v), 1) for k, v in timings.items()},
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
