"""The Overview dashboard's panels of MoE routers and RL policies: the router load imbalance per
layer (a heatmap, one row per layer), the dead experts and the router's auxiliary losses; the
policy's entropy, its KL to the reference and its reward. Every bound from the thresholds.

Built with :mod:`lossbeat.mixin.dashboards`' own panel helpers, passed in (no import circle).
Only runs that pass ``expert_load`` or RL signals have these series: the panels may be empty.
"""

from __future__ import annotations

import math
from typing import Callable

from lossbeat.diagnosis.moe import ROUTER_LOSSES
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.mixin.heatmaps import heatmap_options as heatmap_options_for

__all__ = ["moe_rl_panels", "OPTIONAL_METRICS"]

OPTIONAL_METRICS = ("training_moe_", "training_signal{")
"""Series only MoE runs and runs with named signals export."""


def moe_rl_panels(
    t: Thresholds,
    heatmap: Callable[..., dict],
    timeseries: Callable[..., dict],
    targets: Callable[..., list],
    selector: Callable[..., str],
    thresholds: Callable[..., dict],
) -> list[dict]:
    moe, p = t.moe, t.rl_policy
    imbalance = selector("training_moe_load_imbalance")
    dead = f"{selector('training_moe_dead_experts')} / {selector('training_moe_experts')}"
    routers = "|".join(sorted(ROUTER_LOSSES))
    signal = lambda names: selector("training_signal", matchers=f'signal=~"{names}"')  # noqa: E731
    # Green at a uniform load (1), red from the collapse bound up; no cell is hidden.
    heatmap_options = heatmap_options_for(
        "RdYlGn", reverse_colours=True, hide_below=-math.inf, min=1.0, max=float(moe.imbalance_max)
    )
    return [
        heatmap(
            "Router load imbalance per layer",
            "Each MoE layer's load imbalance (the busiest expert's tokens over the mean per expert; 1 is uniform), "
            f"the largest over the selected ranks; one row per layer. Red from {moe.imbalance_max:g} "
            "(moe.imbalance_max): TrainingMoERouterCollapse.",
            "none",
            targets((f"max by (layer) ({imbalance})", "{{layer}}")),
            size=(24, 10),
            options=heatmap_options,
        ),
        timeseries(
            "Dead experts per layer",
            f"Fraction of each MoE layer's experts that got no token in the last {moe.dead_window_steps} steps "
            f"(moe.dead_window_steps); red from {moe.dead_fraction:g} (moe.dead_fraction).",
            "percentunit",
            targets((f"max by (layer) ({dead})", "{{layer}}")),
            thresholds=thresholds("green", (moe.dead_fraction, "red")),
            threshold_style="dashed",
        ),
        timeseries(
            "Router auxiliary losses",
            "The routers' load-balancing and z-losses, passed as loss components (exported, not judged as a loss).",
            "none",
            targets(
                (selector("training_loss_component", matchers=f'component=~"{routers}"'), "{{component}} rank {{rank}}")
            ),
        ),
        timeseries(
            "Policy entropy",
            "The RL policy's entropy (TRL entropy, verl actor/entropy, ...). TrainingRLEntropyCollapse pages when it "
            f"falls to {p.entropy_collapse_fraction:.0%} of its early level (rl_policy.entropy_collapse_fraction) "
            "while the reward stalls.",
            "none",
            targets((signal("entropy"), "entropy rank {{rank}}")),
            size=(8, 8),
        ),
        timeseries(
            "KL to the reference",
            f"The KL to the reference model, the step's policy KL and the trainer/inference mismatch KL. Red above "
            f"{p.kl_bound:g} (rl_policy.kl_bound): TrainingRLKLExploded. Log scale.",
            "none",
            targets((signal("kl|policy_kl|mismatch_kl"), "{{signal}} rank {{rank}}")),
            size=(8, 8),
            thresholds=thresholds("green", (p.kl_bound, "red")),
            threshold_style="dashed",
            log_scale=True,
        ),
        timeseries(
            "Reward",
            "The reward, its spread within groups and the fraction of groups without spread "
            "(TrainingRLSignalCollapsed).",
            "none",
            targets((signal("reward|reward_std|frac_reward_zero_std|clip_ratio"), "{{signal}} rank {{rank}}")),
            size=(8, 8),
        ),
    ]
