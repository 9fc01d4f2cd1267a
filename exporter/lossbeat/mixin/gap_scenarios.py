"""The promtool scenarios of the event alerts across gaps: a counter that comes back after a gap
at the value it had is no new event, whatever the gap's length; one that comes back higher counted
events meanwhile, and those page once.

A failed scrape writes a staleness marker for every series of its target (``stale``); a target
unreachable for longer writes that marker at its first failed scrape and nothing until it answers
again (``_``). Each scenario holds the counter quiet long past its window before the gap, then
checks every evaluation from the gap's end until a window and two intervals after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lossbeat.mixin.alert_rules import AlertRule
from lossbeat.mixin.rule_series import Expect, Scenario, Series, _Builder, _target, run

__all__ = ["GAPS", "gap_scenarios"]

GAPS = (
    ("one failed scrape", 0),
    ("a target unreachable for 6 minutes", 360),
    ("a target unreachable for 2 hours", 7200),
)
"""(what happened, its length in seconds: 0 for a single failed scrape)."""


@dataclass(frozen=True)
class _Kind:
    what: str
    counter: str
    labels: dict[str, str]
    rule: AlertRule
    window: str
    events: float
    expect_labels: dict[str, str]


def _kinds(b: _Builder) -> list[_Kind]:
    a = b.t.alerts
    return [
        _Kind(
            "a NaN",
            "training_nonfinite_loss_total",
            _target(),
            b.rule("TrainingLossNaN"),
            a.event_window,
            1,
            _target(),
        ),
        _Kind(
            "repeated overflows",
            "training_nonfinite_grad_total",
            _target(),
            b.rule("TrainingGradientNonFinite", trigger="events"),
            a.event_window,
            a.nonfinite_events,
            _target(layer="unknown"),
        ),
        _Kind(
            "a skipped step",
            "training_skipped_steps_total",
            _target(reason="nonfinite"),
            b.rule("TrainingStepsSkipped"),
            a.guard_window,
            1,
            _target(reason="nonfinite"),
        ),
    ]


def _gap(b: _Builder, seconds: int) -> list[str]:
    """The samples of a gap: the staleness marker of the first failed scrape, then none."""
    missing = max(0, seconds // b.i - 1)
    return ["stale"] + ([f"_x{missing}"] if missing else [])


def _with_gap(b: _Builder, k: _Kind, seconds: int, after: float) -> tuple[Series, float, float, float]:
    """The counter: flat at 0 for a window, its events (``at``: the evaluation that sees exactly
    them), quiet at that value for a window and three intervals, the gap, then back at ``after``.
    Returns the series, ``at``, the first evaluation after the gap and the last one checked."""
    n = b.steps(k.window)
    quiet = n + 3
    gap = _gap(b, seconds)
    gap_samples = max(1, seconds // b.i)
    tail = n + 4
    series = Series(k.counter, k.labels, [run(0, n + 1), run(k.events, 1 + quiet), *gap, run(after, tail)])
    at = (n + 1) * b.i
    back = (n + 2 + quiet + gap_samples) * b.i
    return series, at, back, back + (n + 2) * b.i


def gap_scenarios(b: _Builder) -> dict[str, list[Scenario]]:
    """For each event kind and each gap: the events page when they happen and never again when the
    counter comes back at the value it had; events counted during a gap page once when it comes back."""
    out: dict[str, list[Scenario]] = {}
    for k in _kinds(b):

        def fired(value, kind=k):
            return [Expect(kind.rule, kind.expect_labels, value)]

        for what, seconds in GAPS:
            series, at, back, last = _with_gap(b, k, seconds, k.events)
            checks = [(at, k.rule.name, fired(k.events))]
            t = back
            while t <= last:
                checks.append((t, k.rule.name, []))
                t += b.i
            out.setdefault(k.rule.name, []).append(
                Scenario(f"{k.what}, then {what}: the counter back at its value is no new event", [series], checks)
            )
        longest = GAPS[-1][1]
        series, at, back, last = _with_gap(b, k, longest, 2 * k.events)
        out[k.rule.name].append(
            Scenario(
                f"{k.what}, then as many again while the target was unreachable for {longest // 3600} hours: "
                "they page once when it comes back",
                [series],
                [(at, k.rule.name, fired(k.events)), (back, k.rule.name, fired(k.events)), (last, k.rule.name, [])],
            )
        )
    return out
