"""The alerts of the router and policy checks, from the thresholds' ``moe`` and ``rl_policy``:
TrainingMoERouterCollapse (per layer, from the raw per-layer gauges), TrainingRLEntropyCollapse
(the judged ``rl_entropy`` check) and TrainingRLKLExploded (the raw KL past its bound, or the
judged ``rl_kl`` check).

Plain mappings of :class:`lossbeat.mixin.alert_rules.AlertRule`'s fields, which builds them
(this module imports nothing of it: no import circle).
"""

from __future__ import annotations

from typing import Any

from lossbeat.diagnosis.thresholds import Thresholds

__all__ = ["moe_rl_alerts", "MOE_GROUP", "TARGET_LAYER"]

MOE_GROUP = "lossbeat.loss"  # beside the RL alerts: what the model learns, not its liveness
_TARGET = ("job", "run_id", "instance", "rank")
TARGET_LAYER = _TARGET + ("layer",)
_BY = ", ".join(_TARGET)
_VALUE = '{{ $value | printf "%.4g" }}'
_WHO = "Rank {{ $labels.rank }} of job {{ $labels.job }}"


def _number(value: float) -> str:
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def moe_rl_alerts(t: Thresholds) -> list[dict[str, Any]]:
    moe, p = t.moe, t.rl_policy
    imbalance, dead = _number(moe.imbalance_max), _number(moe.dead_fraction)
    by_layer = ", ".join(TARGET_LAYER)
    bound = _number(p.kl_bound)
    return [
        {
            "name": "TrainingMoERouterCollapse",
            "group": MOE_GROUP,
            "severity": "critical",
            "expr": (
                f"max by ({by_layer}) (training_moe_load_imbalance) > {imbalance}\n"
                f"or max by ({by_layer}) (training_moe_dead_experts / training_moe_experts) >= {dead}\n"
            ),
            "for_": moe.for_,
            "summary": "A mixture-of-experts router collapsed onto a few experts",
            "description": (
                f"{_WHO}, MoE layer {{{{ $labels.layer }}}}: its router sends most tokens to a few experts "
                f"for {moe.for_} (value {_VALUE}: the busiest expert's tokens over the mean per expert, above "
                f"{imbalance}, or the fraction of its experts with no token in {moe.dead_window_steps} steps, "
                f"at or above {dead}). The other experts train on nothing; the loss shows it late."
            ),
            "condition": (
                f"a layer's training_moe_load_imbalance > {imbalance}, or its dead experts >= {dead} of its "
                f"experts, for {moe.for_}"
            ),
            "action": "raise the load-balancing loss coefficient or add a router z-loss; restart before the collapse",
            "keeps": TARGET_LAYER,
        },
        {
            "name": "TrainingRLEntropyCollapse",
            "group": "lossbeat.loss",
            "severity": "critical",
            "expr": 'training_health_status{check="rl_entropy",component=""} == 2\n',
            "for_": p.entropy_for,
            "summary": "The RL policy's entropy collapsed while its reward stalls",
            "description": (
                f"{_WHO}: the exporter judges (status {_VALUE}) the policy's entropy collapsed to at most "
                f"{p.entropy_collapse_fraction:.0%} of its early level while the reward stalls, for {p.entropy_for}. "
                "The policy no longer explores and no longer improves."
            ),
            "condition": (
                f"entropy <= {_number(p.entropy_collapse_fraction)} x its early level and the reward not rising, "
                f"judged for {p.entropy_for}"
            ),
            "action": "raise the temperature or add an entropy bonus / clip-higher; lower the LR",
            "keeps": _TARGET + ("check", "component"),
        },
        {
            "name": "TrainingRLKLExploded",
            "group": "lossbeat.loss",
            "severity": "critical",
            "expr": (
                f'max by ({_BY}) (training_signal{{signal="kl"}}) > {bound}\n'
                f'or max by ({_BY}) (training_health_status{{check="rl_kl"}}) == 2\n'
            ),
            "for_": p.kl_for,
            "summary": "The RL policy's KL to the reference exploded",
            "description": (
                f"{_WHO}: the KL to the reference model is past its bound for {p.kl_for} (value {_VALUE}: the KL "
                f"above {bound} nats per token, or 2 when the exporter judged it grown more than "
                f"{_number(p.kl_growth)}x its early level). The policy left the reference: reward hacking or an "
                "LR too high."
            ),
            "condition": (
                f"KL > {bound}, or judged grown > {_number(p.kl_growth)}x its early level (and > {_number(p.kl_bound / 10)}), "
                f"for {p.kl_for}"
            ),
            "action": "raise beta, lower the LR, read the latest completions for reward hacking",
            "keeps": _TARGET,
        },
    ]
