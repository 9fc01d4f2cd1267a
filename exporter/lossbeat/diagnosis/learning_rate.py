"""Checks on the learning rate: invalid, too small, too large, and warmup."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.loss import Trend
from lossbeat.diagnosis.thresholds import LearningRateThresholds, Profile

if TYPE_CHECKING:
    from lossbeat.diagnosis.run_memory import Regression
    from lossbeat.diagnosis.series import LearningRateSchedule, LossSeries

__all__ = ["check_learning_rate", "check_warmup"]


def check_learning_rate(
    schedule: LearningRateSchedule,
    trend: Trend,
    cv: float,
    t: LearningRateThresholds,
    learned: bool | None = None,
    regression: Regression | None = None,
    loss: LossSeries | None = None,
) -> Finding:
    """``schedule``: a :class:`LearningRateSchedule` (the largest LR across param groups per step).

    ``trend``: the loss trend (too small = a flat loss at a tiny LR that did not
    get there by a gradual decay); ``cv``: the robust loss CV (too large); ``learned``: whether
    the loss ever fell significantly below its start (a run that never did, at a peak LR above
    ``too_large``: the LR is the first suspect).
    """
    check = "learning_rate"
    recent = schedule.recent.last(len(schedule.recent))
    if not recent:
        return Finding.unknown(check)
    lr = recent[-1]
    if not math.isfinite(lr):
        return Finding(check, DANGER, f"learning rate is {lr}", "check the scheduler and the optimizer state")
    jumped = _jumped(schedule, trend, regression)
    if jumped is not None:
        return jumped
    collapsed = _collapsed(schedule, loss, t) if loss is not None else None
    if collapsed is not None:
        return collapsed
    ended = schedule.ended
    if len(recent) >= 5 and recent[-5:].count(0) == 5:  # each of the last 5 == 0
        if ended:
            return Finding(check, GOOD, "learning rate reached 0 at the end of its decayed schedule")
        return Finding(
            check,
            WARNING,
            "learning rate is 0: the model is not updating",
            "check the scheduler (a warmup from 0 that never ends, or a decay that ended)",
        )
    if lr < t.too_small and trend.known and not trend.falling and not trend.rising:
        if ended:
            return Finding(check, GOOD, f"learning rate {lr:.3g} at the end of its decayed schedule")
        if not lr <= t.decayed_fraction * schedule.peak:
            # Small all along (DPO and RLHF use 1e-7..1e-6 by design): the plateau check tells a flat loss.
            return Finding(check, GOOD, f"learning rate {lr:.3g} (peak {schedule.peak:.3g})")
        return Finding(
            check,
            WARNING,
            f"learning rate {lr:.3g} with a flat loss ({trend.ratio * 100:+.1f}% over {trend.window_steps:.0f} steps), "
            f"not reached by a gradual decay (peak {schedule.peak:.3g})",
            "the learning rate looks too small: try 10x larger, or check the schedule's minimum",
        )
    if max(recent) > t.too_large and trend.rising:
        return Finding(
            check,
            WARNING,
            f"learning rate {max(recent):.3g} with a rising loss",
            "the learning rate looks too large: lower it (e.g. 3-10x) or lengthen the warmup",
        )
    peak = schedule.peak
    if learned is False and math.isfinite(peak) and peak > t.too_large:
        return Finding(
            check,
            WARNING,
            f"learning rate peaked at {peak:.3g} and the loss never fell below its start: a learning rate that "
            "large overshoots (fine-tuning a pre-trained model usually takes 1e-5 to 2e-4)",
            "lower the learning rate 10-100x and warm it up; check the model's usual fine-tuning LR",
        )
    if math.isfinite(cv) and max(recent) > t.too_large and cv > t.too_large_cv:
        return Finding(
            check,
            WARNING,
            f"learning rate {max(recent):.3g} with a volatile loss (noise {cv:.3f} of its level)",
            "the learning rate looks too large: lower it (e.g. 3-10x) or lengthen the warmup",
        )
    return Finding(check, GOOD, f"learning rate {lr:.3g}")


def _jumped(schedule: LearningRateSchedule, trend: Trend, regression: Regression | None) -> Finding | None:
    """A learning rate that jumped 10x or more mid-run, with the loss gone bad since (settled well
    above its best, or rising): the jump is the cause to name first."""
    step = schedule.jump_step
    if step is None:
        return None
    if regression is not None and regression.went_wrong >= step:
        bad = f"since then {regression.describe()}"
    elif regression is None and trend.known and trend.rising:
        bad = f"the loss is rising since ({trend.recent:.4g} over the last {trend.window_steps:.0f} steps)"
    else:
        return None
    return Finding(
        "learning_rate",
        DANGER,
        f"the learning rate jumped {schedule.jump_to / schedule.jump_from:.0f}x at step {step} "
        f"({schedule.jump_from:.3g} -> {schedule.jump_to:.3g}) and {bad}",
        "restore the learning rate schedule (a scheduler stepped with the wrong count, a resumed run that lost "
        "its scheduler state, a param group's LR set by hand) and go back to a checkpoint from before the jump",
    )


def _collapsed(schedule: LearningRateSchedule, loss: LossSeries, t: LearningRateThresholds) -> Finding | None:
    """A learning rate that fell at once from near its peak to ``collapse_fraction`` of it or less, mid-run
    and still there, with the loss flat since (it fell less than ``too_small_min_decrease`` of its level
    from the first half of the steps since the fall to the second, at least ``windows.trend_min_steps``
    after it): the model stopped learning. A gradual decay
    (cosine, linear, step decays of 10x) never sets the collapse; only a scheduler or a setting gone wrong."""
    step, last = schedule.collapse_step, loss.summary.last_step
    lr = schedule.recent.back(0) if len(schedule.recent) else math.nan
    if step is None or last is None or not lr <= t.collapse_fraction * schedule.peak:
        return None
    width = float(loss.t.windows.trend_min_steps)
    if last - step < width:
        return None  # not yet a window of steps since the fall
    # The first half of the steps since the fall against the second: flat since, or still falling.
    half = (last - step) / 2
    n_before, before = loss.summary.window(step - 1, step - 1 + half)
    n_now, now = loss.summary.window(last - half, last)
    least = loss.t.windows.trend_min_records
    if min(n_before, n_now) < least or not (math.isfinite(before) and math.isfinite(now)) or before == 0:
        return None
    fell = (before - now) / abs(before)
    if fell >= t.too_small_min_decrease:
        return None  # still learning at the small LR (a fine-tune's last phase at 1e-7 can)
    return Finding(
        "learning_rate",
        DANGER,
        f"the learning rate collapsed {schedule.collapse_from / max(schedule.collapse_to, 1e-300):.3g}x at step "
        f"{step} ({schedule.collapse_from:.3g} -> {schedule.collapse_to:.3g}, {lr:.3g} now) mid-schedule, and the "
        f"loss has been flat since ({before:.4g} just after, {now:.4g} over the last {half:.0f} steps): a plateau, the model "
        "stopped learning; every step from here costs compute and buys nothing",
        "restore the learning rate schedule (a scheduler stepped past its end or with the wrong count, a resumed "
        "run that lost its scheduler state, a param group's LR set by hand) and resume from the last checkpoint "
        f"before step {step}",
    )


def check_warmup(series: LossSeries, profile: Profile, t: LearningRateThresholds) -> Finding:
    """A run from scratch (starting above the usual range) should fall well below its start early on."""
    check = "warmup"
    first, at_check = series.initial, series.loss_at_warmup_check
    if not (math.isfinite(first) and math.isfinite(at_check)):
        return Finding.unknown(check)
    start = series.first_step  # set with the first finite loss, as ``first`` is
    if (
        profile.loss_warn_high is None
        or not first > profile.loss_warn_high
        or start is None
        or start > t.warmup_check_step
    ):
        # Starting inside the usual range (fine-tuning), or a log that starts mid-run (resumed).
        return Finding.unknown(check, "not the start of a run from scratch: the warmup check does not apply")
    if first > 0 and at_check > t.warmup_max_ratio * first:
        return Finding(
            check,
            WARNING,
            f"loss {t.warmup_check_step} steps in is {at_check:.4g}, {at_check / first * 100:.0f}% of the initial {first:.4g}",
            "warmup may be too short or the peak LR wrong: try warmup over ~10% of the steps",
        )
    return Finding(
        check, GOOD, f"loss fell from {first:.4g} to {at_check:.4g} in the first {t.warmup_check_step} steps"
    )
