"""Is a mixture-of-experts router healthy? The ``moe_router`` check, per layer, never per expert.

A router that collapses onto a few experts wastes most of the model long before the loss shows
it. Each step's per-layer statistics (``observe(expert_load=...)``, measured on the device by
:mod:`lossbeat.measure.experts`) are kept here as the latest vectors (a reference swap per step);
the check reads them at each diagnosis: a layer whose load imbalance is above ``moe.imbalance_max``
or whose dead experts reach ``moe.dead_fraction`` of its experts on ``moe.collapse_diagnoses``
diagnoses in a row has collapsed. Work per diagnosis: one pass over the layers (at most 256).

The router's auxiliary losses (load balancing, z-loss), given as loss components under one of
:data:`ROUTER_LOSSES`' names, are exported (``training_loss_component``) but not judged as a loss:
they sit near their minimum by design, far below any language-model loss range.
"""

from __future__ import annotations

import math

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.policy_thresholds import MoEThresholds

__all__ = ["MoETrack", "check_moe_router", "is_router_loss", "ROUTER_LOSSES", "CHECK"]

CHECK = "moe_router"
ROUTER_LOSSES = frozenset(
    {
        "aux_loss",
        "router_aux_loss",
        "load_balancing_loss",
        "balance_loss",
        "moe_aux_loss",
        "router_z_loss",
        "z_loss",
        "moe_z_loss",
    }
)
"""Loss component names taken for a router's auxiliary loss (HF's ``aux_loss``, Megatron's
``load_balancing_loss`` and ``z_loss``, ST-MoE's router z-loss)."""

_FIX = (
    "raise the load-balancing loss coefficient (Switch: 0.01) or add a router z-loss (ST-MoE: 0.001), lower "
    "the router's learning rate, check that the aux loss is added to the loss that is backpropagated, and "
    "restart from a checkpoint before the collapse; with capacity-limited routing, raise the capacity factor"
)


def is_router_loss(name: str) -> bool:
    return name in ROUTER_LOSSES


class MoETrack:
    """The latest per-layer router statistics and each layer's run of diagnoses past a bound."""

    __slots__ = ("names", "imbalance", "dead", "experts", "step", "runs", "window")

    def __init__(self, window: int) -> None:
        self.names: tuple[str, ...] = ()
        self.imbalance: list[float] = []
        self.dead: list[float] = []
        self.experts: list[int] = []
        self.step: int | None = None
        self.runs: dict[str, int] = {}
        self.window = window

    def push(
        self, step: int, names: tuple[str, ...], imbalance: list[float], dead: list[float], experts: list[int]
    ) -> None:
        """One step's statistics (every step: references kept, nothing computed)."""
        self.step, self.names, self.imbalance, self.dead, self.experts = step, names, imbalance, dead, experts


def check_moe_router(track: MoETrack | None, t: MoEThresholds) -> Finding | None:
    """The ``moe_router`` finding (None: no expert load was ever observed). ``t``: the ``moe`` thresholds."""
    if track is None or not track.names:
        return None
    runs = track.runs
    worst: tuple[int, str, str] | None = None
    balanced = 0.0
    dead_total = 0
    for name, imbalance, dead, experts in zip(track.names, track.imbalance, track.dead, track.experts):
        why = []
        if imbalance > t.imbalance_max:  # NaN (no token routed this step) is never past it
            why.append(f"imbalance {imbalance:.3g} (above {t.imbalance_max:g})")
        if experts and dead / experts >= t.dead_fraction:
            why.append(f"{int(dead)} of {experts} experts dead (no token in {track.window} steps)")
        run = runs[name] = runs.get(name, 0) + 1 if why else 0
        if why and (worst is None or run > worst[0]):
            worst = (run, name, ", ".join(why))
        if math.isfinite(imbalance):
            balanced = max(balanced, imbalance)
        dead_total += int(dead)
    if len(runs) > len(track.names):  # layers no longer given: forget them (bounded)
        for name in set(runs) - set(track.names):
            del runs[name]
    if worst is None:
        return Finding(
            CHECK,
            GOOD,
            f"{len(track.names)} MoE layer(s) balanced: highest imbalance {balanced:.3g}, {dead_total} dead expert(s)",
        )
    run, name, reasons = worst
    collapsed = sum(1 for n in track.names if runs.get(n, 0) >= t.collapse_diagnoses)
    if run >= t.collapse_diagnoses:
        more = f" (and {collapsed - 1} more layer(s))" if collapsed > 1 else ""
        return Finding(
            CHECK,
            DANGER,
            f"the router of layer {name} collapsed{more}: {reasons}, on each of the last {run} diagnoses: its "
            "tokens go to a few experts, the others train on nothing",
            _FIX,
        )
    return Finding(
        CHECK,
        WARNING,
        f"the router of layer {name} is unbalanced: {reasons} ({run} diagnosis(es) in a row; collapsed after "
        f"{t.collapse_diagnoses})",
        _FIX,
    )
