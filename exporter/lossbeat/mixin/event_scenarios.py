"""The promtool scenarios of TrainingGradientNonFinite: one non-finite gradient the run went on
from is a ticket; repeated ones, or ones the exporter judges ongoing, page
(docs/decisions.md#events-are-findings)."""

from __future__ import annotations

from lossbeat.mixin.rule_series import Expect, Scenario, _Builder, _target

__all__ = ["gradient_nonfinite"]


def gradient_nonfinite(b: _Builder) -> dict[str, list[Scenario]]:
    """Isolated (a ticket), repeated and judged ongoing (pages); the first bad layer named, or unknown."""
    a = b.t.alerts
    early_grad, early_at, early_last = b.first_scrape(
        "training_nonfinite_grad_total", _target(), a.nonfinite_events, a.event_window
    )
    grad = b.rule("TrainingGradientNonFinite", trigger="events")
    gevents, gsustained = grad, b.rule(grad.name, trigger="sustained")
    gisolated = b.rule(grad.name, trigger="isolated")
    gcounter, gat = b.jump("training_nonfinite_grad_total", _target(), a.event_window, a.nonfinite_events)
    gfew, _ = b.jump("training_nonfinite_grad_total", _target(), a.event_window, a.nonfinite_events - 1)
    gone, gone_at = b.jump("training_nonfinite_grad_total", _target(), a.event_window, 1)
    gjudged = lambda v: b.hold("training_health_status", _target(check="nonfinite", component=""), v, 40)  # noqa: E731
    info = b.hold("training_nonfinite_grad_first_layer_info", _target(layer="blocks.1.mlp"), 1, 40)
    flat = b.hold("training_nonfinite_grad_total", _target(), 0, 40)
    return {
        "TrainingGradientNonFinite": [
            Scenario(
                "one non-finite gradient the run went on from is a ticket naming the first bad layer",
                [gone, info, gjudged(1)],
                [(gone_at, grad.name, [Expect(gisolated, _target(layer="blocks.1.mlp"), 1)])],
            ),
            Scenario(
                "one fewer than the page's count is a ticket, with layer unknown when none was named",
                [gfew],
                [(gat, grad.name, [Expect(gisolated, _target(layer="unknown"), a.nonfinite_events - 1)])],
            ),
            Scenario(
                "repeated non-finite gradients page naming the first bad layer",
                [gcounter, info],
                [(gat, grad.name, [Expect(gevents, _target(layer="blocks.1.mlp"), a.nonfinite_events)])],
            ),
            Scenario(
                "one non-finite gradient the exporter judges ongoing pages only",
                [gone, info, gjudged(2)],
                [(gone_at, grad.name, [Expect(gsustained, _target(layer="blocks.1.mlp"), 1)])],
            ),
            Scenario(
                "repeated non-finite gradients counted before the first scrape page",
                [early_grad, info],
                [
                    (early_at, grad.name, [Expect(gevents, _target(layer="blocks.1.mlp"), a.nonfinite_events)]),
                    (early_last, grad.name, [Expect(gevents, _target(layer="blocks.1.mlp"), a.nonfinite_events)]),
                    (early_last + 2 * b.i, grad.name, []),
                ],
            ),
            Scenario("finite gradients are silent", [flat, info, gjudged(0)], [(gat, grad.name, [])]),
        ],
    }
