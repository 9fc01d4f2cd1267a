"""What the cross-rank signals cost the training step (lossbeat.measure.cross_rank), measured.

    python benchmarks/cross_rank_cost.py [--model 10M] [--rounds 40]

Three variants of the same step (forward, backward, clip, AdamW), interleaved round by round
(benchmarks/overhead.py): no monitoring; lossbeat with per-layer norms but without the
cross-rank signals (grad_norm_align_every=0, work_time=False); the same with both
(grad_norm_align_every=100, work_time=True: three forward hooks, a perf_counter per hook and
a 50-float mean per step). The difference between the last two is their cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/cross_rank_cost.py`

import torch

from benchmarks.models import MODEL_SPECS, build_workload
from benchmarks.overhead import measure_overhead
from benchmarks.variants import LossbeatVariant, Variant


def variants() -> list[Variant]:
    return [
        Variant(),
        LossbeatVariant(
            "lossbeat_layers",
            "lossbeat, per-layer norms, no cross-rank signals",
            per_layer=True,
            grad_norm_align_every=0,
            work_time=False,
        ),
        LossbeatVariant(
            "lossbeat_layers_cross_rank",
            "the same + aligned grad norm + work time",
            per_layer=True,
            grad_norm_align_every=100,
            work_time=True,
        ),
    ]


def direct_cost_us(calls: int = 20_000, repeats: int = 5) -> dict[str, float]:
    """Microseconds per step the signals add, measured without a model's noise: a trivial
    module's forward with and without the three hooks, plus ``step_end`` and ``record``."""
    import time

    from lossbeat.measure.cross_rank import CrossRankSignals

    module, x = torch.nn.Identity(), torch.zeros(1)

    def per_call(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls)
        return best * 1e6

    bare = per_call(lambda: module(x))
    signals = CrossRankSignals("0", align_every=100, work_time=True)
    signals.step_end(module)  # hooks the module
    step = iter(range(10**9))

    def hooked_step() -> None:
        module(x)
        signals.step_end(module)
        signals.record(next(step), 1.0)

    hooked = per_call(hooked_step)
    signals.close()
    return {"forward_bare_us": bare, "forward_hooked_plus_bookkeeping_us": hooked, "added_us": hooked - bare}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="10M", choices=sorted(MODEL_SPECS))
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = build_workload(MODEL_SPECS[args.model])
    chosen = variants()
    try:
        results = measure_overhead(workload, chosen, args.rounds)
    finally:
        for v in chosen:
            v.close()
    out = {
        name: {
            "step_ms": r.step_ms,
            "paired_ratio": r.paired_ratio,
            "p25": r.paired_ratio_p25,
            "p75": r.paired_ratio_p75,
        }
        for name, r in results.items()
    }
    layers, cross = results["lossbeat_layers"], results["lossbeat_layers_cross_rank"]
    out["cross_rank_over_layers"] = cross.paired_ratio / layers.paired_ratio
    out["direct"] = direct_cost_us()
    print(json.dumps({"model": args.model, "rounds": args.rounds, **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
