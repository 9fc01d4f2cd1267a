"""The rules split for a sharded set-up (lossbeat.mixin.stages): nothing lost, nothing that a
stage cannot compute from what it holds, and promtool accepts both files."""

import subprocess

import pytest
import yaml
from conftest import require_binary
from test_rules import _names_in

from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin import rules
from lossbeat.mixin.alert_rules import lookback_rules, recording_rules, rule_groups
from lossbeat.mixin.rule_tests import rule_test_documents
from lossbeat.mixin.stages import STAGES, stage_groups, stage_of_record

pytestmark = pytest.mark.servers  # also run against the Prometheus 3 line (make test-prometheus3)


def _rules(groups: list[dict]) -> list[dict]:
    return [r for g in groups for r in g["rules"]]


def _key(rule: dict) -> str:
    return rule.get("alert") or rule["record"]


def test_the_two_stages_hold_every_rule_once():
    t = load_thresholds()
    everything = [_key(r) for r in _rules(rule_groups(t))]
    staged = [_key(r) for stage in STAGES for r in _rules(stage_groups(t, stage))]
    assert sorted(staged) == sorted(everything)


def test_a_shard_reads_only_its_ranks_series_and_its_own_records():
    """The global stage sends nothing back: a shard's rule must never read a global record."""
    t = load_thresholds()
    records = {r.record for r in recording_rules() + lookback_rules()}
    for rule in _rules(stage_groups(t, "shard")):
        for name in _names_in(rule["expr"]) & records:
            assert stage_of_record(name) == "shard", f"{_key(rule)} reads the global {name}"
    # The cross-rank alerts and the job-level records are the global's.
    global_rules = {_key(r) for r in _rules(stage_groups(t, "global"))}
    assert {
        "TrainingRankDown",
        "TrainingLossRankSpread",
        "job:training_loss:median_avg_over_time5m",
        "job_run_id_instance_rank:training_loss:robust_z5m",
    } <= global_rules
    assert "TrainingLossNaN" not in global_rules and "TrainingExporterDown" not in global_rules


def test_the_checked_in_stage_files_are_current_and_promtool_accepts_them(tmp_path):
    promtool = require_binary("promtool")
    t = load_thresholds()
    for stage, path in rules.STAGE_PATHS.items():
        text = (rules.REPO_ROOT / path).read_text(encoding="utf-8")
        assert text == rules.render_stage_rules(t, stage), f"{path} is stale: make generate"
        assert yaml.safe_load(text)["groups"] == stage_groups(t, stage)
        done = subprocess.run(
            [promtool, "check", "rules", str(rules.REPO_ROOT / path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_two_stages_together_judge_the_cross_rank_alerts_as_rules_yml_does(tmp_path):
    """The cross-rank alerts' promtool tests, run on the two stage files in one promtool: the
    global's rules read the shard's partials and per-rank records (in a sharded set-up, one
    remote write later), and every scenario fires and stays silent where rules.yml does: the
    event alerts' gap scenarios too (a counter back after a gap at its value pages nowhere)."""
    promtool = require_binary("promtool")
    t = load_thresholds()
    files = []
    for stage in STAGES:
        path = tmp_path / f"rules-{stage}.yml"
        path.write_text(rules.render_stage_rules(t, stage), encoding="utf-8")
        files.append(str(path))
    order = [g["name"] for stage in STAGES for g in stage_groups(t, stage)]
    documents = rule_test_documents(t)
    names = (
        "trainingrankdown.yml",
        "traininglossrankspread.yml",
        "trainingstraggler.yml",
        "trainingrankgradientmismatch.yml",
        "traininglossnan.yml",
        "traininggradientnonfinite.yml",
        # The event alerts across scrape gaps: the shards remember each counter's value.
        "trainingstepsskipped.yml",
    )
    for name in names:
        document = {**documents[name], "rule_files": files, "group_eval_order": order}
        (tmp_path / name).write_text(yaml.safe_dump(document), encoding="utf-8")
    done = subprocess.run(
        [promtool, "test", "rules", *names], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(names)
