"""What the optimizer guard costs a training step, measured side by side in one process.

Three variants train the same 10M model (benchmarks/models.py) on the same batches, one step
each in turn (a burst of load from the machine's other users lands on all three alike):

- ``bare``: torch's clip_grad_norm_ and optimizer.step();
- ``monitored``: lossbeat's clip, observe() and optimizer.step() (guard off);
- ``guarded``: the same with ``guard="skip"`` and ``monitor.step(optimizer)``.

The guard's cost is (guarded - monitored) / bare, as a median over windows of paired step
times, and as the direct time of the section that differs (observe + step). Host reads are
counted: the guard adds none on CPU (its flags ride the monitor's one transfer per step).

    python -m benchmarks.guard_cost [--steps 300] [--out benchmarks/guard_results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lossbeat.monitor import Monitor, MonitorConfig

from .models import MODEL_SPECS, build_workload, make_optimizer

WINDOW = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", default="10M")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("guard_results.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shared = build_workload(MODEL_SPECS[args.model])
    models = {
        name: shared.model if name == "bare" else _copy(shared.model) for name in ("bare", "monitored", "guarded")
    }
    optimizers = {name: make_optimizer(m) for name, m in models.items()}
    monitors = {
        "monitored": Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False),
        "guarded": Monitor(MonitorConfig(port=0, log_status_changes=False, guard="skip"), serve=False),
    }
    step_s = {name: [] for name in models}
    section_s = {name: [] for name in models}
    order = list(models)
    for step in range(args.steps):
        order = order[1:] + order[:1]  # rotated: no variant always runs first
        for name in order:
            model, optimizer = models[name], optimizers[name]
            tokens, targets = shared.batch(step)
            start = time.perf_counter()
            loss = model(tokens, targets)
            loss.backward()
            section = time.perf_counter()
            if name == "bare":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            else:
                monitor = monitors[name]
                grad_norm = monitor.clip_grad_norm_(model, 1.0)
                monitor.observe(step, loss=loss, grad_norm=grad_norm, optimizer=optimizer, model=model)
                if name == "guarded":
                    monitor.step(optimizer)
                else:
                    optimizer.step()
            end = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            step_s[name].append(end - start)
            section_s[name].append(end - section)
    warm = 20
    windows = range(warm, args.steps - WINDOW + 1, WINDOW)

    def mean(xs, i):
        return statistics.fmean(xs[i : i + WINDOW])

    paired = [(mean(step_s["guarded"], i) - mean(step_s["monitored"], i)) / mean(step_s["bare"], i) for i in windows]
    direct = (
        statistics.median(section_s["guarded"][warm:]) - statistics.median(section_s["monitored"][warm:])
    ) / statistics.median(step_s["bare"][warm:])
    guarded = monitors["guarded"]
    result = {
        "model": args.model,
        "parameters": shared.parameters,
        "steps": args.steps,
        "bare_step_ms": statistics.median(step_s["bare"][warm:]) * 1e3,
        "monitored_step_ms": statistics.median(step_s["monitored"][warm:]) * 1e3,
        "guarded_step_ms": statistics.median(step_s["guarded"][warm:]) * 1e3,
        "guard_cost_pct_paired_median": statistics.median(paired) * 100,
        "guard_cost_pct_direct": direct * 100,
        "host_transfers_per_step": guarded.host_transfers / args.steps,
        "guard_extra_host_reads": guarded._guard.host_reads,
        "skipped_steps": sum(guarded.state.skipped_steps.values()),
        "torch": torch.__version__,
    }
    for m in monitors.values():
        m.close()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


if __name__ == "__main__":
    raise SystemExit(main())
