"""`lossbeat rules`: the generated Prometheus rules, their promtool unit tests, drift and contract."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import require_binary
from helpers.promtool_runs import changed_rule_tests

from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.exposition.metrics import METRICS
from lossbeat.mixin import rules
from lossbeat.mixin.alert_rules import (
    LOOKBACK_GROUP,
    LOOKBACK_INTERVAL,
    alert_rules,
    all_records,
    lookback_rules,
    recording_rules,
)
from lossbeat.mixin.rule_tests import render_template, rule_test_documents
from lossbeat.mixin.stages import series_names

pytestmark = pytest.mark.servers  # also run against the Prometheus 3 line (make test-prometheus3)

REPO = Path(__file__).resolve().parents[1]
RULES_FILE = REPO / "alerting" / "rules.yml"
TESTS_DIR = REPO / "alerting" / "tests"
RUNBOOKS = REPO / "docs" / "runbooks.md"

ALERTS = {  # the contract: name -> severity
    "TrainingLossNaN": "critical",
    "TrainingGradientNonFinite": ("critical", "warning"),  # one non-finite gradient the run went on from is a ticket
    "TrainingLossScaleCollapsed": "critical",
    "TrainingGradientExplosion": ("critical", "warning"),  # an isolated event is a ticket
    "TrainingGradientVanishing": "warning",
    "TrainingLayerGradientExplosion": "warning",
    "TrainingLayerGradientVanishing": "warning",
    "TrainingLossDiverging": "critical",
    "TrainingLossPlateau": "warning",
    "TrainingLossVolatile": "warning",
    "TrainingLossSpikes": ("critical", "warning"),  # spikes judged harmful page, a burst is a ticket
    "TrainingRLSignalCollapsed": "critical",
    "TrainingMoERouterCollapse": "critical",
    "TrainingRLEntropyCollapse": "critical",
    "TrainingRLKLExploded": "critical",
    "TrainingLossOutOfRange": "warning",
    "TrainingOverfitting": "warning",
    "TrainingLearningRateSuspect": "warning",
    "TrainingStalled": "critical",
    "TrainingExporterDown": "critical",
    "TrainingExporterErrors": "warning",
    "TrainingMemoryNearLimit": "critical",
    "TrainingMemoryGrowing": "warning",
    "TrainingThroughputDropped": "warning",
    "TrainingRankDown": "critical",
    "TrainingLossRankSpread": "warning",
    "TrainingStraggler": "warning",
    "TrainingRankGradientMismatch": "critical",
    "TrainingStepsSkipped": "warning",
    "TrainingSkippingRepeatedly": "critical",
    "TrainingGradNormLevelChanged": "warning",
    "TrainingHalted": "critical",
}

# A user's thresholds file changing numbers, counts and (short) durations.
CUSTOM_THRESHOLDS = {
    "loss": {"trend_rising": -0.05, "trend_improving": 0.1, "cv_danger": 0.4},
    "gradients": {"explosion": 25, "layer_explosion": 30, "vanishing": 1e-6, "layer_vanishing": 1e-7},
    "overfitting": {"eval_rise": 0.1},
    "profiles": {"causal-lm": {"loss_warn_high": 6.0, "loss_warn_low": 0.2}},
    # Whole minutes: the rule tests evaluate every minute, as the shipped ones do. A sub-minute
    # duration shrinks every file's evaluation step (the gcd), which multiplies promtool's work by
    # four; that case is checked on the documents (test_sub_minute_durations_shrink_the_step).
    "alerts": {
        "event_window": "3m",
        "explosion_for": "4m",
        "explosion_events": 5,
        "spikes_events": 4,
        "spikes_window": "2m",
        "stalled_after": "4m",
        "exporter_down_for": "3m",
        "overfitting_for": "3m",
        "plateau_for": "5m",
    },
}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [require_binary("promtool"), *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )  # a hang guard: promtool needs ~40 s of CPU for every test file


def checked_in_rules() -> list[dict]:
    return yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]


def all_rules(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"]]


def alerts_by_name(groups: list[dict], name: str) -> list[dict]:
    found = [r for r in all_rules(groups) if r.get("alert") == name]
    assert found, f"no alert {name}"
    return found


@pytest.fixture
def custom_thresholds_file(tmp_path) -> Path:
    path = tmp_path / "thresholds.yaml"
    path.write_text(yaml.safe_dump(CUSTOM_THRESHOLDS), encoding="utf-8")
    return path


def write_layout(root: Path, thresholds) -> None:
    """rules.yml and its unit tests in the repository's layout under ``root``."""
    (root / "tests").mkdir(parents=True)
    (root / "rules.yml").write_text(rules.render_rules(thresholds), encoding="utf-8")
    for name, document in rule_test_documents(thresholds).items():
        (root / "tests" / name).write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")


# --- promtool -------------------------------------------------------------------------


def test_promtool_accepts_the_generated_rules():
    result = promtool("check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    expected = len(all_rules(checked_in_rules()))
    assert f"SUCCESS: {expected} rules found" in result.stdout


def test_promtool_accepts_the_prometheus_rule_groups(tmp_path):
    manifest = yaml.safe_load((REPO / rules.PROMETHEUS_RULE_PATH).read_text(encoding="utf-8"))
    extracted = tmp_path / "spec.yml"
    extracted.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}), encoding="utf-8")
    result = promtool("check", "rules", str(extracted))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass():
    files = sorted(TESTS_DIR.glob("*.yml"))
    result = promtool("test", "rules", *map(str, files))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files) == len(ALERTS) + 1  # and healthyshapes.yml


def test_unit_tests_fail_against_rules_with_other_thresholds(tmp_path):
    """The checked-in unit tests pin the thresholds: rules built from other numbers fail them."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules.yml").write_text(rules.render_rules(load_thresholds(_write(tmp_path, CUSTOM_THRESHOLDS))))
    for name in ("traininggradientexplosion.yml", "traininglossvolatile.yml", "trainingstalled.yml"):
        shutil.copy(TESTS_DIR / name, tmp_path / "tests" / name)
        result = promtool("test", "rules", str(tmp_path / "tests" / name))
        assert result.returncode == 1, f"{name} passed against rules with other thresholds"
        assert "FAILED" in result.stdout + result.stderr


def test_generated_unit_tests_follow_a_threshold_change(tmp_path, custom_thresholds_file):
    thresholds = load_thresholds(custom_thresholds_file)
    write_layout(tmp_path, thresholds)
    # The files these thresholds changed (all of them when the recording rules differ: these
    # thresholds' durations move the minute-cadence groups); the others, and the rules they
    # evaluate, are the checked-in ones that test_promtool_unit_tests_pass runs.
    files = changed_rule_tests(tmp_path)
    assert {"tests/healthyshapes.yml", "tests/trainingstalled.yml"} <= set(files), files
    result = promtool("test", "rules", *files, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files), result.stdout
    explosion = yaml.safe_load((tmp_path / "tests" / "traininggradientexplosion.yml").read_text())
    events = next(t for t in explosion["tests"] if t["name"] == "enough explosion events fire at once")
    assert events["input_series"][0]["values"].endswith("5+0x7")  # alerts.explosion_events: 5
    assert explosion["evaluation_interval"] == "1m"


def test_sub_minute_durations_shrink_the_step(tmp_path):
    """The rule tests evaluate at the largest step that divides every duration: 15 s for
    durations of 45 s and 15 s, and their series are sampled at that step."""
    thresholds = load_thresholds(_write(tmp_path, {"alerts": {"stalled_after": "45s", "exporter_down_for": "15s"}}))
    documents = rule_test_documents(thresholds)
    assert {d["evaluation_interval"] for d in documents.values()} == {"15s"}
    assert {t["interval"] for d in documents.values() for t in d["tests"]} == {"15s"}
    stalled = next(
        t for t in documents["trainingstalled.yml"]["tests"] if t["name"] == "no progress while training fires"
    )
    # The heartbeat age grows by one 15 s step a sample; the alert fires one step past 45 s + 15 s.
    assert stalled["input_series"][0]["values"].startswith("0+0x1 15+15x")
    assert [(c["eval_time"], len(c["exp_alerts"])) for c in stalled["alert_rule_test"]] == [("75s", 1), ("1m", 0)]


def run_rules(*argv: str) -> int:
    """`lossbeat rules ARGV` in this process (the CLI wiring is tested once by subprocess)."""
    parser = argparse.ArgumentParser()
    rules.add_arguments(parser)
    return rules.run(parser.parse_args(argv))


def _write(tmp_path: Path, document: dict) -> Path:
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


# --- drift ----------------------------------------------------------------------------


def test_checked_in_files_match_the_generator():
    thresholds = load_thresholds()
    for path, text in rules.generated_files(thresholds).items():
        checked_in = (REPO / path).read_text(encoding="utf-8")
        assert checked_in == text, f"{path} drifted; run `python -m lossbeat rules`"
    generated_tests = {f"alerting/tests/{n}" for n in rule_test_documents(thresholds)}
    on_disk = {p.relative_to(REPO).as_posix() for p in TESTS_DIR.glob("*.yml")}
    assert on_disk == generated_tests


def test_alert_table_of_the_docs_matches_the_generator():
    doc = (REPO / rules.REFERENCE_DOC).read_text(encoding="utf-8")
    assert doc.count(rules.TABLE_START) == 1 and doc.count(rules.TABLE_END) == 1
    region = doc.split(rules.TABLE_START, 1)[1].split(rules.TABLE_END, 1)[0]
    assert region == "\n" + rules.render_alert_table(load_thresholds()), (
        f"{rules.REFERENCE_DOC} drifted: run `make generate`"
    )


def test_check_passes_on_the_checkout():
    result = subprocess.run(
        [sys.executable, "-m", "lossbeat", "rules", "--check"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_check_reports_drift_with_a_diff(tmp_path, capsys):
    target = tmp_path / "rules.yml"
    assert run_rules("--output-dir", str(tmp_path)) == 0
    assert target.read_text() == RULES_FILE.read_text()
    target.write_text(target.read_text().replace("training_grad_norm < 0.0001", "training_grad_norm < 0.0002"))
    capsys.readouterr()
    assert run_rules("--output-dir", str(tmp_path), "--check") == 1
    out = capsys.readouterr().out
    assert "-          training_grad_norm < 0.0002" in out
    assert "+          training_grad_norm < 0.0001" in out
    assert target.read_text().count("< 0.0002") == 1  # --check writes nothing


def test_generate_in_a_fresh_tree_and_remove_stale_test_files(tmp_path, monkeypatch, capsys):
    (tmp_path / "README.md").write_text("# x\n")  # what marks a checkout
    (tmp_path / rules.REFERENCE_DOC).parent.mkdir()
    (tmp_path / rules.REFERENCE_DOC).write_text(
        f"# x\n\n{rules.TABLE_START}\nPLACEHOLDER-ROW\n{rules.TABLE_END}\n\nkept\n"
    )
    monkeypatch.setattr(rules, "REPO_ROOT", tmp_path)
    assert run_rules("--checkout") == 0
    for path in rules.generated_files(load_thresholds()):
        assert (tmp_path / path).read_text() == (REPO / path).read_text(), path
    doc = (tmp_path / rules.REFERENCE_DOC).read_text()
    assert "PLACEHOLDER-ROW" not in doc and doc.endswith(f"{rules.TABLE_END}\n\nkept\n")
    assert (tmp_path / "README.md").read_text() == "# x\n"
    stale = tmp_path / rules.TESTS_DIR / "traininggone.yml"
    stale.write_text(rules.HEADER + "tests: []\n")
    own = tmp_path / rules.TESTS_DIR / "handwritten.yml"
    own.write_text("tests: []\n")
    capsys.readouterr()
    assert run_rules("--check") == 1
    assert "traininggone.yml: generated file no longer generated from the thresholds" in capsys.readouterr().out
    assert run_rules("--checkout") == 0
    assert not stale.exists() and own.exists()
    assert run_rules("--check") == 0


# --- thresholds drive the rules -------------------------------------------------------


def test_a_threshold_change_changes_the_alert_expression(tmp_path):
    override = _write(
        tmp_path, {"gradients": {"jump_ratio": 7}, "alerts": {"explosion_for": "7m", "explosion_events": 4}}
    )
    assert run_rules("--thresholds", str(override), "--output-dir", str(tmp_path / "out")) == 0
    groups = yaml.safe_load((tmp_path / "out" / "rules.yml").read_text())["groups"]
    sustained, events, isolated = alerts_by_name(groups, "TrainingGradientExplosion")
    # The sustained trigger reads the exporter's judgment (same thresholds file): no raw constant.
    assert sustained["expr"].split() == [
        "training_grad_norm",
        "and",
        "on(job,",
        "run_id,",
        "instance,",
        "rank)",
        'training_health_status{check="grad_norm",component=""}',
        "==",
        "2",
    ]
    assert sustained["for"] == "7m"
    assert "a jump to 7x its baseline" in sustained["annotations"]["description"]
    # The events trigger reads the counter's increase, recorded once first in its group.
    increase = "job_run_id_instance_rank:training_grad_explosions:increase5m"
    assert events["expr"].strip() == f"{increase} >= 4"
    recorded = {r.get("record"): r["expr"] for g in groups for r in g["rules"]}
    assert recorded[increase] == "increase(training_grad_explosions_total[5m])"
    assert "for" not in events  # the event count fires at once
    assert ">= 4" in isolated["expr"] and isolated["labels"]["severity"] == "warning"  # fewer: a ticket
    default_events = alerts_by_name(checked_in_rules(), "TrainingGradientExplosion")[1]
    assert default_events["expr"].strip() == f"{increase} >= 3"
    # The folder gets the rules (and their two stages), their unit tests (which pass) and the
    # PrometheusRule; nothing else.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "kubernetes",
        "rules-global.yml",
        "rules-shard.yml",
        "rules.yml",
        "tests",
    ]
    assert promtool("check", "rules", str(tmp_path / "out" / "rules.yml")).returncode == 0
    # The file these thresholds changed (the others are the checked-in ones, run above).
    tests = changed_rule_tests(tmp_path / "out")
    assert tests == ["tests/healthyshapes.yml", "tests/traininggradientexplosion.yml"]  # the shapes: explosion silent
    tested = promtool("test", "rules", *tests, cwd=tmp_path / "out")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_judgment_alerts_read_the_exporters_judged_status():
    """Rules and live checks agree by construction: the judgment alerts key off training_health_status."""
    groups = rules.build_rule_groups(load_thresholds())
    judged = {
        "TrainingLossOutOfRange": ("loss_range", ">= 1"),
        "TrainingLossDiverging": ("loss_trend", "== 2"),
        "TrainingLossPlateau": ("loss_trend", "== 1"),
        "TrainingLossVolatile": ("loss_volatility", "== 2"),
        "TrainingOverfitting": ("overfitting", ">= 1"),
    }
    for name, (check, condition) in judged.items():
        (rule,) = alerts_by_name(groups, name)
        assert f'training_health_status{{check="{check}"' in rule["expr"] and condition in rule["expr"], name
        assert "training_loss " not in rule["expr"] and "min_over_time" not in rule["expr"]
    # One range rule for every profile (the exporter knows its own profile); its condition names the bounds.
    (ranged,) = alerts_by_name(groups, "TrainingLossOutOfRange")
    table = rules.render_alert_table(load_thresholds())
    assert "causal-lm [0.1, 5]" in table and "preference [-, 0.8]" in table
    assert "profile" not in ranged["labels"]


def test_bad_thresholds_file_exits_2_naming_the_key(tmp_path, capsys):
    override = _write(tmp_path, {"alerts": {"explosion_for": "soon"}})
    assert run_rules("--thresholds", str(override), "--output-dir", str(tmp_path)) == 2
    assert "alerts.explosion_for" in capsys.readouterr().err
    assert not (tmp_path / "rules.yml").exists()


def test_api_rejects_a_non_thresholds_argument():
    with pytest.raises(TypeError, match="thresholds"):
        rules.build_rule_groups({"gradients": {}})


def test_rendering_is_deterministic():
    thresholds = load_thresholds()
    assert rules.render_rules(thresholds) == rules.render_rules(load_thresholds())
    assert [g["name"] for g in yaml.safe_load(rules.render_rules(thresholds))["groups"]] == [
        "lossbeat.recording",
        "lossbeat.lookback",
        "lossbeat.summary",
        "lossbeat.summary.checks",
        "lossbeat.nonfinite",
        "lossbeat.gradients",
        "lossbeat.gradients.slow",
        "lossbeat.loss",
        "lossbeat.loss.slow",
        "lossbeat.optimizer",
        "lossbeat.liveness",
        "lossbeat.liveness.slow",
        "lossbeat.resources",
        "lossbeat.resources.slow",
        "lossbeat.cross_rank",
        "lossbeat.guard",
    ]


# --- the alert contract ---------------------------------------------------------------


def test_alert_names_and_severities_are_the_contract():
    found: dict[str, set] = {}
    for r in all_rules(checked_in_rules()):
        if "alert" in r:
            found.setdefault(r["alert"], set()).add(r["labels"]["severity"])
    assert found == {name: set(s) if isinstance(s, tuple) else {s} for name, s in ALERTS.items()}


def test_every_alert_has_the_required_fields_and_a_runbook_section():
    headings = set(re.findall(r"^## (\w+)\s*$", RUNBOOKS.read_text(encoding="utf-8"), re.M))
    base = load_thresholds().alerts.runbook_url
    for rule in all_rules(checked_in_rules()):
        if "alert" not in rule:
            continue
        name, annotations = rule["alert"], rule["annotations"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert annotations["summary"].strip(), name
        for needle in ("{{ $value", "{{ $labels.job }}", "{{ $labels.rank }}"):
            assert needle in annotations["description"], f"{name}: description lacks {needle}"
        assert annotations["runbook_url"] == f"{base}#{name.lower()}"
        assert name in headings, f"docs/runbooks.md has no '## {name}' section"


def test_runbooks_cover_only_real_alerts_and_the_dashboards():
    text = RUNBOOKS.read_text(encoding="utf-8")
    headings = re.findall(r"^## (\w+)\s*$", text, re.M)
    assert sorted(headings) == sorted(ALERTS)
    for name in ALERTS:
        section = text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**Meaning**", "**Confirm**", "**Fix**"):
            assert part in section, f"{name}: runbook lacks {part}"
        assert "```promql" in section, f"{name}: runbook lacks a query to run"
        assert "lossbeat / Overview" in section or "lossbeat / Layers" in section, name


_names_in = series_names  # the generator's own reading of an expression: one parser for both


def test_expressions_use_only_contract_metrics_and_recording_rules():
    exported = {spec.name + ("_info" if spec.kind == "info" else "") for spec in METRICS.values()}
    records = {r.record for r in all_records(load_thresholds())}
    for rule in all_rules(checked_in_rules()):
        for name in _names_in(rule["expr"]):
            assert name in exported or name in records or name == "up", (
                f"{rule.get('alert') or rule.get('record')}: unknown series {name}"
            )


def test_metric_name_scan_finds_the_series():
    """Guard for the test above: the scan must see series in every position they appear."""
    records = {r.get("record"): r["expr"] for r in all_rules(checked_in_rules())}
    expr = alerts_by_name(checked_in_rules(), "TrainingGradientNonFinite")[0]["expr"]
    first_layer = "job_run_id_instance_rank_layer:training_nonfinite_grad_first_layer:info5m"
    assert {"job_run_id_instance_rank:training_nonfinite_grad:nonzero_events5m", first_layer} <= _names_in(expr)
    assert {"training_nonfinite_grad_first_layer_info"} <= _names_in(records[first_layer])
    assert {"training_nonfinite_grad_total"} <= _names_in(
        records["job_run_id_instance_rank:training_nonfinite_grad:growth5m"]
    )
    expr = alerts_by_name(checked_in_rules(), "TrainingOverfitting")[0]["expr"]
    assert {"training_eval_loss", "training_health_status"} <= _names_in(expr)


def test_the_long_lookbacks_are_state_the_lookback_group_carries():
    """TrainingExporterDown (6h) and TrainingRankDown (1h) read recorded state, O(1) per rank:
    no rule reads hours of a rank's samples; the state rules each keep their own previous sample."""
    groups = {g["name"]: g for g in yaml.safe_load(rules.render_rules(load_thresholds()))["groups"]}
    assert groups[LOOKBACK_GROUP]["interval"] == LOOKBACK_INTERVAL
    for group in groups.values():
        for rule in group["rules"]:
            ranges = re.findall(r"\[(\d+)([smh])(?::[^\]]*)?\]", rule["expr"])
            longest = max((int(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in ranges), default=0)
            name = rule.get("alert") or rule.get("record")
            if name in ("TrainingExporterDown", "TrainingRankDown") or group["name"] == LOOKBACK_GROUP:
                assert longest <= 120, name
    for rule in lookback_rules():
        if rule.record.endswith("_timestamp_seconds"):
            assert f"or\n{rule.record} > time() - " in rule.expr, rule.record  # kept until too old
        else:
            assert f"or\n({rule.record} and on(" in rule.expr, rule.record  # kept while the rank is


def test_recording_rules_follow_level_metric_operations():
    for rule in all_records(load_thresholds()):
        level, metric, operations = rule.record.split(":")
        assert metric in METRICS or metric + "_total" in METRICS, rule.record
        assert operations and re.fullmatch(r"[a-z0-9_]+", operations), rule.record
        # The level names the labels kept; the job-level rules keep the run identity beside the
        # job without spelling it (job:..., as before run_id existed: dashboards query them).
        assert level in ("_".join(rule.keeps), "_".join(k for k in rule.keeps if k != "run_id")), rule.record
        if rule.per_series:  # a per-rank alert reads it: every label of the rank's series is kept
            assert rule.keeps == ("job", "run_id", "instance", "rank") and " by (" not in rule.expr, rule.record
        else:
            assert f"by ({', '.join(rule.keeps)})" in rule.expr, rule.record


def test_every_per_rank_aggregation_and_join_keeps_the_run_identity():
    """`instance` tells apart concurrent runs that share a job label."""
    for rule in recording_rules():
        if "rank" in rule.keeps:
            assert "instance" in rule.keeps, rule.record
    for rule in alert_rules(load_thresholds()):
        assert "rank" not in rule.keeps or "instance" in rule.keeps, rule.name
        for labels in re.findall(r"\b(?:on|by)\s*\(([^)]*)\)", rule.expr):
            names = {n.strip() for n in labels.split(",")}
            # Without instance, the run identity tells concurrent runs apart (a requeued rank is
            # the same rank of the same run on another instance).
            assert "rank" not in names or "instance" in names or "run_id" in names, f"{rule.name}: joins on ({labels})"


def test_prometheus_rule_carries_the_same_groups():
    manifest = yaml.safe_load((REPO / rules.PROMETHEUS_RULE_PATH).read_text(encoding="utf-8"))
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["labels"]["release"] == "prometheus"
    assert manifest["spec"]["groups"] == checked_in_rules()


def test_alert_table_has_a_row_per_alert_with_numbers_and_runbook_links():
    table = rules.render_alert_table(load_thresholds())
    for name, severity in ALERTS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"| {', '.join(severity) if isinstance(severity, tuple) else severity} |" in row
        assert f"(runbooks.md#{name.lower()})" in row  # docs/metrics.md -> docs/runbooks.md
    explosion = next(line for line in table.splitlines() if "`TrainingGradientExplosion`" in line)
    assert "recent median > 10x the rolling baseline" in explosion and ">= 3 explosion events" in explosion


def test_annotation_renderer_matches_go_formatting():
    labels = {"job": "train", "rank": "3"}
    template = 'rank {{ $labels.rank }} of {{ $labels.job }}: {{ $value | printf "%.4g" }}'
    assert render_template(template, labels, 15.0) == "rank 3 of train: 15"
    assert render_template(template, labels, float("nan")) == "rank 3 of train: NaN"
    assert render_template(template, labels, 5e-05) == "rank 3 of train: 5e-05"
    with pytest.raises(ValueError, match="unsupported"):
        render_template("{{ $value | humanize }}", labels, 1.0)


def test_every_alert_rule_has_firing_and_silent_unit_tests():
    documents = rule_test_documents(load_thresholds())
    for rule in alert_rules(load_thresholds()):
        doc = documents[f"{rule.name.lower()}.yml"]
        checks = [c for t in doc["tests"] for c in t["alert_rule_test"]]
        fired = [a["exp_labels"] for c in checks for a in c["exp_alerts"]]
        assert any(all(a.get(k) == v for k, v in rule.labels.items()) for a in fired), (
            f"no test where {rule.name} {rule.labels} fires"
        )
        assert any(not c["exp_alerts"] for c in checks), f"no silent test for {rule.name}"


def test_the_alerts_read_their_groups_event_records_fresh():
    """A page reads the event counters' records of the same evaluation (its group's, earlier in
    it), never a record another group wrote up to an interval ago: a NaN pages one evaluation
    after the scrape that shows it."""
    t = load_thresholds()
    records = {r.record: r for r in all_records(t)}
    groups = rules.build_rule_groups(t)
    read_fresh = 0
    for group in groups:
        seen = set()
        for rule in group["rules"]:
            if "record" in rule:
                seen.add(rule["record"])
                continue
            for name in _names_in(rule["expr"]) & set(records):
                if records[name].per_series or name.endswith(":info5m"):
                    assert name in seen, f"{rule['alert']} reads {name} before its group records it"
                    read_fresh += 1
    assert read_fresh >= 8
    nan = alerts_by_name(groups, "TrainingLossNaN")[0]["expr"]
    assert "increase(" not in nan and "job_run_id_instance_rank:training_nonfinite_loss:nonzero_events5m" in nan


def test_only_tickets_are_judged_at_the_slow_intervals(tmp_path):
    """The groups with their own (longer) interval hold no page, and each ticket there waits at
    least five of that interval before it fires."""
    from lossbeat.mixin.alert_rules import duration_seconds, group_intervals

    t = load_thresholds()
    intervals = group_intervals(t)
    assert intervals["lossbeat.resources.slow"] == intervals["lossbeat.loss.slow"] == "1m"
    tickets = [r for r in alert_rules(t) if r.group in intervals]
    assert {r.name for r in tickets} >= {"TrainingMemoryGrowing", "TrainingThroughputDropped", "TrainingLossPlateau"}
    for rule in tickets:
        assert rule.severity == "warning" and rule.group.endswith(".slow"), rule.name
        wait = duration_seconds(rule.for_ or t.alerts.event_window)
        assert wait >= 5 * duration_seconds(intervals[rule.group]), rule.name
    short = load_thresholds(_write(tmp_path, {"memory": {"growing_for": "3s"}}))
    assert group_intervals(short)["lossbeat.resources.slow"] == "1s"  # tests with windows of seconds: every second
