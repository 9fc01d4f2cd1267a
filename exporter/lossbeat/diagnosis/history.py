"""Bounded training history: what the checks read, fed one record at a time.

Torch-free, so the live monitor and offline analysis of log files share it.
Memory is fixed by the thresholds' window sizes, whatever the run length.
Windows that judge a trend are measured in steps (a :class:`StepSummary`);
noise is measured per record, where it lives.
"""

from __future__ import annotations

import math
from typing import Mapping

from lossbeat.diagnosis.events import EVENT_CHECKS, EventTrack
from lossbeat.diagnosis.profiles import MAX_SIGNALS, SIGNALS, SignalTrack, signal_kind
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.diagnosis.window import LossWindow, NoiseWindow, Ring, StepSummary, median, robust_noise

__all__ = ["History", "StepEvents", "LossSeries", "GradBaseline", "LearningRateSchedule", "EvalTrack"]

_MAX_COMPONENTS = 32  # bounded label cardinality for multi-task losses
_MAX_EVAL_GROUPS = 32
_INITIAL_RECORDS = 1  # the initial loss is the first finite record (the article's 'first loss')
_RECENT_GRADS = 5  # the "recent" grad-norm level is the median of this many records
_CANONICAL = frozenset(SIGNALS)
_EARLY_NOISE_RECORDS = 8
_ZERO_INFLATED = 0.1  # more than this fraction of exact zeros: noise from the non-zero records


class StepEvents:
    """What one step counted (each flag is a counter increment)."""

    __slots__ = ("nonfinite_loss", "nonfinite_grad", "spike", "explosion")

    def __init__(self) -> None:
        self.nonfinite_loss = False
        self.nonfinite_grad = False
        self.spike = False
        self.explosion = False


class LossSeries:
    """One loss (the total or a component): recent records, the whole run by steps, the start."""

    def __init__(self, t: Thresholds, history: int = 0) -> None:
        w = t.windows
        self.t = t
        self.window = LossWindow(w.cv_steps, w.trend_steps, history=history)
        self.summary = StepSummary(w.summary_blocks)
        self._initial: list[float] = []
        self.first_step: int | None = None
        self.nonfinite_run = 0
        """Non-finite values in a row at the end (0: the latest loss is finite)."""
        self.loss_at_warmup_check = math.nan
        self._level = math.nan  # median of the noise window, refreshed every few records
        self._local = math.nan  # median of the last spike_min_steps records
        self._noise = math.nan
        self._pushes = 0
        self._latest = math.nan  # the newest finite record (the ring's back)
        self._spike_limit = math.inf  # spike_limit(), recomputed when its inputs change (a refresh)
        self._noise_window = NoiseWindow(w.noise_records)
        self.same_run = 0
        """Finite records in a row exactly equal to the latest one (1: it differs from the one before)."""
        self.records = 0
        """Finite records seen."""
        self.first_noise = math.nan
        """The robust noise at the first refresh with ``_EARLY_NOISE_RECORDS`` records: the run's own early noise."""
        self.fell_once = False
        """Set by :func:`lossbeat.diagnosis.learning.learned` once the loss fell significantly below its start."""

    @property
    def ring(self) -> Ring:
        return self.window.ring

    def __len__(self) -> int:
        return len(self.window)

    @property
    def initial(self) -> float:
        """The mean of the first finite records: where the run started."""
        return math.fsum(self._initial) / len(self._initial) if self._initial else math.nan

    def push(self, step: int, value: float) -> bool:
        """Record one value; returns whether it is a spike (finite values only).

        O(1) but every ``windows.diagnose_every`` records (and each of the first
        ``loss.spike_min_steps``), when the noise window's level and noise are refreshed."""
        if not math.isfinite(value):
            self.nonfinite_run += 1
            return False
        self.nonfinite_run = 0
        spike = value > self._spike_limit
        if self.first_step is None:
            self.first_step = step
        self.same_run = self.same_run + 1 if self.records and value == self._latest else 1
        self._latest = value
        self.records += 1
        if len(self._initial) < _INITIAL_RECORDS:
            self._initial.append(value)
        if self.loss_at_warmup_check != self.loss_at_warmup_check \
                and step - self.first_step >= self.t.learning_rate.warmup_check_step:  # NaN: not reached yet
            self.loss_at_warmup_check = value
        ring = self.window.ring
        ring.push(value)
        if self._noise_window.size < ring._capacity:
            self._noise_window.update(ring)
        self.summary.push(step, value)
        self._pushes += 1
        if self._pushes % self.t.windows.diagnose_every == 0 or self._pushes <= self.t.loss.spike_min_steps:
            self.refresh()
        return spike

    def spike_limit(self) -> float:
        """The loss above which the next record is a spike (inf until enough records): the local
        level + max(``spike_sigma`` x the robust noise, ``spike_min_rise`` x the level)."""
        return self._spike_limit

    def _limit(self) -> float:
        t = self.t
        if (not t.profile.trend  # an RL policy loss is ~0 by construction: its excursions mean nothing
                or len(self.window) < t.loss.spike_min_steps or not math.isfinite(self._noise) or not self._noise > 0):
            return math.inf
        return self._local + max(t.loss.spike_sigma * self._noise, t.loss.spike_min_rise * abs(self._local))

    def refresh(self) -> None:
        """Recompute the robust level and noise of the noise window (every few records): read
        from the window kept sorted as records come (O(1)), or sorted again (O(window)) for a
        zero-inflated loss."""
        size = self.t.windows.noise_records
        window = self._noise_window
        n = min(size, len(self.ring))
        # A loss that is often exactly 0 (GRPO/PPO groups without advantage, a satisfied hinge) has
        # a median second difference of 0: against that every non-zero record would be a spike.
        # Its noise and local level are those of its non-zero records.
        if window.size == size and window.size < self.ring.capacity and not (
                window.zeros > _ZERO_INFLATED * n and n - window.zeros >= 4):
            self._level = window.values.median()
            self._noise = window.noise()
            local = self.ring.last(self.t.loss.spike_min_steps) if n >= self.t.loss.spike_min_steps \
                else self.ring.last(n)
        else:
            values = self.ring.last(size)
            self._level = median(values)
            nonzero = [v for v in values if v != 0.0]
            if len(values) - len(nonzero) > _ZERO_INFLATED * len(values) and len(nonzero) >= 4:
                values = nonzero
            self._noise = robust_noise(values)
            n = len(values)
            local = values[-self.t.loss.spike_min_steps:]
        if math.isnan(self.first_noise) and n >= _EARLY_NOISE_RECORDS:
            self.first_noise = self._noise
        # Spikes are judged against the local level (a falling loss leaves the window's median behind).
        self._local = median(local)
        self._spike_limit = self._limit()

    def retarget(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        if self._noise_window.size != thresholds.windows.noise_records:
            self._noise_window = NoiseWindow(thresholds.windows.noise_records)
            self._noise_window.rebuild(self.ring)
        self._spike_limit = self._limit()

    @property
    def level(self) -> float:
        return self._level

    @property
    def local(self) -> float:
        """The median of the last ``spike_min_steps`` records (a level one spike does not move)."""
        return self._local

    @property
    def noise(self) -> float:
        """Robust standard deviation of one record's step-to-step noise."""
        return self._noise

    @property
    def span(self) -> int:
        return self.summary.span

    def cv(self) -> float:
        """Plain std / mean of the noise window (the raw ``training_loss_cv`` gauge)."""
        return self.window.cv()

    def trend_ratio(self) -> float:
        """The raw 2 x ``trend_steps``-record trend ratio (the ``training_loss_trend_ratio`` gauge)."""
        return self.window.trend_ratio()

    def clear(self) -> None:
        self.window.clear()
        self.summary.clear()
        self._initial = []
        self.first_step = None
        self.nonfinite_run = 0
        self.loss_at_warmup_check = math.nan
        self._level = self._noise = self._local = math.nan
        self._pushes = 0
        self._latest = math.nan
        self._spike_limit = math.inf
        self._noise_window.clear()
        self.same_run = self.records = 0
        self.fell_once = False
        self.first_noise = math.nan


class GradBaseline:
    """The grad norm against the run's own level.

    ``median``: the rolling median of the baseline window (the records before the
    recent ones), for jumps; ``level``: a slow robust level that follows drifts but
    may rise by at most 2x per ``climb_half_life_steps``, for sustained climbs.
    """

    def __init__(self, t: Thresholds) -> None:
        self.t = t
        self.ring = Ring(t.windows.baseline_records + _RECENT_GRADS)
        self.median = math.nan
        self.level = math.nan
        self.recent = math.nan
        self.last_step: int | None = None
        self._pushes = 0
        self._limit = math.inf  # event_limit(), recomputed when the median or the records change
        self._one_step = (math.nan, math.nan)  # _follow's two factors for a step of 1 (the usual)
        self._one_step_for: float | None = None
        self._established = False  # `established` at the last push (once True, True until the median is taken again)

    @property
    def established(self) -> bool:
        return len(self.ring) - _RECENT_GRADS >= self.t.windows.baseline_min_records and math.isfinite(self.median)

    def event_limit(self) -> float:
        """The norm above which a step departs from the baseline (inf until it is established):
        a jump (``jump_ratio`` x the median), or above the absolute ceiling and ``ceiling_ratio``
        x the median. The optimizer guard compares the step's norm with it on the device."""
        return self._limit

    def _event_limit(self) -> float:
        if not self.established:
            return math.inf
        g_t = self.t.gradients
        return min(g_t.jump_ratio * self.median, max(g_t.explosion, g_t.ceiling_ratio * self.median))

    def is_event(self, g: float) -> bool:
        """A departure from the baseline: a jump, or above the absolute ceiling and well above the level."""
        return g > self._limit

    def push(self, step: int, g: float) -> bool:
        """Record one finite, non-zero norm; returns whether it departs from the baseline.
        O(1) but every ``windows.diagnose_every`` records (and until established), when the
        baseline's median is taken again."""
        event = g > self._limit
        ring = self.ring
        ring.push(g)
        self._pushes += 1
        n = ring._count
        recent = ring.last(_RECENT_GRADS)
        if len(recent) == _RECENT_GRADS:  # the median of 5, as median() takes it
            recent.sort()
            self.recent = recent[_RECENT_GRADS // 2]
        else:
            self.recent = median(recent)
        # Once established, it stays so until the median is taken again (the ring only grows, the
        # median moves only below): the flag is read, not recomputed, on the pushes in between.
        established = self._established or self.established
        if self._pushes % self.t.windows.diagnose_every == 0 or not established:
            if n > _RECENT_GRADS:
                self.median = median(ring.last(n)[: n - _RECENT_GRADS])
                established = self.established
            self._limit = self._event_limit()
        elif self._limit == math.inf:  # established by this record's count, with the median taken before
            self._limit = self._event_limit()
        self._established = established
        if established:
            self._follow(step)
        self.last_step = step
        return event

    def _follow(self, step: int) -> None:
        if math.isnan(self.level):
            self.level = self.median
            return
        half_life = self.t.gradients.climb_half_life_steps
        dt = max(1, step - (self.last_step if self.last_step is not None else step))
        if dt == 1:  # the same two powers every step: computed once per half-life setting
            rise, pull = self._one_step
            if rise != rise or self._one_step_for != half_life:  # NaN: not computed yet
                rise, pull = self._one_step = (2.0 ** (1 / half_life), 1.0 - 0.5 ** (1 / (half_life / 10.0)))
                self._one_step_for = half_life
        else:
            rise, pull = 2.0 ** (dt / half_life), 1.0 - 0.5 ** (dt / (half_life / 10.0))
        # Falls are followed fast (a run settles), rises at most 2x per half-life.
        target = min(self.recent, self.level * rise)
        self.level += pull * (target - self.level)

    def retarget(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._established = False  # baseline_min_records may differ: computed again at the next push
        self._limit = self._event_limit()

    def clear(self) -> None:
        self.ring.clear()
        self.median = self.level = self.recent = math.nan
        self.last_step = None
        self._pushes = 0
        self._limit = math.inf
        self._established = False


class LearningRateSchedule:
    """The LR's peak and whether it has decayed gradually to its end (not dropped at once)."""

    def __init__(self, t: Thresholds) -> None:
        self.t = t
        self.recent = Ring(5)
        self.peak = 0.0
        self.first_step: int | None = None
        self.below_half_at: int | None = None
        self.decayed_at: int | None = None

    def push(self, step: int, lr: float) -> None:
        self.recent.push(lr)
        if not math.isfinite(lr):
            return
        if self.first_step is None:
            self.first_step = step
        if lr > self.peak:
            self.peak = lr
        if lr >= 0.5 * self.peak:  # (re)starts: a warm restart begins a new decay
            self.below_half_at = self.decayed_at = None
            return
        if self.below_half_at is None:
            self.below_half_at = step
        if self.decayed_at is None and lr <= self.t.learning_rate.decayed_fraction * self.peak:
            self.decayed_at = step

    @property
    def ended(self) -> bool:
        """The LR sits at the end of a gradual decay (cosine, linear, ... to a small fraction of its peak)."""
        if self.decayed_at is None or self.below_half_at is None or self.first_step is None:
            return False
        took = self.decayed_at - self.below_half_at
        before = max(1, self.below_half_at - self.first_step)
        return took >= self.t.learning_rate.gradual_min_fraction * before

    @property
    def fraction_of_peak(self) -> float:
        lr = self.recent.back(0) if len(self.recent) else math.nan
        return lr / self.peak if self.peak > 0 else math.nan

    def clear(self) -> None:
        self.__init__(self.t)


class EvalTrack:
    """One eval set: its best loss and how many evaluations in a row sit above it by ``eval_rise``."""

    def __init__(self, t: Thresholds) -> None:
        self.t = t
        self.best = math.inf
        self.best_step: int | None = None
        self.latest = math.nan
        self.count = 0
        self.above = 0
        """Evaluations in a row above the best by ``eval_rise`` and beyond the evaluations' noise."""
        self.still_above = 0
        """Evaluations in a row above the best by ``eval_rise`` x ``hysteresis.release`` (to leave overfitting)."""
        self.recent = Ring(10)
        self.first = math.nan

    def push(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            return
        if not self.count:
            self.first = loss
        self.recent.push(loss)
        self.count += 1
        self.latest = loss
        if loss < self.best:
            self.best, self.best_step = loss, step
        rise = (loss - self.best) / self.best if self.best > 0 else (math.inf if loss > self.best else 0.0)
        # Above the best by eval_rise, and by more than the evaluations' own noise: the best of many
        # noisy evaluations is their luckiest one, so a noisy eval loss sits above it most of the time
        # (a small or shifting validation set: a TFT forecaster's val loss jumps 25-60 % and back
        # between epochs while trending down, issue 18). The noise is the robust evaluation-to-evaluation
        # noise of the last evaluations (second differences: a steady rise, real overfitting, is not
        # noise; see overfitting.noise_z).
        noise = robust_noise(self.recent.last(len(self.recent)))
        beyond = not math.isfinite(noise) or loss - self.best > self.t.overfitting.noise_z * noise
        self.above = self.above + 1 if rise > self.t.overfitting.eval_rise and beyond else 0
        # Once overfitting is judged, it is left only when the eval loss comes back near its best
        # (value hysteresis, as for volatility and plateaus): one lucky evaluation of a noisy eval set
        # that rises steadily is within its noise of the best, not back at it.
        self.still_above = self.still_above + 1 \
            if rise > self.t.overfitting.eval_rise * self.t.hysteresis.release else 0

    @property
    def rise(self) -> float:
        if not self.count:
            return math.nan
        return (self.latest - self.best) / self.best if self.best > 0 else (math.inf if self.latest > self.best else 0.0)


class History:
    def __init__(self, thresholds: Thresholds) -> None:
        t = thresholds
        self.thresholds = t
        w = t.windows
        self.loss = LossSeries(t, history=max(t.learning_rate.too_small_window, w.noise_records))
        self.components: dict[str, LossSeries] = {}
        self.grad = GradBaseline(t)
        self.grad_norms = Ring(w.grad_steps)
        self.lr = LearningRateSchedule(t)
        self.evals: dict[str, EvalTrack] = {}
        self.last_step: int | None = None
        self.steps_seen = 0
        self.nonfinite_seen = 0
        self.last_nonfinite_at: int | None = None  # steps_seen at the last non-finite value
        self.layer_norms: Mapping[str, float] = {}
        self.grad_scale: float | None = None  # fp16 GradScaler's loss scale, when one is observed
        self.signals: dict[str, SignalTrack] = {}
        """Named signals beside the loss (:data:`lossbeat.diagnosis.profiles.SIGNALS`), by canonical name."""
        self.grad_level_peak = math.nan
        """The highest grad-norm baseline median a diagnosis has seen (the RL collapse check's earlier level)."""
        self.grad_records = 0
        self.grad_zero_run = 0
        """Grad norms in a row that are exactly 0."""
        self.grad_nonfinite_run = 0
        """Grad norms in a row that are not finite."""
        self.nonfinite_recent = Ring(w.cv_steps)
        """1.0 for each of the last records that had a non-finite loss or gradient, else 0.0."""
        self.events = {check: EventTrack() for check in EVENT_CHECKS}
        """The loss spikes and explosions counted, with their steps (:mod:`lossbeat.diagnosis.events`)."""
        self.resets = 0
        """Times the windows were reset (the step went backwards)."""

    # Older names, kept for callers that read them.
    @property
    def lrs(self) -> Ring:
        return self.lr.recent

    @property
    def first_loss(self) -> float:
        return self.loss.initial

    @property
    def finite_losses_seen(self) -> int:
        return len(self.loss.summary)

    @property
    def eval_losses(self) -> list[float]:
        track = self.evals.get("")
        return [] if track is None else [track.latest]

    def retarget(self, thresholds: Thresholds) -> None:
        """Judge with ``thresholds`` (another profile) from now on; every window is kept."""
        self.thresholds = thresholds
        for part in (self.loss, self.grad, self.lr, *self.components.values(), *self.evals.values()):
            if hasattr(part, "retarget"):
                part.retarget(thresholds)  # and what it derived from them (the event limits)
            elif hasattr(part, "t"):
                part.t = thresholds

    def reset_windows(self) -> None:
        """The step went backwards (a restart, or another run appended): old windows no longer apply."""
        self.resets += 1
        self.loss.clear()
        for series in self.components.values():
            series.clear()
        self.grad.clear()
        self.grad_norms.clear()
        self.lr.clear()
        self.evals.clear()
        self.signals.clear()
        self.grad_records = self.grad_zero_run = self.grad_nonfinite_run = 0
        self.grad_level_peak = math.nan
        self.nonfinite_recent.clear()
        for track in self.events.values():
            track.clear()

    def _level_before(self, pushed: bool) -> tuple[float, int]:
        """The loss level before this record's event: the median of the ``windows.cv_steps``
        finite records before it, and how many there were (read only when an event is counted)."""
        n = self.thresholds.windows.cv_steps
        values = self.loss.ring.last(n + 1)[:-1] if pushed else self.loss.ring.last(n)
        return (median(values) if values else math.nan), len(values)

    def add_step(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        learning_rate: float | None = None,
        components: Mapping[str, float] | None = None,
    ) -> StepEvents:
        """Record one step; returns the events it counts. Never raises on data.

        ``loss`` None: the step had no loss (a pipeline stage before the last): the loss
        series get no record, the other values count as usual."""
        events = StepEvents()
        self.steps_seen += 1
        if self.last_step is not None and step < self.last_step:
            self.reset_windows()
        self.last_step = step

        pushed = False  # this record's loss is in the loss ring (an event's level before excludes it)
        if loss is not None:
            events.nonfinite_loss = not math.isfinite(loss)
            events.spike = self.loss.push(step, loss)
            pushed = not events.nonfinite_loss
            if events.spike:
                self.events["loss_spikes"].push(self.steps_seen, step, *self._level_before(pushed),
                                                 self.loss.noise, self.loss.records)

        if grad_norm is not None:
            self.grad_records += 1
            self.grad_zero_run = self.grad_zero_run + 1 if grad_norm == 0.0 else 0
            self.grad_nonfinite_run = 0 if math.isfinite(grad_norm) else self.grad_nonfinite_run + 1
            if math.isfinite(grad_norm):
                self.grad_norms.push(grad_norm)
                if grad_norm != 0.0:  # no gradient (an RL step without advantage) is not a level
                    events.explosion = self.grad.push(step, grad_norm)
                    if events.explosion:
                        self.events["grad_explosions"].push(self.steps_seen, step, *self._level_before(pushed),
                                                            self.loss.noise, self.loss.records)
            else:
                events.nonfinite_grad = True

        if learning_rate is not None:
            self.lr.push(step, learning_rate)

        if events.nonfinite_loss or events.nonfinite_grad:
            self.nonfinite_seen += 1
            self.last_nonfinite_at = self.steps_seen
        self.nonfinite_recent.push(1.0 if events.nonfinite_loss or events.nonfinite_grad else 0.0)

        if components:
            for name, value in components.items():
                series = self.components.get(name)
                if series is None:
                    if len(self.components) >= _MAX_COMPONENTS:
                        continue
                    series = self.components[name] = LossSeries(self.thresholds, self.thresholds.windows.noise_records)
                series.push(step, value)
        return events

    def add_signal(self, name: str, value: float, step: int | None = None) -> None:
        """Record a named signal (``reward_std``, ``rewards/accuracies``, ...); names outside
        :data:`~lossbeat.diagnosis.profiles.SIGNALS` and non-numbers are ignored (bounded)."""
        kind = signal_kind(name) or (name if name in _CANONICAL else None)
        if kind is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        track = self.signals.get(kind)
        if track is None:
            if len(self.signals) >= MAX_SIGNALS:
                return
            track = self.signals[kind] = SignalTrack()
        track.push(self.last_step if step is None else step, float(value))

    def add_eval(self, eval_loss: float, group: str = "", step: int | None = None) -> None:
        """Record an evaluation loss of eval set ``group`` ('' = the only or unnamed one)."""
        track = self.evals.get(group)
        if track is None:
            if len(self.evals) >= _MAX_EVAL_GROUPS:
                return
            track = self.evals[group] = EvalTrack(self.thresholds)
        track.push(self.last_step if step is None else step, eval_loss)
