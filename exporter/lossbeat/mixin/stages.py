"""The rules split in two stages for a sharded set-up: per-rank work on every shard, the rest once.

``alerting/rules.yml`` evaluates everything on one Prometheus. Past a few thousand ranks
(docs/scale.md) the ranks are split over shard Prometheus servers (``hashmod`` on the target
address, deploy/sharding/) that each scrape and judge their own ranks (``rules-shard.yml``:
every rule of one rank, which needs only that rank's series), and remote-write what they hold
to one global Prometheus (``rules-global.yml``: what compares the ranks of a job: the job-level
aggregates, the medians and z-scores across ranks, the count of ranks present, and the
cross-rank alerts). Thanos and Mimir rulers take the same two files: the shard file where the
ranks' samples are, the global one where every rank of a job is (a global query or tenant).

A per-rank recording rule belongs to the global stage when it reads a job-level series
(``on(job, run_id) group_left``): a rank's z-score against the job's median, its aligned
gradient norm at the job's latest aligned step.
"""

from __future__ import annotations

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.mixin.alert_rules import (LOOKBACK_GROUP, LOOKBACK_INTERVAL, RECORDING_GROUP, lookback_rules,
                                        recording_rules, rule_groups)

__all__ = ["STAGES", "CROSS_RANK_GROUP", "GLOBAL_RECORDING_GROUP", "stage_groups", "stage_of_record"]

STAGES = ("shard", "global")
CROSS_RANK_GROUP = "lossbeat.cross_rank"
"""The alerts that compare the ranks of a job: the global stage's."""
GLOBAL_RECORDING_GROUP = "lossbeat.recording.global"


def stage_of_record(record: str) -> str:
    """``shard`` for a rule over one rank's own series, ``global`` for one across the ranks of a job."""
    for rule in recording_rules() + lookback_rules():
        if rule.record == record:
            across = "rank" not in rule.keeps or "group_left" in rule.expr
            return "global" if across else "shard"
    raise KeyError(record)


def stage_groups(thresholds: Thresholds, stage: str) -> list[dict]:
    """The rule groups of ``stage`` (:data:`STAGES`), in ``rules.yml``'s order."""
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {', '.join(STAGES)}, got {stage!r}")
    out = []
    for group in rule_groups(thresholds):
        name = group["name"]
        if name in (RECORDING_GROUP, LOOKBACK_GROUP):
            rules = [r for r in group["rules"] if stage_of_record(r["record"]) == stage]
            if stage == "global" and name == RECORDING_GROUP:
                name = GLOBAL_RECORDING_GROUP  # its own name: the two stages may share one ruler
        else:
            rules = group["rules"] if (name == CROSS_RANK_GROUP) == (stage == "global") else []
        if rules:
            out.append({"name": name, **({"interval": LOOKBACK_INTERVAL} if name == LOOKBACK_GROUP else {}),
                        "rules": rules})
    return out
