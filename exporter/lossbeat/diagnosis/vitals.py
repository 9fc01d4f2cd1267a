"""The run's vitals beyond the loss: memory, throughput, the LR against its schedule, and
the loss-curve pattern, for :class:`lossbeat.Monitor` (the article's daily checklist).

The monitor feeds one step time per step (plain float, no sync) and asks for findings at
each diagnosis (every ``windows.diagnose_every`` steps), when memory is read from the
allocator's host-side counters and the scheduler's step counter is read as an int.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from lossbeat.diagnosis.findings import Finding
from lossbeat.diagnosis.patterns import Pattern, PatternTracker
from lossbeat.diagnosis.resources import ThroughputTracker, check_memory
from lossbeat.diagnosis.schedule import LRSchedule, ScheduleTracker
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.diagnosis.window import Ring

__all__ = ["Vitals", "as_schedule", "LIVE_ONLY_CHECKS"]

_HELD_TIMES = 256  # step times held for the next diagnosis at most (it comes every windows.diagnose_every)

LIVE_ONLY_CHECKS = frozenset({"layer_grad_norm", "memory", "throughput", "lr_schedule"})
"""Checks a live process makes from what it measures (per-layer norms, memory, step times, the
scheduler's counter): most logs do not carry them, and ``lossbeat analyze`` judges them only from a
log that does (a Lightning metrics.csv with ``grad_2.0_norm/*``, ``step_time``, ``memory_allocated``)."""


def as_schedule(value: Any) -> tuple[LRSchedule | None, Any]:
    """``MonitorConfig.lr_schedule`` as (declared schedule, scheduler object): an
    :class:`LRSchedule`, a mapping of its fields, or the run's LR scheduler (anything with
    an integer ``last_epoch``, as torch's schedulers have)."""
    if value is None:
        return None, None
    if isinstance(value, LRSchedule):
        return value, None
    if isinstance(value, Mapping):
        try:
            return LRSchedule(**value), None
        except TypeError as exc:
            raise TypeError(f"lr_schedule: {exc}") from None
    if isinstance(getattr(value, "last_epoch", None), int):
        if type(value).__name__ == "ReduceLROnPlateau":
            raise TypeError(
                "lr_schedule: ReduceLROnPlateau follows the eval loss, not a schedule; "
                "pass None (its LR is still exported and checked)"
            )
        return None, value
    raise TypeError(
        f"lr_schedule: expected an LRSchedule, a mapping of its fields or an LR scheduler, got {type(value).__name__}"
    )


class Vitals:
    """Bounded state: a memory ring, a step-time ring and two small trackers."""

    def __init__(self, thresholds: Thresholds, lr_schedule: Any = None) -> None:
        self.t = thresholds
        schedule, self._scheduler = as_schedule(lr_schedule)
        self._schedule = ScheduleTracker(thresholds.lr_schedule, schedule)
        self._memory = Ring(thresholds.memory.samples)
        self._memory_seen = 0
        self._peak = 0.0
        self._limit: float | None = None
        self._throughput = ThroughputTracker(thresholds.throughput)
        self._step_times: list[float] = []  # judged at the next findings(), in order
        self._patterns = PatternTracker()

    def add_step_time(self, seconds: float | None, training: bool) -> None:
        """One step's wall time; None (unknown) or outside the train phase is skipped. Kept in a
        list until the next diagnosis reads the throughput (a list append a step)."""
        if seconds is not None and training:
            times = self._step_times
            times.append(seconds)
            if len(times) >= _HELD_TIMES:  # bounded even when no diagnosis comes
                self._add_times()

    def _add_times(self) -> None:
        times, self._step_times = self._step_times, []
        self._throughput.extend(times)

    def findings(self, step: int | None, lr: float | None, memory: Any) -> list[Finding]:
        """The vitals' findings; ``memory`` is a reading with ``allocated``, ``peak`` and ``limit``
        (bytes; :func:`lossbeat.measure.memory.read_memory`), taken by the caller so this room needs
        no torch; None where the memory is not the training's (a run read from its log): unknown."""
        reading = memory
        if reading is not None:
            self._memory_seen += 1
            self._peak = reading.peak  # windowed: the peak since the previous diagnosis, not the lifetime one
            self._limit = reading.limit
            if self._memory_seen > self.t.memory.warmup_samples:
                self._memory.push(reading.allocated)
        counter = self._scheduler.last_epoch if self._scheduler is not None else None
        if self._step_times:
            self._add_times()
        return [
            check_memory(
                self._memory.last(len(self._memory)),
                self._peak,
                self._limit,
                self.t.memory,
                self.t.windows.diagnose_every,
            ),
            self._throughput.finding(),
            self._schedule.update(step, lr, counter),
        ]

    def pattern(self, findings: Iterable[Finding], step: int | None) -> Pattern | None:
        return self._patterns.update(findings, step)

    @property
    def pattern_since(self) -> int | None:
        return self._patterns.since_step

    def describe_pattern(self) -> str:
        return self._patterns.describe()
