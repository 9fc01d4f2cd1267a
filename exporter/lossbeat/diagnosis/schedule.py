"""The learning rate against the schedule the run declared (the daily checklist's item 5).

Two ways to declare it, both cheap: an :class:`LRSchedule` (warmup, peak, decay kind,
total steps), compared with the LR the optimizer reports; or the run's own scheduler,
whose step counter (``last_epoch``) is compared with the optimizer steps, which catches
a scheduler that is not stepped, stepped per micro-batch, or reset by a resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.thresholds import ScheduleThresholds

__all__ = ["LRSchedule", "ScheduleTracker"]

_DECAYS = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    """A declared learning-rate schedule: linear warmup to ``peak_lr``, then ``decay``."""

    peak_lr: float
    """The LR at the end of warmup."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from ``warmup_start_lr``."""
    total_steps: int | None = None
    """Optimizer steps of the whole run (needed by cosine and linear decay)."""
    decay: str = "cosine"
    """After warmup: ``cosine`` or ``linear`` to ``min_lr`` at ``total_steps``, or ``constant``."""
    min_lr: float = 0.0
    """The LR at the end of the decay."""
    warmup_start_lr: float = 0.0
    """The LR at step 0."""

    def __post_init__(self) -> None:
        for name in ("peak_lr", "min_lr", "warmup_start_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"lr_schedule.{name}: expected a finite number >= 0, got {value!r}")
        if not self.peak_lr > 0:
            raise ValueError(f"lr_schedule.peak_lr: must be > 0, got {self.peak_lr!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"lr_schedule.warmup_steps: expected an int >= 0, got {self.warmup_steps!r}")
        if self.decay not in _DECAYS:
            raise ValueError(f"lr_schedule.decay: expected one of {', '.join(_DECAYS)}, got {self.decay!r}")
        if self.decay != "constant":
            if (
                isinstance(self.total_steps, bool)
                or not isinstance(self.total_steps, int)
                or self.total_steps <= self.warmup_steps
            ):
                raise ValueError(
                    f"lr_schedule.total_steps: {self.decay} decay needs an int above warmup_steps, "
                    f"got {self.total_steps!r}"
                )

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_start_lr + (self.peak_lr - self.warmup_start_lr) * step / self.warmup_steps
        total = self.total_steps
        if self.decay == "constant" or total is None:  # None only with "constant": __post_init__ says so
            return self.peak_lr
        progress = min(1.0, (step - self.warmup_steps) / (total - self.warmup_steps))
        if self.decay == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.peak_lr - self.min_lr) * factor


class ScheduleTracker:
    """Compares, at each diagnosis, the observed LR (declared schedule) or the scheduler's
    step counter (the run's scheduler) with the optimizer steps. Bounded state: a few numbers."""

    def __init__(self, t: ScheduleThresholds, schedule: LRSchedule | None = None) -> None:
        self.t = t
        self.schedule = schedule
        self._departures = 0
        self._finding: Finding = Finding.unknown("lr_schedule", "no schedule declared")
        self._last: tuple[int, int] | None = None  # (optimizer step, scheduler counter)
        self._offset: int | None = None  # scheduler counter - step once it is known to track

    def update(self, step: int | None, lr: float | None, scheduler_steps: int | None = None) -> Finding:
        """``step``: the last optimizer step; ``lr``: the LR reported at it; ``scheduler_steps``:
        the run's scheduler's counter now (``last_epoch``), when a scheduler was given."""
        if step is None:
            return self._finding
        if scheduler_steps is not None:
            self._finding = self._check_counter(step, scheduler_steps)
        elif self.schedule is not None and lr is not None:
            self._finding = self._check_lr(self.schedule, step, lr)
        return self._finding

    def _warn(self, message: str, fix: str) -> Finding:
        self._departures += 1
        if self._departures < self.t.consecutive:
            return self._finding if self._finding.status else Finding("lr_schedule", GOOD, "LR follows the schedule")
        return Finding("lr_schedule", WARNING, message, fix)

    def _check_lr(self, schedule: LRSchedule, step: int, lr: float) -> Finding:
        expected = schedule.lr_at(step)
        if not math.isfinite(lr):
            return Finding("lr_schedule", DANGER, f"LR is {lr} at step {step}", "check the scheduler")
        scale = max(expected, 1e-12)
        if abs(lr - expected) > self.t.tolerance * scale:
            return self._warn(
                f"LR {lr:.3g} at step {step} departs from the declared schedule ({expected:.3g})",
                "check that the scheduler steps once per optimizer step (not per micro-batch), "
                "that a resumed run restored its state, and that the declared schedule is the run's",
            )
        self._departures = 0
        return Finding("lr_schedule", GOOD, f"LR {lr:.3g} follows the schedule ({expected:.3g} at step {step})")

    def _check_counter(self, step: int, counter: int) -> Finding:
        last, self._last = self._last, (step, counter)
        if last is None:
            return self._finding
        d_step, d_counter = step - last[0], counter - last[1]
        if d_step < 0 or d_counter < 0:  # a resume: judge from here on
            self._departures = 0
            return self._finding
        if d_step == 0:
            return self._finding
        if d_counter == 0:
            return self._warn(
                f"the LR scheduler did not step during the last {d_step} optimizer steps",
                "call scheduler.step() after optimizer.step() (or declare a per-epoch scheduler)",
            )
        if d_counter > d_step * (1 + self.t.tolerance):
            return self._warn(
                f"the LR scheduler stepped {d_counter} times in {d_step} optimizer steps: stepped per micro-batch?",
                "step the scheduler once per optimizer step, outside the gradient-accumulation loop",
            )
        if counter + max(1, int(self.t.tolerance * step)) < step and step > 10 * self.t.consecutive:
            return self._warn(
                f"the LR scheduler is at step {counter} while the optimizer is at {step}: "
                "its state was reset (a resume without scheduler.load_state_dict?)",
                "restore the scheduler's state with the optimizer's when resuming",
            )
        self._departures = 0
        return Finding("lr_schedule", GOOD, f"the LR scheduler steps with the optimizer (at {counter})")
