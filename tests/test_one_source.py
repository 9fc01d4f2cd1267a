"""One thresholds file: a single change moves the diagnosis, the alert and the dashboard together."""

import json

from lossbeat import Monitor, MonitorConfig
from lossbeat.dashboards import build_dashboards
from lossbeat.diagnosis import Status
from lossbeat.rules import render_rules
from lossbeat.thresholds import load_thresholds


def test_one_threshold_change_reaches_diagnosis_rules_and_dashboards(tmp_path):
    path = tmp_path / "thresholds.yaml"
    path.write_text("gradients:\n  explosion: 25\n")
    default, changed = load_thresholds(), load_thresholds(path)

    # Prometheus: the explosion alert compares against the new number.
    assert "training_grad_norm > 10" in render_rules(default).replace("\n", " ").replace("  ", " ")
    rules = render_rules(changed).replace("\n", " ").replace("  ", " ")
    assert "training_grad_norm > 25" in rules and "training_grad_norm > 10" not in rules

    # Grafana: the explosion line of the grad-norm panel moves.
    dashboards = json.dumps(build_dashboards(changed))
    assert '"value": 25.0' in dashboards and '"value": 25.0' not in json.dumps(build_dashboards(default))

    # In process: a grad norm of 20 is an explosion by default, not with the new file.
    for thresholds, expected_explosions, status in ((default, 20, Status.DANGER), (changed, 0, Status.GOOD)):
        monitor = Monitor(MonitorConfig(port=0, thresholds=thresholds), serve=False)
        for step in range(20):
            monitor.observe(step, loss=2.0, grad_norm=20.0)
        assert monitor.state.grad_explosions_total == expected_explosions
        assert monitor.state.health[("grad_norm", "")] == status
        monitor.close()
