"""``promtool test rules`` unit tests for every alert, computed from the thresholds.

Each alert gets a bad series (it fires, with the exact labels and annotations),
a healthy series and a series just inside the threshold (both silent). Test
values derive from the thresholds (e.g. explosion * 1.5 and * 0.99), so a
threshold change regenerates tests that still hold.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import reduce

from lossbeat.alert_rules import (
    RECORDING_GROUP,
    AlertRule,
    alert_rules,
    duration_seconds,
    number,
)
from lossbeat.thresholds import Thresholds

__all__ = ["rule_test_documents", "render_template"]

JOB, INSTANCE = "train", "127.0.0.1:8470"


def _target(rank: str = "0", **extra: str) -> dict[str, str]:
    return {"job": JOB, "instance": INSTANCE, "rank": rank, **extra}


def _fmt(value: float) -> str:
    return "NaN" if math.isnan(value) else number(value)


def run(value: float, samples: int) -> str:
    """``samples`` samples of ``value`` in promtool's expanding notation."""
    return f"{_fmt(value)}+0x{samples - 1}"


def ramp(start: float, step: float, samples: int) -> str:
    """``samples`` samples from ``start``, changing by ``step`` each interval."""
    return f"{_fmt(start)}{'-' if step < 0 else '+'}{_fmt(abs(step))}x{samples - 1}"


@dataclass
class Series:
    metric: str
    labels: dict[str, str]
    values: list[str]
    """Runs in promtool notation (see :func:`run`, :func:`ramp`, ``"stale"``)."""

    def to_doc(self) -> dict:
        body = ",".join(f'{k}="{v}"' for k, v in self.labels.items())
        return {"series": f"{self.metric}{{{body}}}", "values": " ".join(self.values)}


@dataclass
class Expect:
    rule: AlertRule
    labels: dict[str, str]
    """Labels of the expression's result, before the rule's labels."""
    value: float


@dataclass
class Scenario:
    name: str
    series: list[Series]
    checks: list[tuple[float, str, list[Expect]]] = field(default_factory=list)
    """(eval time in seconds, alert name, the alerts expected to fire)."""


_LABEL = re.compile(r"\{\{ \$labels\.(\w+) \}\}")
_VALUE = re.compile(r'\{\{ \$value \| printf "(%[.0-9]*[fge])" \}\}')


def render_template(template: str, labels: dict[str, str], value: float) -> str:
    """Render the subset of Go templating the alert annotations use, as Prometheus does."""

    def value_text(match: re.Match) -> str:
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return match.group(1) % value

    text = _VALUE.sub(value_text, _LABEL.sub(lambda m: labels.get(m.group(1), ""), template))
    if "{{" in text:
        raise ValueError(f"template: unsupported construct left in {text!r}")
    return text


def _expected(expect: Expect, runbook_base: str) -> dict:
    """promtool's ``exp_alerts`` entry: the rule's own labels and annotations, rendered."""
    rule = expect.rule.to_rule(runbook_base)
    # Prometheus drops labels with empty values (a total loss's component="").
    labels = {k: v for k, v in {**expect.labels, **rule["labels"]}.items() if v != ""}
    annotations = {k: render_template(v, labels, expect.value) for k, v in rule["annotations"].items()}
    return {"exp_labels": labels, "exp_annotations": annotations}


class _Builder:
    """Scenario helpers bound to the thresholds and the test interval."""

    def __init__(self, t: Thresholds, interval: int):
        self.t = t
        self.i = interval
        self.rules = alert_rules(t)

    def rule(self, name: str, **labels: str) -> AlertRule:
        for rule in self.rules:
            if rule.name == name and all(rule.labels.get(k) == v for k, v in labels.items()):
                return rule
        raise KeyError(f"alert {name} with labels {labels}")

    def steps(self, duration: str) -> int:
        return int(duration_seconds(duration) // self.i)

    def hold(self, metric: str, labels: dict, value: float, samples: int) -> Series:
        return Series(metric, labels, [run(value, samples)])

    def jump(self, metric: str, labels: dict, window: str, to: float, after: int = 8) -> tuple[Series, float]:
        """A counter flat at 0 for a full window, then at ``to``; and the eval time
        at which ``increase(...[window])`` is exactly ``to``."""
        n = self.steps(window)
        series = Series(metric, labels, [run(0, n + 1), run(to, after)])
        return series, (n + 1) * self.i

    def after_for(self, duration: str, start: float = 0) -> float:
        return start + duration_seconds(duration) + self.i


def _nonfinite(b: _Builder) -> dict[str, list[Scenario]]:
    a = b.t.alerts
    nan = b.rule("TrainingLossNaN")
    counter, at = b.jump("training_nonfinite_loss_total", _target(), a.event_window, 1)
    loss_ok = b.hold("training_loss", _target(), 2.5, 40)
    loss_nan = Series("training_loss", _target(), [run(2.5, 3), run(math.nan, 5)])
    grad = b.rule("TrainingGradientNonFinite")
    gcounter, gat = b.jump("training_nonfinite_grad_total", _target(), a.event_window, 2)
    info = b.hold("training_nonfinite_grad_first_layer_info", _target(layer="blocks.1.mlp"), 1, 40)
    flat = b.hold("training_nonfinite_grad_total", _target(), 0, 40)
    scale = b.rule("TrainingLossScaleCollapsed")
    scale_at = b.after_for(a.loss_scale_for)
    scale_min = b.t.gradients.loss_scale_min
    loss_scale = lambda v: b.hold("training_grad_scale", _target(), v, int(scale_at // b.i) + 2)  # noqa: E731
    return {
        "TrainingLossNaN": [
            Scenario("a non-finite loss step fires", [counter, loss_ok],
                     [(at, nan.name, [Expect(nan, _target(), 1)])]),
            Scenario("a NaN loss fires at once", [loss_nan, b.hold("training_nonfinite_loss_total", _target(), 0, 8)],
                     [(3 * b.i, nan.name, [Expect(nan, _target(), math.nan)])]),
            Scenario("a finite loss is silent", [loss_ok, b.hold("training_nonfinite_loss_total", _target(), 0, 40)],
                     [(at, nan.name, [])]),
        ],
        "TrainingGradientNonFinite": [
            Scenario("fires naming the first bad layer", [gcounter, info],
                     [(gat, grad.name, [Expect(grad, _target(layer="blocks.1.mlp"), 2)])]),
            Scenario("fires with layer unknown when the exporter named none", [gcounter],
                     [(gat, grad.name, [Expect(grad, _target(layer="unknown"), 2)])]),
            Scenario("finite gradients are silent", [flat, info], [(gat, grad.name, [])]),
        ],
        "TrainingLossScaleCollapsed": [
            Scenario("a collapsed loss scale fires after its for", [loss_scale(scale_min * 0.5)],
                     [(scale_at, scale.name, [Expect(scale, _target(), scale_min * 0.5)]),
                      (scale_at - 2 * b.i, scale.name, [])]),
            Scenario("just above the minimum is silent", [loss_scale(scale_min * 1.01)], [(scale_at, scale.name, [])]),
            Scenario("a healthy loss scale is silent", [loss_scale(65536)], [(scale_at, scale.name, [])]),
        ],
    }


def _gradients(b: _Builder) -> dict[str, list[Scenario]]:
    a, g = b.t.alerts, b.t.gradients
    sustained = b.rule("TrainingGradientExplosion", trigger="sustained")
    events = b.rule("TrainingGradientExplosion", trigger="events")
    at = b.after_for(a.explosion_for)
    samples = int(at // b.i) + 2
    judged = lambda v: b.hold("training_health_status", _target(check="grad_norm", component=""), v, samples)  # noqa: E731
    norm = lambda v: b.hold("training_grad_norm", _target(), v, samples)  # noqa: E731
    burst, burst_at = b.jump("training_grad_explosions_total", _target(), a.event_window, a.explosion_events)
    few, _ = b.jump("training_grad_explosions_total", _target(), a.event_window, a.explosion_events - 1)
    name = sustained.name
    out = {
        name: [
            Scenario("a grad norm judged exploding fires after its for", [judged(2), norm(g.explosion * 1.5)],
                     [(at, name, [Expect(sustained, _target(), g.explosion * 1.5)]),
                      (at - 2 * b.i, name, [])]),
            Scenario("a stable high grad norm at the run's own level is silent",
                     [judged(0), norm(g.explosion * 1.8)], [(at, name, [])]),
            Scenario("a vanishing warning is not an explosion", [judged(1)], [(at, name, [])]),
            Scenario("enough explosion events fire at once", [burst],
                     [(burst_at, name, [Expect(events, _target(), a.explosion_events)])]),
            Scenario("one event fewer is silent", [few], [(burst_at, name, [])]),
        ],
    }
    vanish = b.rule("TrainingGradientVanishing")
    at = b.after_for(a.vanishing_for)
    samples = int(at // b.i) + 2
    out[vanish.name] = [
        Scenario("a vanishing grad norm fires", [b.hold("training_grad_norm", _target(), g.vanishing * 0.5, samples)],
                 [(at, vanish.name, [Expect(vanish, _target(), g.vanishing * 0.5)])]),
        Scenario("just above the threshold is silent",
                 [b.hold("training_grad_norm", _target(), g.vanishing * 1.01, samples)], [(at, vanish.name, [])]),
        Scenario("a healthy grad norm is silent",
                 [b.hold("training_grad_norm", _target(), g.healthy_low, samples)], [(at, vanish.name, [])]),
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
            Scenario("fires for the bad layer only", [layer("blocks.0.attn", bad), layer("head", healthy_layer)],
                     [(at, alert_name, [Expect(rule, _target(layer="blocks.0.attn"), bad)])]),
            Scenario("just inside the threshold is silent", [layer("blocks.0.attn", edge)], [(at, alert_name, [])]),
        ]
    return out


def _judged(b: _Builder, alert: str, check: str, fires: float, silent: tuple[float, ...], for_: str,
            component: str = "") -> list[Scenario]:
    """An alert that reads the exporter's judged status of ``check``: fires at ``fires``, silent at the others."""
    rule = b.rule(alert)
    at = b.after_for(for_)
    samples = int(at // b.i) + 2
    labels = _target(check=check, component=component)
    out = [Scenario(f"{check} judged {fires:g} fires after its for", [b.hold("training_health_status", labels, fires, samples)],
                    [(at, alert, [Expect(rule, labels, fires)]), (at - 2 * b.i, alert, [])])]
    out += [Scenario(f"{check} judged {v:g} is silent", [b.hold("training_health_status", labels, v, samples)],
                     [(at, alert, [])]) for v in silent]
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
    return out


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
            Scenario("judged overfitting fires with the eval loss", [eval_loss, status(1)],
                     [(at, rule.name, [Expect(rule, _target(), 2.4)]), (at - 2 * b.i, rule.name, [])]),
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
            Scenario("a zero LR fires for its param group", [lr("0", 0), lr("1", good_lr), check(0)],
                     [(at, lr_rule.name, [Expect(lr_rule, _target(param_group="0"), 0)])]),
            Scenario("a NaN LR fires", [lr("0", math.nan)],
                     [(at, lr_rule.name, [Expect(lr_rule, _target(param_group="0"), math.nan)])]),
            Scenario("the exporter's LR check fires", [lr("0", good_lr), check(1)],
                     [(at, lr_rule.name, [Expect(lr_rule, _target(param_group="0"), good_lr)])]),
            Scenario("a healthy LR is silent", [lr("0", good_lr), check(0)], [(at, lr_rule.name, [])]),
        ]
    }
    stalled = b.rule("TrainingStalled")
    limit = duration_seconds(a.stalled_after)
    last = b.i  # the last step happened at t = one interval
    samples = int((last + limit) // b.i) + 4
    frozen = b.hold("training_last_step_timestamp_seconds", _target(), last, samples)
    moving = Series("training_last_step_timestamp_seconds", _target(), [ramp(0, b.i, samples)])
    out[stalled.name] = [
        Scenario("no step for too long fires", [frozen],
                 [(last + limit + b.i, stalled.name, [Expect(stalled, _target(), limit + b.i)]),
                  (last + limit, stalled.name, [])]),
        Scenario("a job that keeps stepping is silent", [moving], [(last + limit + b.i, stalled.name, [])]),
    ]
    down = b.rule("TrainingExporterDown")
    up_for = 3
    fires = b.after_for(a.exporter_down_for, start=up_for * b.i)
    samples = int(fires // b.i) + 2
    target = {"job": JOB, "instance": INSTANCE}
    info = Series("training_run_info", {**_target(), "run": "test", "profile": b.t.profile.name},
                  [run(1, up_for), "stale"])
    out[down.name] = [
        Scenario("a lossbeat target that stops answering fires",
                 [Series("up", target, [run(1, up_for), run(0, samples - up_for)]), info],
                 [(fires, down.name, [Expect(down, _target(), 0)]),
                  (fires - 2 * b.i, down.name, [])]),
        Scenario("a target that answers is silent", [b.hold("up", target, 1, samples),
                                                     b.hold("training_run_info", info.labels, 1, samples)],
                 [(fires, down.name, [])]),
        Scenario("other jobs' targets are not ours", [b.hold("up", {"job": "node", "instance": "n1:9100"}, 0, samples)],
                 [(fires, down.name, [])]),
    ]
    return out


# Judgment alerts, the check each reads and the status at which it fires.
_JUDGED = {
    "TrainingGradientExplosion": ("grad_norm", 2),
    "TrainingLossDiverging": ("loss_trend", 2),
    "TrainingLossPlateau": ("loss_trend", 1),
    "TrainingLossVolatile": ("loss_volatility", 2),
    "TrainingLossOutOfRange": ("loss_range", 1),
    "TrainingOverfitting": ("overfitting", 1),
}


_HEALTHY_SAMPLES = 60


def _rle(values: list[float]) -> list[str]:
    """Runs of equal values in promtool notation."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.append(run(values[i], j - i + 1))
        i = j + 1
    return out


def _healthy(b: _Builder) -> dict[str, list[Scenario]]:
    """The synthetic healthy shapes of ``lossbeat.evaluation`` replayed through the exporter's Judge,
    one scrape per judgment: every judgment alert whose check the Judge never raised to its level
    stays silent (the rules agree with the live checks), and the explosion events never page."""
    from lossbeat.analyze.replay import _merged, _Replay  # the live judgment, offline
    from lossbeat.evaluation import healthy_shapes
    from lossbeat.logs import TrainRecord

    out: dict[str, list[Scenario]] = {name: [] for name in _JUDGED}
    for shape in healthy_shapes():
        replay = _Replay(shape.log, b.t)
        samples: list[tuple[dict[str, float], int]] = []
        judge = replay.diagnose

        def record(step, _judge=judge, _replay=replay):
            findings = _judge(step)
            samples.append(({f.check: float(f.status) for f in findings if not f.component},
                            _replay.a.counters["grad_explosions"]))
            return findings

        replay.diagnose = record
        for item in _merged(shape.log.train, shape.log.evals):
            replay.train(item) if isinstance(item, TrainRecord) else replay.eval(item)
        # At most _HEALTHY_SAMPLES scrapes (promtool evaluates every rule at each): the worst status
        # and the last counter value of each stretch of judgments, so nothing raised is lost.
        chunk = -(-len(samples) // _HEALTHY_SAMPLES)
        parts = [samples[i:i + chunk] for i in range(0, len(samples), chunk)]
        samples = [({c: max(p[0].get(c, 0.0) for p in part) for c in part[0][0]}, part[-1][1]) for part in parts]
        end = (len(samples) - 1) * b.i
        events = Series("training_grad_explosions_total", _target(), _rle([float(n) for _, n in samples]))
        name = shape.name.removeprefix("synthetic: ")
        for alert, (check, level) in _JUDGED.items():
            statuses = [s.get(check, 0.0) for s, _ in samples]
            if max(statuses) >= level:
                continue  # the Judge raised it (a warning a reader agrees with): not a silent case
            series = [Series("training_health_status", _target(check=check, component=""), _rle(statuses)),
                      Series("training_grad_norm", _target(), [run(1.0, len(samples))]),
                      Series("training_eval_loss", _target(), [run(1.0, len(samples))])]
            if alert == "TrainingGradientExplosion":
                series.append(events)
            out[alert].append(Scenario(f"healthy shape, silent: {name}", series, [(end, alert, [])]))
    return out


def _interval(t: Thresholds) -> int:
    """The largest step (<= 60s) that divides every duration the tests use."""
    a = t.alerts
    durations = [a.event_window, a.explosion_for, a.vanishing_for, a.layer_for, a.diverging_for,
                 a.plateau_for, a.volatile_for, a.spikes_window, a.out_of_range_for, a.overfitting_for,
                 a.learning_rate_for, a.stalled_after, a.exporter_down_for, a.loss_scale_for]
    seconds = [duration_seconds(d) for d in durations]
    if any(s != int(s) or s < 1 for s in seconds):
        raise ValueError("alerts: rule tests need durations of whole seconds")
    return reduce(math.gcd, [int(s) for s in seconds], 60)


def _duration_text(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def rule_test_documents(thresholds: Thresholds, rule_file: str = "../rules.yml") -> dict[str, dict]:
    """One promtool test document per alert name, keyed by ``<alertname lowercased>.yml``."""
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected Thresholds, got {type(thresholds).__name__}")
    interval = _interval(thresholds)
    b = _Builder(thresholds, interval)
    scenarios: dict[str, list[Scenario]] = {}
    for part in (_nonfinite, _gradients, _trend, _out_of_range, _overfitting, _progress):
        scenarios.update(part(b))
    for name, healthy in _healthy(b).items():
        scenarios[name] = scenarios[name] + healthy
    missing = {r.name for r in b.rules} - set(scenarios)
    if missing:
        raise ValueError(f"rule tests: no scenarios for {sorted(missing)}")
    groups = [RECORDING_GROUP] + list(dict.fromkeys(r.group for r in b.rules))
    runbook = thresholds.alerts.runbook_url
    documents = {}
    for alert_name in dict.fromkeys(r.name for r in b.rules):
        tests = []
        for scenario in scenarios[alert_name]:
            checks = []
            for when, name, expects in scenario.checks:
                alerts = [_expected(e, runbook) for e in expects]
                checks.append({"eval_time": _duration_text(when), "alertname": name, "exp_alerts": alerts})
            tests.append({
                "name": scenario.name,
                "interval": _duration_text(interval),
                "input_series": [s.to_doc() for s in scenario.series],
                "alert_rule_test": checks,
            })
        documents[f"{alert_name.lower()}.yml"] = {
            "rule_files": [rule_file],
            "evaluation_interval": _duration_text(interval),
            "group_eval_order": groups,
            "tests": tests,
        }
    return documents
