"""Run every check on a :class:`History` and return the raw findings (before hysteresis)."""

from __future__ import annotations

import math
from typing import Mapping

from lossbeat.diagnosis.events import check_events
from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding, Status
from lossbeat.diagnosis.gradients import check_grad_norm, check_layer_grad_norms
from lossbeat.diagnosis.history import History
from lossbeat.diagnosis.learning import check_learning, learned
from lossbeat.diagnosis.learning_rate import check_learning_rate, check_warmup
from lossbeat.diagnosis.loss import (
    EvalMetric,
    Trend,
    check_loss_range,
    check_loss_trend,
    check_loss_volatility,
    check_overfitting,
    robust_cv,
    trend_of,
)
from lossbeat.diagnosis.moe import is_router_loss
from lossbeat.diagnosis.rl import router_and_policy
from lossbeat.diagnosis.series import LossSeries

__all__ = ["diagnose"]

_NOISE_GREW = 1.5  # the absolute noise above this x the run's early noise: it grew
_REPEATED_NONFINITE = 3  # more non-finite records than this in the window (and > 10 % of it): repeated


def diagnose(history: History, held: Mapping[tuple[str, str], Status] | None = None) -> list[Finding]:
    """One finding per check (plus range/trend/volatility per loss component, overfitting per eval set).

    ``held``: the statuses the checks hold now (a :class:`Judge`'s), for the value hysteresis.
    """
    held = held or {}
    release = history.thresholds.hysteresis.release
    t = history.thresholds
    profile = t.profile
    loss = history.loss
    trend = trend_of(loss, t, profile.volatility_floor)
    cv = robust_cv(loss, profile)
    schedule = history.lr
    ended = schedule.ended
    did_learn = learned(history, t)
    memory = history.memory
    memory.update(history)
    history.update_layer_levels()
    regression = memory.regressed(history)
    findings = [
        check_loss_range(loss, profile, t, trend, learned=did_learn),
        check_loss_trend(
            trend,
            loss,
            t,
            profile,
            schedule_ended=ended,
            lr_fraction=schedule.fraction_of_peak,
            held=held.get(("loss_trend", ""), GOOD),
            learned=did_learn,
            regression=regression,
            best=memory.best,
        ),
        _hides_trend(
            check_loss_volatility(
                cv,
                t.loss,
                nonfinite=bool(loss.nonfinite_run),
                held=held.get(("loss_volatility", ""), GOOD),
                release=release,
            ),
            trend,
            loss,
            did_learn,
        ),
        check_grad_norm(history.grad, t.gradients),
        check_layer_grad_norms(history.layer_norms, t.gradients, levels=history.layer_levels),
        check_learning_rate(schedule, trend, cv, t.learning_rate, learned=did_learn, regression=regression, loss=loss),
        check_warmup(loss, profile, t.learning_rate),
        check_overfitting(
            history.evals.get(""),
            trend,
            t.overfitting,
            learned=did_learn,
            metric=_eval_metric(history),
            held=held.get(("overfitting", ""), GOOD),
            regression=regression,
        ),
        _nonfinite(history),
        check_events(history, "loss_spikes", regression),
        check_events(history, "grad_explosions", regression),
        check_learning(history, trend, t, regression),
    ]
    findings += router_and_policy(history, t)  # MoE routers, an RL policy's entropy and KL
    for group, track in history.evals.items():
        if group:
            findings.append(
                check_overfitting(
                    track,
                    trend,
                    t.overfitting,
                    group,
                    learned=did_learn,
                    held=held.get(("overfitting", group), GOOD),
                    regression=regression,
                )
            )
    component_profile = t.profiles.get("multi-task", profile) if profile.name == "multi-task" else profile
    for name, series in history.components.items():
        if is_router_loss(name):  # a router's aux / z-loss: exported, not judged as a loss
            continue
        c_trend = trend_of(series, t, component_profile.volatility_floor)
        findings.append(check_loss_range(series, component_profile, t, c_trend, name))
        findings.append(
            check_loss_trend(
                c_trend,
                series,
                t,
                component_profile,
                schedule_ended=ended,
                lr_fraction=schedule.fraction_of_peak,
                component=name,
                held=held.get(("loss_trend", name), GOOD),
            )
        )
        findings.append(
            check_loss_volatility(
                robust_cv(series, component_profile),
                t.loss,
                name,
                nonfinite=bool(series.nonfinite_run),
                held=held.get(("loss_volatility", name), GOOD),
                release=release,
            )
        )
    return findings


_EVAL_METRICS = (("eval_accuracy", True), ("eval_f1", True), ("eval_wer", False), ("eval_cer", False))


def _eval_metric(history: History) -> EvalMetric | None:
    """The eval set's task metric beside its loss (the first logged of accuracy, F1, WER, CER)."""
    for name, higher in _EVAL_METRICS:
        track = history.signals.get(name)
        if track is not None and track.count:
            return name, track, higher
    return None


def _hides_trend(f: Finding, trend: Trend, series: LossSeries, did_learn: bool | None = None) -> Finding:
    """Per-step losses of small or variable-length batches are noisy by nature: noise is a danger
    only when it grew against the run's own early noise while the loss stopped improving (it
    hides the trend), or in a run that never learned through it. Otherwise a warning that says why."""
    if f.status is not DANGER:
        return f
    early, now = series.first_noise, series.noise
    grew = math.isfinite(early) and math.isfinite(now) and now > _NOISE_GREW * early
    if (grew or did_learn is False) and trend.known and not trend.falling:
        return f
    if not trend.known:
        why = "too few records to tell whether it hides the trend"
    elif trend.falling:
        why = "the loss still falls through it"
    else:
        why = f"no more than the run's own early noise ({early:.3g})" if math.isfinite(early) else "as from the start"
    return Finding(f.check, WARNING, f"{f.message}; {why}", f.fix, f.component)


def _nonfinite(history: History) -> Finding:
    """Danger while a non-finite loss or gradient is within the volatility window, or while
    the fp16 loss scale has collapsed (nearly every step overflows and is skipped)."""
    scale, scale_min = history.grad_scale, history.thresholds.gradients.loss_scale_min
    if scale is not None and not scale >= scale_min:
        return Finding(
            "nonfinite",
            DANGER,
            f"fp16 loss scale collapsed to {scale:.3g} (below {scale_min:g}): nearly every step overflows and is "
            "skipped",
            "the gradients overflow even unscaled: lower the learning rate, check the inputs for NaN/Inf, "
            "train in bf16, and locate the first bad op with torch.autograd.set_detect_anomaly(True)",
        )
    last = history.last_nonfinite_at
    if last is not None and history.steps_seen - last < history.thresholds.windows.cv_steps:
        ago = history.steps_seen - last
        recent = history.nonfinite_recent
        bad = int(sum(recent))
        # A non-finite loss now, or gradients non-finite twice in a row, is ongoing; one
        # non-finite gradient beside a finite loss is what an fp16 overflow skip looks like.
        ongoing = history.loss.nonfinite_run > 0 or history.grad_nonfinite_run > 1
        # Isolated and recovered (fp16 loss-scale overflow skips look like this, a GradScaler's
        # warm-up too: 2-5 in its first steps): a warning that says so. Ongoing (the latest
        # record), or repeated within the window: danger (TrainingGradientNonFinite pages on it).
        if ongoing or bad > max(_REPEATED_NONFINITE, len(recent) // 10):
            return Finding(
                "nonfinite",
                DANGER,
                f"non-finite loss or gradient {ago} step(s) ago ({bad} of the last {len(recent)} records, "
                f"{history.nonfinite_seen} so far)" + (": still non-finite" if ongoing else ": repeated"),
                "lower the learning rate 10x, check the inputs for NaN/Inf, prefer bf16 over fp16 or use loss scaling, "
                "and locate the first bad op with torch.autograd.set_detect_anomaly(True)",
            )
        return Finding(
            "nonfinite",
            WARNING,
            f"{bad} isolated non-finite value(s) in the last {len(recent)} records ({history.nonfinite_seen} so far); "
            f"the run recovered (finite for the last {ago} records): what fp16 loss-scale overflow skips look like",
            "if this run uses fp16 with a GradScaler, pass grad_scaler= to observe (skips are then counted apart); "
            "else check the inputs of those steps",
        )
    if history.nonfinite_seen:
        return Finding(
            "nonfinite",
            GOOD,
            f"all values finite lately ({history.nonfinite_seen} non-finite record(s) earlier, recovered)",
        )
    return Finding("nonfinite", GOOD, "all values finite")
