"""alerting/alertmanager.yml: valid for amtool, routes by severity, inhibits echoes of a NaN
loss for the same rank of the same run only."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import free_ports, require_binary

from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin.alert_rules import JOB, LOSS_DERIVED_ALERTS, TARGET, alert_rules

pytestmark = pytest.mark.servers  # also run against the Prometheus 3 line (make test-prometheus3)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "alerting" / "alertmanager.yml"
# Every loss-derived alert (plateau and overfitting included: their last judgment stays
# exported, stale, while the loss is NaN), and the gradient alert a NaN loss makes non-finite too.
INHIBITED_BY_NAN = set(LOSS_DERIVED_ALERTS) | {"TrainingGradientNonFinite"}
assert {"TrainingLossPlateau", "TrainingOverfitting", "TrainingLossDiverging"} <= INHIBITED_BY_NAN


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [require_binary("amtool", install="apt-get install prometheus-alertmanager"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


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
    assert "5 inhibit rules" in result.stdout and "2 receivers" in result.stdout


def test_every_alert_routes_by_its_severity():
    expected = {"critical": ["page"], "warning": ["ticket"]}
    for rule in alert_rules(load_thresholds()):
        labels = [
            f"alertname={rule.name}",
            "job=train",
            "rank=0",
            f"severity={rule.severity}",
            *(f"{k}={v}" for k, v in rule.labels.items()),
        ]
        assert receivers_for(*labels) == expected[rule.severity], rule.name


def test_amtool_verify_rejects_the_wrong_receiver():
    """The routing test above relies on amtool telling receivers apart."""
    result = amtool(
        "config", "routes", "test", f"--config.file={CONFIG}", "--verify.receivers=ticket", "severity=critical"
    )
    assert result.returncode == 1


def test_grouping_and_timing():
    route = config()["route"]
    assert route["group_by"] == ["job", "run_id", "alertname"]  # one notification per run and alert
    assert route["receiver"] == "ticket"
    critical = next(r for r in route["routes"] if r["matchers"] == ['severity="critical"'])
    assert critical["receiver"] == "page"
    assert critical["group_wait"] == "10s" and critical["repeat_interval"] == "1h"
    assert route["group_wait"] == "30s" and route["group_interval"] == "5m"


def test_receivers_post_to_the_local_webhooks():
    urls = {r["name"]: [w["url"] for w in r["webhook_configs"]] for r in config()["receivers"]}
    assert urls == {"page": ["http://127.0.0.1:5001/page"], "ticket": ["http://127.0.0.1:5001/ticket"]}


def _targets(rule: dict) -> set[str]:
    (target,) = rule["target_matchers"]
    return set(target.removeprefix('alertname=~"').removeprefix('alertname="').removesuffix('"').split("|"))


def test_inhibition_rule_content():
    names = set()
    rules_ = config()["inhibit_rules"]
    by_source = {}
    for rule in rules_:
        (source,) = rule["source_matchers"]
        by_source.setdefault(source, []).append(rule)
    for rule in by_source['alertname="TrainingLossNaN"']:
        names |= _targets(rule)
        if _targets(rule) == {"TrainingGradientNonFinite"}:  # every rank's gradients: across the run
            assert rule["equal"] == list(JOB)
        else:  # the loss echoes: one rank of one run, the labels every alert keeps
            assert rule["equal"] == list(TARGET)
    # The optimizer guard: a stop is the page (the exporter vanishing and the skips are context);
    # repeated skips page, their ticket is context.
    (halted,) = by_source['alertname="TrainingHalted"']
    assert halted["target_matchers"] == [
        'alertname=~"TrainingExporterDown|TrainingStalled|TrainingSkippingRepeatedly|TrainingStepsSkipped"'
    ]
    (repeated,) = by_source['alertname="TrainingSkippingRepeatedly"']
    assert repeated["target_matchers"] == ['alertname="TrainingStepsSkipped"']
    assert halted["equal"] == repeated["equal"] == list(TARGET)
    assert names == INHIBITED_BY_NAN
    (down,) = by_source['alertname="TrainingExporterDown"']
    assert _targets(down) == {"TrainingRankDown", "TrainingStalled"} and down["equal"] == list(JOB)
    assert len(rules_) == 5
    rules = {r.name: r for r in alert_rules(load_thresholds())}
    assert INHIBITED_BY_NAN | {"TrainingLossNaN"} <= set(rules)
    for name in INHIBITED_BY_NAN | {"TrainingLossNaN"}:
        assert set(TARGET) <= set(rules[name].keeps), name


# --- a real Alertmanager applies the inhibition -----------------------------------------


def _api(port: int, path: str, body: object | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/v2/{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
        return json.loads(text) if text else None


@pytest.fixture
def alertmanager(tmp_path):
    binary = require_binary("alertmanager", "prometheus-alertmanager")
    port = free_ports()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={CONFIG}",
            f"--storage.path={tmp_path}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _api(port, "status")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"alertmanager did not start: {process.stderr.read().decode()[-2000:]}"
                    ) from None
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


RUN_A, RUN_B = "gpu-a:8470", "gpu-b:8470"  # two runs under one job label, each rank 0 on its node


def _alert(name: str, rank: str, severity: str, instance: str = RUN_A) -> dict:
    run_id = {RUN_A: "101", RUN_B: "102"}[instance]  # each run its own identity (Slurm job id)
    return _run_alert(name, run_id, instance, rank, severity=severity)


def _run_alert(name: str, run_id: str, instance: str, rank: str, **extra: str) -> dict:
    return {
        "labels": {
            "alertname": name,
            "job": "train",
            "run_id": run_id,
            "instance": instance,
            "rank": rank,
            "severity": "critical",
            **extra,
        }
    }


def _states(port: int, run: str) -> dict:
    """Each alert's status by (alertname, ``run`` label: instance or run_id, rank)."""
    return {
        (a["labels"]["alertname"], a["labels"][run], a["labels"]["rank"]): a["status"] for a in _api(port, "alerts")
    }


def _wait_suppressed(port: int, key: tuple, run: str = "instance") -> dict:
    deadline = time.monotonic() + 10
    while True:
        seen = _states(port, run)
        if seen.get(key, {}).get("state") == "suppressed" or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def test_real_alertmanager_mutes_loss_alerts_of_the_nan_rank_only(alertmanager):
    _api(
        alertmanager,
        "alerts",
        [
            _alert("TrainingLossNaN", "0", "critical"),
            _alert("TrainingLossVolatile", "0", "warning"),
            _alert("TrainingLossDiverging", "0", "critical"),
            _alert("TrainingLossVolatile", "1", "warning"),
            _alert("TrainingGradientVanishing", "0", "warning"),
        ],
    )

    seen = _wait_suppressed(alertmanager, ("TrainingLossVolatile", RUN_A, "0"))
    assert seen[("TrainingLossVolatile", RUN_A, "0")]["state"] == "suppressed"
    assert seen[("TrainingLossVolatile", RUN_A, "0")]["inhibitedBy"]
    assert seen[("TrainingLossDiverging", RUN_A, "0")]["state"] == "suppressed"
    assert seen[("TrainingLossVolatile", RUN_A, "1")]["state"] == "active"  # another rank: not muted
    assert seen[("TrainingGradientVanishing", RUN_A, "0")]["state"] == "active"  # not a loss echo
    assert seen[("TrainingLossNaN", RUN_A, "0")]["state"] == "active"


def test_real_alertmanager_keeps_another_run_under_the_same_job_label(alertmanager):
    """Run A's NaN mutes run A's echoes only; run B, same job and rank, still reaches people."""
    _api(
        alertmanager,
        "alerts",
        [
            _alert("TrainingLossNaN", "0", "critical", RUN_A),
            _alert("TrainingLossVolatile", "0", "warning", RUN_A),
            _alert("TrainingLossVolatile", "0", "warning", RUN_B),
            _alert("TrainingLossDiverging", "0", "critical", RUN_B),
        ],
    )
    seen = _wait_suppressed(alertmanager, ("TrainingLossVolatile", RUN_A, "0"))
    assert seen[("TrainingLossVolatile", RUN_A, "0")]["state"] == "suppressed"
    assert seen[("TrainingLossVolatile", RUN_B, "0")]["state"] == "active"
    assert seen[("TrainingLossDiverging", RUN_B, "0")]["state"] == "active"


def test_real_alertmanager_pages_a_forward_nan_once(alertmanager):
    """A NaN loss makes the gradients NaN too: TrainingGradientNonFinite of that rank is
    held; a non-finite gradient with a finite loss (run B) still pages."""
    _api(
        alertmanager,
        "alerts",
        [
            _alert("TrainingLossNaN", "0", "critical", RUN_A),
            {
                "labels": {
                    **_alert("TrainingGradientNonFinite", "0", "critical", RUN_A)["labels"],
                    "layer": "all layers",
                }
            },
            {"labels": {**_alert("TrainingGradientNonFinite", "0", "critical", RUN_B)["labels"], "layer": "blocks.2"}},
        ],
    )
    seen = _wait_suppressed(alertmanager, ("TrainingGradientNonFinite", RUN_A, "0"))
    assert seen[("TrainingGradientNonFinite", RUN_A, "0")]["state"] == "suppressed"
    assert seen[("TrainingGradientNonFinite", RUN_A, "0")]["inhibitedBy"]
    assert seen[("TrainingGradientNonFinite", RUN_B, "0")]["state"] == "active"
    assert seen[("TrainingLossNaN", RUN_A, "0")]["state"] == "active"


def test_real_alertmanager_pages_a_nan_on_one_ddp_rank_once_for_the_run(alertmanager):
    """Rank 1's NaN loss reaches rank 0's gradients through the all-reduce: rank 0's
    TrainingGradientNonFinite (another rank, another instance) is held; run 102 is not."""
    _api(
        alertmanager,
        "alerts",
        [
            _run_alert("TrainingLossNaN", "101", "gpu-b:8470", "1"),
            _run_alert(
                "TrainingGradientNonFinite",
                "101",
                "gpu-a:8470",
                "0",
                layer="poisoned by the gradient all-reduce from another rank",
            ),
            _run_alert("TrainingGradientNonFinite", "102", "gpu-c:8470", "0", layer="blocks.2"),
        ],
    )
    seen = _wait_suppressed(alertmanager, ("TrainingGradientNonFinite", "101", "0"), run="run_id")
    assert seen[("TrainingGradientNonFinite", "101", "0")]["state"] == "suppressed"
    assert seen[("TrainingLossNaN", "101", "1")]["state"] == "active"
    assert seen[("TrainingGradientNonFinite", "102", "0")]["state"] == "active"


def test_real_alertmanager_pages_one_crash_once(alertmanager):
    """Rank 1 of run 101 died: TrainingExporterDown pages; its run's TrainingRankDown and the
    others' TrainingStalled (waiting for it in a collective) are held. Run 102 still pages."""
    _api(
        alertmanager,
        "alerts",
        [
            _run_alert("TrainingExporterDown", "101", "gpu-b:8470", "1"),
            _run_alert("TrainingRankDown", "101", "gpu-b:8470", "1", world_size="2"),
            _run_alert("TrainingStalled", "101", "gpu-a:8470", "0", phase="train"),
            _run_alert("TrainingStalled", "102", "gpu-c:8470", "0", phase="train"),
        ],
    )
    seen = _wait_suppressed(alertmanager, ("TrainingStalled", "101", "0"), run="run_id")
    assert seen[("TrainingStalled", "101", "0")]["state"] == "suppressed"
    assert seen[("TrainingRankDown", "101", "1")]["state"] == "suppressed"
    assert seen[("TrainingExporterDown", "101", "1")]["state"] == "active"
    assert seen[("TrainingStalled", "102", "0")]["state"] == "active"


def test_real_alertmanager_pages_a_guard_stop_once(alertmanager):
    """A stopped run pages TrainingHalted; its exporter vanishing and its skips are held, for that
    rank of that run only."""
    _api(
        alertmanager,
        "alerts",
        [
            _alert("TrainingHalted", "0", "critical", RUN_A),
            _alert("TrainingExporterDown", "0", "critical", RUN_A),
            _alert("TrainingSkippingRepeatedly", "0", "critical", RUN_A),
            _alert("TrainingExporterDown", "0", "critical", RUN_B),
        ],
    )
    seen = _wait_suppressed(alertmanager, ("TrainingExporterDown", RUN_A, "0"))
    assert seen[("TrainingExporterDown", RUN_A, "0")]["state"] == "suppressed"
    assert seen[("TrainingSkippingRepeatedly", RUN_A, "0")]["state"] == "suppressed"
    assert seen[("TrainingHalted", RUN_A, "0")]["state"] == "active"
    assert seen[("TrainingExporterDown", RUN_B, "0")]["state"] == "active"  # another run still pages
