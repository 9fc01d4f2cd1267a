"""The Prometheus recording and alerting rules, built from the thresholds.

Every number and duration comes from :class:`lossbeat.diagnosis.thresholds.Thresholds`;
:mod:`lossbeat.mixin.rules` renders these objects to files. Alert names, recording
rule names and the labels they keep are a contract with Alertmanager routing,
the dashboards and the runbooks.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TypedDict

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.mixin.moe_rl_rules import moe_rl_alerts

__all__ = [
    "AlertRule",
    "RecordingRule",
    "LOSS_DERIVED_ALERTS",
    "RECORDING_GROUP",
    "LOOKBACK_GROUP",
    "LOOKBACK_INTERVAL",
    "SUMMARY_GROUP",
    "CHECKS_SUMMARY_GROUP",
    "SLOW",
    "TICKETS",
    "group_intervals",
    "lookback_rules",
    "event_records",
    "all_records",
    "alert_rules",
    "recording_rules",
    "rule_groups",
    "number",
    "duration_seconds",
    "TARGET",
    "JOB_RANK",
    "ON_TARGET",
    "LOSS_AVG_5M",
    "LOSS_COMPONENT_AVG_5M",
]

RECORDING_GROUP = "lossbeat.recording"
NONFINITE_GROUP = "lossbeat.nonfinite"
GRADIENTS_GROUP = "lossbeat.gradients"
LOOKBACK_GROUP = "lossbeat.lookback"
"""Recording rules evaluated every ``LOOKBACK_INTERVAL``: what the long lookbacks of
TrainingExporterDown (6h) and TrainingRankDown (1h) need, kept per rank at O(1) per evaluation."""
LOOKBACK_INTERVAL = "1m"
SUMMARY_GROUP = "lossbeat.summary"
"""The recording rules only dashboards read (the job-level series, a few per-rank 5m means),
every SUMMARY_INTERVAL."""
CHECKS_SUMMARY_GROUP = "lossbeat.summary.checks"
"""The job's worst status of each check, every SUMMARY_INTERVAL: alone in its group, as it reads
every rank's 16 health checks."""
SUMMARY_INTERVAL = "1m"
SLOW = ".slow"
"""The suffix of a family's group of TICKETS (``lossbeat.loss.slow``, ...)."""
TICKETS = (
    "TrainingGradientVanishing",
    "TrainingLossPlateau",
    "TrainingLossVolatile",
    "TrainingLossOutOfRange",
    "TrainingOverfitting",
    "TrainingExporterErrors",
    "TrainingMemoryGrowing",
    "TrainingThroughputDropped",
)
"""Warnings that hold for 10 minutes or more before they fire, or count a counter over its window
(TrainingExporterErrors): judged every minute (:func:`group_intervals`) in their family's ``.slow``
group, not at every scrape; a ticket may wait a minute more. Together they read more than the
pages do."""
SEEN_WINDOW = "2m"
"""Raw samples a lookback rule or alert reads: a scrape and the lookback group's interval, so a
rank seen between two evaluations of the group is never missed (8 samples at 15 s)."""

# A target counts as a lossbeat exporter if it exposed the run info this recently.
EXPORTER_SEEN_LOOKBACK = "6h"

# Shared pieces of the annotation templates.
VALUE = '{{ $value | printf "%.4g" }}'
WHO = "rank {{ $labels.rank }} of job {{ $labels.job }}"
WHO_CAP = "Rank {{ $labels.rank }} of job {{ $labels.job }}"


@dataclass(frozen=True)
class RecordingRule:
    record: str
    """``level:metric:operations``."""
    expr: str
    keeps: tuple[str, ...]
    """Labels of the result series."""
    group: str = RECORDING_GROUP
    """Its rule group: a record that alerts read fresh sits in their group, before them (the
    rules of a group run in order, and each one sees what the ones before it wrote)."""
    per_series: bool = False
    """Keeps every label of the series it reads, aggregating nothing: a per-rank alert reads it,
    and a target's own labels (a pod, a namespace from service discovery) must reach Alertmanager."""


@dataclass(frozen=True)
class AlertRule:
    name: str
    group: str
    severity: str
    expr: str
    summary: str
    description: str
    """Go template; may use ``$labels.X`` and ``$value | printf "FMT"`` only."""
    condition: str
    """When it fires, in words with the numbers (the alert table of docs/metrics.md)."""
    action: str
    """The first thing to do (the alert table of docs/metrics.md)."""
    keeps: tuple[str, ...]
    """Labels of the expression's result series (before the rule's labels)."""
    for_: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    """Static labels besides ``severity``."""

    def to_rule(self, runbook_base: str) -> dict:
        rule: dict = {"alert": self.name, "expr": self.expr}
        if self.for_:
            rule["for"] = self.for_
        rule["labels"] = {"severity": self.severity, **self.labels}
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": f"{runbook_base}#{self.name.lower()}",
        }
        return rule


def number(value: float) -> str:
    """A threshold as PromQL and prose write it: ``10``, ``0.3``, ``1e-05``."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h|d|w|y)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1h30m``."""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"duration: expected a Prometheus duration like 5m, got {text!r}")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in parts)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


# The identity of one rank of one run. `run_id` (the run identity the exporter puts on every
# series: the Slurm job id, torchrun's run id, ...) keeps concurrent runs apart when they share
# a `job` label (every resubmission of one sbatch template, say); `instance` (the host:port
# its exporter serves on) keeps the ranks apart. Each per-rank aggregation, join and
# Alertmanager `equal:` keeps all four. JOB_RANK is the same tuple under its historical name.
TARGET = ("job", "run_id", "instance", "rank")
JOB_RANK = TARGET
ON_TARGET = f"on({', '.join(TARGET)})"
"""The vector matching of a join between two per-rank series of the same run."""


def level(keeps: tuple[str, ...]) -> str:
    """The ``level`` part of a recording rule's name: the labels it keeps."""
    return "_".join(keeps)


LOSS_AVG_5M = f"{level(TARGET)}:training_loss:avg_over_time5m"
"""Per-rank 5m mean of the training loss (recording rule)."""
LOSS_COMPONENT_AVG_5M = f"{level(TARGET + ('component',))}:training_loss_component:avg_over_time5m"
"""Per-rank 5m mean of each loss component (recording rule)."""


JOB = ("job", "run_id")
"""The labels that identify one run across its ranks, for cross-rank comparisons: the job name
and the run identity, so that two concurrent runs of one job name are never one population
(the ``job:`` recording rules keep both, under their historical level name)."""

# Cross-rank: how long a rank that stopped reporting is still named (older: rank="unknown").
RANK_SEEN_LOOKBACK = "1h"
RANK_DISCOVERY_GRACE = SEEN_WINDOW
"""How long a run reports before its never-seen ranks count as missing (rank="unknown"): its ranks'
first scrapes are spread over a scrape interval and their discovery, so a rule evaluated between
them would otherwise count a healthy run short at its start."""
# 0.6745 = the standard normal's 75th percentile: scales the MAD to a standard deviation.
MAD_TO_SIGMA = 0.6745


def _by(labels: tuple[str, ...]) -> str:
    return ", ".join(labels)


# Alerts judged from the loss: meaningless while the loss is not finite, so the Alertmanager
# configuration inhibits them while TrainingLossNaN fires for the same job and rank.
LOSS_DERIVED_ALERTS = (
    "TrainingLossOutOfRange",
    "TrainingLossVolatile",
    "TrainingLossDiverging",
    "TrainingLossPlateau",
    "TrainingLossSpikes",
    "TrainingOverfitting",
    "TrainingLearningRateSuspect",
)


def _status(check: str, component: str | None = "") -> str:
    """The exporter's judged status of ``check`` (``component=None``: every component)."""
    where = f'check="{check}"' + ("" if component is None else f',component="{component}"')
    return f"training_health_status{{{where}}}"


def recording_rules() -> list[RecordingRule]:
    """Shared aggregations for dashboards and alerts (fixed 5m windows: stable names).

    What an alert reads is recorded at every evaluation (``RECORDING_GROUP``); what only
    dashboards read, every minute (``SUMMARY_GROUP``: a 5m mean changes little in a minute).
    The job-level ones are computed in two steps, each once: every shard of a sharded set-up
    reduces its own ranks to one partial per job (``*_shard:*``, a sum, a count or a max:
    :func:`_shard_partials`), and the job's value combines the shards' partials
    (:func:`_job_summaries`). On one Prometheus the partials are the job's. The global
    Prometheus of a sharded set-up then reads a few series per job and shard, not the ranks'."""

    def per_rank(
        metric_operations: str, expr: str, extra: tuple[str, ...] = (), group: str = RECORDING_GROUP
    ) -> RecordingRule:
        """A rule per rank of each run: ``{by}`` in ``expr`` becomes the labels it keeps."""
        keeps = TARGET + extra
        return RecordingRule(f"{level(keeps)}:{metric_operations}", expr.format(by=", ".join(keeps)), keeps, group)

    return (
        [
            per_rank("training_loss:avg_over_time5m", "avg by ({by}) (avg_over_time(training_loss[5m]))"),
            per_rank(
                "training_loss_component:avg_over_time5m",
                "avg by ({by}) (avg_over_time(training_loss_component[5m]))",
                ("component",),
                SUMMARY_GROUP,
            ),
            per_rank(
                "training_grad_norm:avg_over_time5m",
                "avg by ({by}) (avg_over_time(training_grad_norm[5m]))",
                group=SUMMARY_GROUP,
            ),
            per_rank("training_steps:rate5m", "sum by ({by}) (rate(training_steps_total[5m]))"),
            per_rank(
                "training_step_duration_seconds:avg_over_time5m",
                "avg by ({by}) (avg_over_time(training_step_duration_seconds[5m]))",
                group=SUMMARY_GROUP,
            ),
            per_rank(
                "training_loss_spikes:increase5m",
                "sum by ({by}) (increase(training_loss_spikes_total[5m]))",
                group=SUMMARY_GROUP,
            ),
            # Each rank's work time once (the median and TrainingStraggler read it).
            RecordingRule(
                WORK_AVG_5M, f"avg by ({_by(JOB_RANK)}) (avg_over_time(training_rank_work_seconds[5m]))", JOB_RANK
            ),
            # The ranks present (reporting now, or gone after their completion marker), and the ranks
            # gone (seen in the last RANK_SEEN_LOOKBACK, not present): once per evaluation for every
            # rank, on the rank's own shard, where TrainingRankDown read them five times, each over
            # an hour of samples.
            RecordingRule(RANK_PRESENT, _present(), JOB_RANK + ("world_size",)),
            RecordingRule(
                RANK_GONE,
                f"group by ({_by(JOB_RANK)}) ({_seen_lately()})\nunless on({_by(JOB_RANK)}) {RANK_PRESENT}",
                JOB_RANK,
            ),
        ]
        + _shard_partials()
        + _job_summaries()
        + _cross_rank_recording_rules()
    )


SHARD = "shard"
"""The label a shard's remote write adds to its partials (deploy/sharding: ``write_relabel_configs``),
so that the global Prometheus tells them apart; absent on one Prometheus."""


def _partial(
    metric_operations: str, aggregation: str, expr: str, extra: tuple[str, ...] = (), group: str = SUMMARY_GROUP
) -> RecordingRule:
    """One shard's ``aggregation`` of ``expr`` per job (and ``extra``), by ``shard`` too: a label its
    ranks' series lack, and its remote write adds."""
    keeps = JOB + extra + (SHARD,)
    return RecordingRule(
        f"{level(('job',) + extra + (SHARD,))}:{metric_operations}",
        f"{aggregation} by ({_by(keeps)}) ({expr})",
        keeps,
        group,
    )


LOSS_SUM, LOSS_COUNT = "job_shard:training_loss:sum", "job_shard:training_loss:count"
EVAL_SUM, EVAL_COUNT = "job_shard:training_eval_loss:sum", "job_shard:training_eval_loss:count"
STEPS_RATE_SUM, STEPS_RATE_COUNT = "job_shard:training_steps:sum_rate5m", "job_shard:training_steps:count_rate5m"
PRESENT_COUNT = "job_world_size_shard:training_run:count_present"


def _shard_partials() -> list[RecordingRule]:
    """What the job-level rules need from a shard's ranks, reduced there: a few series per job."""
    steps_rate = f"{level(TARGET)}:training_steps:rate5m"
    return [
        _partial("training_loss:sum", "sum", "training_loss"),
        _partial("training_loss:count", "count", "training_loss"),
        _partial("training_eval_loss:sum", "sum", "training_eval_loss"),
        _partial("training_eval_loss:count", "count", "training_eval_loss"),
        _partial("training_grad_norm:max", "max", "training_grad_norm"),
        _partial("training_layer_grad_norm:max", "max", "training_layer_grad_norm", ("layer",)),
        _partial("training_steps:sum_rate5m", "sum", steps_rate),
        _partial("training_steps:count_rate5m", "count", steps_rate),
        _partial("training_tokens:rate5m", "sum", "rate(training_tokens_total[5m])"),
        _partial("training_health_status:max", "max", "training_health_status", ("check",), CHECKS_SUMMARY_GROUP),
        # TrainingRankDown reads this one: at every evaluation.
        _partial("training_run:count_present", "count", RANK_PRESENT, ("world_size",), RECORDING_GROUP),
    ]


def _job_summaries() -> list[RecordingRule]:
    """The job-level series of dashboards, from the shards' partials (every minute)."""
    job = _by(JOB)
    return [
        dataclasses.replace(r, group=SUMMARY_GROUP)
        for r in (
            RecordingRule("job:training_loss:avg", f"sum by ({job}) ({LOSS_SUM}) / sum by ({job}) ({LOSS_COUNT})", JOB),
            RecordingRule(
                "job:training_eval_loss:avg", f"sum by ({job}) ({EVAL_SUM}) / sum by ({job}) ({EVAL_COUNT})", JOB
            ),
            RecordingRule("job:training_grad_norm:max", f"max by ({job}) (job_shard:training_grad_norm:max)", JOB),
            RecordingRule(
                "job_layer:training_layer_grad_norm:max",
                f"max by ({job}, layer) (job_layer_shard:training_layer_grad_norm:max)",
                JOB + ("layer",),
            ),
            # Every rank takes the same steps: the job's step rate is their mean; tokens add up.
            RecordingRule(
                "job:training_steps:rate5m",
                f"sum by ({job}) ({STEPS_RATE_SUM}) / sum by ({job}) ({STEPS_RATE_COUNT})",
                JOB,
            ),
            RecordingRule("job:training_tokens:rate5m", f"sum by ({job}) (job_shard:training_tokens:rate5m)", JOB),
            # Worst status of each check across the job's ranks (0 good, 1 warning, 2 danger).
        )
    ] + [
        RecordingRule(
            "job_check:training_health_status:max",
            f"max by ({job}, check) (job_check_shard:training_health_status:max)",
            JOB + ("check",),
            CHECKS_SUMMARY_GROUP,
        )
    ]


def _cross_rank_recording_rules() -> list[RecordingRule]:
    """Median, MAD and robust z-score of the ranks' 5m mean losses, per job (after the 5m mean)."""
    job, job_rank = _by(JOB), _by(JOB_RANK)
    mean = LOSS_AVG_5M
    median = "job:training_loss:median_avg_over_time5m"
    mad = "job:training_loss:mad_avg_over_time5m"
    aligned = f"{level(JOB_RANK)}:training_grad_norm_aligned:latest_step"
    aligned_median = "job:training_grad_norm_aligned:median_latest_step"
    return [
        RecordingRule(median, f"quantile by ({job}) (0.5, {mean})", JOB),
        RecordingRule(mad, f"quantile by ({job}) (0.5, abs({mean} - on({job}) group_left {median}))", JOB),
        RecordingRule(
            f"{level(JOB_RANK)}:training_loss:robust_z5m",
            f"sum by ({job_rank}) ({MAD_TO_SIGMA} * ({mean} - on({job}) group_left {median})"
            f" / on({job}) group_left {mad})",
            JOB_RANK,
        ),
        # Each rank's aligned grad norm, kept only at the job's latest aligned step.
        RecordingRule(
            aligned,
            f"max by ({job_rank}) (training_grad_norm_aligned and on({_by(TARGET)}) "
            f"(training_grad_norm_aligned_step == on({job}) group_left "
            f"max by ({job}) (training_grad_norm_aligned_step)))",
            JOB_RANK,
        ),
        RecordingRule(aligned_median, f"quantile by ({job}) (0.5, {aligned})", JOB),
        # Each rank's departure from that median, only once every rank exporting aligned norms is
        # at that step: while the scrapes of a new aligned step come in, the ranks already there
        # would be compared among themselves (the median of a subset). TrainingRankGradientMismatch
        # reads the last complete comparison, so the moments in between neither fire nor reset it.
        RecordingRule(
            ALIGNED_DEPARTURE,
            f"max by ({job_rank}) (\n"
            f"  abs({aligned}\n"
            f"    - on({job}) group_left {aligned_median})\n"
            f"  / on({job}) group_left abs({aligned_median})\n"
            f")\nand on({job})\n"
            f"  count by ({job}) ({aligned})\n"
            f"  == count by ({job}) (training_grad_norm_aligned_step)",
            JOB_RANK,
        ),
        RecordingRule(
            "job:training_rank_work_seconds:median_avg_over_time5m", f"quantile by ({job}) (0.5, {WORK_AVG_5M})", JOB
        ),
        # Per run, the count of ranks present (the shards' counts added up) where it is not the
        # world size the ranks report (count_values writes the count into a label to compare).
        RecordingRule(
            RANKS_SHORT,
            f"sum by ({job}, world_size) ({PRESENT_COUNT})\nunless on({job}, world_size)\n"
            f'count_values by ({job}) ("world_size", sum by ({job}) ({PRESENT_COUNT}))',
            JOB + ("world_size",),
        ),
    ]


WORK_AVG_5M = f"{level(JOB_RANK)}:training_rank_work_seconds:avg_over_time5m"
ALIGNED_DEPARTURE = f"{level(JOB_RANK)}:training_grad_norm_aligned:relative_departure_complete_step"
"""|a rank's aligned grad norm - the job's median| / |median|, at the latest aligned step every rank reached."""
ALIGNED_LOOKBACK = "5m"
"""How long TrainingRankGradientMismatch holds the last complete comparison (Prometheus's staleness
window: a job that stops exporting aligned norms lets it go as its series go)."""
RANK_PRESENT = f"{level(JOB_RANK + ('world_size',))}:training_run:present"
"""1 for each rank of a run reporting now, or gone after its completion marker."""
RANK_GONE = f"{level(JOB_RANK)}:training_run:gone"
"""1 for each rank that reported ``training_run_info`` in the last RANK_SEEN_LOOKBACK and is not present."""
RANKS_SHORT = "job_world_size:training_run:ranks_short"
"""Per run whose count of present ranks is not the world size they report: that count."""
STEPS_LAST = f"{level(TARGET)}:training_steps_total:last"
"""Each rank's last step count, kept EXPORTER_SEEN_LOOKBACK after it was last seen."""
SEEN_AT = f"{level(TARGET)}:training_steps:last_seen_timestamp_seconds"
COMPLETED_LAST = f"{level(TARGET)}:training_run_completed:last"
"""Each rank's last completion marker, kept as long as STEPS_LAST."""
INFO_SEEN_AT = f"{level(JOB_RANK + ('world_size',))}:training_run:last_seen_timestamp_seconds"
"""When each rank last reported ``training_run_info``, kept RANK_SEEN_LOOKBACK, and a completed rank while
another rank of its run still reports."""
EVENT_COUNTERS = (
    "training_nonfinite_loss_total",
    "training_nonfinite_grad_total",
    "training_grad_explosions_total",
    "training_exporter_errors_total",
    "training_skipped_steps_total",
    "training_guard_level_changes_total",
)
"""The counters of events that alert once per event: each is remembered across gaps."""
EVENT_MEMORY = "7d"
"""How long a rank's event counters are remembered after it last showed any event: a counter
that comes back within it (a scrape gap, a target unreachable for hours, a suspended job) at the
value it had is no new event."""
EVENT_BRIDGE = "1h"
"""How far back an event record looks for the value remembered before its window: a Prometheus
down (restarted, upgraded) for up to this long still finds it."""
EVENTS_SEEN_AT = f"{level(TARGET)}:training_run:events_last_seen_timestamp_seconds"
"""When each rank last showed a non-zero event counter, kept EVENT_MEMORY."""


def event_memory(counter: str) -> str:
    """The record holding ``counter``'s last non-zero value per series, kept while the rank's
    events are remembered (:data:`EVENT_MEMORY`) and its series is not back at zero."""
    return f"{level(TARGET)}:{counter.removesuffix('_total')}:last_nonzero"


def event_memory_rules() -> list[RecordingRule]:
    """The event counters' memory, carried by the lookback group like the other long lookbacks
    (instant reads of its own previous sample, O(1) per rank): one series per counter series
    that was ever non-zero, none for the healthy ranks."""
    t = _by(TARGET)
    now = [f"last_over_time({c}[{SEEN_WINDOW}])" for c in EVENT_COUNTERS]
    keep = number(duration_seconds(EVENT_MEMORY))
    seen = RecordingRule(
        EVENTS_SEEN_AT,
        f"group by ({t}) ({' or '.join(f'{n} > 0' for n in now)}) * 0 + time()\nor\n{EVENTS_SEEN_AT} > time() - {keep}",
        TARGET,
        LOOKBACK_GROUP,
    )
    memories = [
        RecordingRule(
            event_memory(c),
            f"{n} > 0\nor\n({event_memory(c)} and on({t}) {EVENTS_SEEN_AT} unless {n})",
            TARGET,
            LOOKBACK_GROUP,
            per_series=True,
        )
        for c, n in zip(EVENT_COUNTERS, now)
    ]
    return [seen, *memories]


def lookback_rules() -> list[RecordingRule]:
    """The long lookbacks as state carried from one evaluation to the next (group
    ``LOOKBACK_GROUP``, every ``LOOKBACK_INTERVAL``): each rule keeps what it recorded last time
    for the ranks it does not see now (``or`` its own previous sample), until it is too old.
    Every evaluation reads ``SEEN_WINDOW`` of raw samples and one recorded sample per rank:
    O(ranks), where ``last_over_time(x[6h])`` read every sample of six hours of every rank.
    The state lives in the recorded series: a Prometheus down for more than the 5m staleness
    window forgets the ranks that vanished before it came back (their alerts then need a rank
    seen since)."""
    t, jr = _by(TARGET), _by(JOB_RANK)
    keep_for, info_for = duration_seconds(EXPORTER_SEEN_LOOKBACK), duration_seconds(RANK_SEEN_LOOKBACK)
    seen_now = f"max by ({t}) (last_over_time(training_steps_total[{SEEN_WINDOW}]))"
    return [
        RecordingRule(
            SEEN_AT, f"{seen_now} * 0 + time()\nor\n{SEEN_AT} > time() - {number(keep_for)}", TARGET, LOOKBACK_GROUP
        ),
        RecordingRule(STEPS_LAST, f"{seen_now}\nor\n({STEPS_LAST} and on({t}) {SEEN_AT})", TARGET, LOOKBACK_GROUP),
        RecordingRule(
            INFO_SEEN_AT,
            f"group by ({jr}, world_size) (last_over_time(training_run_info[{SEEN_WINDOW}])) * 0 + time()\n"
            f"or\n{INFO_SEEN_AT} > time() - {number(info_for)}\n"
            # A rank that completed stays seen while a rank of its run reports: rank 0's wrap-up
            # (a final save, push_to_hub, an evaluation) may outlast the lookback.
            f"or\n({INFO_SEEN_AT} and on({jr}) {COMPLETED_LAST} == 1 and on(job, run_id) "
            f"group by (job, run_id) (training_run_info))",
            JOB_RANK + ("world_size",),
            LOOKBACK_GROUP,
        ),
        # Kept while either lookback remembers the rank.
        RecordingRule(
            COMPLETED_LAST,
            f"max by ({t}) (max_over_time(training_run_completed[{SEEN_WINDOW}]))\n"
            f"or\n({COMPLETED_LAST} and on({t}) ({SEEN_AT} or on({t}) {INFO_SEEN_AT}))",
            TARGET,
            LOOKBACK_GROUP,
        ),
        *event_memory_rules(),
    ]


def _completed() -> str:
    """The ranks whose last word was the completion marker: recorded, or in the raw window the
    lookback group has not recorded yet."""
    t = _by(TARGET)
    return f"({COMPLETED_LAST} == 1 or max by ({t}) (max_over_time(training_run_completed[{SEEN_WINDOW}])) == 1)"


def _seen_lately() -> str:
    """The ranks (with their world size) that reported ``training_run_info`` in the last RANK_SEEN_LOOKBACK."""
    jr = _by(JOB_RANK)
    return (
        f"group by ({jr}, world_size) ({INFO_SEEN_AT} or "
        f"group by ({jr}, world_size) (last_over_time(training_run_info[{SEEN_WINDOW}])))"
    )


def _present() -> str:
    jr = _by(JOB_RANK)
    return (
        f"group by ({jr}, world_size) (training_run_info)\nor on({jr})\n({_seen_lately()} and on({jr}) {_completed()})"
    )


def _nonfinite_alerts(t: Thresholds) -> list[AlertRule]:
    a, scale_min = t.alerts, number(t.gradients.loss_scale_min)
    return [
        AlertRule(
            name="TrainingLossNaN",
            group="lossbeat.nonfinite",
            severity="critical",
            expr=(
                f"{_events(t)['nonfinite_loss'].nonzero}\n"
                "or\n"
                "training_loss != training_loss\n"
                # A NaN step the optimizer guard kept from the optimizer is a skip (a ticket,
                # TrainingStepsSkipped), not a page: the weights never saw it.
                f"  unless {ON_TARGET} training_guard_consecutive_skips > 0\n"
            ),
            summary="The training loss is NaN or infinite",
            description=(
                f"{WHO_CAP} produced a non-finite loss: {VALUE} non-finite steps in the last "
                f"{a.event_window} (NaN: the current loss itself is NaN). Those steps teach the model nothing "
                "and usually poison the weights."
            ),
            condition=f"any step with a NaN/Inf loss within {a.event_window}, or the current loss is NaN",
            action="stop or roll back; lower the LR 10x, check the data for NaN/Inf",
            keeps=TARGET,
        ),
        *_gradient_nonfinite_alerts(t),
        AlertRule(
            name="TrainingLossScaleCollapsed",
            group="lossbeat.nonfinite",
            severity="critical",
            expr=f"training_grad_scale < {scale_min}\n",
            for_=a.loss_scale_for,
            summary="The fp16 loss scale collapsed: nearly every step is skipped",
            description=(
                f"{WHO_CAP} has a GradScaler loss scale of {VALUE}, below {scale_min}: its gradients overflow "
                "at almost every step even unscaled, so the scaler skips those steps and the model stops learning."
            ),
            condition=f"the fp16 GradScaler's loss scale below {scale_min} for {a.loss_scale_for}",
            action="lower the LR, check the data for NaN/Inf, train in bf16; find the first bad op with anomaly detection",
            keeps=TARGET,
        ),
    ]


@dataclass(frozen=True)
class Events:
    """An event counter read by several alerts of one group: its ``increase()``, its growth since
    the value remembered before the window, and the ranks with events (normally none) recorded
    once per evaluation, first in the group, where each alert computed them again
    (TrainingGradientNonFinite's three rules read the counter sixteen times). The alerts read the
    records of the same evaluation: no delay, and every label of the counter's series kept.

    An event is an increase of the counter's value, judged against its own history: a series that
    comes back after a gap of any length (a failed scrape, a target unreachable for hours, a
    Prometheus restart) at the value it had is no new event. Only a series never seen before is
    taken at its face value (a new run's first events, counted before its first scrape)."""

    counter: str
    window: str
    group: str
    counted: bool = True
    """Its alerts compare the count with a threshold (an ``increase()`` record, 0 included); else
    they only ask whether there was any event (no record but the nonzero one per series)."""

    @property
    def metric(self) -> str:
        return self.counter.removesuffix("_total")

    @property
    def increase(self) -> str:
        return f"{level(TARGET)}:{self.metric}:increase{self.window}"

    @property
    def growth(self) -> str:
        """The counter's value less its last non-zero value remembered before ``window``, or its
        whole value where none is remembered (a new series, or one that was zero): only where
        that is above 0 (a series per counter that grew, none for the healthy ranks)."""
        return f"{level(TARGET)}:{self.metric}:growth{self.window}"

    @property
    def nonzero(self) -> str:
        """The series with events within ``window`` (only those)."""
        return f"{level(TARGET)}:{self.metric}:nonzero_events{self.window}"

    def count(self) -> str:
        """The events counted within ``window``, as a vector (0 included): the larger of
        ``increase()`` (which sees a counter reset) and the growth (which sees the events before a
        new series' first scrape, and those a gap across the window's start hid)."""
        assert self.counted, self.counter
        return f"({self.increase} > {self.growth} or {self.growth} or {self.increase})"

    def records(self) -> list[RecordingRule]:
        c, w = self.counter, self.window
        before = f"last_over_time({event_memory(c)}[{EVENT_BRIDGE}] offset {w})"
        increase = self.increase if self.counted else f"increase({c}[{w}])"
        growth = f"({c} - {before}) > 0\nor\n({c} > 0 unless {before})"
        return [
            *(
                [RecordingRule(self.increase, f"increase({c}[{w}])", TARGET, self.group, per_series=True)]
                * self.counted
            ),
            RecordingRule(self.growth, growth, TARGET, self.group, per_series=True),
            RecordingRule(self.nonzero, f"{increase} > 0 or {self.growth} > 0", TARGET, self.group, per_series=True),
        ]


def _events(t: Thresholds) -> dict[str, Events]:
    w = t.alerts.event_window
    return {
        "nonfinite_loss": Events("training_nonfinite_loss_total", w, NONFINITE_GROUP),
        "nonfinite_grad": Events("training_nonfinite_grad_total", w, NONFINITE_GROUP),
        "grad_explosions": Events("training_grad_explosions_total", w, GRADIENTS_GROUP),
        "exporter_errors": Events("training_exporter_errors_total", w, "lossbeat.liveness" + SLOW, counted=False),
        "skipped": Events("training_skipped_steps_total", t.alerts.guard_window, "lossbeat.guard", counted=False),
        "level_changes": Events(
            "training_guard_level_changes_total", t.alerts.guard_window, "lossbeat.guard", counted=False
        ),
    }


def _first_layer_record(t: Thresholds) -> str:
    return f"{level(TARGET + ('layer',))}:training_nonfinite_grad_first_layer:info{t.alerts.event_window}"


def event_records(t: Thresholds) -> list[RecordingRule]:
    """The event counters' records, and the first bad layer of each rank with non-finite gradients
    within the window (``layer="unknown"`` where the exporter named none): what the alerts of the
    nonfinite and gradients groups share."""
    events = _events(t)
    grad, jt = events["nonfinite_grad"], _by(TARGET)
    first_layer = RecordingRule(
        _first_layer_record(t),
        f"max by ({jt}, layer) (\n  training_nonfinite_grad_first_layer_info and on({jt}) {grad.nonzero}\n"
        f"  or on({jt})\n"
        f'  label_replace(group by ({jt}) ({grad.nonzero}), "layer", "unknown", "__name__", ".*")\n)',
        TARGET + ("layer",),
        NONFINITE_GROUP,
    )
    return [
        *events["nonfinite_loss"].records(),
        *grad.records(),
        first_layer,
        *events["grad_explosions"].records(),
        *events["exporter_errors"].records(),
        *events["skipped"].records(),
        *events["level_changes"].records(),
    ]


def all_records(t: Thresholds) -> list[RecordingRule]:
    """Every recording rule of every group."""
    return recording_rules() + lookback_rules() + event_records(t)


def _with_first_layer(t: Thresholds, expr: str) -> str:
    """``expr`` (one series per rank with non-finite gradients in the window) labelled with the
    first layer whose gradient was non-finite, ``layer="unknown"`` where the exporter named none."""
    return f"{expr}\n  * {ON_TARGET} group_left(layer)\n    {_first_layer_record(t)}\n"


_FIRST_LAYER = (
    "it started at layer {{ $labels.layer }} (the last layer in model order with a non-finite "
    "gradient: backprop spreads it to every layer before; 'all layers' when a non-finite loss "
    "poisoned them all (on a pipeline stage without a loss: the gradient from later stages), "
    "'unknown' without per-layer norms)."
)


class _SharedFields(TypedDict):
    """The :class:`AlertRule` fields that one alert's variants (by trigger) share."""

    name: str
    group: str
    action: str
    keeps: tuple[str, ...]


def _gradient_nonfinite_alerts(t: Thresholds) -> list[AlertRule]:
    """Non-finite gradient norms: repeated or judged ongoing page, one the run went on from is a
    ticket (what an fp16 overflow skip looks like), as the exporter's ``nonfinite`` finding says."""
    window, n = t.alerts.event_window, t.alerts.nonfinite_events
    events = _events(t)["nonfinite_grad"]
    new, count = events.nonzero, events.count()
    judged = f"{_status('nonfinite')} == 2"
    rule = _SharedFields(
        name="TrainingGradientNonFinite",
        group="lossbeat.nonfinite",
        action="inspect the named layer; lower the LR, clip gradients, use bf16 or loss scaling",
        keeps=TARGET + ("layer",),
    )
    return [
        AlertRule(
            **rule,
            severity="critical",
            # The exporter's judgment: non-finite gradients twice in a row, or a non-finite loss.
            expr=_with_first_layer(t, f"({new}\n  and {ON_TARGET} {judged})"),
            labels={"trigger": "sustained"},
            summary="Gradients keep coming out NaN or infinite",
            description=(
                f"{WHO_CAP} produced {VALUE} steps with a NaN/Inf gradient norm in the last {window}, and the "
                f"exporter judges them ongoing (non-finite in consecutive steps, or with the loss); " + _FIRST_LAYER
            ),
            condition=(
                f"a NaN/Inf gradient norm within {window} and the exporter's nonfinite check a danger "
                "(consecutive non-finite steps); names the first bad layer (`trigger=sustained`)"
            ),
        ),
        AlertRule(
            **rule,
            severity="critical",
            expr=_with_first_layer(t, f"({count} >= {n})"),
            labels={"trigger": "events"},
            summary="Repeated NaN or infinite gradients",
            description=(
                f"{WHO_CAP} produced {VALUE} steps with a NaN/Inf gradient norm in the last {window} "
                f"(alert at {n}): the run keeps producing them; " + _FIRST_LAYER
            ),
            condition=f">= {n} steps with a NaN/Inf gradient norm within {window}; names the first bad layer (`trigger=events`)",
        ),
        AlertRule(
            **rule,
            severity="warning",
            # One non-finite step the run went on from (fp16 overflow skipping, one bad batch): a ticket.
            expr=_with_first_layer(t, f"({new}\n  unless {ON_TARGET} ({count} >= {n} or {judged}))"),
            labels={"trigger": "isolated"},
            summary="An isolated NaN or infinite gradient",
            description=(
                f"{WHO_CAP} produced {VALUE} step(s) with a NaN/Inf gradient norm in the last {window}, fewer "
                f"than {n} and not consecutive: the run went on (what fp16 loss-scale overflow skipping or one bad "
                "batch looks like). It pages if it repeats. " + _FIRST_LAYER[0].upper() + _FIRST_LAYER[1:]
            ),
            condition=(
                f"1 to {n - 1} steps with a NaN/Inf gradient norm within {window}, not judged ongoing "
                "(`trigger=isolated`, a ticket)"
            ),
        ),
    ]


def _gradient_alerts(t: Thresholds) -> list[AlertRule]:
    """The gradient norm's alerts: explosions (sustained, repeated, isolated), vanishing, and per layer."""
    return [
        *_grad_explosion_alerts(t),
        _grad_vanishing_alert(t),
        *_layer_gradient_alerts(t),
    ]


def _grad_explosion_alerts(t: Thresholds) -> list[AlertRule]:
    """The global gradient norm judged exploding, its explosions repeated (both page), or one absorbed."""
    a, g = t.alerts, t.gradients
    explosion = number(g.explosion)
    explosions = _events(t)["grad_explosions"]
    return [
        AlertRule(
            name="TrainingGradientExplosion",
            group="lossbeat.gradients",
            severity="critical",
            # The exporter's judgment: the recent grad norm jumped to `jump_ratio` x its rolling
            # baseline, or climbed to `climb_ratio` x the run's slow level. A stable high level
            # (pre-clip norms of 15-20 are common) is the run's own level and does not page.
            expr=f"training_grad_norm\n  and {ON_TARGET} {_status('grad_norm')} == 2\n",
            for_=a.explosion_for,
            labels={"trigger": "sustained"},
            summary="The gradient norm departed from the run's own level",
            description=(
                f"The exporter judges the global gradient norm of {WHO}, now {VALUE}, exploding (a jump to "
                f"{number(g.jump_ratio)}x its baseline, or a climb to {number(g.climb_ratio)}x the run's level) "
                f"for at least {a.explosion_for}; see training_grad_norm against training_grad_norm_baseline."
            ),
            condition=(
                f"grad norm judged exploding (recent median > {number(g.jump_ratio)}x the rolling baseline, or > "
                f"{number(g.climb_ratio)}x the run's level) for {a.explosion_for} (`trigger=sustained`)"
            ),
            action="clip gradients (max_norm 1.0), lower the LR",
            keeps=TARGET,
        ),
        AlertRule(
            name="TrainingGradientExplosion",
            group="lossbeat.gradients",
            severity="critical",
            expr=f"{explosions.increase} >= {a.explosion_events}\n",
            labels={"trigger": "events"},
            summary="Repeated gradient explosions",
            description=(
                f"{WHO_CAP} had {VALUE} steps whose global gradient norm departed from its baseline (above "
                f"{number(g.jump_ratio)}x, or above {explosion} and {number(g.ceiling_ratio)}x) in the last "
                f"{a.event_window} (alert at {a.explosion_events})."
            ),
            condition=(
                f">= {a.explosion_events} explosion events (norm > {number(g.jump_ratio)}x the baseline, or > {explosion} "
                f"and {number(g.ceiling_ratio)}x it) within {a.event_window} (`trigger=events`)"
            ),
            action="clip gradients (max_norm 1.0), lower the LR",
            keeps=TARGET,
        ),
        AlertRule(
            name="TrainingGradientExplosion",
            group="lossbeat.gradients",
            severity="warning",
            # One departure the run absorbed (fewer than explosion_events, not judged sustained): a ticket.
            expr=(
                f"{explosions.nonzero}\n"
                f"  unless {ON_TARGET} ({explosions.increase} >= {a.explosion_events}"
                f" or {_status('grad_norm')} == 2)\n"
            ),
            labels={"trigger": "isolated"},
            summary="An isolated gradient-norm explosion",
            description=(
                f"{WHO_CAP} had {VALUE} step(s) whose global gradient norm departed from its baseline in the last "
                f"{a.event_window}, fewer than {a.explosion_events} and not sustained: the run absorbed it so far "
                "(clipping, one bad batch). It pages if it repeats or the norm stays high."
            ),
            condition=(
                f"1 to {a.explosion_events - 1} explosion events within {a.event_window}, the grad norm not judged "
                "exploding (`trigger=isolated`, a ticket)"
            ),
            action="look at the batch of that step; check that gradients are clipped",
            keeps=TARGET,
        ),
    ]


def _grad_vanishing_alert(t: Thresholds) -> AlertRule:
    """The global gradient norm below the vanishing bound."""
    a, g = t.alerts, t.gradients
    return AlertRule(
        name="TrainingGradientVanishing",
        group="lossbeat.gradients",
        severity="warning",
        expr=f"training_grad_norm < {number(g.vanishing)}\n",
        for_=a.vanishing_for,
        summary="The gradient norm is vanishingly small",
        description=(
            f"The global gradient norm of {WHO} is {VALUE}, below {number(g.vanishing)} "
            f"for at least {a.vanishing_for}: the weights barely move."
        ),
        condition=f"global grad norm < {number(g.vanishing)} for {a.vanishing_for}",
        action="check the LR schedule; residual connections, normalisation, ReLU/GELU",
        keeps=TARGET,
    )


def _layer_gradient_alerts(t: Thresholds) -> list[AlertRule]:
    """One layer's gradient norm above its explosion bound or below its vanishing bound."""
    a, g = t.alerts, t.gradients
    return [
        AlertRule(
            name="TrainingLayerGradientExplosion",
            group="lossbeat.gradients",
            severity="warning",
            expr=f"training_layer_grad_norm > {number(g.layer_explosion)}\n",
            for_=a.layer_for,
            summary="One layer's gradient norm is exploding",
            description=(
                f"The gradient norm of layer {{{{ $labels.layer }}}} on {WHO} is {VALUE}, "
                f"above {number(g.layer_explosion)} for at least {a.layer_for}."
            ),
            condition=f"a layer's grad norm > {number(g.layer_explosion)} for {a.layer_for} (per layer)",
            action="check that layer's init and normalisation; clip gradients",
            keeps=TARGET + ("layer",),
        ),
        AlertRule(
            name="TrainingLayerGradientVanishing",
            group="lossbeat.gradients",
            severity="warning",
            expr=f"training_layer_grad_norm < {number(g.layer_vanishing)}\n",
            for_=a.layer_for,
            summary="One layer's gradient norm is vanishing",
            description=(
                f"The gradient norm of layer {{{{ $labels.layer }}}} on {WHO} is {VALUE}, "
                f"below {number(g.layer_vanishing)} for at least {a.layer_for}."
            ),
            condition=f"a layer's grad norm < {number(g.layer_vanishing)} for {a.layer_for} (per layer)",
            action="look for dead activations or a detached branch; add residuals or normalisation",
            keeps=TARGET + ("layer",),
        ),
    ]


def _range_alert(t: Thresholds) -> AlertRule:
    a = t.alerts
    ranges = "; ".join(
        f"{p.name} [{number(p.loss_warn_low) if p.loss_warn_low is not None else '-'}, "
        f"{number(p.loss_warn_high) if p.loss_warn_high is not None else '-'}]"
        for p in t.profiles.values()
        if p.loss_warn_low is not None or p.loss_warn_high is not None
    )
    return AlertRule(
        name="TrainingLossOutOfRange",
        group="lossbeat.loss",
        severity="warning",
        expr=f"{_status('loss_range', None)} >= 1\n",
        for_=a.out_of_range_for,
        summary="The loss is outside the expected range for its task",
        description=(
            f"The exporter judges (status {VALUE}) the loss of {WHO} (component '{{{{ $labels.component }}}}') outside its task's "
            "range: after the first steps, above the profile's high bound while no longer falling, below its low "
            "bound (label leakage, memorisation), at chance level, or an initial loss no vocabulary explains."
        ),
        condition=(
            f"loss judged out of range (each component) for {a.out_of_range_for}; judged after "
            f"{t.loss.range_after_steps} steps or once the loss stops falling; bounds per profile: {ranges}"
        ),
        action="too high: check data and LR; too low: look for label leakage",
        keeps=TARGET + ("check", "component"),
    )


def _loss_alerts(t: Thresholds) -> list[AlertRule]:
    """The loss's alerts: its trend (rising, flat), its noise, its spikes, its range, and overfitting."""
    return [
        *_loss_trend_alerts(t),
        _loss_volatile_alert(t),
        *_loss_spike_alerts(t),
        _range_alert(t),
        _overfitting_alert(t),
    ]


def _loss_trend_alerts(t: Thresholds) -> list[AlertRule]:
    """The loss judged rising (critical) or flat (warning) across its trend windows."""
    a, loss = t.alerts, t.loss
    windows = (
        f"windows of {number(100 * t.windows.trend_fraction)}% of the steps seen "
        f"(at least {t.windows.trend_min_steps} steps)"
    )
    return [
        AlertRule(
            name="TrainingLossDiverging",
            group="lossbeat.loss",
            severity="critical",
            expr=f"{_status('loss_trend', None)} == 2\n",
            for_=a.diverging_for,
            summary="The training loss is rising",
            description=(
                f"The exporter judges (status {VALUE}) the loss of {WHO} (component '{{{{ $labels.component }}}}') rising: its recent "
                f"window is more than {number(-100 * loss.trend_rising)}% and {number(loss.trend_min_z)} standard "
                f"errors above the window before (or {number(100 * loss.regress_max)}% above the best level of the "
                f"run), for at least {a.diverging_for}."
            ),
            condition=(
                f"loss judged rising (> {number(-100 * loss.trend_rising)}% and > {number(loss.trend_min_z)} "
                f"standard errors across {windows}, or > {number(100 * loss.regress_max)}% above the run's best window) "
                f"for {a.diverging_for}"
            ),
            action="lower the LR; check for bad data or a broken schedule",
            keeps=TARGET + ("check", "component"),
        ),
        AlertRule(
            name="TrainingLossPlateau",
            group="lossbeat.loss",
            severity="warning",
            expr=f"{_status('loss_trend', None)} == 1\n",
            for_=a.plateau_for,
            summary="The training loss has stopped improving",
            description=(
                f"The exporter judges (status {VALUE}) the loss of {WHO} (component '{{{{ $labels.component }}}}') flat for at least "
                f"{a.plateau_for}: it fell less than {number(100 * loss.plateau_max_fall)}% (or not significantly) "
                "across its trend windows, and the LR is not at the end of a decayed schedule."
            ),
            condition=(
                f"loss judged flat (fall < {number(100 * loss.plateau_max_fall)}% or < {number(loss.fall_min_z)} "
                f"standard errors across {windows}; not at the end of a decayed LR schedule) for {a.plateau_for}"
            ),
            action="raise the LR or restart it (cosine with restarts); check the data",
            keeps=TARGET + ("check", "component"),
        ),
    ]


def _loss_volatile_alert(t: Thresholds) -> AlertRule:
    """The loss's step-to-step noise judged too large for its level."""
    a, loss = t.alerts, t.loss
    return AlertRule(
        name="TrainingLossVolatile",
        group="lossbeat.loss",
        severity="warning",
        expr=f"{_status('loss_volatility', None)} == 2\n",
        for_=a.volatile_for,
        summary="The training loss oscillates strongly",
        description=(
            f"The exporter judges (status {VALUE}) the loss of {WHO} (component '{{{{ $labels.component }}}}') very volatile: its "
            f"step-to-step noise around the trend is at least {number(loss.cv_danger)} of its level, "
            f"for at least {a.volatile_for}."
        ),
        condition=(
            f"robust step-to-step noise / loss level (over {t.windows.cv_steps} records, around the trend) "
            f">= {number(loss.cv_danger)} for {a.volatile_for}"
        ),
        action="lower the LR to a third, raise the batch size",
        keeps=TARGET + ("check", "component"),
    )


def _loss_spike_alerts(t: Thresholds) -> list[AlertRule]:
    """Loss spikes repeated within a window (warning), or judged to have done damage (critical)."""
    a, loss = t.alerts, t.loss
    return [
        AlertRule(
            name="TrainingLossSpikes",
            group="lossbeat.loss",
            severity="warning",
            expr=f"increase(training_loss_spikes_total[{a.spikes_window}]) >= {a.spikes_events}\n",
            summary="Repeated loss spikes",
            description=(
                f"{WHO_CAP} had {VALUE} loss spikes (above the recent median by {number(loss.spike_sigma)} robust "
                f"standard deviations and {number(100 * loss.spike_min_rise)}%) in the last {a.spikes_window}."
            ),
            condition=(
                f">= {a.spikes_events} loss spikes (> median + {number(loss.spike_sigma)} robust std and "
                f"+{number(100 * loss.spike_min_rise)}%) within {a.spikes_window}"
            ),
            action="look for bad batches; clip gradients, lower the LR",
            keeps=TARGET,
        ),
        AlertRule(
            name="TrainingLossSpikes",
            group="lossbeat.loss",
            severity="critical",
            # The exporter's judgment (lossbeat.diagnosis.events): spikes repeated within its
            # window and the loss not back at its level, or one followed by a worse loss.
            expr=f"{_status('loss_spikes')} == 2\n",
            for_=a.diverging_for,
            labels={"trigger": "sustained"},
            summary="Loss spikes that did damage",
            description=(
                f"The exporter judges (status {VALUE}) the loss spikes of {WHO} harmful: {t.events.repeated} or more "
                f"within {t.windows.cv_steps} records with the loss not back at its level, or a spike after which the "
                f"loss stays more than {number(100 * t.events.worse_after)}% above its level before; for {a.diverging_for}."
            ),
            condition=(
                f"loss spikes judged harmful (>= {t.events.repeated} within {t.windows.cv_steps} records and the loss "
                f"not recovered, or a spike after which the loss stays {number(100 * t.events.worse_after)}% worse) "
                f"for {a.diverging_for} (`trigger=sustained`)"
            ),
            action="roll back to the checkpoint before the spikes; lower the LR, clip gradients, inspect those batches",
            keeps=TARGET + ("check", "component"),
        ),
    ]


def _overfitting_alert(t: Thresholds) -> AlertRule:
    """The eval loss rising above its best while the training loss does not: the exporter's judgment."""
    a = t.alerts
    return AlertRule(
        name="TrainingOverfitting",
        group="lossbeat.loss",
        severity="warning",
        # The exporter's judgment only: it knows the best eval loss of the whole run and
        # requires `overfitting.evals` evaluations in a row above it (one blip is noise).
        expr=(f"training_eval_loss\n  and {ON_TARGET} {_status('overfitting')} >= 1\n"),
        for_=a.overfitting_for,
        summary="Eval loss rises while the training loss falls",
        description=(
            f"The eval loss of {WHO} is {VALUE}, more than {number(100 * t.overfitting.eval_rise)}% above "
            f"its best, and above it by more than {number(t.overfitting.noise_z)}x the evaluations' own noise, "
            f"for {t.overfitting.evals} evaluations in a row while the training loss does not rise: "
            "the model is overfitting."
        ),
        condition=(
            f"eval loss > {number(100 * t.overfitting.eval_rise)}% above its best and beyond "
            f"{number(t.overfitting.noise_z)}x its own noise for {t.overfitting.evals} evaluations in a row "
            "while the training loss does not rise "
            f"(the exporter's judgment); for {a.overfitting_for}"
        ),
        action="early stop at the best checkpoint; weight decay, dropout, more data",
        keeps=TARGET,
    )


def _progress_alerts(t: Thresholds) -> list[AlertRule]:
    a = t.alerts
    return [
        AlertRule(
            name="TrainingLearningRateSuspect",
            group="lossbeat.optimizer",
            severity="warning",
            # Zero or NaN (abs(x) > 0 holds for neither), or judged suspect: every LR series but
            # the nonzero ones of ranks whose check is fine (the LR read twice, not four times).
            expr=(
                "training_learning_rate\n"
                "unless\n"
                "  (abs(training_learning_rate) > 0\n"
                f'    unless {ON_TARGET} training_health_status{{check="learning_rate"}} >= 1)\n'
            ),
            for_=a.learning_rate_for,
            summary="The learning rate is zero, NaN or does not suit the loss",
            description=(
                f"The learning rate of param group {{{{ $labels.param_group }}}} on {WHO} is {VALUE}; it is zero "
                "or NaN, or the exporter's learning-rate check finds it too small or too large for the loss."
            ),
            condition=(
                f"LR is 0 or NaN, or the exporter's LR check warns (LR < {number(t.learning_rate.too_small)} "
                f"with a flat loss, or > {number(t.learning_rate.too_large)} with loss CV > "
                f"{number(t.learning_rate.too_large_cv)}); for {a.learning_rate_for}"
            ),
            action="check the scheduler and warmup; scale the LR 3x in the suggested direction",
            keeps=TARGET + ("param_group",),
        ),
        _stalled_alert(t),
        AlertRule(
            name="TrainingExporterDown",
            group="lossbeat.liveness",
            severity="critical",
            # A rank's lossbeat series were scraped in the lookback and are gone now (its
            # target answers no more, or service discovery removed it), and the last thing
            # it said was not "completed" (Monitor.close() publishes that and lingers one
            # scrape interval). The value: the steps it had taken.
            # The lookback: each rank's last step count, recorded by the lookback group (O(1) per
            # rank and evaluation), or the raw window it has not recorded yet.
            expr=(
                f"({STEPS_LAST} or max by ({', '.join(TARGET)}) (last_over_time(training_steps_total[{SEEN_WINDOW}])))\n"
                f"unless {ON_TARGET}\n"
                "  training_steps_total\n"
                # The same rank of the same run reporting again from another instance: the run
                # was requeued or restarted elsewhere (Slurm keeps the job id, torchrun its run id).
                "unless on(job, run_id, rank)\n"
                "  group by (job, run_id, rank) (training_steps_total)\n"
                f"unless {ON_TARGET}\n"
                f"  {_completed()}\n"
            ),
            for_=a.exporter_down_for,
            summary="A training process stopped sending metrics without finishing",
            description=(
                f"Prometheus has had no lossbeat metrics from {{{{ $labels.instance }}}} ({WHO}) for at least "
                f'{a.exporter_down_for}, after {{{{ $value | printf "%.0f" }}}} steps, and the run never '
                "reported completion: the process died (crash, OOM kill, scancel, eviction), hangs, "
                "or is unreachable."
            ),
            condition=(
                f"a rank's lossbeat metrics vanished (target down or removed) for {a.exporter_down_for} "
                f"without its completion marker, and the rank reports from no other instance (a requeue); "
                f"looks back {EXPORTER_SEEN_LOOKBACK}"
            ),
            action="check whether the process crashed (OOM? exit code?) or was killed; check the network",
            keeps=TARGET,
        ),
        AlertRule(
            name="TrainingExporterErrors",
            group="lossbeat.liveness",
            severity="warning",
            expr=f"{_events(t)['exporter_errors'].nonzero}\n",
            summary="lossbeat itself failed while training went on",
            description=(
                f"The lossbeat exporter of {WHO} counted {VALUE} errors in {{{{ $labels.where }}}} within "
                f"{a.event_window}; training continues, but its metrics may be partial or missing "
                "(a failing observe() records no step)."
            ),
            condition=f"any error counted by the exporter itself (`training_exporter_errors_total`) within {a.event_window}",
            action="read the training log for the 'lossbeat: error' traceback; report it",
            keeps=TARGET + ("where",),
        ),
    ]


def _stalled_alert(t: Thresholds) -> AlertRule:
    """No sign of progress: a long limit inside an evaluation or a checkpoint, the short one in training."""
    a = t.alerts
    train, other = number(duration_seconds(a.stalled_after)), number(duration_seconds(a.stalled_phase_after))
    # The exporter's own age of the heartbeat (the node's clock against itself: no skew with
    # Prometheus'); exporters without it (older versions) fall back to Prometheus' clock.
    age = f"(training_heartbeat_age_seconds + 0 or {ON_TARGET} (time() - training_last_heartbeat_timestamp_seconds))"
    # Each rank's limit in the phase it is in, with that phase's label: the age is read once.
    limit = (
        f'(training_phase{{phase="train"}} == 1) * 0 + {train}\n'
        f"  or {ON_TARGET}\n"
        f'  (training_phase{{phase!="train"}} == 1) * 0 + {other}'
    )
    return AlertRule(
        name="TrainingStalled",
        group="lossbeat.liveness",
        severity="critical",
        expr=f"{age}\n> {ON_TARGET} group_left(phase) (\n  {limit}\n)\n",
        summary="Training has stopped making progress",
        description=(
            f'{WHO_CAP} showed no progress for {{{{ $value | printf "%.0f" }}}}s in phase '
            f"{{{{ $labels.phase }}}} (alert after {a.stalled_after} in training, {a.stalled_phase_after} "
            "in an evaluation or checkpoint) while its exporter is still up."
        ),
        condition=(
            f"no step, evaluation or heartbeat for {a.stalled_after} while training, or for "
            f'{a.stalled_phase_after} inside `monitor.phase("eval")` / `phase("checkpoint")`; the exporter is up'
        ),
        action="look for a hang: data loader, NCCL collective, checkpoint I/O",
        keeps=TARGET + ("phase",),
    )


def _resource_alerts(t: Thresholds) -> list[AlertRule]:
    """The daily checklist's memory and speed items: a leak, an OOM coming, a slowdown."""
    m, tp = t.memory, t.throughput
    near = number(m.near_limit)
    horizon = number(duration_seconds(m.oom_horizon))
    allocated, limit = "training_memory_allocated_bytes", "training_memory_limit_bytes"
    rate = f"rate(training_steps_total[{tp.rate_window}])"
    past_rate = f"{level(TARGET)}:training_steps:rate5m" if duration_seconds(tp.rate_window) == 300 else rate
    # The baseline's subquery samples the rate every minute, or every rate window when shorter.
    resolution = _duration(min(60, duration_seconds(tp.rate_window)))
    return [
        AlertRule(
            name="TrainingMemoryNearLimit",
            group="lossbeat.resources",
            severity="critical",
            expr=f"100 * training_memory_peak_bytes / {limit} > {number(100 * m.near_limit)}\n",
            for_=m.near_limit_for,
            summary="Memory is close to the device's limit: an out-of-memory error is coming",
            description=(
                f"The peak memory in use (since the previous scrape) of {WHO} on {{{{ $labels.device }}}} is "
                f'{{{{ $value | printf "%.1f" }}}}% of its limit (alert above {number(100 * m.near_limit)}%): '
                "a longer batch or an evaluation can fail with an out-of-memory error."
            ),
            condition=(
                f"peak memory in use since the previous scrape (allocated + outside the allocator) / "
                f"the device's total > {near} for {m.near_limit_for}"
            ),
            action="lower the micro-batch size (raise accumulation), activation checkpointing",
            keeps=TARGET + ("device",),
        ),
        AlertRule(
            name="TrainingMemoryGrowing",
            group="lossbeat.resources",
            severity="warning",
            # Grown by a share of the device within the window, on course to reach the limit
            # within the horizon, and the run is older than the window (start-up allocation is
            # not a leak).
            expr=(
                f"100 * ({allocated} - min_over_time({allocated}[{m.window}])) / {limit} > {number(100 * m.growth_fraction)}\n"
                f"and\n"
                f"predict_linear({allocated}[{m.window}], {horizon}) > {limit}\n"
                f"and\n"
                f"{allocated} offset {m.window}\n"
            ),
            for_=m.growing_for,
            summary="Memory keeps growing: a leak",
            description=(
                f"The allocated memory of {WHO} on {{{{ $labels.device }}}} grew by "
                f'{{{{ $value | printf "%.1f" }}}}% of its limit in the last {m.window} and, at that rate, '
                f"reaches the limit within {m.oom_horizon}."
            ),
            condition=(
                f"allocated memory grew > {number(100 * m.growth_fraction)}% of the limit within {m.window} and "
                f"would reach the limit within {m.oom_horizon}; for {m.growing_for}"
            ),
            action="look for tensors kept across steps (losses not .item()'d, caches, retain_graph)",
            keeps=TARGET + ("device",),
        ),
        AlertRule(
            name="TrainingThroughputDropped",
            group="lossbeat.resources",
            severity="warning",
            # The baseline ends `for` ago so a drop never lowers its own reference; only while
            # the run says it trains (Monitor.phase), and not when it stopped (TrainingStalled).
            # The baseline reads the recorded per-rank rate when it is the same window (one sample
            # per rank and resolution step, where the raw rate reads every sample of each window),
            # and so does "not stopped".
            expr=(
                f"{rate}\n"
                f"  < {ON_TARGET} {number(tp.drop_fraction)} * quantile_over_time(0.5, "
                f"{past_rate}[{tp.baseline}:{resolution}] offset {tp.for_})\n"
                f'and {ON_TARGET} (training_phase{{phase="train"}} == 1)\n'
                f"and {ON_TARGET} {past_rate} > 0\n"
            ),
            for_=tp.for_,
            summary="Training runs much slower than it did",
            description=(
                f'{WHO_CAP} makes {{{{ $value | printf "%.3g" }}}} steps/s, below '
                f"{number(100 * tp.drop_fraction)}% of its median over the {tp.baseline} before, for {tp.for_}."
            ),
            condition=(
                f"steps/s ({tp.rate_window} rate) < {number(tp.drop_fraction)} x its median over the previous {tp.baseline}, "
                f"while in the train phase and not stopped; for {tp.for_}"
            ),
            action="find the slow node: GPU clocks/thermals, data loader, storage, checkpoint I/O in the step",
            keeps=TARGET,
        ),
    ]


def _cluster_alerts(t: Thresholds) -> list[AlertRule]:
    """Alerts that compare the ranks of one job with each other, from series every rank already exports."""
    return [
        _rank_down_alert(t),
        _loss_spread_alert(t),
        _straggler_alert(t),
        _grad_mismatch_alert(t),
    ]


def _rank_down_alert(t: Thresholds) -> AlertRule:
    """Fewer ranks report than the job's world size, by the missing rank when it reported before."""
    a, job = t.alerts, _by(JOB)
    # The ranks present (reporting now, or gone after their completion marker: ranks that
    # finished before rank 0's final eval or upload are not down) and the runs short of their
    # world size are recording rules (RANK_PRESENT, RANKS_SHORT: PromQL cannot read a label as
    # a number, count_values writes the count into one to compare); the missing ranks are the
    # ones seen in the last RANK_SEEN_LOOKBACK (recorded by the lookback group) not present.
    short, gone, grace = RANKS_SHORT, RANK_GONE, RANK_DISCOVERY_GRACE
    return AlertRule(
        name="TrainingRankDown",
        group="lossbeat.cross_rank",
        severity="critical",
        # The missing ranks that reported in the last hour, by name; else rank="unknown", once
        # the run has reported for the discovery grace (its shards' counts of that long ago).
        expr=(
            f"topk by ({job}) (1, {short})\n* on({job}) group_right(world_size)\n{gone}\n"
            f"or on({job})\n"
            f'label_replace({short}, "rank", "unknown", "__name__", ".*")\n'
            f"  and on({job}) {PRESENT_COUNT} offset {grace}\n"
        ),
        for_=a.rank_down_for,
        summary="Fewer ranks report metrics than the job's world size",
        description=(
            f'Only {{{{ $value | printf "%.0f" }}}} of the {{{{ $labels.world_size }}}} ranks of job '
            "{{ $labels.job }} report metrics; missing: rank {{ $labels.rank }} (unknown: it has not "
            f"reported in the last {RANK_SEEN_LOOKBACK}). A rank died, hangs without serving, or was never "
            "discovered, while the others go on."
        ),
        condition=(
            f"distinct ranks reporting `training_run_info` (or gone after their completion marker) < its "
            f"`world_size` for {a.rank_down_for}, per run; names ranks seen in the last {RANK_SEEN_LOOKBACK}; "
            f"ranks never seen count once the run has reported for {RANK_DISCOVERY_GRACE}"
        ),
        action="find the missing rank's node and process (OOM, crash, hang); restart from the last checkpoint",
        keeps=JOB_RANK + ("world_size",),
    )


def _loss_spread_alert(t: Thresholds) -> AlertRule:
    """One rank's loss far from the job's other ranks."""
    a, c = t.alerts, t.cross_rank
    job, job_rank = _by(JOB), _by(JOB_RANK)
    z, rel, ranks = number(c.loss_spread_z), number(c.loss_spread_min_relative), c.min_ranks
    mean, median = LOSS_AVG_5M, "job:training_loss:median_avg_over_time5m"
    robust_z = f"{level(JOB_RANK)}:training_loss:robust_z5m"
    return AlertRule(
        name="TrainingLossRankSpread",
        group="lossbeat.cross_rank",
        severity="warning",
        expr=(
            f"(\n  {robust_z} > {z}\nor\n  {robust_z} < -{z}\n)\n"
            f"and on({job_rank})\n"
            f"  abs({mean} - on({job}) group_left {median})\n"
            f"    > on({job}) group_left() ({rel} * abs({median}))\n"
            f"and on({job})\n"
            f"  count by ({job}) ({mean}) >= {ranks}\n"
        ),
        for_=a.loss_spread_for,
        summary="One rank's loss departs from the job's other ranks",
        description=(
            f"The 5m mean loss of {WHO} has a robust z-score of {VALUE} against the job's ranks "
            f"(beyond +-{z}, and more than {number(100 * c.loss_spread_min_relative)}% from the job's median): "
            "its data shard or its node differs from the others."
        ),
        condition=(
            f"a rank's 5m mean loss has |robust z| > {z} across the job's ranks (median / MAD) and departs "
            f"> {number(100 * c.loss_spread_min_relative)}% from the median, with >= {ranks} ranks; for {a.loss_spread_for}"
        ),
        action="check that rank's data shard (sampler seed, file list) and its node (GPU errors, ECC)",
        keeps=JOB_RANK,
    )


def _straggler_alert(t: Thresholds) -> AlertRule:
    """One rank's host work per step consistently above the job's median."""
    a, c = t.alerts, t.cross_rank
    job, ranks = _by(JOB), c.min_ranks
    work_median = "job:training_rank_work_seconds:median_avg_over_time5m"
    return AlertRule(
        name="TrainingStraggler",
        group="lossbeat.cross_rank",
        severity="warning",
        expr=(
            f"{WORK_AVG_5M}\n"
            f"  / on({job}) group_left {work_median}\n"
            f"> {number(c.straggler_ratio)}\n"
            f"and\n"
            f"{WORK_AVG_5M}\n"
            f"  - on({job}) group_left {work_median}\n"
            f"> {number(c.straggler_min_seconds)}\n"
            f"and on({job})\n"
            f"  count by ({job}) ({WORK_AVG_5M}) >= {ranks}\n"
        ),
        for_=a.straggler_for,
        summary="One rank is consistently slower than the others",
        description=(
            f"{WHO_CAP} (instance {{{{ $labels.instance }}}}) spends {VALUE}x the job's median on its own "
            "work per step, timed on the host (`training_rank_work_seconds`: data loading, optimizer step "
            "and forward): every other rank waits for it in each all-reduce. Host time: under asynchronous "
            "CUDA a slow GPU does not show here, and a host that waits for its device (`loss.item()` to log "
            "on rank 0 only) is charged that wait."
        ),
        condition=(
            f"a rank's 5m mean work time > {number(c.straggler_ratio)}x the job's median and "
            f"> median + {number(c.straggler_min_seconds)}s, with >= {ranks} ranks; for {a.straggler_for}"
        ),
        action="check that rank's data loading (workers, storage), its host (CPU contention) and any "
        "host-device sync it alone does (rank-0 logging); a slow GPU needs DCGM, not this alert",
        keeps=TARGET,
    )


def _grad_mismatch_alert(t: Thresholds) -> AlertRule:
    """Data-parallel replicas that disagree on the gradient norm they should share."""
    a, c = t.alerts, t.cross_rank
    job = _by(JOB)
    return AlertRule(
        name="TrainingRankGradientMismatch",
        group="lossbeat.cross_rank",
        severity="critical",
        expr=(
            f"last_over_time({ALIGNED_DEPARTURE}[{ALIGNED_LOOKBACK}]) > {number(c.grad_norm_rtol)}\n"
            f"and on({job})\n"
            f"  count by ({job}) (last_over_time({ALIGNED_DEPARTURE}[{ALIGNED_LOOKBACK}])) >= 2\n"
        ),
        for_=a.grad_mismatch_for,
        summary="Data-parallel replicas disagree on the gradient norm",
        description=(
            f"At the job's latest aligned step that every rank reached, the global gradient norm of {WHO} "
            "differs from the median of "
            f"the job's ranks by {VALUE} of it; after the all-reduce every replica must "
            f"hold the same gradients (tolerance {number(c.grad_norm_rtol)}): silent data corruption or "
            "desynchronised replicas."
        ),
        condition=(
            f"a rank's global grad norm at the job's latest step multiple of `grad_norm_align_every` that "
            f"every rank reached differs from the ranks' median by > {number(100 * c.grad_norm_rtol)}%; "
            f"for {a.grad_mismatch_for}"
        ),
        action="stop the job; run GPU diagnostics on that rank's node; restart from a checkpoint without it",
        keeps=JOB_RANK,
    )


def _guard_alerts(t: Thresholds) -> list[AlertRule]:
    """The optimizer guard (MonitorConfig.guard): what it kept from the optimizer, and a stop."""
    a, g = t.alerts, t.guard
    skipped = "training_skipped_steps_total"
    return [
        AlertRule(
            name="TrainingStepsSkipped",
            group="lossbeat.guard",
            severity="warning",
            expr=f"{_events(t)['skipped'].nonzero}\n",
            summary="The optimizer guard skipped steps",
            description=(
                f"{WHO_CAP}: the optimizer guard kept {VALUE} step(s) from the optimizer in the last "
                f"{a.guard_window} (reason {{{{ $labels.reason }}}}). Parameters, optimizer state and loss "
                "scale are as if those steps never happened; training goes on."
            ),
            condition=f"any skipped step within {a.guard_window}",
            action="look at the skipped steps' batches; a few absorbed are routine, a pattern is not",
            keeps=TARGET + ("reason",),
        ),
        AlertRule(
            name="TrainingSkippingRepeatedly",
            group="lossbeat.guard",
            severity="critical",
            expr=f"sum without(reason) (increase({skipped}[{a.guard_window}])) > {g.page_skips}\n",
            summary="The optimizer guard skips step after step",
            description=(
                f"{WHO_CAP}: the optimizer guard skipped {VALUE} steps in the last {a.guard_window} "
                f"(more than {g.page_skips}): the run is skipping, not learning. After "
                f"{g.max_consecutive} in a row it stops (TrainingHalted)."
            ),
            condition=f"more than {g.page_skips} skipped steps within {a.guard_window}",
            action="roll back to the last good checkpoint; lower the LR, check the data stream",
            keeps=TARGET,
        ),
        AlertRule(
            name="TrainingGradNormLevelChanged",
            group="lossbeat.guard",
            severity="warning",
            expr=f"{_events(t)['level_changes'].nonzero}\n",
            summary="The optimizer guard accepted a new gradient-norm level",
            description=(
                f"{WHO_CAP}: the pre-clip gradient norm settled at a new level with a healthy loss, and "
                f"after {g.accept_level_after} skipped steps in a row the optimizer guard took it as the "
                f"run's baseline ({VALUE} time(s) in the last {a.guard_window}); training goes on. Expected after unfreezing layers, a change of loss "
                "reduction, data mix or sequence length; otherwise the gradients grew for a reason to find."
            ),
            condition=f"a new gradient-norm level accepted within {a.guard_window}",
            action="check that something changed the gradient scale on purpose at that step (the run's log says which)",
            keeps=TARGET,
        ),
        AlertRule(
            name="TrainingHalted",
            group="lossbeat.guard",
            severity="critical",
            expr=f"max_over_time(training_halted[{a.guard_window}]) > 0\n",
            summary="The optimizer guard stopped the run",
            description=(
                f"{WHO_CAP} was stopped by the optimizer guard (training_halted {VALUE}; TrainingHalted raised on every rank): "
                f"guard='stop' met a bad step, or more than {g.max_consecutive} steps in a row were bad. "
                "No bad step reached the weights; the last checkpoint is good."
            ),
            condition=f"training_halted was 1 within {a.guard_window}",
            action="read the TrainingHalted message in the log (step, reason, values); resume from the last checkpoint",
            keeps=TARGET,
        ),
    ]


def _rl_alerts(t: Thresholds) -> list[AlertRule]:
    a, rl = t.alerts, t.rl
    zero = number(rl.reward_std_zero)
    fraction = number(rl.zero_std_fraction)
    return [
        AlertRule(
            name="TrainingRLSignalCollapsed",
            group="lossbeat.loss",
            severity="critical",
            expr=(
                f'max by ({_by(TARGET)}) (training_signal{{signal="reward_std"}}) <= {zero}\n'
                f'or max by ({_by(TARGET)}) (training_signal{{signal="frac_reward_zero_std"}}) >= {fraction}\n'
                # No advantage at all: a zero loss with zero gradients, in a run judged as RL.
                f"or (max by ({_by(TARGET)}) (training_grad_norm) == 0\n"
                f"  and {ON_TARGET} training_loss == 0\n"
                f'  and {ON_TARGET} training_profile_info{{profile="rl"}})\n'
            ),
            for_=a.rl_collapse_for,
            summary="The RL run's learning signal collapsed",
            description=(
                f"{WHO_CAP} shows no learning signal for {a.rl_collapse_for} (value {VALUE}): reward_std at or below "
                f"{zero}, frac_reward_zero_std at or above {fraction}, or a zero loss with a zero gradient norm. "
                "Every completion of a group gets the same reward: no advantage, no gradient, the policy does not move."
            ),
            condition=(
                f"reward_std <= {zero}, or frac_reward_zero_std >= {fraction}, or grad norm and loss both 0 in an RL "
                f"run, for {a.rl_collapse_for}"
            ),
            action="raise the sampling temperature or group size; check the reward function; filter prompts always or never solved",
            keeps=TARGET,
        ),
    ]


def alert_rules(thresholds: Thresholds) -> list[AlertRule]:
    """Every alerting rule, in the order of the rule groups."""
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected Thresholds, got {type(thresholds).__name__}")
    rules = (
        _nonfinite_alerts(thresholds)
        + _gradient_alerts(thresholds)
        + _loss_alerts(thresholds)
        + _rl_alerts(thresholds)
        + [AlertRule(**spec) for spec in moe_rl_alerts(thresholds)]  # MoE routers, RL entropy and KL
        + _progress_alerts(thresholds)
        + _resource_alerts(thresholds)
        + _cluster_alerts(thresholds)
        + _guard_alerts(thresholds)
    )
    return [dataclasses.replace(r, group=r.group + SLOW) if r.name in TICKETS else r for r in rules]


def group_intervals(thresholds: Thresholds) -> dict[str, str]:
    """The groups evaluated at their own interval, not the server's evaluation interval: the
    lookback state and the dashboards' summaries every minute, the tickets every fifth of the
    shortest wait among them (``for``, or the counter's window), at most a minute."""
    tickets = [r for r in alert_rules(thresholds) if r.group.endswith(SLOW)]
    waits = [duration_seconds(r.for_ or thresholds.alerts.event_window) for r in tickets]
    slow = _duration(max(1, min(60, int(min(waits)) // 5)))
    return {
        LOOKBACK_GROUP: LOOKBACK_INTERVAL,
        SUMMARY_GROUP: SUMMARY_INTERVAL,
        CHECKS_SUMMARY_GROUP: SUMMARY_INTERVAL,
        **{r.group: slow for r in tickets},
    }


def rule_groups(thresholds: Thresholds) -> list[dict]:
    """Prometheus rule groups: recording rules first, then the alerts by group (a group's own
    records before its alerts)."""
    alerts = alert_rules(thresholds)
    groups: dict[str, list[dict]] = {
        RECORDING_GROUP: [],
        LOOKBACK_GROUP: [],
        SUMMARY_GROUP: [],
        CHECKS_SUMMARY_GROUP: [],
    }
    for alert in alerts:  # the groups in the alerts' order, whichever holds records
        groups.setdefault(alert.group, [])
    for record in all_records(thresholds):
        groups.setdefault(record.group, []).append({"record": record.record, "expr": record.expr})
    for alert in alerts:
        groups.setdefault(alert.group, []).append(alert.to_rule(thresholds.alerts.runbook_url))
    intervals = group_intervals(thresholds)
    return [
        {"name": name, **({"interval": intervals[name]} if name in intervals else {}), "rules": rules}
        for name, rules in groups.items()
        if rules
    ]
