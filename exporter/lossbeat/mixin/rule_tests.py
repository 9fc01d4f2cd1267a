"""``promtool test rules`` unit tests for every alert, computed from the thresholds.

The scenarios live in :mod:`lossbeat.mixin.rule_scenarios`, written in the small language of
:mod:`lossbeat.mixin.rule_series`; this module assembles them into one test document per alert.
Test values derive from the thresholds, so a threshold change regenerates tests that still hold.
"""

from __future__ import annotations

import math
from functools import reduce

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.mixin.alert_rules import RECORDING_GROUP, duration_seconds
from lossbeat.mixin.rule_scenarios import JUDGED, SCENARIO_FAMILIES
from lossbeat.mixin.rule_series import Scenario, Series, _Builder, _expected, _target, render_template, run

__all__ = ["rule_test_documents", "render_template"]

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


def _replayed_shapes(t: Thresholds) -> list[tuple[str, list[tuple[dict[str, float], int]]]]:
    """Each synthetic healthy shape of ``lossbeat.analyze.evaluation`` replayed through the exporter's
    Judge: (its name, one (statuses, explosion events) sample per judgment). Some 30,000 judged
    steps, the bulk of generating the rule tests, and the same for the same thresholds: kept for
    the last few thresholds (the drift check, the bundle and the rules command each build them)."""
    key = repr(t)  # frozen dataclasses: the repr is every field, nested ones included
    if key in _REPLAYED:
        return _REPLAYED[key]
    from lossbeat.analyze.evaluation import healthy_shapes
    from lossbeat.analyze.replay import _merged, _Replay  # the live judgment, offline
    from lossbeat.logs import TrainRecord

    shapes = []
    for shape in healthy_shapes():
        replay = _Replay(shape.log, t)
        samples: list[tuple[dict[str, float], int]] = []
        judge = replay.diagnose

        def record(step, _judge=judge, _replay=replay, _samples=samples):
            findings = _judge(step)
            _samples.append(
                ({f.check: float(f.status) for f in findings if not f.component}, _replay.a.counters["grad_explosions"])
            )
            return findings

        replay.diagnose = record  # type: ignore[method-assign]  # this replay's only: recorded as it judges
        for item in _merged(shape.log.train, shape.log.evals):
            replay.train(item) if isinstance(item, TrainRecord) else replay.eval(item)
        shapes.append((shape.name, samples))
    while len(_REPLAYED) >= _REPLAYED_KEPT:
        _REPLAYED.pop(next(iter(_REPLAYED)))
    _REPLAYED[key] = shapes
    return shapes


_REPLAYED: dict[str, list] = {}
_REPLAYED_KEPT = 4


HEALTHY_SHAPES_FILE = "healthyshapes.yml"


def _healthy(b: _Builder) -> list[Scenario]:
    """The synthetic healthy shapes, one scrape per judgment, one test each: every judgment alert
    whose check the Judge never raised to its level stays silent (the rules agree with the live
    checks), and the explosion events never page. One test holds every check's series (no alert
    reads another), so promtool evaluates the rules once per shape, not once per shape and alert."""
    out = []
    for shape_name, samples in _replayed_shapes(b.t):
        # At most _HEALTHY_SAMPLES scrapes (promtool evaluates every rule at each): the worst status
        # and the last counter value of each stretch of judgments, so nothing raised is lost.
        chunk = -(-len(samples) // _HEALTHY_SAMPLES)
        parts = [samples[i : i + chunk] for i in range(0, len(samples), chunk)]
        samples = [({c: max(p[0].get(c, 0.0) for p in part) for c in part[0][0]}, part[-1][1]) for part in parts]
        end = (len(samples) - 1) * b.i
        series = [
            Series("training_grad_explosions_total", _target(), _rle([float(n) for _, n in samples])),
            Series("training_grad_norm", _target(), [run(1.0, len(samples))]),
            Series("training_eval_loss", _target(), [run(1.0, len(samples))]),
        ]
        silent = []
        for check in dict.fromkeys(check for check, _ in JUDGED.values()):
            statuses = [s.get(check, 0.0) for s, _ in samples]
            series.append(Series("training_health_status", _target(check=check, component=""), _rle(statuses)))
            # An alert whose check the Judge raised (a warning a reader agrees with) is no silent case.
            silent += [alert for alert, (c, level) in JUDGED.items() if c == check and max(statuses) < level]
        name = shape_name.removeprefix("synthetic: ")
        out.append(Scenario(f"healthy shape, silent: {name}", series, [(end, alert, []) for alert in silent]))
    return out


def _interval(t: Thresholds) -> int:
    """The largest step (<= 60s) that divides every duration the tests use."""
    a = t.alerts
    durations = [
        a.event_window,
        a.explosion_for,
        a.vanishing_for,
        a.layer_for,
        a.diverging_for,
        a.plateau_for,
        a.volatile_for,
        a.spikes_window,
        a.out_of_range_for,
        a.overfitting_for,
        a.learning_rate_for,
        a.stalled_after,
        a.stalled_phase_after,
        a.exporter_down_for,
        a.loss_scale_for,
        t.memory.near_limit_for,
        t.memory.growing_for,
        t.memory.window,
        t.throughput.baseline,
        t.throughput.for_,
        t.throughput.rate_window,
        a.rank_down_for,
        a.loss_spread_for,
        a.straggler_for,
        a.grad_mismatch_for,
    ]
    seconds = [duration_seconds(d) for d in durations]
    if any(s != int(s) or s < 1 for s in seconds):
        raise ValueError("alerts: rule tests need durations of whole seconds")
    return reduce(math.gcd, [int(s) for s in seconds], 60)


def _duration_text(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def rule_test_documents(thresholds: Thresholds, rule_file: str = "../rules.yml") -> dict[str, dict]:
    """One promtool test document per alert name, keyed by ``<alertname lowercased>.yml``, and
    the healthy shapes' (``healthyshapes.yml``: every judgment alert silent on each)."""
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds: expected Thresholds, got {type(thresholds).__name__}")
    interval = _interval(thresholds)
    b = _Builder(thresholds, interval)
    scenarios: dict[str, list[Scenario]] = {}
    for part in SCENARIO_FAMILIES:
        for name, more in part(b).items():
            scenarios.setdefault(name, []).extend(more)
    missing = {r.name for r in b.rules} - set(scenarios)
    if missing:
        raise ValueError(f"rule tests: no scenarios for {sorted(missing)}")
    groups = [RECORDING_GROUP] + list(dict.fromkeys(r.group for r in b.rules))
    runbook = thresholds.alerts.runbook_url
    documents = {}
    files = {f"{name.lower()}.yml": scenarios[name] for name in dict.fromkeys(r.name for r in b.rules)}
    files[HEALTHY_SHAPES_FILE] = _healthy(b)
    for file_name, file_scenarios in files.items():
        tests = []
        for scenario in file_scenarios:
            checks = []
            for when, name, expects in scenario.checks:
                alerts = [_expected(e, runbook) for e in expects]
                checks.append({"eval_time": _duration_text(when), "alertname": name, "exp_alerts": alerts})
            tests.append(
                {
                    "name": scenario.name,
                    "interval": _duration_text(interval),
                    "input_series": [s.to_doc() for s in scenario.series],
                    "alert_rule_test": checks,
                }
            )
        documents[file_name] = {
            "rule_files": [rule_file],
            "evaluation_interval": _duration_text(interval),
            "group_eval_order": groups,
            "tests": tests,
        }
    return documents
