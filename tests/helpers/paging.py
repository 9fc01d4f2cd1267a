"""Does a real monitor's scrape page? Its samples, held for an alert's ``for``, through the checked-in
rules (alerting/rules.yml) in a promtool unit test: the alerts expected fire with their exact labels
and annotations, and no other instance of the alert does."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import yaml
from conftest import require_binary
from prometheus_client.parser import text_string_to_metric_families

from lossbeat import load_thresholds
from lossbeat.mixin.alert_rules import duration_seconds
from lossbeat.mixin.rule_series import Expect, _Builder, _expected

RULES = Path(__file__).resolve().parents[2] / "alerting" / "rules.yml"
TARGET = {"job": "train", "instance": "127.0.0.1:8470"}
INTERVAL = 30


def _value(v: float) -> str:
    return "NaN" if math.isnan(v) else repr(float(v))


def scrape_series(body: str, prefixes: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels with the target's, value) of each sample whose name starts with one of ``prefixes``."""
    out = []
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name.startswith(prefixes):
                out.append((s.name, {**s.labels, **TARGET}, s.value))
    return out


def pages(
    tmp_path: Path, body: str, alert: str, for_: str, prefixes: tuple[str, ...], expected: list[tuple[dict, float]]
):
    """Run the promtool test: ``expected`` (labels of the expression's result, value) fire for ``alert``
    once the samples held ``for_``, and nothing before it. Fails with promtool's output otherwise."""
    promtool = require_binary("promtool")
    samples = int(duration_seconds(for_) // INTERVAL) + 4
    series = [
        {
            "series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}",
            "values": f"{_value(value)}+0x{samples - 1}",
        }
        for name, labels, value in scrape_series(body, prefixes)
    ]
    assert series, "the scrape has none of the series the alert reads"
    rule = _Builder(load_thresholds(), INTERVAL).rule(alert)
    runbook = load_thresholds().alerts.runbook_url
    fired = [_expected(Expect(rule, {**labels, **TARGET}, value), runbook) for labels, value in expected]
    at = int(duration_seconds(for_)) + 2 * INTERVAL
    doc = {
        "rule_files": [str(RULES)],
        "evaluation_interval": f"{INTERVAL}s",
        "tests": [
            {
                "interval": f"{INTERVAL}s",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": f"{at}s", "alertname": alert, "exp_alerts": fired},
                    {"eval_time": f"{INTERVAL}s", "alertname": alert, "exp_alerts": []},
                ],
            }
        ],
    }
    path = tmp_path / f"{alert.lower()}-from-scrape.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
