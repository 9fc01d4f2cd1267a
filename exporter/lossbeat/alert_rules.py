"""The Prometheus recording and alerting rules, built from the thresholds.

Every number and duration comes from :class:`lossbeat.thresholds.Thresholds`;
:mod:`lossbeat.rules` renders these objects to files. Alert names, recording
rule names and the labels they keep are a contract with Alertmanager routing,
the dashboards and the runbooks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lossbeat.thresholds import Thresholds

__all__ = [
    "AlertRule",
    "RecordingRule",
    "LOSS_DERIVED_ALERTS",
    "RECORDING_GROUP",
    "alert_rules",
    "recording_rules",
    "rule_groups",
    "number",
    "duration_seconds",
]

RECORDING_GROUP = "lossbeat.recording"

# Profiles whose loss is a sum of tasks: the range applies to each component.
COMPONENT_PROFILES = frozenset({"multi-task"})

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
    """When it fires, in words with the numbers (README table)."""
    action: str
    """The first thing to do (README table)."""
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


JOB_RANK = ("job", "rank")
TARGET = ("job", "instance", "rank")

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
    """Shared aggregations for dashboards and alerts (fixed 5m windows: stable names)."""
    return [
        RecordingRule("job_rank:training_loss:avg_over_time5m",
                      "avg by (job, rank) (avg_over_time(training_loss[5m]))", JOB_RANK),
        RecordingRule("job_rank_component:training_loss_component:avg_over_time5m",
                      "avg by (job, rank, component) (avg_over_time(training_loss_component[5m]))",
                      ("job", "rank", "component")),
        RecordingRule("job:training_loss:avg", "avg by (job) (training_loss)", ("job",)),
        RecordingRule("job:training_eval_loss:avg", "avg by (job) (training_eval_loss)", ("job",)),
        RecordingRule("job_rank:training_grad_norm:avg_over_time5m",
                      "avg by (job, rank) (avg_over_time(training_grad_norm[5m]))", JOB_RANK),
        RecordingRule("job:training_grad_norm:max", "max by (job) (training_grad_norm)", ("job",)),
        RecordingRule("job_layer:training_layer_grad_norm:max",
                      "max by (job, layer) (training_layer_grad_norm)", ("job", "layer")),
        # Every rank takes the same steps: the job's step rate is their mean; tokens add up.
        RecordingRule("job:training_steps:rate5m",
                      "avg by (job) (rate(training_steps_total[5m]))", ("job",)),
        RecordingRule("job_rank:training_steps:rate5m",
                      "sum by (job, rank) (rate(training_steps_total[5m]))", JOB_RANK),
        RecordingRule("job:training_tokens:rate5m",
                      "sum by (job) (rate(training_tokens_total[5m]))", ("job",)),
        RecordingRule("job_rank:training_step_duration_seconds:avg_over_time5m",
                      "avg by (job, rank) (avg_over_time(training_step_duration_seconds[5m]))", JOB_RANK),
        RecordingRule("job_rank:training_nonfinite_loss:increase5m",
                      "sum by (job, rank) (increase(training_nonfinite_loss_total[5m]))", JOB_RANK),
        RecordingRule("job_rank:training_nonfinite_grad:increase5m",
                      "sum by (job, rank) (increase(training_nonfinite_grad_total[5m]))", JOB_RANK),
        RecordingRule("job_rank:training_loss_spikes:increase5m",
                      "sum by (job, rank) (increase(training_loss_spikes_total[5m]))", JOB_RANK),
        RecordingRule("job_rank:training_grad_explosions:increase5m",
                      "sum by (job, rank) (increase(training_grad_explosions_total[5m]))", JOB_RANK),
        # Worst status of each check across the job's ranks (0 good, 1 warning, 2 danger).
        RecordingRule("job_check:training_health_status:max",
                      "max by (job, check) (training_health_status)", ("job", "check")),
    ]


def _nonfinite_alerts(t: Thresholds) -> list[AlertRule]:
    a, scale_min = t.alerts, number(t.gradients.loss_scale_min)
    return [
        AlertRule(
            name="TrainingLossNaN",
            group="lossbeat.nonfinite",
            severity="critical",
            expr=(
                f"increase(training_nonfinite_loss_total[{a.event_window}]) > 0\n"
                "or\n"
                "training_loss != training_loss\n"
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
        AlertRule(
            name="TrainingGradientNonFinite",
            group="lossbeat.nonfinite",
            severity="critical",
            expr=(
                f"(increase(training_nonfinite_grad_total[{a.event_window}]) > 0)\n"
                "  * on(job, instance, rank) group_left(layer)\n"
                "    training_nonfinite_grad_first_layer_info\n"
                "or\n"
                "label_replace(\n"
                f"  (increase(training_nonfinite_grad_total[{a.event_window}]) > 0)\n"
                "    unless on(job, instance, rank) training_nonfinite_grad_first_layer_info,\n"
                '  "layer", "unknown", "__name__", ".*"\n'
                ")\n"
            ),
            summary="Gradients became NaN or infinite",
            description=(
                f"{WHO_CAP} produced {VALUE} steps with a NaN/Inf gradient norm in the last {a.event_window}; "
                "the first layer (in model order) with a non-finite gradient is {{ $labels.layer }}."
            ),
            condition=f"any step with a NaN/Inf gradient norm within {a.event_window}; names the first bad layer",
            action="inspect the named layer; lower the LR, clip gradients, use bf16 or loss scaling",
            keeps=TARGET + ("layer",),
        ),
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


def _gradient_alerts(t: Thresholds) -> list[AlertRule]:
    a, g = t.alerts, t.gradients
    explosion = number(g.explosion)
    return [
        AlertRule(
            name="TrainingGradientExplosion",
            group="lossbeat.gradients",
            severity="critical",
            # The exporter's judgment: the recent grad norm jumped to `jump_ratio` x its rolling
            # baseline, or climbed to `climb_ratio` x the run's slow level. A stable high level
            # (pre-clip norms of 15-20 are common) is the run's own level and does not page.
            expr=f'training_grad_norm\n  and on(job, instance, rank) {_status("grad_norm")} == 2\n',
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
            expr=f"increase(training_grad_explosions_total[{a.event_window}]) >= {a.explosion_events}\n",
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
        ),
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
        expr=f'{_status("loss_range", None)} >= 1\n',
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
    a, loss = t.alerts, t.loss
    windows = (f"windows of {number(100 * t.windows.trend_fraction)}% of the steps seen "
               f"(at least {t.windows.trend_min_steps} steps)")
    rules = [
        AlertRule(
            name="TrainingLossDiverging",
            group="lossbeat.loss",
            severity="critical",
            expr=f'{_status("loss_trend", None)} == 2\n',
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
            expr=f'{_status("loss_trend", None)} == 1\n',
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
        AlertRule(
            name="TrainingLossVolatile",
            group="lossbeat.loss",
            severity="warning",
            expr=f'{_status("loss_volatility", None)} == 2\n',
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
        ),
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
        _range_alert(t),
        AlertRule(
            name="TrainingOverfitting",
            group="lossbeat.loss",
            severity="warning",
            # The exporter's judgment only: it knows the best eval loss of the whole run and
            # requires `overfitting.evals` evaluations in a row above it (one blip is noise).
            expr=(
                "training_eval_loss\n"
                f'  and on(job, instance, rank) {_status("overfitting")} >= 1\n'
            ),
            for_=a.overfitting_for,
            summary="Eval loss rises while the training loss falls",
            description=(
                f"The eval loss of {WHO} is {VALUE}, more than {number(100 * t.overfitting.eval_rise)}% above "
                f"its best for {t.overfitting.evals} evaluations in a row while the training loss does not rise: "
                "the model is overfitting."
            ),
            condition=(
                f"eval loss > {number(100 * t.overfitting.eval_rise)}% above its best for "
                f"{t.overfitting.evals} evaluations in a row while the training loss does not rise "
                f"(the exporter's judgment); for {a.overfitting_for}"
            ),
            action="early stop at the best checkpoint; weight decay, dropout, more data",
            keeps=TARGET,
        ),
    ]
    return rules


def _progress_alerts(t: Thresholds) -> list[AlertRule]:
    a = t.alerts
    return [
        AlertRule(
            name="TrainingLearningRateSuspect",
            group="lossbeat.optimizer",
            severity="warning",
            expr=(
                "training_learning_rate == 0\n"
                "or\n"
                "training_learning_rate != training_learning_rate\n"
                "or\n"
                '(training_learning_rate and on(job, instance, rank) training_health_status{check="learning_rate"} >= 1)\n'
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
        AlertRule(
            name="TrainingStalled",
            group="lossbeat.liveness",
            severity="critical",
            expr=(
                f"time() - training_last_step_timestamp_seconds > {number(duration_seconds(a.stalled_after))}\n"
                "and\n"
                "training_last_step_timestamp_seconds > 0\n"
            ),
            summary="Training has stopped making steps",
            description=(
                f"{WHO_CAP} completed its last step {{{{ $value | printf \"%.0f\" }}}}s ago "
                f"(alert after {a.stalled_after}) while its exporter is still up."
            ),
            condition=f"no completed step for {a.stalled_after} while the exporter is up",
            action="look for a hang: data loader, NCCL collective, checkpoint I/O",
            keeps=TARGET,
        ),
        AlertRule(
            name="TrainingExporterDown",
            group="lossbeat.liveness",
            severity="critical",
            # Only targets that served lossbeat metrics lately; `rank` comes from their run info.
            expr=(
                "up\n"
                "  * on(job, instance) group_left(rank)\n"
                f"    topk by (job, instance) (1, present_over_time(training_run_info[{EXPORTER_SEEN_LOOKBACK}]))\n"
                "== 0\n"
            ),
            for_=a.exporter_down_for,
            summary="Prometheus cannot scrape a training exporter",
            description=(
                f"Prometheus has failed to scrape {{{{ $labels.instance }}}} ({WHO}) for at least "
                f"{a.exporter_down_for} (up = {VALUE}): the process died, hangs, or is unreachable."
            ),
            condition=(
                f"`up == 0` for {a.exporter_down_for} on a target that exposed lossbeat metrics "
                f"in the last {EXPORTER_SEEN_LOOKBACK}"
            ),
            action="check whether the process crashed (OOM?) or finished; check the network",
            keeps=TARGET,
        ),
    ]


def alert_rules(thresholds: Thresholds) -> list[AlertRule]:
    """Every alerting rule, in the order of the rule groups."""
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected Thresholds, got {type(thresholds).__name__}")
    return (
        _nonfinite_alerts(thresholds)
        + _gradient_alerts(thresholds)
        + _loss_alerts(thresholds)
        + _progress_alerts(thresholds)
    )


def rule_groups(thresholds: Thresholds) -> list[dict]:
    """Prometheus rule groups: recording rules first, then the alerts by group."""
    groups: dict[str, list[dict]] = {
        RECORDING_GROUP: [{"record": r.record, "expr": r.expr} for r in recording_rules()]
    }
    for alert in alert_rules(thresholds):
        groups.setdefault(alert.group, []).append(alert.to_rule(thresholds.alerts.runbook_url))
    return [{"name": name, "rules": rules} for name, rules in groups.items()]
