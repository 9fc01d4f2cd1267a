"""Events are findings: the loss spikes and gradient-norm explosions a run counted, with their steps.

A counted event is a fact; what it means depends on what followed it:

* isolated and recovered (one x80 jump of the grad norm and back, one bad batch whose loss
  spike the run absorbed): a WARNING that says so. It holds while the event is recent (over a
  tenth of the records seen, at least ``windows.cv_steps``), so it does not come and go with
  each of a long run's sparse events; once the run has absorbed events of the kind (they left
  that window), later ones the loss recovers from are the run's own pattern: a GOOD note that
  counts them (a warning that came back with each burst would flap);
* repeated (``events.repeated`` within the last ``windows.cv_steps`` records): a WARNING while
  the loss recovers from them (the run's first), a DANGER when it did not;
* followed by a worse loss (the loss level after it ``events.worse_after`` above the level
  before it, and beyond the noise of those levels): a DANGER.

The levels are medians of ``windows.cv_steps`` records: those before the event, and those right
after it, measured once (where the event left the loss, not where it wandered since). An event
that left the window is a GOOD note with its steps. Non-finite values are judged by
:func:`lossbeat.diagnosis.run._nonfinite` on the same principle. Fixed memory per kind.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Mapping, Protocol

from lossbeat.diagnosis.event_thresholds import EventThresholds
from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.window import median

if TYPE_CHECKING:
    from lossbeat.diagnosis.run_memory import Regression, RunMemory
    from lossbeat.diagnosis.series import LossSeries
    from lossbeat.diagnosis.thresholds import Thresholds

__all__ = ["Event", "EventThresholds", "EventTrack", "check_events", "EVENT_CHECKS"]

EVENT_CHECKS = {"loss_spikes": "loss spike", "grad_explosions": "gradient-norm explosion"}
"""Check name -> the event it judges (the counters' names)."""

_KEPT = 64  # recent events kept per kind
_FIRST = 5  # first steps named in messages
_HELD_FRACTION = 10  # a warning holds over a tenth of the records seen (at least windows.cv_steps)
_MEDIAN_SE = math.sqrt(math.pi / 2)  # a median of n normal records: sqrt(pi/2) sigma / sqrt(n)
_AFTER_WINDOWS = 2  # the level after an event: over this many windows in a row (damage lasts)


class History(Protocol):
    """What the event checks read of a :class:`~lossbeat.diagnosis.history.History` (which
    imports this module: described here, not imported)."""

    @property
    def events(self) -> Mapping[str, EventTrack]: ...
    @property
    def thresholds(self) -> Thresholds: ...
    @property
    def loss(self) -> LossSeries: ...
    @property
    def memory(self) -> RunMemory: ...
    @property
    def grad_records(self) -> int: ...
    @property
    def steps_seen(self) -> int: ...


class Event:
    """One counted event: where it was, and the loss level around it."""

    __slots__ = ("index", "step", "before", "n_before", "noise", "loss_records", "after")

    def __init__(self, index: int, step: int, before: float, n_before: int, noise: float, loss_records: int) -> None:
        self.index, self.step = index, step
        """The record index (``History.steps_seen``) and step of the event."""
        self.before, self.n_before, self.noise = before, n_before, noise
        """The median of the finite losses before it, how many records it is the median of, and
        the loss's robust noise then (the level's standard error is judged with it)."""
        self.loss_records = loss_records
        """Finite losses recorded up to and with the event (``LossSeries.records``)."""
        self.after: tuple[float, ...] = ()
        """The medians of the ``_AFTER_WINDOWS`` windows of ``windows.cv_steps`` finite losses
        right after it, in order, once there are that many (fixed from then on)."""


class EventTrack:
    """The events of one kind: their total, the first steps, and the recent ones (fixed memory)."""

    def __init__(self) -> None:
        self.total = 0
        self.first_steps: list[int] = []
        self.recent: deque[Event] = deque(maxlen=_KEPT)  # a Ring holds floats; this holds Events

    def push(
        self, index: int, step: int, level_before: float, records_before: int, noise: float, loss_records: int
    ) -> None:
        self.total += 1
        if len(self.first_steps) < _FIRST:
            self.first_steps.append(step)
        self.recent.append(Event(index, step, level_before, records_before, noise, loss_records))

    def clear(self) -> None:
        self.total = 0
        self.first_steps = []
        self.recent = deque(maxlen=_KEPT)

    def within(self, now: int, window: int) -> list[Event]:
        return [e for e in self.recent if now - e.index < window]


def _steps(steps: list[int], total: int) -> str:
    shown = ", ".join(str(s) for s in steps[:_FIRST])
    return f"step{'s' if len(steps) > 1 else ''} {shown}" + (", ..." if total > len(steps[:_FIRST]) else "")


def check_events(history: History, check: str, regression: Regression | None = None) -> Finding:
    """The finding for one kind of event (``loss_spikes`` or ``grad_explosions``).

    ``regression``: the run settled well above its best (:meth:`RunMemory.regressed`). Events are
    absorbed only once the loss is back at its level before the first of them (the run memory's
    open event): never against a level the events themselves raised."""
    track: EventTrack = history.events[check]
    what = EVENT_CHECKS[check]
    t = history.thresholds
    unrecovered = _unrecovered(history, what, regression)
    if unrecovered is not None:
        return unrecovered
    if not track.total:
        # A rank that never had the series (a pipeline stage before the last has no loss) has
        # nothing to judge: unknown, as the other loss checks say, not "no spikes".
        seen = history.loss.records if check == "loss_spikes" else history.grad_records
        return Finding(check, GOOD, f"no {what}s") if seen else Finding.unknown(check, f"no {what} series")
    now = history.steps_seen
    window = t.windows.cv_steps
    # An event holds the finding until the run showed where it left the loss (the windows
    # after it), and then over a span that grows with the run (a tenth of the records seen, at
    # least the volatility window): events a few hundred records apart in a long run are one
    # finding, not a warning that comes and goes with each.
    held = window * _AFTER_WINDOWS + max(window, now // _HELD_FRACTION)
    recent = track.within(now, held)
    if not recent:
        return Finding(
            check,
            GOOD,
            f"{track.total} {what}(s) earlier ({_steps(track.first_steps, track.total)}), "
            f"none in the last {held} records: the run went on",
        )
    for e in recent:
        _measure_after(history, e)
    fix = (
        "inspect the batches of those steps (corrupt, duplicated or very long samples); clip gradients "
        "(max_norm 1.0) and lower the learning rate if they repeat"
    )
    bursts = _bursts(recent, window, t.events.repeated)
    for first, last, count in bursts:
        # Repeated: a danger unless the loss came back to its level before them (a spike's own
        # height, loss.spike_min_rise, above it is not back).
        worse = _worse(history, first, last.after, t.loss.spike_min_rise)
        if worse:
            return Finding(
                check,
                DANGER,
                f"{count} {what}s within {window} records (steps {first.step} to {last.step}; "
                f"{track.total} so far): repeated, and the loss did not recover: {worse}",
                fix,
            )
    for e in recent:
        worse = _worse(history, e, e.after, t.events.worse_after)
        if worse:
            return Finding(check, DANGER, f"{what} at step {e.step} followed by a worse loss: {worse}", fix)
    steps = [e.step for e in recent]
    first, last = recent[0], recent[-1]
    back = (
        f"; the loss is back at its level ({first.before:.4g} before, {last.after[-1]:.4g} after)"
        if t.profile.trend and math.isfinite(first.before) and last.after and math.isfinite(last.after[-1])
        else ""
    )
    earlier = track.total - len(recent)
    kind = "repeated" if bursts else "isolated"
    if earlier:
        # The run absorbed events of this kind before (they left the window): more now that the
        # loss recovers from (isolated or in a burst; one it did not recover from is a danger
        # above) are its own pattern (a long run's sparse spikes), a note, not a warning again.
        return Finding(
            check,
            GOOD,
            f"{len(recent)} {kind} {what}(s) in the last {held} records ({_steps(steps, len(steps))}; "
            f"{track.total} so far, the {earlier} before absorbed): this run's own pattern{back}",
        )
    return Finding(
        check,
        WARNING,
        f"{len(recent)} {kind} {what}(s) in the last {held} records ({_steps(steps, len(steps))}; "
        f"{track.total} so far); the run goes on{back}",
        fix,
    )


def _unrecovered(history: History, what: str, regression: Regression | None) -> Finding | None:
    """A danger (the run settled well above its best since) or a warning while the loss is not back
    at its level before the earliest event of this kind it has not recovered from, once the windows
    after it have passed (the time a recovery takes)."""
    memory = history.memory
    step, last = memory.event_step, history.loss.summary.last_step
    track = history.events[next(c for c, w in EVENT_CHECKS.items() if w == what)]
    latest = track.recent[-1].step if len(track.recent) else None
    # Events of this kind since the open one (its own, or the jump or explosion that started them).
    if step is None or latest is None or latest < step or last is None or not history.thresholds.profile.trend:
        return None
    # Judged once the records after it fill the windows a recovery is read from (as _measure_after).
    if history.loss.records - memory.event_records < history.thresholds.windows.cv_steps * _AFTER_WINDOWS:
        return None
    fix = (
        "go back to a checkpoint from before the first of them; clip gradients (max_norm 1.0), lower the "
        "learning rate, and inspect the batches of those steps"
    )
    counted = f"{track.total} {what}(s) ({_steps(track.first_steps, track.total)})"
    if regression is not None:
        return Finding(
            "loss_spikes" if what == "loss spike" else "grad_explosions",
            DANGER,
            f"{counted}; the loss never came back to its level before the {memory.event_kind} at step {step} "
            f"({memory.event_before:.4g}): {regression.describe()}",
            fix,
        )
    return Finding(
        "loss_spikes" if what == "loss spike" else "grad_explosions",
        WARNING,
        f"{counted}; the loss is not yet back at its level before the {memory.event_kind} at step {step} "
        f"({memory.event_before:.4g})",
        fix,
    )


def _bursts(events: list[Event], window: int, repeated: int) -> list[tuple[Event, Event, int]]:
    """(first, last, count) of each run of events in which ``repeated`` or more fall within
    ``window`` records: a burst runs from its first event to the last one that starts a
    further ``repeated`` within ``window`` (or ends one)."""
    out: list[tuple[Event, Event, int]] = []
    i = 0
    while i + repeated <= len(events):
        if events[i + repeated - 1].index - events[i].index >= window:
            i += 1
            continue
        j = i + repeated - 1  # extend while the next event keeps ``repeated`` within the window
        while j + 1 < len(events) and events[j + 1].index - events[j + 2 - repeated].index < window:
            j += 1
        out.append((events[i], events[j], j - i + 1))
        i = j + 1
    return out


def _measure_after(history: History, event: Event) -> None:
    """The loss level right after ``event``: the medians of the ``_AFTER_WINDOWS`` windows of
    ``windows.cv_steps`` finite losses that followed it, read once there are that many (while
    they are in the loss window; a diagnosis later than that reads what is left)."""
    if event.after:
        return
    loss = history.loss
    n = history.thresholds.windows.cv_steps
    span = n * _AFTER_WINDOWS
    k = loss.records - event.loss_records  # finite losses since the event
    if k < span:
        return
    values = loss.ring.last(min(k, len(loss.ring)))[:span]
    event.after = tuple(median(values[i : i + n]) for i in range(0, len(values) - n + 1, n)) or (median(values),)


def _worse(history: History, event: Event, after: tuple[float, ...], rise_min: float) -> str:
    """Why the levels ``after`` are worse than the level before ``event``, each by more than
    ``rise_min`` of it and beyond its noise ('' if one is not, or cannot tell yet): the damage
    lasted, not one window's shift of the data's level.

    The levels are medians of the loss's noisy records (``event.n_before`` before it,
    ``windows.cv_steps`` in each window after): a difference is a rise only beyond
    ``loss.trend_min_z`` standard errors of a difference of two such medians (sqrt(pi/2) sigma
    / sqrt(n) each, with the noise at the event), so the wander of the level between batches is
    not damage; a fall (a new epoch's level drop) never is."""
    t = history.thresholds
    before, noise = event.before, event.noise
    if (
        not t.profile.trend
        or not math.isfinite(before)
        or not event.n_before
        or not after
        or not all(math.isfinite(a) for a in after)
    ):
        return ""
    n = t.windows.cv_steps
    floor = (
        t.loss.trend_min_z * _MEDIAN_SE * noise * math.sqrt(1.0 / n + 1.0 / event.n_before)
        if math.isfinite(noise)
        else 0.0
    )
    rise = min(after) - before
    if rise > max(rise_min * abs(before), floor):
        change = f" ({rise / abs(before) * 100:+.1f} % or more)" if before else ""
        levels = ", then ".join(f"{a:.4g}" for a in after)
        return f"its level went from {before:.4g} before to {levels} after{change}"
    return ""
