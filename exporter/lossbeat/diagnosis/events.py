"""Events are findings: the loss spikes and gradient-norm explosions a run counted, with their steps.

A counted event is a fact; what it means depends on what followed it:

* isolated and recovered (one x80 jump of the grad norm and back, one bad batch whose loss
  spike the run absorbed): a WARNING that says so, while the event is recent;
* repeated (``events.repeated`` within the last ``windows.cv_steps`` records), or followed by
  a worse loss (the loss level after it ``events.worse_after`` above the level before it, and
  beyond the loss's own noise): a DANGER.

An event that left the window is a GOOD note with its steps. Non-finite values are judged by
:func:`lossbeat.diagnosis.run._nonfinite` on the same principle. Fixed memory per kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lossbeat.diagnosis.findings import Finding, Status
from lossbeat.diagnosis.window import Ring, median

__all__ = ["EventThresholds", "EventTrack", "check_events", "EVENT_CHECKS"]

EVENT_CHECKS = {"loss_spikes": "loss spike", "grad_explosions": "gradient-norm explosion"}
"""Check name -> the event it judges (the counters' names)."""

_KEPT = 64  # recent events kept per kind
_FIRST = 5  # first steps named in messages
_HELD_FRACTION = 10  # a warning holds over a tenth of the records seen (at least windows.cv_steps)


@dataclass(frozen=True)
class EventThresholds:
    repeated: int
    """Events within the last ``windows.cv_steps`` records that make them repeated (a DANGER)."""
    worse_after: float
    """The loss level after an event this fraction above the level before it: the event did damage."""


class EventTrack:
    """The events of one kind: their total, the first steps, and the recent ones (fixed memory)."""

    def __init__(self) -> None:
        self.total = 0
        self.first_steps: list[int] = []
        self.recent = Ring(_KEPT)  # (record index, step, loss level before)

    def push(self, index: int, step: int, level_before: float) -> None:
        self.total += 1
        if len(self.first_steps) < _FIRST:
            self.first_steps.append(step)
        self.recent.push((index, step, level_before))

    def clear(self) -> None:
        self.__init__()

    def within(self, now: int, window: int) -> list[tuple[int, int, float]]:
        return [e for e in self.recent.last(len(self.recent)) if now - e[0] < window]


def _steps(steps: list[int], total: int) -> str:
    shown = ", ".join(str(s) for s in steps[:_FIRST])
    return f"step{'s' if len(steps) > 1 else ''} {shown}" + (", ..." if total > len(steps[:_FIRST]) else "")


def check_events(history, check: str) -> Finding:
    """The finding for one kind of event (``loss_spikes`` or ``grad_explosions``)."""
    track: EventTrack = history.events[check]
    what = EVENT_CHECKS[check]
    t = history.thresholds
    if not track.total:
        return Finding(check, Status.GOOD, f"no {what}s")
    now = history.steps_seen
    # An event holds the warning over a span that grows with the run (a tenth of the records
    # seen, at least the volatility window): events a few hundred records apart in a long run
    # are one finding, not a warning that comes and goes with each.
    held = max(t.windows.cv_steps, now // _HELD_FRACTION)
    recent = track.within(now, held)
    if not recent:
        return Finding(check, Status.GOOD, f"{track.total} {what}(s) earlier ({_steps(track.first_steps, track.total)}), "
                                           f"none in the last {held} records: the run absorbed them")
    fix = ("inspect the batches of those steps (corrupt, duplicated or very long samples); clip gradients "
           "(max_norm 1.0) and lower the learning rate if they repeat")
    window = t.windows.cv_steps
    burst = track.within(now, window)
    steps = [e[1] for e in recent]
    if len(burst) >= t.events.repeated:
        # Repeated: a danger unless the loss came back to its level before them (a spike's own
        # height, loss.spike_min_rise, above it is not back).
        worse = _worse_after(history, burst[0], t.loss.spike_min_rise)
        if worse:
            return Finding(check, Status.DANGER,
                           f"{len(burst)} {what}s in the last {window} records ({_steps([e[1] for e in burst], len(burst))}; "
                           f"{track.total} so far): repeated, and the loss did not recover: {worse}", fix)
    worse = _worse_after(history, recent[0], t.events.worse_after)
    if worse:
        return Finding(check, Status.DANGER, f"{what} at step {recent[0][1]} followed by a worse loss: {worse}", fix)
    loss = history.loss
    settled = now - recent[-1][0] >= t.loss.spike_min_steps
    level = _level_now(loss)
    back = (f"; the loss is back at its level ({recent[0][2]:.4g} before, {level:.4g} now)"
            if settled and t.profile.trend and math.isfinite(recent[0][2]) and math.isfinite(level) else "")
    kind = "repeated" if len(recent) >= t.events.repeated else "isolated"
    return Finding(check, Status.WARNING,
                   f"{len(recent)} {kind} {what}(s) in the last {held} records ({_steps(steps, len(steps))}; "
                   f"{track.total} so far); the run goes on{back}", fix)


def _level_now(loss) -> float:
    return median(loss.ring.last(loss.t.loss.spike_min_steps))


def _worse_after(history, event: tuple[int, int, float], rise_min: float) -> str:
    """Why the loss after ``event`` is worse than before it, by more than ``rise_min`` of its level
    and its noise ('' if it is not, or cannot tell yet: the level is read once the latest event
    of the kind is ``windows.cv_steps`` records past, and over that many records, so a burst is
    judged by where it left the loss, not by its own records or a short shift of the data's level)."""
    t = history.thresholds
    index, _, before = event
    loss = history.loss
    n = t.windows.cv_steps
    latest = max(tr.recent.back(0)[0] for tr in history.events.values() if len(tr.recent))
    if not t.profile.trend or not math.isfinite(before) or history.steps_seen - max(index, latest) < n \
            or len(loss.ring) < n:
        return ""
    now = median(loss.ring.last(n))
    noise = loss.noise
    floor = t.loss.trend_min_z * noise / math.sqrt(n) if math.isfinite(noise) else 0.0
    rise = now - before
    if math.isfinite(now) and rise > max(rise_min * abs(before), floor):
        change = f" ({rise / abs(before) * 100:+.1f} %)" if before else ""
        return f"its level went from {before:.4g} before to {now:.4g} now{change}"
    return ""
