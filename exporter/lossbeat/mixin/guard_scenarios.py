"""The promtool scenarios of the optimizer guard's alerts: isolated skips are a ticket, repeated
skips and a stop page, and a NaN the guard absorbed never pages TrainingLossNaN."""

from __future__ import annotations

import math

from lossbeat.mixin.rule_series import Expect, Scenario, Series, _Builder, _target, run

__all__ = ["guard_scenarios"]


def guard_scenarios(b: _Builder) -> dict[str, list[Scenario]]:
    """Isolated skips are a ticket, repeated skips and a stop page; an absorbed NaN never pages."""
    a, g = b.t.alerts, b.t.guard
    skipped, rep, halted = (
        b.rule("TrainingStepsSkipped"),
        b.rule("TrainingSkippingRepeatedly"),
        b.rule("TrainingHalted"),
    )
    nan = b.rule("TrainingLossNaN")
    level = b.rule("TrainingGradNormLevelChanged")
    changed, changed_at = b.jump("training_guard_level_changes_total", _target(), a.guard_window, 1)
    one, at = b.jump("training_skipped_steps_total", _target(reason="nonfinite"), a.guard_window, 1)
    many, many_at = b.jump(
        "training_skipped_steps_total", _target(reason="explosion"), a.guard_window, g.page_skips + 1
    )
    few, _ = b.jump("training_skipped_steps_total", _target(reason="explosion"), a.guard_window, g.page_skips)
    n = int(at // b.i) + 8
    # The NaN step the guard absorbed: training_loss NaN while it is being skipped, then finite.
    absorbed_loss = Series("training_loss", _target(), [run(2.5, n - 9), run(math.nan, 1), run(2.4, 8)])
    skips_now = Series("training_guard_consecutive_skips", _target(), [run(0, n - 9), run(1, 1), run(0, 8)])
    nan_at = (n - 9) * b.i
    stopped = Series("training_halted", _target(), [run(0, 3), run(1, 2), "stale"])
    return {
        skipped.name: [
            Scenario(
                "one absorbed NaN is a ticket",
                [one],
                [(at, skipped.name, [Expect(skipped, _target(reason="nonfinite"), 1)])],
            ),
            Scenario(
                "no skip is silent",
                [b.hold("training_skipped_steps_total", _target(reason="spike"), 0, n)],
                [(at, skipped.name, [])],
            ),
        ],
        rep.name: [
            Scenario(
                "more skips than guard.page_skips page",
                [many],
                [(many_at, rep.name, [Expect(rep, _target(), g.page_skips + 1)])],
            ),
            Scenario("guard.page_skips skips are no page", [few], [(many_at, rep.name, [])]),
        ],
        halted.name: [
            Scenario(
                "a stop pages, after the exporter is gone too",
                [stopped],
                [
                    (3 * b.i, halted.name, [Expect(halted, _target(), 1)]),
                    (8 * b.i, halted.name, [Expect(halted, _target(), 1)]),
                ],
            ),
            Scenario(
                "a guarded run that never stopped is silent",
                [b.hold("training_halted", _target(), 0, 10)],
                [(5 * b.i, halted.name, [])],
            ),
        ],
        level.name: [
            Scenario(
                "an accepted new level is a ticket",
                [changed],
                [(changed_at, level.name, [Expect(level, _target(), 1)])],
            ),
            Scenario(
                "no new level is silent",
                [b.hold("training_guard_level_changes_total", _target(), 0, n)],
                [(at, level.name, [])],
            ),
        ],
        nan.name: [
            Scenario(
                "a NaN the guard absorbed, then finite steps, does not page",
                [absorbed_loss, skips_now, b.hold("training_nonfinite_loss_total", _target(), 0, n)],
                [(nan_at, nan.name, [])],
            ),
        ],
    }
