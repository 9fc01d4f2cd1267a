"""One thresholds file: a single change moves the diagnosis, the alert and the dashboard together."""

import json

from lossbeat import Monitor, MonitorConfig
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin.dashboards import build_dashboards
from lossbeat.mixin.rules import render_rules


def test_one_threshold_change_reaches_diagnosis_rules_and_dashboards(tmp_path):
    path = tmp_path / "thresholds.yaml"
    path.write_text("gradients:\n  explosion: 25\n")
    default, changed = load_thresholds(), load_thresholds(path)

    # Prometheus: the explosion alert states the new ceiling (its events count what the exporter judged).
    assert "or above 10 and 3x" in render_rules(default)
    rules = render_rules(changed)
    assert "or above 25 and 3x" in rules and "or above 10 and" not in rules

    # Grafana: the explosion line of the grad-norm panel moves.
    dashboards = json.dumps(build_dashboards(changed))
    assert '"value": 25.0' in dashboards and '"value": 25.0' not in json.dumps(build_dashboards(default))

    # In process: against a baseline of 3, a norm of 24 (8x: not a jump) is above the ceiling of
    # 10 and 3x the baseline: an explosion event by default, not with the ceiling at 25.
    for thresholds, expected_explosions in ((default, 2), (changed, 0)):
        monitor = Monitor(MonitorConfig(port=0, thresholds=thresholds), serve=False)
        for step in range(40):
            monitor.observe(step, loss=2.0, grad_norm=24.0 if step in (30, 35) else 3.0)
        assert monitor.state.grad_explosions_total == expected_explosions
        assert monitor.state.health[("grad_norm", "")] == Status.GOOD  # isolated events: no danger
        monitor.close()
