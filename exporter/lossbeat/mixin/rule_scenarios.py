"""The scenarios of the promtool rule tests, one builder per family of alerts: each alert gets a
bad series (it fires, with its exact labels and annotations), a healthy one and one just inside
the threshold (both silent), with values derived from the thresholds (e.g. explosion * 1.5 and * 0.99).
"""

from __future__ import annotations

import math

from lossbeat.mixin.alert_rules import EXPORTER_SEEN_LOOKBACK, duration_seconds
from lossbeat.mixin.cross_rank_scenarios import cross_rank
from lossbeat.mixin.event_scenarios import gradient_nonfinite
from lossbeat.mixin.gap_scenarios import gap_scenarios
from lossbeat.mixin.guard_scenarios import guard_scenarios
from lossbeat.mixin.moe_rl_scenarios import moe_rl_scenarios
from lossbeat.mixin.rule_series import (
    INSTANCE,
    JOB,
    OTHER_INSTANCE,
    Expect,
    Scenario,
    Series,
    _Builder,
    _target,
    ramp,
    run,
)
from lossbeat.mixin.run_scenarios import concurrent_cross_rank, ranks_discovered, ranks_finishing

__all__ = ["SCENARIO_FAMILIES", "JUDGED"]


def _nonfinite(b: _Builder) -> dict[str, list[Scenario]]:
    a = b.t.alerts
    nan = b.rule("TrainingLossNaN")
    early_nan, early_at, early_last = b.first_scrape("training_nonfinite_loss_total", _target(), 1, a.event_window)
    counter, at = b.jump("training_nonfinite_loss_total", _target(), a.event_window, 1)
    loss_ok = b.hold("training_loss", _target(), 2.5, 40)
    loss_nan = Series("training_loss", _target(), [run(2.5, 3), run(math.nan, 5)])
    scale = b.rule("TrainingLossScaleCollapsed")
    scale_at = b.after_for(a.loss_scale_for)
    scale_min = b.t.gradients.loss_scale_min
    loss_scale = lambda v: b.hold("training_grad_scale", _target(), v, int(scale_at // b.i) + 2)  # noqa: E731
    return {
        "TrainingLossNaN": [
            Scenario("a non-finite loss step fires", [counter, loss_ok], [(at, nan.name, [Expect(nan, _target(), 1)])]),
            Scenario(
                "a NaN counted before the first scrape fires for the window, then stops",
                [early_nan, loss_ok],
                [
                    (early_at, nan.name, [Expect(nan, _target(), 1)]),
                    (early_last, nan.name, [Expect(nan, _target(), 1)]),
                    (early_last + 2 * b.i, nan.name, []),
                ],
            ),
            Scenario(
                "a NaN loss fires at once",
                [loss_nan, b.hold("training_nonfinite_loss_total", _target(), 0, 8)],
                [(3 * b.i, nan.name, [Expect(nan, _target(), math.nan)])],
            ),
            Scenario(
                "a finite loss is silent",
                [loss_ok, b.hold("training_nonfinite_loss_total", _target(), 0, 40)],
                [(at, nan.name, [])],
            ),
        ],
        "TrainingLossScaleCollapsed": [
            Scenario(
                "a collapsed loss scale fires after its for",
                [loss_scale(scale_min * 0.5)],
                [
                    (scale_at, scale.name, [Expect(scale, _target(), scale_min * 0.5)]),
                    (scale_at - 2 * b.i, scale.name, []),
                ],
            ),
            Scenario("just above the minimum is silent", [loss_scale(scale_min * 1.01)], [(scale_at, scale.name, [])]),
            Scenario("a healthy loss scale is silent", [loss_scale(65536)], [(scale_at, scale.name, [])]),
        ],
    }


def _gradients(b: _Builder) -> dict[str, list[Scenario]]:
    a, g = b.t.alerts, b.t.gradients
    sustained = b.rule("TrainingGradientExplosion", trigger="sustained")
    events = b.rule("TrainingGradientExplosion", trigger="events")
    isolated = b.rule("TrainingGradientExplosion", trigger="isolated")
    one, one_at = b.jump("training_grad_explosions_total", _target(), a.event_window, 1)
    at = b.after_for(a.explosion_for)
    samples = int(at // b.i) + 2
    judged = lambda v: b.hold("training_health_status", _target(check="grad_norm", component=""), v, samples)  # noqa: E731
    norm = lambda v: b.hold("training_grad_norm", _target(), v, samples)  # noqa: E731
    burst, burst_at = b.jump("training_grad_explosions_total", _target(), a.event_window, a.explosion_events)
    few, _ = b.jump("training_grad_explosions_total", _target(), a.event_window, a.explosion_events - 1)
    name = sustained.name
    out = {
        name: [
            Scenario(
                "a grad norm judged exploding fires after its for",
                [judged(2), norm(g.explosion * 1.5)],
                [(at, name, [Expect(sustained, _target(), g.explosion * 1.5)]), (at - 2 * b.i, name, [])],
            ),
            Scenario(
                "a stable high grad norm at the run's own level is silent",
                [judged(0), norm(g.explosion * 1.8)],
                [(at, name, [])],
            ),
            Scenario("a vanishing warning is not an explosion", [judged(1)], [(at, name, [])]),
            Scenario(
                "enough explosion events fire at once",
                [burst],
                [(burst_at, name, [Expect(events, _target(), a.explosion_events)])],
            ),
            Scenario(
                "one event fewer is a ticket, not a page",
                [few],
                [(burst_at, name, [Expect(isolated, _target(), a.explosion_events - 1)])],
            ),
            Scenario(
                "one isolated explosion is a ticket",
                [one, judged(0)],
                [(one_at, name, [Expect(isolated, _target(), 1)])],
            ),
            Scenario(
                "an explosion in a grad norm judged exploding pages only",
                [one, judged(2), norm(g.explosion * 1.5)],
                [(at, name, [Expect(sustained, _target(), g.explosion * 1.5)])],
            ),
            Scenario(
                "no explosion event is silent",
                [b.hold("training_grad_explosions_total", _target(), 0, samples)],
                [(one_at, name, [])],
            ),
        ],
    }
    vanish = b.rule("TrainingGradientVanishing")
    at = b.after_for(a.vanishing_for)
    samples = int(at // b.i) + 2
    out[vanish.name] = [
        Scenario(
            "a vanishing grad norm fires",
            [b.hold("training_grad_norm", _target(), g.vanishing * 0.5, samples)],
            [(at, vanish.name, [Expect(vanish, _target(), g.vanishing * 0.5)])],
        ),
        Scenario(
            "just above the threshold is silent",
            [b.hold("training_grad_norm", _target(), g.vanishing * 1.01, samples)],
            [(at, vanish.name, [])],
        ),
        Scenario(
            "a healthy grad norm is silent",
            [b.hold("training_grad_norm", _target(), g.healthy_low, samples)],
            [(at, vanish.name, [])],
        ),
    ]
    at = b.after_for(a.layer_for)
    samples = int(at // b.i) + 2
    layer = lambda name, v: b.hold("training_layer_grad_norm", _target(layer=name), v, samples)  # noqa: E731
    healthy_layer = (g.healthy_low + g.healthy_high) / 2
    for alert_name, bad, edge in (
        ("TrainingLayerGradientExplosion", g.layer_explosion * 1.5, g.layer_explosion * 0.99),
        ("TrainingLayerGradientVanishing", g.layer_vanishing * 0.5, g.layer_vanishing * 1.01),
    ):
        rule = b.rule(alert_name)
        out[alert_name] = [
            Scenario(
                "fires for the bad layer only",
                [layer("blocks.0.attn", bad), layer("head", healthy_layer)],
                [(at, alert_name, [Expect(rule, _target(layer="blocks.0.attn"), bad)])],
            ),
            Scenario("just inside the threshold is silent", [layer("blocks.0.attn", edge)], [(at, alert_name, [])]),
        ]
    return out


def _judged(
    b: _Builder, alert: str, check: str, fires: float, silent: tuple[float, ...], for_: str, component: str = ""
) -> list[Scenario]:
    """An alert that reads the exporter's judged status of ``check``: fires at ``fires``, silent at the others."""
    rule = b.rule(alert)
    at = b.after_for(for_)
    samples = int(at // b.i) + 2
    labels = _target(check=check, component=component)
    out = [
        Scenario(
            f"{check} judged {fires:g} fires after its for",
            [b.hold("training_health_status", labels, fires, samples)],
            [(at, alert, [Expect(rule, labels, fires)]), (at - 2 * b.i, alert, [])],
        )
    ]
    out += [
        Scenario(
            f"{check} judged {v:g} is silent", [b.hold("training_health_status", labels, v, samples)], [(at, alert, [])]
        )
        for v in silent
    ]
    return out


def _trend(b: _Builder) -> dict[str, list[Scenario]]:
    a = b.t.alerts
    out = {
        "TrainingLossDiverging": _judged(b, "TrainingLossDiverging", "loss_trend", 2, (1, 0), a.diverging_for)
        + _judged(b, "TrainingLossDiverging", "loss_trend", 2, (), a.diverging_for, component="aux")[:1],
        "TrainingLossPlateau": _judged(b, "TrainingLossPlateau", "loss_trend", 1, (2, 0), a.plateau_for),
        "TrainingLossVolatile": _judged(b, "TrainingLossVolatile", "loss_volatility", 2, (1, 0), a.volatile_for),
    }
    spikes = b.rule("TrainingLossSpikes")
    many, at = b.jump("training_loss_spikes_total", _target(), a.spikes_window, a.spikes_events)
    fewer, _ = b.jump("training_loss_spikes_total", _target(), a.spikes_window, a.spikes_events - 1)
    out[spikes.name] = [
        Scenario("enough spikes fire", [many], [(at, spikes.name, [Expect(spikes, _target(), a.spikes_events)])]),
        Scenario("one spike fewer is silent", [fewer], [(at, spikes.name, [])]),
    ]
    # Spikes judged harmful (repeated and not recovered, or followed by a worse loss) page.
    harmful = b.rule("TrainingLossSpikes", trigger="sustained")
    h_at = b.after_for(a.diverging_for)
    h_samples = int(h_at // b.i) + 2
    judged = lambda v: b.hold("training_health_status", _target(check="loss_spikes", component=""), v, h_samples)  # noqa: E731
    out[spikes.name] += [
        Scenario(
            "spikes judged harmful page after their for",
            [judged(2)],
            [
                (h_at, spikes.name, [Expect(harmful, _target(check="loss_spikes", component=""), 2)]),
                (h_at - 2 * b.i, spikes.name, []),
            ],
        ),
        Scenario("isolated spikes (judged a warning) do not page", [judged(1)], [(h_at, spikes.name, [])]),
    ]
    return out


def _rl(b: _Builder) -> dict[str, list[Scenario]]:
    a, rl = b.t.alerts, b.t.rl
    rule = b.rule("TrainingRLSignalCollapsed")
    at = b.after_for(a.rl_collapse_for)
    n = int(at // b.i) + 2
    signal = lambda name, v: b.hold("training_signal", _target(signal=name), v, n)  # noqa: E731
    hold = lambda metric, v, **labels: b.hold(metric, _target(**labels), v, n)  # noqa: E731

    def info(profile):
        return b.hold(
            "training_profile_info",
            _target(
                profile=profile,
                source="detected",
                fields="reward_std",
            ),
            1,
            n,
        )

    name = rule.name
    return {
        name: [
            Scenario(
                "reward_std at 0 fires after its for",
                [signal("reward_std", 0), signal("reward", 0.5)],
                [(at, name, [Expect(rule, _target(), 0)]), (at - 2 * b.i, name, [])],
            ),
            Scenario(
                "every group without spread fires",
                [signal("frac_reward_zero_std", 1)],
                [(at, name, [Expect(rule, _target(), 1)])],
            ),
            Scenario(
                "a zero loss with a zero grad norm in an RL run fires",
                [hold("training_grad_norm", 0), hold("training_loss", 0), info("rl")],
                [(at, name, [Expect(rule, _target(), 0)])],
            ),
            Scenario(
                "a zero loss with a zero grad norm outside RL is not this alert",
                [hold("training_grad_norm", 0), hold("training_loss", 0), info("causal-lm")],
                [(at, name, [])],
            ),
            Scenario(
                "a healthy spread is silent",
                [signal("reward_std", 0.3), signal("frac_reward_zero_std", rl.zero_std_fraction * 0.9)],
                [(at, name, [])],
            ),
            Scenario("just above the zero is silent", [signal("reward_std", rl.reward_std_zero * 2)], [(at, name, [])]),
        ]
    }


def _out_of_range(b: _Builder) -> dict[str, list[Scenario]]:
    a = b.t.alerts
    return {
        "TrainingLossOutOfRange": _judged(b, "TrainingLossOutOfRange", "loss_range", 1, (0,), a.out_of_range_for)
        + _judged(b, "TrainingLossOutOfRange", "loss_range", 1, (), a.out_of_range_for, component="lm")[:1],
    }


def _overfitting(b: _Builder) -> dict[str, list[Scenario]]:
    a = b.t.alerts
    rule = b.rule("TrainingOverfitting")
    at = b.after_for(a.overfitting_for)
    samples = int(at // b.i) + 2
    eval_loss = b.hold("training_eval_loss", _target(), 2.4, samples)
    status = lambda v: b.hold("training_health_status", _target(check="overfitting", component=""), v, samples)  # noqa: E731
    # One eval above the best, then back: the exporter never judged it; a raw PromQL rule would have fired.
    blip = Series("training_eval_loss", _target(), [run(2.0, 2), run(2.4, 2), run(2.0, samples - 4)])
    return {
        rule.name: [
            Scenario(
                "judged overfitting fires with the eval loss",
                [eval_loss, status(1)],
                [(at, rule.name, [Expect(rule, _target(), 2.4)]), (at - 2 * b.i, rule.name, [])],
            ),
            Scenario("a one-evaluation blip is silent", [blip, status(0)], [(at, rule.name, [])]),
            Scenario("eval up without the judgment is silent", [eval_loss, status(0)], [(at, rule.name, [])]),
        ]
    }


def _progress(b: _Builder) -> dict[str, list[Scenario]]:
    a = b.t.alerts
    lr_rule = b.rule("TrainingLearningRateSuspect")
    at = b.after_for(a.learning_rate_for)
    samples = int(at // b.i) + 2
    lr = lambda group, v: b.hold("training_learning_rate", _target(param_group=group), v, samples)  # noqa: E731
    check = lambda v: b.hold("training_health_status", _target(check="learning_rate"), v, samples)  # noqa: E731
    good_lr = b.t.learning_rate.too_small * 100
    out = {
        lr_rule.name: [
            Scenario(
                "a zero LR fires for its param group",
                [lr("0", 0), lr("1", good_lr), check(0)],
                [(at, lr_rule.name, [Expect(lr_rule, _target(param_group="0"), 0)])],
            ),
            Scenario(
                "a NaN LR fires",
                [lr("0", math.nan)],
                [(at, lr_rule.name, [Expect(lr_rule, _target(param_group="0"), math.nan)])],
            ),
            Scenario(
                "the exporter's LR check fires",
                [lr("0", good_lr), check(1)],
                [(at, lr_rule.name, [Expect(lr_rule, _target(param_group="0"), good_lr)])],
            ),
            Scenario("a healthy LR is silent", [lr("0", good_lr), check(0)], [(at, lr_rule.name, [])]),
        ]
    }
    out.update(_stalled(b))
    out.update(_exporter_down(b))
    errors = b.rule("TrainingExporterErrors")
    failing, err_at = b.jump("training_exporter_errors_total", _target(where="observe"), a.event_window, 2)
    quiet = lambda where: b.hold("training_exporter_errors_total", _target(where=where), 0, 20)  # noqa: E731
    early, early_at, _ = b.first_scrape("training_exporter_errors_total", _target(where="collect"), 1, a.event_window)
    out[errors.name] = [
        Scenario(
            "errors in observe() fire, naming where",
            [failing, quiet("collect")],
            [(err_at, errors.name, [Expect(errors, _target(where="observe"), 2)])],
        ),
        Scenario(
            "errors counted before the first scrape fire",
            [early],
            [(early_at, errors.name, [Expect(errors, _target(where="collect"), 1)])],
        ),
        Scenario("no error is silent", [quiet("observe"), quiet("collect")], [(err_at, errors.name, [])]),
    ]
    return out


def _stalled(b: _Builder) -> dict[str, list[Scenario]]:
    a = b.t.alerts
    stalled = b.rule("TrainingStalled")
    limit, phase_limit = duration_seconds(a.stalled_after), duration_seconds(a.stalled_phase_after)
    last = b.i  # the last sign of progress happened at t = one interval
    samples = int((last + phase_limit) // b.i) + 4
    # The exporter's age of its heartbeat at each scrape (its own clock), and the timestamp
    # on a node whose clock is an hour behind Prometheus' (the age must win: no page from skew).
    skew = 3600
    frozen = [
        Series("training_heartbeat_age_seconds", _target(), [run(0, 2), ramp(b.i, b.i, samples - 2)]),
        b.hold("training_last_heartbeat_timestamp_seconds", _target(), last - skew, samples),
    ]
    moving = [
        b.hold("training_heartbeat_age_seconds", _target(), 0, samples),
        Series("training_last_heartbeat_timestamp_seconds", _target(), [ramp(-skew, b.i, samples)]),
    ]
    legacy = [
        b.hold("training_last_heartbeat_timestamp_seconds", _target(), last, samples)
    ]  # no age: an older exporter

    def in_phase(current: str) -> list[Series]:
        return [
            b.hold("training_phase", _target(phase=p), 1 if p == current else 0, samples)
            for p in ("train", "eval", "checkpoint")
        ]

    return {
        stalled.name: [
            Scenario(
                "no progress while training fires",
                [*frozen, *in_phase("train")],
                [
                    (last + limit + b.i, stalled.name, [Expect(stalled, _target(phase="train"), limit + b.i)]),
                    (last + limit, stalled.name, []),
                ],
            ),
            Scenario(
                "a job that keeps stepping on a node whose clock is an hour behind is silent",
                [*moving, *in_phase("train")],
                [(last + limit + b.i, stalled.name, [])],
            ),
            Scenario(
                "an older exporter without the age: measured on Prometheus' clock",
                [*legacy, *in_phase("train")],
                [
                    (last + limit + b.i, stalled.name, [Expect(stalled, _target(phase="train"), limit + b.i)]),
                    (last + limit, stalled.name, []),
                ],
            ),
            Scenario(
                "an evaluation longer than stalled_after is silent, a hung one fires",
                [*frozen, *in_phase("eval")],
                [
                    (last + limit + b.i, stalled.name, []),
                    (last + phase_limit, stalled.name, []),
                    (
                        last + phase_limit + b.i,
                        stalled.name,
                        [Expect(stalled, _target(phase="eval"), phase_limit + b.i)],
                    ),
                ],
            ),
            Scenario(
                "a long checkpoint is silent",
                [*frozen, *in_phase("checkpoint")],
                [(last + limit + b.i, stalled.name, []), (last + phase_limit, stalled.name, [])],
            ),
        ]
    }


def _exporter_down(b: _Builder) -> dict[str, list[Scenario]]:
    """A rank that vanished without its completion marker pages; one that finished does not."""
    a = b.t.alerts
    down = b.rule("TrainingExporterDown")
    up_for = 3  # scraped for 3 intervals, then gone
    fires = b.after_for(a.exporter_down_for, start=up_for * b.i)
    samples = int(fires // b.i) + 2
    target = {"job": JOB, "instance": INSTANCE}
    steps = Series("training_steps_total", _target(), [ramp(0, 10, up_for), "stale"])
    info = Series(
        "training_run_info", {**_target(), "run": "test", "profile": b.t.profile.name}, [run(1, up_for), "stale"]
    )
    running = Series("training_run_completed", _target(), [run(0, up_for), "stale"])
    finished = Series("training_run_completed", _target(), [run(0, up_for - 1), "1", "stale"])
    up_then_down = Series("up", target, [run(1, up_for), run(0, samples - up_for)])
    up_then_removed = Series("up", target, [run(1, up_for), "stale"])
    last_steps = 10 * (up_for - 1)
    hours, past = 3 * 3600.0, duration_seconds(EXPORTER_SEEN_LOOKBACK) + 15 * b.i
    long_down = Series("up", target, [run(1, up_for), run(0, int(past // b.i) + 2 - up_for)])
    checks = lambda *expected: [(fires, down.name, list(expected)), (fires - 2 * b.i, down.name, [])]  # noqa: E731
    return {
        down.name: [
            Scenario(
                "a crash with the target kept (up == 0) fires",
                [up_then_down, info, steps, running],
                checks(Expect(down, _target(), last_steps)),
            ),
            Scenario(
                "a crash whose target service discovery removed fires",
                [up_then_removed, info, steps, running],
                checks(Expect(down, _target(), last_steps)),
            ),
            Scenario("a normal finish with the target kept is silent", [up_then_down, info, steps, finished], checks()),
            Scenario(
                "a normal finish whose target was removed is silent", [up_then_removed, info, steps, finished], checks()
            ),
            Scenario(
                "a target that answers is silent",
                [
                    b.hold("up", target, 1, samples),
                    b.hold("training_steps_total", _target(), 5, samples),
                    b.hold("training_run_completed", _target(), 0, samples),
                ],
                checks(),
            ),
            Scenario(
                "other jobs' targets are not ours",
                [b.hold("up", {"job": "node", "instance": "n1:9100"}, 0, samples)],
                checks(),
            ),
            # The lookback is state the lookback group carries from one evaluation to the next: it
            # must hold for hours past the raw samples' window, and end with the lookback.
            Scenario(
                f"a crash still fires hours later, and no more after {EXPORTER_SEEN_LOOKBACK}",
                [long_down, info, steps, running],
                [(hours, down.name, [Expect(down, _target(), last_steps)]), (past, down.name, [])],
            ),
            Scenario(
                "a normal finish is still silent hours later",
                [long_down, info, steps, finished],
                [(hours, down.name, [])],
            ),
            Scenario(
                "a rank requeued onto another instance under the same run_id: its old instance's down "
                "resolves once it reports again",
                _requeued(b, up_for, back := int(fires // b.i) + 3),
                [
                    (fires, down.name, [Expect(down, _target(run_id="4242"), last_steps)]),
                    ((back + 2) * b.i, down.name, []),
                ],
            ),
        ]
    }


def _requeued(b: _Builder, up_for: int, back: int) -> list[Series]:
    """Rank 0 of run 4242 preempted after ``up_for`` intervals (no marker), and the same rank of
    the same run reporting from another node from interval ``back`` on (Slurm keeps the job id
    across a requeue, torchrun its run id across an elastic restart)."""
    old, new = _target(run_id="4242"), _target(instance=OTHER_INSTANCE, run_id="4242")
    info = {"run": "test", "profile": b.t.profile.name}
    return [
        Series("up", {"job": JOB, "instance": INSTANCE}, [run(1, up_for), "stale"]),
        Series("training_steps_total", old, [ramp(0, 10, up_for), "stale"]),
        Series("training_run_info", {**old, **info}, [run(1, up_for), "stale"]),
        Series("training_run_completed", old, [run(0, up_for), "stale"]),
        Series("up", {"job": JOB, "instance": OTHER_INSTANCE}, [f"_x{back}", run(1, 6)]),
        Series("training_steps_total", new, [f"_x{back}", ramp(0, 10, 6)]),
        Series("training_run_info", {**new, **info}, [f"_x{back}", run(1, 6)]),
        Series("training_run_completed", new, [f"_x{back}", run(0, 6)]),
    ]


def _concurrent_runs(b: _Builder) -> dict[str, list[Scenario]]:
    """Two runs under one job label (two submissions of one sbatch template), each rank 0 on
    its own instance: each is judged on its own, never by their mix."""
    rule = b.rule("TrainingLossOutOfRange")
    at = b.after_for(b.t.alerts.out_of_range_for)
    samples = int(at // b.i) + 2

    def judged(instance: str, status: float) -> Series:
        return b.hold(
            "training_health_status", _target(instance=instance, check="loss_range", component=""), status, samples
        )

    return {
        rule.name: [
            Scenario(
                "two healthy runs under one job are silent",
                [judged(INSTANCE, 0), judged(OTHER_INSTANCE, 0)],
                [(at, rule.name, [])],
            ),
            Scenario(
                "a bad run next to a healthy one fires for itself alone",
                [judged(INSTANCE, 0), judged(OTHER_INSTANCE, 1)],
                [
                    (
                        at,
                        rule.name,
                        [Expect(rule, _target(instance=OTHER_INSTANCE, check="loss_range", component=""), 1)],
                    )
                ],
            ),
        ]
    }


def _resources(b: _Builder) -> dict[str, list[Scenario]]:
    """Memory near the limit, memory that grows, throughput that drops: firing and silent."""
    m, tp = b.t.memory, b.t.throughput
    gib = 2.0**30
    limit = 80 * gib
    dev = _target(device="cuda:0")
    out = {}

    near = b.rule("TrainingMemoryNearLimit")
    at = b.after_for(m.near_limit_for)
    n = int(at // b.i) + 2
    high, safe = limit * (m.near_limit + 0.02), limit * (m.near_limit - 0.05)
    out[near.name] = [
        Scenario(
            "a peak near the limit fires",
            [b.hold("training_memory_peak_bytes", dev, high, n), b.hold("training_memory_limit_bytes", dev, limit, n)],
            [(at, near.name, [Expect(near, dev, 100 * high / limit)])],
        ),
        Scenario(
            "a peak with headroom is silent",
            [b.hold("training_memory_peak_bytes", dev, safe, n), b.hold("training_memory_limit_bytes", dev, limit, n)],
            [(at, near.name, [])],
        ),
    ]

    growing = b.rule("TrainingMemoryGrowing")
    window, horizon = duration_seconds(m.window), duration_seconds(m.oom_horizon)
    start = 0.3 * limit
    # Fast enough that the growth over the window and the projection both cross.
    per_s = max(1.2 * m.growth_fraction * limit / window, 1.2 * (limit - start) / (window + horizon + 3600))
    steps = b.steps(m.window) + b.steps(m.growing_for) + 3
    at = (b.steps(m.window) + b.steps(m.growing_for) + 2) * b.i
    # No sample exactly one window before the evaluation: Prometheus 2 counts a sample on a range's
    # left edge and Prometheus 3 does not, so without the gap the growth read at `at` differs by
    # one interval between the two. With it, both see the same samples.
    edge = at // b.i - b.steps(m.window)
    d = per_s * b.i
    leak = Series(
        "training_memory_allocated_bytes",
        dev,
        [ramp(start, d, edge), "_", ramp(start + d * (edge + 1), d, steps + 1 - (edge + 1))],
    )
    flat = b.hold("training_memory_allocated_bytes", dev, start, steps + 1)
    young = Series(
        "training_memory_allocated_bytes",
        dev,
        [f"_x{b.steps(m.window)}", ramp(start, per_s * b.i, b.steps(m.growing_for) + 3)],
    )
    lim = b.hold("training_memory_limit_bytes", dev, limit, steps + 1)
    grown = 100 * per_s * (duration_seconds(m.window) - b.i) / limit
    out[growing.name] = [
        Scenario(
            "memory rising towards the limit fires", [leak, lim], [(at, growing.name, [Expect(growing, dev, grown)])]
        ),
        Scenario("flat memory is silent", [flat, lim], [(at, growing.name, [])]),
        Scenario("start-up allocation of a young run is silent", [young, lim], [(at, growing.name, [])]),
    ]

    dropped = b.rule("TrainingThroughputDropped")
    base_s, for_s = duration_seconds(tp.baseline), duration_seconds(tp.for_)
    rate, slow = 2.0, 2.0 * tp.drop_fraction * 0.5
    before = int((base_s + for_s) // b.i) + 2
    after = int((for_s + 600) // b.i) + 2
    at = (before + after - 2) * b.i

    def steps_total(second_rate: float) -> Series:
        return Series(
            "training_steps_total",
            _target(),
            [ramp(0, rate * b.i, before), ramp(rate * b.i * before, second_rate * b.i, after)],
        )

    def phase(current: str) -> list[Series]:
        return [
            b.hold("training_phase", _target(phase=p), 1 if p == current else 0, before + after + 1)
            for p in ("train", "eval", "checkpoint")
        ]

    out[dropped.name] = [
        Scenario(
            "a run slowed to a quarter fires",
            [steps_total(slow), *phase("train")],
            [(at, dropped.name, [Expect(dropped, _target(), slow)])],
        ),
        Scenario("a steady run is silent", [steps_total(rate), *phase("train")], [(at, dropped.name, [])]),
        Scenario("a long evaluation is silent", [steps_total(slow), *phase("eval")], [(at, dropped.name, [])]),
        Scenario(
            "a stopped run is TrainingStalled's, silent here",
            [steps_total(0), *phase("train")],
            [(at, dropped.name, [])],
        ),
    ]
    return out


# Judgment alerts, the check each reads and the status at which it fires.
JUDGED = {
    "TrainingGradientExplosion": ("grad_norm", 2),
    "TrainingLossDiverging": ("loss_trend", 2),
    "TrainingLossPlateau": ("loss_trend", 1),
    "TrainingLossVolatile": ("loss_volatility", 2),
    "TrainingLossOutOfRange": ("loss_range", 1),
    "TrainingOverfitting": ("overfitting", 1),
}


SCENARIO_FAMILIES = (
    _nonfinite,
    gradient_nonfinite,
    _gradients,
    _trend,
    _rl,
    _out_of_range,
    _concurrent_runs,
    _overfitting,
    _progress,
    _resources,
    cross_rank,
    ranks_discovered,
    concurrent_cross_rank,
    ranks_finishing,
    guard_scenarios,
    gap_scenarios,
    moe_rl_scenarios,
)
"""Every family of scenarios, in the order the test documents list them."""
