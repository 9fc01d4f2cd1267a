"""The rules split in two stages for a sharded set-up: per-rank work on every shard, the rest once.

``alerting/rules.yml`` evaluates everything on one Prometheus. Past a few thousand ranks
(docs/scale.md) the ranks are split over shard Prometheus servers (``hashmod`` on the target
address, deploy/sharding/) that each scrape and judge their own ranks (``rules-shard.yml``:
every rule of one rank, which needs only that rank's series, and each job's partial aggregates
over the shard's ranks), and remote-write what the global stage reads to one global Prometheus
(``rules-global.yml``: the job-level series from the shards' partials, the medians and
z-scores across ranks, the count of ranks present against the world size, and the cross-rank
alerts). Thanos and Mimir rulers take the same two files: the shard file where the ranks'
samples are, the global one where every shard of a job is (a global query or tenant).

A recording rule is the shard's when it reads one rank's series, or reduces a shard's ranks to a
partial (its labels include ``shard``); the global's when it combines partials, or compares
ranks: a job-level aggregate, or a per-rank rule that reads a job-level series
(``on(job, run_id) group_left``: a rank's z-score against the job's median).
"""

from __future__ import annotations

import re

from lossbeat.diagnosis.thresholds import Thresholds, load_thresholds
from lossbeat.mixin.alert_rules import SHARD, RecordingRule, all_records, rule_groups

__all__ = [
    "STAGES",
    "CROSS_RANK_GROUP",
    "GLOBAL_SUFFIX",
    "stage_groups",
    "stage_of",
    "stage_of_record",
    "series_names",
    "forwarded_names",
]

STAGES = ("shard", "global")
CROSS_RANK_GROUP = "lossbeat.cross_rank"
"""The alerts that compare the ranks of a job: the global stage's."""
GLOBAL_SUFFIX = ".global"
"""A group with rules in both stages keeps its name on the shards and takes this suffix on the
global (the two stages may share one ruler)."""
_NAME = re.compile(r"[a-zA-Z_][\w]*(?::[\w]+){2}")


def stage_of(rule: RecordingRule, records: dict[str, RecordingRule]) -> str:
    """``shard`` or ``global`` for ``rule``, given every record by name (what it may read)."""
    if SHARD in rule.keeps:
        return "shard"
    read = [records[name] for name in _NAME.findall(rule.expr) if name in records]
    if any(SHARD in r.keeps for r in read):
        return "global"
    across = "rank" not in rule.keeps or "group_left" in rule.expr
    return "global" if across else "shard"


def stage_of_record(record: str, thresholds: Thresholds | None = None) -> str:
    """``shard`` for a rule over one rank's own series or one shard's ranks, ``global`` for one across the
    ranks of a job."""
    records = {r.record: r for r in all_records(thresholds or load_thresholds())}
    return stage_of(records[record], records)


def stage_groups(thresholds: Thresholds, stage: str) -> list[dict]:
    """The rule groups of ``stage`` (:data:`STAGES`), in ``rules.yml``'s order."""
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {', '.join(STAGES)}, got {stage!r}")
    records = {r.record: r for r in all_records(thresholds)}
    out = []
    for group in rule_groups(thresholds):
        stages = [
            stage_of(records[r["record"]], records)
            if "record" in r
            else ("global" if group["name"] == CROSS_RANK_GROUP else "shard")
            for r in group["rules"]
        ]
        rules = [r for r, s in zip(group["rules"], stages) if s == stage]
        if not rules:
            continue
        name = group["name"] + (GLOBAL_SUFFIX if stage == "global" and "shard" in stages else "")
        out.append({"name": name, **({"interval": group["interval"]} if "interval" in group else {}), "rules": rules})
    return out


def series_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers that are not functions, keywords, label
    lists, strings, numbers or range durations."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    names = set(re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\b(?!\s*\()", text))
    return names - {"and", "or", "unless", "bool", "offset", "NaN", "Inf", "group_left", "group_right"}


def forwarded_names(thresholds: Thresholds) -> set[str]:
    """The series the global stage reads and does not record itself: what each shard must
    remote-write to it (deploy/sharding's ``write_relabel_configs`` keep them, and no more)."""
    groups = stage_groups(thresholds, "global")
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    return {n for g in groups for r in g["rules"] for n in series_names(r["expr"])} - recorded
