"""What the judgments remember of the whole run, beyond their windows (fixed memory).

Each check reads a recent window; after a disaster the damaged state fills that window and
becomes its normal (a loss that exploded and settled at 3.6x its best reads as "falling"
from the explosion's peak). The run memory keeps what a person reading the whole curve keeps:

* the best smoothed train loss (the median of the latest ``loss.spike_min_steps`` records, taken
  at each diagnosis) and its step, the best eval loss and its step;
* the first loss, and the chance level where the task's profile knows one (ln 2 for preferences);
* the earliest event the run has not recovered from (a loss spike, a gradient explosion, a
  non-finite value, a jump of the learning rate), with the loss level before it and its step.
  An event is recovered from once the smoothed loss is back within its noise (and
  ``events.worse_after``) of the level before it; until then later events do not replace it,
  so a burst is measured against the level before its first event, never its peak.

:meth:`RunMemory.regressed` says whether the run settled well above its best (``loss.regress_max``
and beyond ``loss.trend_min_z`` standard errors): the step it went wrong, how far above its best
it is, and the checkpoint to return to. Every value is a float or an int: O(1) memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Mapping, NamedTuple, Protocol

from lossbeat.diagnosis.window import median

if TYPE_CHECKING:
    from lossbeat.diagnosis.series import LearningRateSchedule, LossSeries
    from lossbeat.diagnosis.thresholds import Thresholds

__all__ = ["Regression", "RunMemory"]

_MEDIAN_SE = 1.25  # the standard error of a median of n records: about 1.25 sigma / sqrt(n)
_MISSING = object()
_FLOATS = frozenset({"best", "best_eval", "first", "event_before", "event_noise"})
_OPTIONAL_INTS = frozenset({"best_step", "best_eval_step", "left_best_step", "event_step", "lr_jump_seen"})


class _EvalBest(Protocol):
    """What the run memory reads of an eval set's track (``EvalTrack``)."""

    @property
    def best(self) -> float: ...
    @property
    def best_step(self) -> int | None: ...


class History(Protocol):
    """What the run memory reads of a :class:`~lossbeat.diagnosis.history.History` (which
    imports this module: described here, not imported)."""

    @property
    def thresholds(self) -> Thresholds: ...
    @property
    def loss(self) -> LossSeries: ...
    @property
    def lr(self) -> LearningRateSchedule: ...
    @property
    def evals(self) -> Mapping[str, _EvalBest]: ...


class Regression(NamedTuple):
    """A run settled well above its best level."""

    level: float
    """The smoothed train loss now."""
    best: float
    best_step: int
    above: float
    """(level - best) / max(|best|, the profile's floor): 2.6 is 260 % above."""
    went_wrong: int
    """The step it went wrong: the earliest event not recovered from, else where it left its best."""
    cause: str
    """What happened there ("loss spike", "learning-rate jump 0.003 -> 0.3", ...), or ''."""

    def describe(self) -> str:
        where = (
            f"it went wrong at step {self.went_wrong} ({self.cause})"
            if self.cause
            else f"it left its best level by step {self.went_wrong}"
        )
        return (
            f"the loss settled at {self.level:.4g}, {self.above * 100:.0f}% above its best {self.best:.4g} "
            f"(step {self.best_step}); {where}"
        )

    def fix(self) -> str:
        return (
            f"go back to the last checkpoint saved before step {self.went_wrong} (the loss was at its best at "
            f"step {self.best_step}) and resume with a lower learning rate and gradient clipping; check the data "
            "of the steps around it"
        )


class RunMemory:
    """The run's best levels and the earliest event it has not recovered from (see the module)."""

    __slots__ = (
        "best",
        "best_step",
        "best_eval",
        "best_eval_step",
        "first",
        "left_best_step",
        "left_best_records",
        "event_step",
        "event_kind",
        "event_before",
        "event_noise",
        "event_records",
        "lr_jump_seen",
    )

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.best = math.inf
        self.best_step: int | None = None
        self.best_eval = math.inf
        self.best_eval_step: int | None = None
        self.first = math.nan
        self.left_best_step: int | None = None
        """The step since which the smoothed loss sits well above its best (None: it does not)."""
        self.left_best_records = 0
        self.event_step: int | None = None
        """The step of the earliest event not recovered from (None: none open)."""
        self.event_kind = ""
        self.event_before = math.nan
        """The smoothed loss level before that event."""
        self.event_noise = math.nan
        self.event_records = 0
        """Finite losses recorded before that event: recovery is read from records after it only."""
        self.lr_jump_seen: int | None = None
        """The step of the last learning-rate jump already noted (each is noted once)."""

    def state(self) -> dict[str, float | int | str | None]:
        """What a checkpoint keeps of the run memory (plain values, O(1)), for :meth:`load` at a resume."""
        return {name: getattr(self, name) for name in self.__slots__}

    def load(self, state: Mapping[str, object]) -> int:
        """Restore what :meth:`state` gave (a resumed run's checkpoint); keys or values of another kind are
        left out (a checkpoint of another version). Returns the values taken."""
        taken = 0
        for name in self.__slots__:
            value = state.get(name, _MISSING)
            if isinstance(value, bool) or value is _MISSING:
                continue
            if name in _FLOATS:
                ok = isinstance(value, (int, float))
            elif name in _OPTIONAL_INTS:
                ok = value is None or isinstance(value, int)
            else:
                ok = isinstance(value, type(getattr(self, name)))
            if ok:
                setattr(self, name, float(value) if name in _FLOATS else value)  # type: ignore[arg-type]
                taken += 1
        return taken

    def resume(self, step: int) -> None:
        """The run went back to ``step`` (a resume from a checkpoint): the first loss and the best levels
        stay (the run reached them), what the abandoned steps from ``step`` on opened does not: an event
        not recovered from and the step it left its best. The counts of records restart with the windows."""
        if self.event_step is not None and self.event_step >= step:
            self.event_step, self.event_kind, self.event_before = None, "", math.nan
        self.event_records = 0
        self.left_best_step, self.left_best_records = None, 0
        if self.lr_jump_seen is not None and self.lr_jump_seen >= step:
            self.lr_jump_seen = None

    def note_event(self, kind: str, step: int, before: float, noise: float, records: int) -> None:
        """An event at ``step`` with the loss level ``before`` it, after ``records`` finite losses:
        remembered unless an earlier one is still open (a burst is measured against the level before
        its first event). Rare: only on a counted event."""
        if self.event_step is None and math.isfinite(before):
            self.event_step, self.event_kind, self.event_before, self.event_noise = step, kind, before, noise
            self.event_records = records

    def restore(
        self, t: Thresholds, train: Iterable[tuple[int, float]], evals: Iterable[tuple[int, float]] = ()
    ) -> int:
        """What a resumed run's log or callback gives of its earlier steps (``(step, loss)`` in step
        order, and ``(step, eval loss)``): the first loss, the best smoothed level (the median of
        each ``loss.spike_min_steps`` consecutive finite records, as :meth:`update` takes it) and the
        best eval loss, with their steps. Read once, O(records); nothing of them is kept. Returns
        the finite train losses read."""
        n = t.loss.spike_min_steps
        window: list[float] = []
        read = 0
        for step, loss in train:
            if not isinstance(loss, (int, float)) or not math.isfinite(loss):
                continue
            read += 1
            if math.isnan(self.first):
                self.first = float(loss)
            window.append(float(loss))
            if len(window) > n:
                del window[0]
            if len(window) >= min(n, t.windows.trend_min_records):
                level = median(window)
                if level < self.best:
                    self.best, self.best_step = level, int(step)
        for step, loss in evals:
            if isinstance(loss, (int, float)) and math.isfinite(loss) and loss < self.best_eval:
                self.best_eval, self.best_eval_step = float(loss), int(step)
        return read

    def update(self, history: History) -> None:
        """Read the run at a diagnosis: the best levels, a learning-rate jump, recovery. O(cv_steps)."""
        t = history.thresholds
        loss = history.loss
        if math.isnan(self.first):  # restored from a resumed run's earlier steps, or this run's first
            self.first = loss.initial
        for group, track in history.evals.items():
            if not group and track.best < self.best_eval:
                self.best_eval, self.best_eval_step = track.best, track.best_step
        schedule = history.lr
        jump = schedule.jump_step
        if jump is not None and jump != self.lr_jump_seen:
            self.lr_jump_seen = jump
            n, before = loss.summary.window(jump - max(1.0, float(t.windows.trend_min_steps)), jump - 1)
            if n and math.isfinite(before) and (self.event_step is None or self.event_step >= jump):
                # The jump precedes what it caused (the spikes counted right after it): it is the cause.
                self.event_step, self.event_before, self.event_noise = jump, before, loss.noise
                self.event_records = loss.records - loss.summary.window(jump - 1, math.inf)[0]
                self.event_kind = f"learning-rate jump {schedule.jump_from:.3g} -> {schedule.jump_to:.3g}"
        level, n = self.level(history)
        if not math.isfinite(level) or loss.summary.last_step is None:
            return
        if level < self.best:
            self.best, self.best_step = level, loss.summary.last_step
        noise = loss.noise
        tolerance = _MEDIAN_SE * noise * math.sqrt(2.0 / n) * t.loss.trend_min_z if math.isfinite(noise) else 0.0
        if self.event_step is not None and loss.records - self.event_records >= n:  # a level of records after it
            back = self.event_before + max(t.events.worse_after * abs(self.event_before), tolerance)
            if level <= back:
                self.event_step, self.event_kind = None, ""
        scale = max(abs(self.best), t.profile.volatility_floor or 0.0)  # as regressed() measures it
        if level > self.best + max(t.loss.regress_max * scale, tolerance):
            if self.left_best_step is None:
                self.left_best_step, self.left_best_records = loss.summary.last_step, loss.records
        else:
            self.left_best_step = None

    @staticmethod
    def level(history: History) -> tuple[float, int]:
        """The smoothed train loss now: the median of the latest ``loss.spike_min_steps`` finite records
        (the local level spikes are judged against; at least ``windows.trend_min_records``), and how
        many; (nan, 0) while fewer. Records, not steps: a sparse log's level is as fresh as a dense one's."""
        t = history.thresholds
        values = history.loss.ring.last(t.loss.spike_min_steps)
        if len(values) < t.windows.trend_min_records or history.loss.nonfinite_run:
            return math.nan, 0
        return median(values), len(values)

    def regressed(self, history: History) -> Regression | None:
        """The run sits well above its best: ``loss.regress_max`` of the level (floored by the
        profile's ``volatility_floor``) and ``loss.trend_min_z`` standard errors of the two
        smoothed levels above it. None for a loss not meant to fall (RL) or before a best."""
        t = history.thresholds
        if not t.profile.trend or self.best_step is None:
            return None
        level, n = self.level(history)
        if not math.isfinite(level):
            return None
        noise = history.loss.noise
        se = _MEDIAN_SE * noise * math.sqrt(2.0 / n) if math.isfinite(noise) else 0.0
        rise = level - self.best
        scale = max(abs(self.best), t.profile.volatility_floor or 0.0)
        above = rise / scale if scale > 0 else (math.inf if rise > 0 else 0.0)
        # trend_danger_z, not trend_min_z: the best is the lowest of the many smoothed levels the run
        # had (one per diagnosis), so it sits below the run's level by a few standard errors by chance.
        if not (above > t.loss.regress_max and rise > t.loss.trend_danger_z * se):
            return None
        # Settled: above since long enough that its level is all records after it left the best, and
        # for the trend's shortest window in steps. A burst of hard batches (a memorising model's
        # loss jumping 0.03 -> 0.4 for 20-40 records, then back) lifts the level, and is not a run
        # gone wrong.
        since, last = self.left_best_step, history.loss.summary.last_step
        if (
            since is None
            or last is None  # None only before the first record
            or last - since < t.windows.trend_min_steps
            or history.loss.records - self.left_best_records < t.loss.spike_min_steps
        ):
            return None
        if self.event_step is not None and self.event_step >= self.best_step:
            went_wrong, cause = self.event_step, self.event_kind
        else:
            went_wrong, cause = (since or last), ""  # since: self.left_best_step
        return Regression(level, self.best, self.best_step, above, went_wrong, cause)
