"""alerting/alertmanager.yml: valid for amtool, routes by severity, inhibits loss echoes of a NaN."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from lossbeat.alert_rules import LOSS_DERIVED_ALERTS, alert_rules
from lossbeat.thresholds import load_thresholds
from conftest import require_binary

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "alerting" / "alertmanager.yml"
# Every loss-derived alert (plateau and overfitting included: issue 9's stale plateau under a NaN loss).
INHIBITED_BY_NAN = set(LOSS_DERIVED_ALERTS)
assert {"TrainingLossPlateau", "TrainingOverfitting", "TrainingLossDiverging"} <= INHIBITED_BY_NAN


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("amtool", install="apt-get install prometheus-alertmanager"), *args], capture_output=True, text=True, timeout=60)


def receivers_for(*labels: str) -> list[str]:
    result = amtool("config", "routes", "test", f"--config.file={CONFIG}", *labels)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()


def config() -> dict:
    return yaml.safe_load(CONFIG.read_text(encoding="utf-8"))


def test_amtool_accepts_the_config():
    result = amtool("check-config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert "1 inhibit rules" in result.stdout and "2 receivers" in result.stdout


def test_every_alert_routes_by_its_severity():
    expected = {"critical": ["page"], "warning": ["ticket"]}
    for rule in alert_rules(load_thresholds()):
        labels = [f"alertname={rule.name}", "job=train", "rank=0", f"severity={rule.severity}",
                  *(f"{k}={v}" for k, v in rule.labels.items())]
        assert receivers_for(*labels) == expected[rule.severity], rule.name


def test_amtool_verify_rejects_the_wrong_receiver():
    """The routing test above relies on amtool telling receivers apart."""
    result = amtool("config", "routes", "test", f"--config.file={CONFIG}", "--verify.receivers=ticket",
                    "severity=critical")
    assert result.returncode == 1


def test_grouping_and_timing():
    route = config()["route"]
    assert route["group_by"] == ["job", "alertname"]
    assert route["receiver"] == "ticket"
    critical = next(r for r in route["routes"] if r["matchers"] == ['severity="critical"'])
    assert critical["receiver"] == "page"
    assert critical["group_wait"] == "10s" and critical["repeat_interval"] == "1h"
    assert route["group_wait"] == "30s" and route["group_interval"] == "5m"


def test_receivers_post_to_the_local_webhooks():
    urls = {r["name"]: [w["url"] for w in r["webhook_configs"]] for r in config()["receivers"]}
    assert urls == {"page": ["http://127.0.0.1:5001/page"], "ticket": ["http://127.0.0.1:5001/ticket"]}


def test_inhibition_rule_content():
    (rule,) = config()["inhibit_rules"]
    assert rule["source_matchers"] == ['alertname="TrainingLossNaN"']
    (target,) = rule["target_matchers"]
    names = target.removeprefix('alertname=~"').removesuffix('"').split("|")
    assert set(names) == INHIBITED_BY_NAN
    assert rule["equal"] == ["job", "rank"]
    alert_names = {r.name for r in alert_rules(load_thresholds())}
    assert INHIBITED_BY_NAN | {"TrainingLossNaN"} <= alert_names


# --- a real Alertmanager applies the inhibition -----------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(port: int, path: str, body: object | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v2/{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
        return json.loads(text) if text else None


@pytest.fixture
def alertmanager(tmp_path):
    binary = require_binary("alertmanager", "prometheus-alertmanager")
    port = _free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={CONFIG}", f"--storage.path={tmp_path}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _api(port, "status")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"alertmanager did not start: {process.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def _alert(name: str, rank: str, severity: str) -> dict:
    return {"labels": {"alertname": name, "job": "train", "rank": rank, "severity": severity}}


def test_real_alertmanager_mutes_loss_alerts_of_the_nan_rank_only(alertmanager):
    _api(alertmanager, "alerts", [
        _alert("TrainingLossNaN", "0", "critical"),
        _alert("TrainingLossVolatile", "0", "warning"),
        _alert("TrainingLossDiverging", "0", "critical"),
        _alert("TrainingLossVolatile", "1", "warning"),
        _alert("TrainingGradientVanishing", "0", "warning"),
    ])

    def states() -> dict:
        return {(a["labels"]["alertname"], a["labels"]["rank"]): a["status"] for a in _api(alertmanager, "alerts")}

    deadline = time.monotonic() + 10
    while True:
        seen = states()
        if seen.get(("TrainingLossVolatile", "0"), {}).get("state") == "suppressed" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen[("TrainingLossVolatile", "0")]["state"] == "suppressed"
    assert seen[("TrainingLossVolatile", "0")]["inhibitedBy"]
    assert seen[("TrainingLossDiverging", "0")]["state"] == "suppressed"
    assert seen[("TrainingLossVolatile", "1")]["state"] == "active"  # another rank: not muted
    assert seen[("TrainingGradientVanishing", "0")]["state"] == "active"  # not a loss echo
    assert seen[("TrainingLossNaN", "0")]["state"] == "active"
