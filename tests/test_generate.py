"""`lossbeat generate` and the generators' output folders: the full set for a user's thresholds,
written only where asked, with runbook links that carry the configured base and an existing anchor."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import require_binary
from helpers.promtool_runs import changed_rule_tests

from lossbeat.cli import main
from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin.bundle import bundle_files

REPO = Path(__file__).resolve().parents[1]
RUNBOOKS = REPO / "docs" / "runbooks.md"
BASE = "https://wiki.example.com/ml/runbooks"


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub (and most Markdown renderers) give the headings of ``markdown``."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def _alerts(rules_text: str) -> list[dict]:
    return [r for g in yaml.safe_load(rules_text)["groups"] for r in g["rules"] if "alert" in r]


@pytest.fixture
def thresholds_file(tmp_path) -> Path:
    path = tmp_path / "mine.yaml"
    # stalled_after keeps the rule tests' evaluation interval (test_rules.py's custom set changes that).
    path.write_text("gradients:\n  explosion: 25\nalerts:\n  stalled_after: 3m\n", encoding="utf-8")
    return path


def test_generate_writes_the_full_set_for_custom_thresholds(tmp_path, thresholds_file):
    out = tmp_path / "monitoring"
    assert (
        main(["generate", "--thresholds", str(thresholds_file), "--output-dir", str(out), "--runbook-url-base", BASE])
        == 0
    )
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {
        "rules.yml",
        "alertmanager.yml",
        "runbooks.md",
        "grafana/lossbeat-overview.json",
        "grafana/lossbeat-layers.json",
        "kubernetes/prometheusrule.yaml",
        "kubernetes/grafana-dashboards-configmap.yaml",
        "tests/traininglossnan.yml",
    } <= written
    assert written == set(bundle_files(load_thresholds(thresholds_file)))
    rules_text = (out / "rules.yml").read_text()
    assert "above 25 and" in rules_text and "* 0 + 180" in rules_text  # the explosion ceiling, the stall limit
    assert '"value": 25.0' in (out / "grafana" / "lossbeat-overview.json").read_text()
    assert (out / "runbooks.md").read_text() == RUNBOOKS.read_text()
    assert (out / "alertmanager.yml").read_text() == (REPO / "alerting" / "alertmanager.yml").read_text()
    # Rerunning with --check finds nothing to change.
    assert (
        main(
            [
                "generate",
                "--thresholds",
                str(thresholds_file),
                "--output-dir",
                str(out),
                "--runbook-url-base",
                BASE,
                "--check",
            ]
        )
        == 0
    )


def test_runbook_urls_carry_the_base_and_an_anchor_of_the_runbooks(tmp_path):
    anchors = github_anchors(RUNBOOKS.read_text(encoding="utf-8"))
    out = tmp_path / "out"
    assert main(["rules", "--output-dir", str(out), "--runbook-url-base", BASE]) == 0
    for rules_text in (
        (out / "rules.yml").read_text(),
        yaml.dump(
            {"groups": yaml.safe_load((out / "kubernetes" / "prometheusrule.yaml").read_text())["spec"]["groups"]}
        ),
    ):
        alerts = _alerts(rules_text)
        assert len(alerts) >= 16
        for alert in alerts:
            url = alert["annotations"]["runbook_url"]
            base, _, anchor = url.partition("#")
            assert base == BASE, url
            assert anchor in anchors, f"{alert['alert']}: #{anchor} is no heading of docs/runbooks.md"
    # The checked-in rules: the thresholds' base, same anchors.
    default_base = load_thresholds().alerts.runbook_url
    for alert in _alerts((REPO / "alerting" / "rules.yml").read_text()):
        base, _, anchor = alert["annotations"]["runbook_url"].partition("#")
        assert base == default_base and anchor in anchors


def test_a_bad_runbook_base_is_refused(tmp_path, capsys):
    assert main(["rules", "--output-dir", str(tmp_path), "--runbook-url-base", "wiki/runbooks"]) == 2
    assert "--runbook-url-base" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["rules", "dashboards", "generate"])
def test_generators_write_nothing_without_an_output_folder(tmp_path, thresholds_file, command):
    before = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    result = subprocess.run(
        [sys.executable, "-m", "lossbeat", command, "--thresholds", str(thresholds_file)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2
    assert "--output-dir" in result.stderr and result.stdout == ""
    assert list(tmp_path.iterdir()) == [thresholds_file]
    after = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    assert after == before


def test_rules_check_alone_reads_the_checkout_and_writes_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "lossbeat", "rules", "--check"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.servers
def test_generated_set_passes_promtool_and_amtool(tmp_path, thresholds_file):
    promtool = require_binary("promtool")
    amtool = require_binary("amtool", install="apt-get install prometheus-alertmanager")
    out = tmp_path / "set"
    assert main(["generate", "--thresholds", str(thresholds_file), "--output-dir", str(out)]) == 0
    checked = subprocess.run([promtool, "check", "rules", "rules.yml"], cwd=out, capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    # The files these thresholds changed (the others are the checked-in ones, run by test_rules.py).
    tests = changed_rule_tests(out)
    assert tests == ["tests/healthyshapes.yml", "tests/traininggradientexplosion.yml", "tests/trainingstalled.yml"]
    tested = subprocess.run([promtool, "test", "rules", *tests], cwd=out, capture_output=True, text=True)
    assert tested.returncode == 0 and tested.stdout.count("SUCCESS") == len(tests), tested.stdout + tested.stderr
    config = subprocess.run([amtool, "check-config", "alertmanager.yml"], cwd=out, capture_output=True, text=True)
    assert config.returncode == 0 and "SUCCESS" in config.stdout, config.stdout + config.stderr
