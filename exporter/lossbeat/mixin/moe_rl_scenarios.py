"""The promtool scenarios of TrainingMoERouterCollapse, TrainingRLEntropyCollapse and
TrainingRLKLExploded: a bad series fires after its ``for`` with its exact labels (the layer, for a
router), a series just inside the threshold and a healthy one stay silent; values from the thresholds."""

from __future__ import annotations

import math

from lossbeat.mixin.rule_series import Expect, Scenario, _Builder, _target

__all__ = ["moe_rl_scenarios"]


def _moe(b: _Builder) -> list[Scenario]:
    moe = b.t.moe
    rule = b.rule("TrainingMoERouterCollapse")
    at = b.after_for(moe.for_)
    n = int(at // b.i) + 2
    experts = 64
    dead_bad = math.ceil(moe.dead_fraction * experts)

    def layer(name: str, imbalance: float, dead: float) -> list:
        labels = _target(layer=name)
        return [
            b.hold("training_moe_load_imbalance", labels, imbalance, n),
            b.hold("training_moe_dead_experts", labels, dead, n),
            b.hold("training_moe_experts", labels, experts, n),
        ]

    bad = moe.imbalance_max * 2
    return [
        Scenario(
            "a layer's imbalance above the bound fires after its for, for that layer only",
            layer("layers.3.mlp", bad, 0) + layer("layers.4.mlp", 1.2, 0),
            [(at, rule.name, [Expect(rule, _target(layer="layers.3.mlp"), bad)]), (at - 2 * b.i, rule.name, [])],
        ),
        Scenario(
            "a layer with dead experts at the fraction fires",
            layer("layers.0.mlp", 1.2, dead_bad),
            [(at, rule.name, [Expect(rule, _target(layer="layers.0.mlp"), dead_bad / experts)])],
        ),
        Scenario(
            "just inside both bounds is silent",
            layer("layers.0.mlp", moe.imbalance_max * 0.99, dead_bad - 1),
            [(at, rule.name, [])],
        ),
        Scenario("a balanced router is silent", layer("layers.0.mlp", 1.1, 0), [(at, rule.name, [])]),
    ]


def _judged(b: _Builder, alert: str, check: str, for_: str) -> list[Scenario]:
    rule = b.rule(alert)
    at = b.after_for(for_)
    n = int(at // b.i) + 2
    labels = _target(check=check, component="")
    status = lambda v: [b.hold("training_health_status", labels, v, n)]  # noqa: E731
    return [
        Scenario(
            f"{check} judged a danger fires after its for",
            status(2),
            [(at, alert, [Expect(rule, labels if "check" in rule.keeps else _target(), 2)]), (at - 2 * b.i, alert, [])],
        ),
        Scenario(f"{check} judged a warning is silent", status(1), [(at, alert, [])]),
        Scenario(f"{check} judged good is silent", status(0), [(at, alert, [])]),
    ]


def _kl(b: _Builder) -> list[Scenario]:
    p = b.t.rl_policy
    rule = b.rule("TrainingRLKLExploded")
    at = b.after_for(p.kl_for)
    n = int(at // b.i) + 2
    kl = lambda v: [b.hold("training_signal", _target(signal="kl"), v, n)]  # noqa: E731
    bad = p.kl_bound * 3
    return [
        Scenario(
            "a KL above its bound fires after its for",
            kl(bad),
            [(at, rule.name, [Expect(rule, _target(), bad)]), (at - 2 * b.i, rule.name, [])],
        ),
        Scenario("a KL just inside its bound is silent", kl(p.kl_bound * 0.99), [(at, rule.name, [])]),
        Scenario("a healthy KL is silent", kl(0.02), [(at, rule.name, [])]),
    ] + _judged(b, "TrainingRLKLExploded", "rl_kl", p.kl_for)


def moe_rl_scenarios(b: _Builder) -> dict[str, list[Scenario]]:
    p = b.t.rl_policy
    return {
        "TrainingMoERouterCollapse": _moe(b),
        "TrainingRLEntropyCollapse": _judged(b, "TrainingRLEntropyCollapse", "rl_entropy", p.entropy_for),
        "TrainingRLKLExploded": _kl(b),
    }
