"""Checks on the loss: absolute range, trend, volatility, overfitting.

Pure functions over a :class:`LossSeries` (and plain floats); thresholds come
from :mod:`lossbeat.diagnosis.thresholds`. While the latest loss is non-finite, every
loss-derived check says it cannot judge: its windows hold only stale values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding, Status
from lossbeat.diagnosis.thresholds import LossThresholds, OverfittingThresholds, Profile, Thresholds
from lossbeat.diagnosis.window import StepSummary, fsum, median

if TYPE_CHECKING:
    from lossbeat.diagnosis.history import EvalTrack
    from lossbeat.diagnosis.profiles import SignalTrack
    from lossbeat.diagnosis.run_memory import Regression
    from lossbeat.diagnosis.series import LossSeries

__all__ = [
    "Trend",
    "trend_of",
    "check_loss_range",
    "check_loss_trend",
    "check_loss_volatility",
    "robust_cv",
    "check_overfitting",
    "is_spike",
    "uniform_classes",
]

NONFINITE = "cannot judge: the latest loss is not finite"
_CHANCE_PROFILES = frozenset({"classification", "preference"})
_CHANCE_TOLERANCE = 0.005  # relative distance to ln K that reads as "exactly" chance
_MAX_CLASSES = 100
_MAX_CLASSES_LOSS = math.log(_MAX_CLASSES) + 1.0

EvalMetric = tuple[str, "SignalTrack", bool]
"""An eval set's task metric: ``(name, its SignalTrack, higher_is_better)``."""
_Comparison = tuple[float, float, float, float, float, bool, float]
"""What :func:`_compare` returns: ``(ratio, z, recent, previous, best, rising, rise_z)``."""


class Trend(NamedTuple):
    """The loss over the last two windows of equal length in steps (a tuple: built at every diagnosis)."""

    known: bool
    ratio: float = math.nan
    """(previous mean - recent mean) / previous mean: positive when the loss falls."""
    z: float = math.nan
    """The fall in standard errors of the records' noise (negative: a rise)."""
    window_steps: float = math.nan
    recent: float = math.nan
    previous: float = math.nan
    best: float = math.nan
    """The lowest window mean of the run so far (windows of the same width)."""
    rising: bool = False
    """Significantly and meaningfully higher than before, and lasting or far beyond the noise (danger)."""
    falling: bool = False
    """Significantly and meaningfully lower than before (learning)."""
    watching: bool = False
    """Higher beyond trend_min_z standard errors, but not yet lasting (a warning)."""


def _compare(
    s: StepSummary, noise: float, width: float, t: Thresholds, floor: float | None, end: float
) -> _Comparison | None:
    """(ratio, z, recent, previous, best, rising, rise_z) for windows of ``width`` steps ending at
    ``end`` (the last step seen, or earlier); ``rise_z``: the rise in standard errors."""
    w, loss = t.windows, t.loss
    n_recent, recent = s.window(end - width, end)
    n_previous, previous = s.window(end - 2 * width, end - width)
    if min(n_recent, n_previous) < w.trend_min_records or not math.isfinite(previous) or previous == 0:
        return None
    se = noise * math.sqrt(1.0 / n_recent + 1.0 / n_previous) if math.isfinite(noise) else math.nan
    fall = previous - recent
    z = fall / se if se and se > 0 else (math.inf if fall > 0 else -math.inf if fall < 0 else 0.0)
    # Relative to the level, floored by the profile's floor: a converged loss near zero moving
    # 0.0100 -> 0.0104 is +4% of itself but nothing against the task's scale.
    ratio = fall / max(abs(previous), floor or 0.0)
    rising = ratio < loss.trend_rising and z < -loss.trend_min_z
    rise_z = -z
    # Or well above the best level the run reached (a jump that settled higher: the previous
    # window alone would read the way back down as a fall).
    n_best, best = s.best(width, w.trend_min_records, end - width)
    if n_best and math.isfinite(noise) and not rising:
        above = (recent - best) / max(abs(best), floor or 0.0) if best else math.inf
        z_best = (recent - best) / (noise * math.sqrt(1.0 / n_recent + 1.0 / n_best)) if noise > 0 else math.inf
        rising = above > loss.regress_max and z_best > loss.trend_min_z
        rise_z = z_best
    return ratio, z, recent, previous, best, rising, rise_z


def _lasts(s: StepSummary, noise: float, width: float, t: Thresholds, floor: float | None, last: int) -> bool:
    """A rise within ``loss.trend_danger_z`` standard errors must last: the same comparison half a
    window earlier says so too. A bump shorter than half a window (a stretch of harder batches in a
    noisy per-record log) is tested at every diagnosis, and over the many diagnoses of a run one
    passes 3 standard errors by chance."""
    earlier = _compare(s, noise, width, t, floor, last - width / 2.0)
    return earlier is not None and earlier[5]


def trend_of(series: LossSeries, t: Thresholds, floor: float | None = None) -> Trend:
    """Compare the last ``trend_fraction`` of the steps seen with the same span before it.

    A rise is also looked for over windows of at most ``windows.rise_max_steps``: late in a
    long run a regression must be found as fast as early in it (quarter-run windows of a
    30,000-step run would take 7,500 steps to see a +15 % regression)."""
    w, loss = t.windows, t.loss
    s = series.summary
    last = s.last_step
    if s.first_step is None or last is None:  # set together by the summary's first record
        return Trend(False)
    span = s.span
    width = max(float(w.trend_min_steps), w.trend_fraction * span)
    if 2 * width > span + s.width:  # the previous window must lie inside the run
        return Trend(False)
    noise = series.noise
    got = _compare(s, noise, width, t, floor, last)
    if got is None:
        return Trend(False)
    ratio, z, recent, previous, best, rising, rise_z = got
    watching = rising
    rising = rising and (rise_z >= loss.trend_danger_z or _lasts(s, noise, width, t, floor, last))
    short = max(float(w.trend_min_steps), float(w.rise_max_steps))
    if not rising and short < width:
        fast = _compare(s, noise, short, t, floor, last)
        if fast is not None and fast[5]:
            confirmed = fast[6] >= loss.trend_danger_z or _lasts(s, noise, short, t, floor, last)
            if confirmed or not watching:  # the shorter windows say it (the message quotes them)
                ratio, z, recent, previous, best, _, rise_z = fast
                width, rising, watching = short, confirmed, True
    # A rise must show in the median of the latest records too: one huge spike that recovered
    # at the next record lifts a window's mean, not the run's level.
    local = getattr(series, "local", math.nan)
    if (rising or watching) and math.isfinite(local):
        # The median of n records has a standard error of about 1.25 noise / sqrt(n).
        tolerance = max(
            abs(loss.trend_rising) * max(abs(previous), floor or 0.0),
            loss.trend_min_z * 1.25 * noise / math.sqrt(loss.spike_min_steps) if math.isfinite(noise) else 0.0,
        )
        rising = rising and local > previous + tolerance
        watching = watching and local > previous + tolerance
    falling = not rising and ratio >= loss.plateau_max_fall and z >= loss.fall_min_z
    return Trend(True, ratio, z, width, recent, previous, best, rising, falling, watching and not rising)


def uniform_classes(loss: float) -> int | None:
    """K when ``loss`` is ln K for a small K (chance level of a K-way prediction), else None."""
    if not 0 < loss <= _MAX_CLASSES_LOSS:  # exp() of a larger loss is no class count (and overflows)
        return None
    k = round(math.exp(loss))
    if 2 <= k <= _MAX_CLASSES and abs(loss - math.log(k)) <= _CHANCE_TOLERANCE * math.log(k):
        return k
    return None


def _start(series: LossSeries, profile: Profile, named: bool = True) -> str:
    """The run's first loss, explained only as far as the numbers and the task say: ``named`` False (no
    task named or detected, the default profile's guess) keeps to what the value itself shows."""
    initial = series.initial
    if not math.isfinite(initial):
        return ""
    # A vocabulary explains the start only where the numbers fit one: above ln of any plausible
    # vocabulary (loss_init_high) the loss lives on another scale (regression, a summed loss), and
    # exp() of it says nothing (and overflows above ~709).
    plausible = profile.loss_init_high is not None and initial <= profile.loss_init_high
    if profile.loss_good is not None and initial > profile.loss_good[1] and plausible:
        size = math.exp(initial)
        return (
            f"initial loss {initial:.4g} = ln {size:,.0f}: a uniform prediction over about {size:,.0f} tokens "
            "or classes, the healthy start of a model trained from scratch"
        )
    if profile.name == "preference" and abs(initial - math.log(2)) < 0.02:
        return f"initial loss {initial:.4g} = ln 2: the policy starts equal to its reference, as expected"
    if not named:
        # An unknown task: a start above any vocabulary is another scale, not a cross-entropy's start, and
        # one inside the usual range is not proof of a fine-tune (a regression's MSE starts there too).
        return f"initial loss {initial:.4g} (no task named or detected: no chance level to read it against)"
    if not plausible and profile.loss_init_high is not None:
        return (
            f"initial loss {initial:.4g}, above {profile.loss_init_high:g}: more than any plausible vocabulary explains"
        )
    return f"initial loss {initial:.4g}: a model that already knows the task (fine-tuning)"


def check_loss_range(
    series: LossSeries, profile: Profile, t: Thresholds, trend: Trend, component: str = "", learned: bool | None = None
) -> Finding:
    """Layer 1: is the loss where this task's losses live, once the run has had time to learn?

    ``learned``: whether the loss fell significantly below its start
    (:func:`lossbeat.diagnosis.learning.learned`)."""
    check = "loss_range"
    if series.nonfinite_run:
        return Finding.unknown(check, NONFINITE, component)
    if (
        profile.loss_good is None
        and profile.loss_warn_low is None
        and profile.loss_warn_high is None
        and profile.loss_init_high is None
    ):
        return Finding.unknown(check, f"profile {profile.name} has no absolute loss range", component)
    recent = series.ring.last(t.windows.range_steps)
    if not recent:
        return Finding.unknown(check, component=component)
    mean = fsum(recent) / len(recent)
    initial = series.initial
    # A start above any vocabulary is a fact of the run's start: a warning only while the
    # run has not left it, by half, and is not seen leaving it (a significant fall from the first
    # records: the range judges where it settles). Judged from the third record of a sparse log, a
    # fast fall 19.2 -> 13.0 (a VLM fine-tune, healthy) had not halved yet.
    if (
        profile.loss_init_high is not None
        and initial > profile.loss_init_high
        and not mean < 0.5 * initial
        and learned is not True
    ):
        return Finding(
            check,
            WARNING,
            (
                f"initial loss {initial:.4g} is above {profile.loss_init_high:g}, more than a uniform prediction over "
                f"any plausible vocabulary or class count (now {mean:.4g})"
                if getattr(t, "profile_named", True)
                else f"initial loss {initial:.4g} is above {profile.loss_init_high:g}, the highest start the "
                f"{profile.name} profile expects (now {mean:.4g})"
            )
            + _unnamed(t),
            "check the initialisation, the labels (ignored index, shifted targets) and the loss reduction "
            "(a sum instead of a mean, or a missing division by the accumulation steps)",
            component,
        )
    # "Still falling" by the fall's size, not its significance: a high loss falling 5-8 % per window is
    # learning even where two windows of few noisy records cannot prove it (the plateau check says no
    # more either); keyed on significance, the exemption came and went with the fall's z and the range
    # warning flapped (real-logs-3's YOLOv3 loss, 45.9 -> 3.4 over 40 epochs, above 5 for 60 % of the run).
    descending = trend.known and (
        trend.falling or (not trend.rising and not trend.watching and trend.ratio >= t.loss.plateau_max_fall)
    )
    learning = series.span < t.loss.range_after_steps and not (trend.known and not descending)
    if learning:
        start = _start(series, profile, named=getattr(t, "profile_named", True))
        return Finding(
            check,
            GOOD,
            f"mean loss {mean:.4g} while still learning" + (f"; {start}" if start else ""),
            component=component,
        )
    k = uniform_classes(mean) if profile.name in _CHANCE_PROFILES else None
    if k is not None and trend.known and not trend.falling:
        what = (
            "the policy does not separate chosen from rejected"
            if profile.name == "preference" and k == 2
            else f"the model predicts uniformly over {k} classes (chance level)"
        )
        return Finding(
            check,
            WARNING,
            f"loss {mean:.4g} equals ln {k}: {what}",
            "the model is not learning: check that labels match inputs (shuffled together), the learning rate, "
            "and that the classifier head is trained",
            component,
        )
    if profile.loss_warn_high is not None and mean > profile.loss_warn_high and descending:
        return Finding(
            check,
            GOOD,
            f"mean loss {mean:.4g}, above {profile.loss_warn_high:g} but still falling "
            f"({trend.ratio * 100:.1f}% over the last {trend.window_steps:.0f} steps)",
            component=component,
        )
    if profile.loss_warn_high is not None and mean > profile.loss_warn_high:
        return Finding(
            check,
            WARNING,
            f"mean loss {mean:.4g} is above {profile.loss_warn_high:g} for a {profile.name} task "
            f"after {series.span} steps" + _unnamed(t),
            "check the learning rate, the labels and the loss reduction; a loss this high often means the model is not learning",
            component,
        )
    if profile.loss_warn_low is not None and mean < profile.loss_warn_low:
        return Finding(
            check,
            WARNING,
            f"mean loss {mean:.4g} is below {profile.loss_warn_low:g}: suspiciously low for a {profile.name} task",
            "look for label leakage or memorisation: compare with the eval loss and check the data split",
            component,
        )
    if profile.loss_good is not None and profile.loss_good[0] <= mean <= profile.loss_good[1]:
        return Finding(check, GOOD, f"mean loss {mean:.4g} is in the usual range", component=component)
    return Finding(check, GOOD, f"mean loss {mean:.4g}", component=component)


def _unnamed(t: Thresholds) -> str:
    """For a task nobody named or the fields did not show: the range is the default profile's guess."""
    if getattr(t, "profile_named", True):
        return ""
    return (
        f"; no task was named or detected, so this is the {t.profile.name} range: if this loss is another "
        "kind (a regression on raw units, a summed loss), name its profile"
    )


def check_loss_trend(
    trend: Trend,
    series: LossSeries,
    t: Thresholds,
    profile: Profile,
    *,
    schedule_ended: bool = False,
    lr_fraction: float = math.nan,
    component: str = "",
    held: Status = GOOD,
    learned: bool | None = None,
    regression: Regression | None = None,
    best: float = math.inf,
) -> Finding:
    """Layer 2: is the loss still falling, flat, or rising, over windows in steps?

    ``best``: the run's best smoothed loss (:class:`RunMemory`); while the loss is non-finite, a
    climb above it in the finite records before the NaN is named (the run diverged into it).

    ``regression``: the run settled well above its best (:meth:`RunMemory.regressed`): a danger
    whatever the latest windows say (falling from an explosion's peak is no recovery).

    ``learned``: whether the loss ever fell from its start (:func:`lossbeat.diagnosis.learning.learned`);
    a flat end of a decayed schedule is expected only for a run that learned something first.

    ``held``: the status the check holds now; a plateau is left only for a fall
    beyond ``plateau_max_fall / hysteresis.release`` (value hysteresis).
    """
    found = _trend_unjudged(trend, series, t, profile, component, regression, best)
    if found is not None:
        return found
    span = f"{trend.window_steps:.0f} steps"  # formatted once: every finding below names it
    found = _trend_rising(trend, span, component)
    if found is None:
        found = _trend_falling(trend, span, series, t, profile, component, held, schedule_ended, lr_fraction, learned)
    if found is None:
        found = _trend_flat(trend, span, t, profile, component, held, learned)
    return found


_TREND = "loss_trend"


def _against_before(trend: Trend) -> float:
    """The latest window's move against the window before, in %."""
    return (trend.recent - trend.previous) / abs(trend.previous) * 100 if trend.previous else math.inf


def _trend_unjudged(
    trend: Trend,
    series: LossSeries,
    t: Thresholds,
    profile: Profile,
    component: str,
    regression: Regression | None,
    best: float,
) -> Finding | None:
    """What the windows cannot say or need not: a non-finite loss (a danger when the loss climbed
    into it), a loss not meant to fall, a run settled above its best (a danger whatever the
    windows say), windows not known yet."""
    if not profile.trend:
        return Finding.unknown(_TREND, f"profile {profile.name}: this loss is not meant to fall", component)
    if series.nonfinite_run:
        climb = _climb_before_nonfinite(series, t, profile, best)
        return Finding.unknown(_TREND, NONFINITE, component) if climb is None else climb.finding(component)
    if regression is not None:
        now = (
            f"; {_moved(-trend.ratio * 100)} over the last {trend.window_steps:.0f} steps, not back at its best"
            if trend.known
            else ""
        )
        return Finding(_TREND, DANGER, f"{regression.describe()}{now}", regression.fix(), component)
    if not trend.known:
        return Finding.unknown(_TREND, component=component)
    return None


class _Climb(NamedTuple):
    """The finite loss rose well above its best level before it went non-finite."""

    base: float
    level: float
    records: int
    last_finite_step: int
    against: str
    """What ``base`` is: "its best level" or "where it was" (the first of the records read)."""

    def finding(self, component: str) -> Finding:
        rise = (self.level - self.base) / abs(self.base) * 100 if self.base else math.inf
        return Finding(
            _TREND,
            DANGER,
            f"the loss diverged before it went non-finite: {self.level:.4g} over its last {self.records} finite "
            f"records (to step {self.last_finite_step}), {rise:.0f}% above {self.against}, {self.base:.4g}; "
            "then non-finite",
            "lower the learning rate and clip gradients: the loss climbed for several steps before the NaN (an "
            "instability, not one bad batch); resume from the last checkpoint before the climb",
            component,
        )


def _climb_before_nonfinite(series: LossSeries, t: Thresholds, profile: Profile, best: float) -> _Climb | None:
    """Whether the finite records before the current non-finite run (the ring's newest: a
    non-finite loss is never pushed) climbed well above where they were: the median of their
    last ``k`` records above the median of the ring's first ``k`` (``loss.trend_min_z`` standard
    errors, as a rising trend is judged), or above the run's best smoothed level (``trend_danger_z``,
    as a run settled above its best: that best is the lowest of many levels), and by
    ``loss.regress_max`` of it. ``k`` is ``loss.spike_min_steps``, fewer in a run that went
    non-finite within its first records (a third of them, at least 3)."""
    values = series.ring.last(len(series.ring))
    n = len(values)
    k = min(t.loss.spike_min_steps, max(3, n // 3))
    last_step = series.summary.last_step
    if n < 2 * k or last_step is None:
        return None
    level = median(values[-k:])
    noise = series.noise
    se = 1.25 * noise * math.sqrt(2.0 / k) if math.isfinite(noise) else 0.0  # of a difference of two medians
    for base, z, against in (
        (median(values[:k]), t.loss.trend_min_z, f"its level {n - k} finite records earlier"),
        (best, t.loss.trend_danger_z, "its best level"),
    ):
        scale = max(abs(base), profile.volatility_floor or 0.0)
        rise = level - base
        if math.isfinite(rise) and rise > t.loss.regress_max * scale and rise > z * se:
            return _Climb(base, level, k, last_step, against)
    return None


def _trend_rising(trend: Trend, span: str, component: str) -> Finding | None:
    """A lasting rise (danger), or one beyond the noise not yet lasting half a window (watching)."""
    if trend.rising:
        best = (
            f"; {(trend.recent - trend.best) / abs(trend.best) * 100:.0f}% above the best level {trend.best:.4g}"
            if math.isfinite(trend.best) and trend.best and trend.recent > trend.best
            else ""
        )
        return Finding(
            _TREND,
            DANGER,
            f"loss is rising: {trend.recent:.4g} over the last {span}, {_moved(_against_before(trend))} against the "
            f"window before ({trend.previous:.4g}){best}",
            "lower the learning rate, enable gradient clipping, and check the data of the recent steps",
            component,
        )
    if trend.watching:
        return Finding(
            _TREND,
            WARNING,
            f"loss {_moved(_against_before(trend))} over the last {span} against the window before ({trend.recent:.4g} "
            f"against {trend.previous:.4g}): beyond its noise, not yet lasting half a window: watching",
            "if it keeps rising: lower the learning rate, enable gradient clipping, and check the data of the recent "
            "steps",
            component,
        )
    return None


def _trend_falling(
    trend: Trend,
    span: str,
    series: LossSeries,
    t: Thresholds,
    profile: Profile,
    component: str,
    held: Status,
    schedule_ended: bool,
    lr_fraction: float,
    learned: bool | None,
) -> Finding | None:
    """A fall that counts (a plateau held is left only for a lasting fall beyond its threshold /
    release), or a flat end of a decayed schedule after the run learned: both good."""
    release = t.hysteresis.release
    pct = trend.ratio * 100
    if held is WARNING:  # a plateau is left for a fall beyond its threshold / release ...
        falling = (
            trend.falling
            and trend.ratio >= t.loss.plateau_max_fall / release
            and trend.z >= t.loss.fall_min_z / release
            and _fall_lasts(trend, series, t, profile)
        )
    else:
        falling = trend.falling
    if falling:
        return Finding(_TREND, GOOD, f"loss falling ({pct:.1f}% over the last {span})", component=component)
    if schedule_ended and learned is not False:
        return Finding(
            _TREND,
            GOOD,
            f"loss flat ({_moved(-pct)} over the last {span}) at the end of a decayed LR schedule "
            f"(LR at {lr_fraction * 100:.2g}% of its peak): expected",
            component=component,
        )
    return None


def _trend_flat(
    trend: Trend, span: str, t: Thresholds, profile: Profile, component: str, held: Status, learned: bool | None
) -> Finding:
    """A loss neither rising nor falling enough: a slow fall at the threshold, a fall within the
    windows' noise, a loss flat near zero (all good), else a plateau."""
    release = t.hysteresis.release
    pct = trend.ratio * 100
    # ... and entered only below its threshold x release: a descent at the threshold does not flap.
    if (
        held is not WARNING
        and not trend.rising
        and trend.ratio >= t.loss.plateau_max_fall * release
        and trend.z >= t.loss.fall_min_z * release
    ):
        return Finding(
            _TREND,
            GOOD,
            f"loss falling slowly ({pct:.1f}% over the last {span}), at the plateau threshold",
            component=component,
        )
    # A plateau is a fall too small to matter. A fall as large as one that matters, but within the
    # noise of two windows of few records (a sparse or noisy log early in the run), is no evidence
    # either way: absence of evidence of a fall is not evidence of its absence. The windows lack the
    # power to tell, so no plateau is entered on it; one already held stays until a significant fall.
    # Entering on it made noisy descents flap, plateau and back, as the fall's z crossed 3 by chance
    # (real-logs-3's YOLOv3 loss falling 5-8 % per window, z 1.7-3, over 40 epochs).
    if held is not WARNING and not trend.rising and trend.ratio >= t.loss.plateau_max_fall * release:
        return Finding(
            _TREND,
            GOOD,
            f"loss {_moved(-pct)} over the last {span}, within the noise of the "
            "windows: too few records to call it falling or a plateau",
            component=component,
        )
    floor = profile.volatility_floor
    near_zero = 0.1 * (floor or 0.0) * (release if held is WARNING else 1.0 / release)
    if floor is not None and abs(trend.recent) < near_zero:
        return Finding(
            _TREND, GOOD, f"loss flat near zero ({trend.recent:.3g}): nothing left to fall", component=component
        )
    return Finding(
        _TREND,
        WARNING,
        f"loss has plateaued: {_moved(-pct)} over the last {span} "
        + (
            f"(no fall of {t.loss.plateau_max_fall * 100:g}% of the level)"
            if trend.ratio < t.loss.plateau_max_fall
            else "(not a significant fall)"
        )
        + ("; it never fell below its start" if learned is False else ""),
        "if it is not converged: raise the learning rate, try a cosine schedule with restarts, or check that the data is shuffled",
        component,
    )


def _fall_lasts(trend: Trend, series: LossSeries, t: Thresholds, profile: Profile) -> bool:
    """A plateau is left for a descent that lasts: the same comparison half a window earlier shows
    a fall too (beyond ``plateau_max_fall`` and ``fall_min_z``), as a rise must last before it is a
    danger. One stretch of easier batches, or a single step down, lifts the latest windows' fall
    past its threshold for a few diagnoses and is gone: leaving on it, a slow noisy descent went
    plateau, falling, plateau again within a window (real-logs-3's medical LoRA SFT: three plateau episodes
    in one epoch-long descent)."""
    s = getattr(series, "summary", None)
    if s is None or s.last_step is None or not math.isfinite(trend.window_steps):
        return True
    earlier = _compare(
        s, series.noise, trend.window_steps, t, profile.volatility_floor, s.last_step - trend.window_steps / 2.0
    )
    if earlier is None:
        return True  # no earlier windows inside the run: the latest comparison is all there is
    ratio, z = earlier[0], earlier[1]
    return ratio >= t.loss.plateau_max_fall and z >= t.loss.fall_min_z


def _moved(pct: float) -> str:
    """A change in percent as words: 'rose 7.1%', 'fell 7.1%', 'unchanged'."""
    if not math.isfinite(pct):
        return "up from 0"
    if abs(pct) < 0.05:
        return "unchanged"
    return f"rose {pct:.1f}%" if pct > 0 else f"fell {-pct:.1f}%"


def robust_cv(series: LossSeries, profile: Profile) -> float:
    """Robust step-to-step noise over the loss level (the level floored by the profile's floor)."""
    floor = profile.volatility_floor
    level, noise = series.level, series.noise
    if floor is None or not (math.isfinite(level) and math.isfinite(noise)):
        return math.nan
    return noise / max(abs(level), floor)


def check_loss_volatility(
    cv: float,
    t: LossThresholds,
    component: str = "",
    nonfinite: bool = False,
    held: Status = GOOD,
    release: float = 1.0,
) -> Finding:
    """Layer 3: how much does the loss jump around its trend? ``cv``: :func:`robust_cv`.

    ``held``: the status the check holds now; to leave it, ``cv`` must fall below
    ``release`` x the threshold that status was entered at (hysteresis).
    """
    check = "loss_volatility"
    if nonfinite:
        return Finding.unknown(check, NONFINITE, component)
    if not math.isfinite(cv):
        return Finding.unknown(check, component=component)
    warning = t.cv_warning * (release if held >= WARNING else 1.0)
    danger = t.cv_danger * (release if held >= DANGER else 1.0)
    if cv < warning:
        return Finding(check, GOOD, f"loss volatility normal (noise/level {cv:.3f})", component=component)
    if cv < danger:
        return Finding(
            check,
            WARNING,
            f"loss is volatile (step-to-step noise {cv:.3f} of its level)",
            "use a larger batch (or gradient accumulation) or a lower learning rate",
            component,
        )
    return Finding(
        check,
        DANGER,
        f"loss is very volatile (step-to-step noise {cv:.3f} of its level)",
        "lower the learning rate, clip gradients, and look for bad batches",
        component,
    )


def is_spike(value: float, level: float, noise: float, t: LossThresholds) -> bool:
    """A loss above the recent median by ``spike_sigma`` robust std and ``spike_min_rise`` of the level."""
    return (
        math.isfinite(value)
        and math.isfinite(noise)
        and value - level > max(t.spike_sigma * noise, t.spike_min_rise * abs(level))
    )


def check_overfitting(
    track: EvalTrack | None,
    trend: Trend,
    t: OverfittingThresholds,
    component: str = "",
    learned: bool | None = None,
    metric: EvalMetric | None = None,
    held: Status = GOOD,
    regression: Regression | None = None,
) -> Finding:
    """Eval loss above its best for ``t.evals`` evaluations in a row while the training loss does not rise.

    ``regression``: the training loss itself settled well above its best
    (:meth:`RunMemory.regressed`): an eval loss rising with it is that blow-up, not overfitting.

    ``learned`` False (the training loss never fell below its start): an eval loss rising there is
    not overfitting, the run never learned (the ``learning`` check says so). ``metric``: the eval
    set's task metric, ``(name, SignalTrack, higher_is_better)``: an eval loss that rises while the
    metric still improves is over-confidence, and the finding says so."""
    check = "overfitting"
    if track is None or track.count < 2:
        return Finding.unknown(check, component=component)
    rise = track.rise
    # Entered on evaluations above the best beyond their noise; held while they stay above it by
    # eval_rise x release (``held``: the status the check holds now).
    above = max(track.above, getattr(track, "still_above", 0)) if held >= WARNING else track.above
    if learned is not True and above:
        why = (
            "the training loss never fell below its start: not overfitting, a run that never learned"
            if learned is False
            else "the training loss has not been seen falling yet"
        )
        return Finding(
            check,
            GOOD,
            f"eval loss {track.latest:.4g} is {rise * 100:.0f}% above its best {track.best:.4g}, but {why}",
            component=component,
        )
    if above and regression is not None:
        return Finding(
            check,
            GOOD,
            f"eval loss {track.latest:.4g} is {rise * 100:.0f}% above its best {track.best:.4g}, but the training "
            f"loss itself blew up ({regression.above * 100:.0f}% above its best): not overfitting (see loss_trend)",
            component=component,
        )
    if above >= t.evals and not trend.rising:
        confident = _still_improving(metric, track)
        if confident:
            return Finding(
                check,
                WARNING,
                f"over-confident: eval loss {track.latest:.4g} is {rise * 100:.0f}% above its best {track.best:.4g} "
                f"(step {track.best_step}) for {above} evaluations while the {confident}: the model grows "
                "more confident in the answers it gets wrong, so the loss rises while the metric improves",
                "choose the checkpoint by the metric (metric_for_best_model), not the eval loss; calibrate "
                "(label smoothing, temperature scaling) if probabilities matter; regularise once the metric stops "
                "improving",
                component,
            )
        return Finding(
            check,
            WARNING,
            f"eval loss {track.latest:.4g} is {rise * 100:.0f}% above its best {track.best:.4g} (step {track.best_step}) "
            f"for {above} evaluations while the training loss does not rise",
            "add weight decay or dropout, get more data, or stop early at the best checkpoint",
            component,
        )
    if above:
        return Finding(
            check,
            GOOD,
            f"eval loss {track.latest:.4g} is {rise * 100:.0f}% above its best {track.best:.4g}: "
            "one evaluation, watching",
            component=component,
        )
    return Finding(check, GOOD, f"eval loss {track.latest:.4g} (best {track.best:.4g})", component=component)


_METRIC_NAMES = {"eval_accuracy": "eval accuracy", "eval_f1": "eval F1", "eval_wer": "eval WER", "eval_cer": "eval CER"}


def _still_improving(metric: EvalMetric | None, track: EvalTrack) -> str | None:
    """How the eval metric still improves past the eval loss's best evaluation, or None.

    Improved: the median of its latest 3 values beats its best block mean up to the eval loss's
    best step by more than its own record-to-record noise."""
    if metric is None or track.best_step is None:
        return None
    name, values, higher = metric
    if values is None or values.count < 3:
        return None
    before = values.best_until(track.best_step, higher)
    now = values.recent_median(3)
    noise = values.noise()
    tol = max(noise if math.isfinite(noise) else 0.0, 1e-3 * abs(before) if math.isfinite(before) else 0.0)
    gain = (now - before) if higher else (before - now)
    if not (math.isfinite(gain) and gain > tol):
        return None
    return f"{_METRIC_NAMES.get(name, name)} still improves ({before:.4g} by then, {now:.4g} now)"
