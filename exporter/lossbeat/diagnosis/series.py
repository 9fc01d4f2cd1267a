"""The per-step series of a run's history: a loss (total or component), the grad-norm baseline, the LR schedule.

Each takes one record (``push``) or a run of them (``extend``: what :class:`~lossbeat.diagnosis.history.History`
does with the records it held back), with the same state after either, float for float.
"""

from __future__ import annotations

import math
from typing import Sequence

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.diagnosis.window import LossWindow, NoiseWindow, Ring, StepSummary, median, robust_noise

__all__ = ["LossSeries", "GradBaseline", "LearningRateSchedule"]

_INITIAL_RECORDS = 1  # the initial loss is the first finite record (the article's 'first loss')
_RECENT_GRADS = 5  # the "recent" grad-norm level is the median of this many records
_EARLY_NOISE_RECORDS = 8
_JUMP = 10.0  # an LR this many times the one before in one record: a jump (the article's 10x LR sweep step)
_STEADY = 3  # records of an LR moving less than 2x each before a jump (not a warmup's first records)
_ZERO_INFLATED = 0.1  # more than this fraction of exact zeros: noise from the non-zero records


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
        spike = value > self._spike_limit
        self.extend((step,), (value,))
        return spike

    def extend(self, steps: Sequence[int], values: Sequence[float]) -> None:
        """Record finite values in order, as ``push`` does each (the caller tested them for spikes):
        refreshed after the same records, so the same state, float for float."""
        n = len(values)
        every, early = self.t.windows.diagnose_every, self.t.loss.spike_min_steps
        i = 0
        while i < n:
            pushes = self._pushes
            # The records up to the next refresh: each of the first `early`, then every `every`.
            j = i + 1 if pushes < early else min(n, i + every - pushes % every)
            if i == 0 and j == n:
                self._append(steps, values)
            else:
                self._append(steps[i:j], values[i:j])
            if self._pushes % every == 0 or self._pushes <= early:
                self.refresh()
            i = j

    def _append(self, steps: Sequence[int], values: Sequence[float]) -> None:
        """Finite values in, no refresh among them."""
        self.nonfinite_run = 0
        if self.first_step is None:
            self.first_step = steps[0]
        latest, same, records = self._latest, self.same_run, self.records
        for value in values:
            same = same + 1 if records and value == latest else 1
            latest = value
            records += 1
        self._latest, self.same_run, self.records = latest, same, records
        if len(self._initial) < _INITIAL_RECORDS:
            self._initial.extend(values[: _INITIAL_RECORDS - len(self._initial)])
        if self.loss_at_warmup_check != self.loss_at_warmup_check:  # NaN: not reached yet
            first, at = self.first_step, self.t.learning_rate.warmup_check_step
            for step, value in zip(steps, values):
                if step - first >= at:
                    self.loss_at_warmup_check = value
                    break
        ring = self.window.ring
        if self._noise_window.size < ring._capacity:
            self._noise_window.extend(ring, values)  # pushes them to the ring too
        else:
            ring.extend(values)
        self.summary.extend(steps, values)
        self._pushes += len(values)

    def spike_limit(self) -> float:
        """The loss above which the next record is a spike (inf until enough records): the local
        level + max(``spike_sigma`` x the robust noise, ``spike_min_rise`` x the level)."""
        return self._spike_limit

    def _limit(self) -> float:
        t = self.t
        if (
            not t.profile.trend  # an RL policy loss is ~0 by construction: its excursions mean nothing
            or len(self.window) < t.loss.spike_min_steps
            or not math.isfinite(self._noise)
            or not self._noise > 0
        ):
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
        if (
            window.size == size
            and window.size < self.ring.capacity
            and not (window.zeros > _ZERO_INFLATED * n and n - window.zeros >= 4)
        ):
            self._level = window.values.median()
            self._noise = window.noise()
            local = (
                self.ring.last(self.t.loss.spike_min_steps) if n >= self.t.loss.spike_min_steps else self.ring.last(n)
            )
        else:
            values = self.ring.last(size)
            self._level = median(values)
            nonzero = [v for v in values if v != 0.0]
            if len(values) - len(nonzero) > _ZERO_INFLATED * len(values) and len(nonzero) >= 4:
                values = nonzero
            self._noise = robust_noise(values)
            n = len(values)
            local = values[-self.t.loss.spike_min_steps :]
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
        self._one_step = (math.nan, math.nan)  # the level's two factors for a step of 1 (the usual)
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
        self.extend((step,), (g,))
        return event

    def extend(self, steps: Sequence[int], norms: Sequence[float]) -> None:
        """Record finite, non-zero norms in order, as ``push`` does each (the caller tested them
        for events): the same state, float for float. The loop runs on locals (the ring's slots
        written in place, no builtin calls) but where the baseline's median is taken again."""
        t = self.t
        every, half_life = t.windows.diagnose_every, t.gradients.climb_half_life_steps
        ring = self.ring
        data, capacity, slot, count = ring._data, ring._capacity, ring._next, ring._count
        rise_1, pull_1 = self._one_step  # the level's two factors for a step of 1 (the usual)
        if rise_1 != rise_1 or self._one_step_for != half_life:  # NaN: not computed yet
            rise_1, pull_1 = self._one_step = (2.0 ** (1 / half_life), 1.0 - 0.5 ** (1 / (half_life / 10.0)))
            self._one_step_for = half_life
        pushes, established, limit = self._pushes, self._established, self._limit
        level, last, recent = self.level, self.last_step, self.recent
        window = ring.last(_RECENT_GRADS - 1)  # the records before, then each new one
        for step, g in zip(steps, norms):
            data[slot] = g  # Ring.push
            slot += 1
            if slot == capacity:
                slot = 0
            if count < capacity:
                count += 1
            pushes += 1
            window.append(g)
            five = window[-_RECENT_GRADS:]
            if count >= _RECENT_GRADS:  # the median of 5, as median() takes it
                five.sort()
                recent = five[_RECENT_GRADS // 2]
            else:
                recent = median(five)
            if not established or pushes % every == 0:
                ring._next, ring._count = slot, count  # what the median and the flag read
                # Once established, it stays so until the median is taken again (the ring only grows,
                # the median moves only below): the flag is read, not recomputed, in between.
                established = established or self.established
                if pushes % every == 0 or not established:
                    if count > _RECENT_GRADS:
                        self.median = median(ring.last(count)[: count - _RECENT_GRADS])
                        established = self.established
                    limit = self._event_limit()
                elif limit == math.inf:  # established by this record's count, with the median taken before
                    limit = self._event_limit()
            if established:  # the slow level follows
                if level != level:  # NaN: it starts at the median
                    level = self.median
                else:
                    if last is None or step - last <= 1:
                        rise, pull = rise_1, pull_1
                    else:
                        dt = step - last
                        rise, pull = 2.0 ** (dt / half_life), 1.0 - 0.5 ** (dt / (half_life / 10.0))
                    # Falls are followed fast (a run settles), rises at most 2x per half-life.
                    target = level * rise
                    if not target < recent:  # min(recent, level * rise)
                        target = recent
                    level += pull * (target - level)
            last = step
        ring._next, ring._count = slot, count
        self._pushes, self._established, self._limit = pushes, established, limit
        self.level, self.last_step, self.recent = level, last, recent

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
        self.jump_step: int | None = None
        """The step of the latest jump: an LR ``_JUMP`` x the one before and above the peak before,
        after ``_STEADY`` records that moved less than 2x each (a warmup climbs, a restart returns
        to its peak: neither is a jump)."""
        self.jump_from = self.jump_to = math.nan
        self.collapse_step: int | None = None
        """The step at which the LR last fell at once, in one record, from near its peak (at least
        ``decayed_fraction`` of it) to ``learning_rate.collapse_fraction`` of it or less; None once it
        climbs back to half its peak (a gradual decay never sets it)."""
        self.collapse_from = self.collapse_to = math.nan
        self._previous = math.nan
        self._steady = 0

    def push(self, step: int, lr: float) -> None:
        self.extend((step,), (lr,))

    def extend(self, steps: Sequence[int], lrs: Sequence[float]) -> None:
        """Record learning rates in order (any floats: a non-finite one only enters ``recent``)."""
        self.recent.extend(lrs)
        peak, first, below, decayed = self.peak, self.first_step, self.below_half_at, self.decayed_at
        fraction = self.t.learning_rate.decayed_fraction
        collapse = self.t.learning_rate.collapse_fraction
        previous, steady = self._previous, self._steady
        for step, lr in zip(steps, lrs):
            if not math.isfinite(lr):
                continue
            if first is None:
                first = step
            if previous > 0 and lr >= _JUMP * previous and lr > peak and steady >= _STEADY:
                self.jump_step, self.jump_from, self.jump_to = step, previous, lr
            if previous >= fraction * peak > 0 and lr <= collapse * peak and lr <= collapse * previous:
                self.collapse_step, self.collapse_from, self.collapse_to = step, previous, lr
            steady = steady + 1 if previous > 0 and 0.5 * previous <= lr <= 2.0 * previous else 0
            previous = lr
            if lr > peak:
                peak = lr
            if lr >= 0.5 * peak:  # (re)starts: a warm restart begins a new decay
                below = decayed = None
                self.collapse_step = None
                continue
            if below is None:
                below = step
            if decayed is None and lr <= fraction * peak:
                decayed = step
        self.peak, self.first_step, self.below_half_at, self.decayed_at = peak, first, below, decayed
        self._previous, self._steady = previous, steady

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
        LearningRateSchedule.__init__(self, self.t)  # this class's: self.__init__ may be a subclass's
