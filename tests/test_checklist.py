"""``lossbeat checklist`` on finished logs: the eight items in the article's order, the
pattern, --json, exit codes, errors in one line, a closed pipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REAL_LOGS

from lossbeat.analyze.checklist import ITEMS, from_findings
from lossbeat.diagnosis import Finding, Status

ROOT = Path(__file__).resolve().parents[1]


def _checklist(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lossbeat", "checklist", *args], capture_output=True, text=True, timeout=120
    )


def test_items_follow_the_article_order():
    assert [name for name, _, _ in ITEMS] == [
        "loss in its usual range",
        "loss still falling",
        "loss volatility normal",
        "grad norm within its band",
        "LR following its schedule",
        "no NaN/Inf",
        "memory use stable",
        "training speed normal",
    ]


def test_items_from_findings_tick_cross_and_unknown():
    findings = [
        Finding("loss_range", Status.GOOD, "mean loss 2.1"),
        Finding("loss_trend", Status.WARNING, "flat"),
        Finding("nonfinite", Status.DANGER, "NaN 3 steps ago"),
        Finding.unknown("memory"),
        Finding("learning_rate", Status.GOOD, "lr 1e-4"),
        Finding("lr_schedule", Status.WARNING, "departs"),
        Finding("loss_range", Status.DANGER, "component", component="aux"),  # components are not items
    ]
    items = {i.number: i for i in from_findings(findings)}
    assert [items[n].ok for n in range(1, 9)] == [True, False, None, None, False, False, None, None]
    assert items[5].value == "departs"  # the worst of the item's checks
    assert items[4].value == "not in this log"


def test_overfitting_log_names_pattern_3():
    # A seq2seq fine-tune (detected from eval_wer): its train loss near 0 is no range fault, so no
    # checklist item fails; the curve's pattern names the overfitting the eval losses show.
    path = REAL_LOGS / "hf-whisper-large-v2-ja-overfit-trainer_state.json"
    result = _checklist(str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "pattern: 3, overfitting" in lines[1]
    assert [line.split(". ", 1)[0].strip()[-1] for line in lines[2:10]] == list("12345678")
    assert lines[-1].strip().endswith("not judged")


def test_json_output_and_pattern(tmp_path):
    path = REAL_LOGS / "hf-whisper-large-v2-ja-overfit-trainer_state.json"
    result = _checklist(str(path), "--json")
    doc = json.loads(result.stdout)
    assert doc["pattern"].startswith("3, overfitting")
    assert [i["number"] for i in doc["items"]] == list(range(1, 9))
    assert {i["number"] for i in doc["items"] if i["ok"] is None} >= {7, 8}  # not in a trainer_state.json


def test_unreadable_input_is_one_line_and_exit_2(tmp_path):
    missing = _checklist(str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nope.json" in missing.stderr
    neither = _checklist()
    assert neither.returncode == 2 and "give a log FILE" in neither.stderr
    no_job = _checklist("--prometheus", "http://127.0.0.1:1")
    assert no_job.returncode == 2 and "--job" in no_job.stderr
    unreachable = _checklist("--prometheus", "http://127.0.0.1:1", "--job", "x")
    assert unreachable.returncode == 2 and "Traceback" not in unreachable.stderr


def test_a_closed_pipe_ends_quietly():
    path = REAL_LOGS / "hf-whisper-large-v2-ja-overfit-trainer_state.json"
    proc = subprocess.Popen(
        f"{sys.executable} -m lossbeat checklist {path} | head -1",
        shell=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=120)
    assert out.startswith("lossbeat checklist:") and "Traceback" not in err and "BrokenPipe" not in err
