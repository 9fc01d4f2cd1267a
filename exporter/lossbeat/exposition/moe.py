"""The router statistics at scrape time: per MoE layer, never per expert (bounded cardinality:
three series per layer, at most ``MAX_MOE_LAYERS`` layers)."""

from __future__ import annotations

import math
from typing import Any, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from lossbeat.exposition.metrics import METRICS

__all__ = ["moe_families", "status_sections", "POLICY_SIGNALS", "STATUS_ROUTERS"]

POLICY_SIGNALS = (
    "entropy",
    "kl",
    "policy_kl",
    "mismatch_kl",
    "clip_ratio",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
)
"""The RL signals the status page shows, in this order, when the run logs them."""
STATUS_ROUTERS = 16
"""MoE layers the status page lists: the most unbalanced first."""

_SERIES = ("training_moe_load_imbalance", "training_moe_dead_experts", "training_moe_experts")


def moe_families(state: Any) -> Iterator[Metric]:
    """The three per-layer gauges of the last step observed with ``expert_load`` (none before one)."""
    moe = getattr(state, "moe", None)
    if not moe:
        return
    names, imbalance, dead, experts = moe  # swapped whole by the training thread
    rank = state.rank
    for metric, values in zip(_SERIES, (imbalance, dead, experts)):
        g = GaugeMetricFamily(metric, METRICS[metric].help, labels=("rank", "layer"))
        for name, value in zip(names, values):
            g.add_metric([rank, name], float(value) if math.isfinite(value) else math.nan)
        yield g


def status_sections(state: Any) -> dict[str, Any]:
    """The status page's ``routers`` (the most unbalanced MoE layers first) and ``policy`` (the RL
    signals) sections, each present only when the run has them."""
    out: dict[str, Any] = {}
    moe = getattr(state, "moe", None)
    if moe:
        names, imbalance, dead, experts = moe  # swapped whole
        rows = [
            {
                "layer": name,
                "imbalance": value if math.isfinite(value) else None,
                "dead": int(d) if math.isfinite(d) else None,
                "experts": int(e),
            }
            for name, value, d, e in zip(names, imbalance, dead, experts)
        ]
        rows.sort(key=lambda r: (-(r["dead"] or 0) / max(r["experts"], 1), -(r["imbalance"] or 0.0)))
        out["routers"] = {"layers": len(rows), "worst": rows[:STATUS_ROUTERS]}
    signals = state.signals  # swapped whole
    policy = {name: signals[name] for name in POLICY_SIGNALS if name in signals and math.isfinite(signals[name])}
    if "entropy" in policy or "kl" in policy:
        out["policy"] = policy
    return out
