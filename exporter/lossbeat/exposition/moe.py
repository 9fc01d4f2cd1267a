"""The router statistics at scrape time: per MoE layer, never per expert (bounded cardinality:
three series per layer, at most ``MAX_MOE_LAYERS`` layers)."""

from __future__ import annotations

import math
from typing import Any, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from lossbeat.exposition.metrics import METRICS

__all__ = ["moe_families"]

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
