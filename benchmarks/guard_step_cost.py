"""What the guarded section of a step costs (``observe()`` and ``monitor.step``), on a small model.

    python -m benchmarks.guard_step_cost [--steps 1500] [--guard skip] [--optimizers 1]

A small CPU MLP (the guard's bookkeeping, not the model, is what is timed): each step runs
forward and backward, then the timed section: ``monitor.clip_grad_norm_``, ``observe(loss,
grad_norm, model)`` and ``monitor.step`` for each optimizer. Prints the section's median and
minimum in µs, the host transfers per step (the monitor's one) and the guard's own host reads.
Run it under two checkouts (``PYTHONPATH=<checkout>/exporter``) to set them side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from lossbeat.monitor import Monitor, MonitorConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--guard", default="skip", choices=("off", "skip", "stop"))
    parser.add_argument("--optimizers", type=int, default=1, choices=(1, 2))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
    if args.optimizers == 2:
        optimizers = [
            torch.optim.AdamW(model[0].parameters(), lr=1e-3),
            torch.optim.AdamW(list(model[2].parameters()) + list(model[4].parameters()), lr=1e-3),
        ]
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    monitor = Monitor(MonitorConfig(port=0, guard=args.guard, log_status_changes=False), serve=False)
    x = torch.randn(32, 64)
    y = x[:, :1] * 0.5
    section = []
    for step in range(args.steps):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        start = time.perf_counter()
        grad_norm = monitor.clip_grad_norm_(model, 1.0)
        monitor.observe(step, loss=loss, grad_norm=grad_norm, model=model)
        for optimizer in optimizers:
            monitor.step(optimizer)
        section.append(time.perf_counter() - start)
    warm = min(200, args.steps // 4)
    result = {
        "guard": args.guard,
        "optimizers": args.optimizers,
        "steps": args.steps,
        "section_us_median": statistics.median(section[warm:]) * 1e6,
        "section_us_min": min(section[warm:]) * 1e6,
        "host_transfers_per_step": monitor.host_transfers / args.steps,
        "guard_host_reads": monitor._guard.host_reads,
        "skipped_steps": sum(monitor.state.skipped_steps.values()),
    }
    monitor.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
