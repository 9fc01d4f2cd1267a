"""A process restart resets every counter to 0, and a resume from a checkpoint sends
``training_step`` back: the shipped rules (alerting/rules.yml) must read both right.
promtool unit tests over series that restart mid-way."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import require_binary

pytestmark = pytest.mark.servers  # also run against the Prometheus 3 line (make test-prometheus3)

RULES = Path(__file__).resolve().parent.parent / "alerting" / "rules.yml"
SERIES = 'job="train",instance="127.0.0.1:8470",rank="0"'


def within(expr: str, low: float, high: float) -> str:
    return f"({expr} > bool {low}) * ({expr} < bool {high})"


TESTS = [
    {
        "name": "a restart resets the non-finite counter: no alert, no phantom increase",
        "interval": "1m",
        "input_series": [
            {"series": f"training_nonfinite_loss_total{{{SERIES}}}", "values": "3+0x9 0+0x10"},
            {"series": f"training_loss{{{SERIES}}}", "values": "2.5+0x20"},
        ],
        "alert_rule_test": [
            {"eval_time": t, "alertname": "TrainingLossNaN", "exp_alerts": []} for t in ("9m", "11m", "14m", "18m")
        ],
        "promql_expr_test": [
            {
                "expr": "job_run_id_instance_rank:training_nonfinite_loss:increase5m",
                "eval_time": t,
                "exp_samples": [
                    {
                        "labels": "job_run_id_instance_rank:training_nonfinite_loss:increase5m"
                        '{instance="127.0.0.1:8470",job="train",rank="0"}',
                        "value": 0,
                    }
                ],
            }
            for t in ("11m", "14m")
        ],
    },
    {
        "name": "a non-finite loss right after a restart is still seen",
        "interval": "1m",
        "input_series": [
            {"series": f"training_nonfinite_loss_total{{{SERIES}}}", "values": "3+0x9 0 0 1+0x8"},
            {"series": f"training_loss{{{SERIES}}}", "values": "2.5+0x20"},
        ],
        "promql_expr_test": [
            {
                "expr": "job_run_id_instance_rank:training_nonfinite_loss:increase5m > bool 0.5",
                "eval_time": "14m",
                "exp_samples": [{"labels": '{instance="127.0.0.1:8470",job="train",rank="0"}', "value": 1}],
            }
        ],
    },
    {
        "name": "the step rate across a restart: never negative, never a spike, right once past it",
        "interval": "1m",
        "input_series": [
            # 1 step/s; the process restarts at 11m and counts from 0 again.
            {"series": f"training_steps_total{{{SERIES}}}", "values": "0+60x10 0+60x10"},
        ],
        "promql_expr_test": [
            *(
                {
                    "expr": within("job:training_steps:rate5m", 0.9, 1.1),
                    "eval_time": t,
                    "exp_samples": [{"labels": '{job="train"}', "value": 1}],
                }
                for t in ("9m", "17m", "20m")
            ),
            # The window holding the restart reads low (the minute with the restart counts 0), not wrong:
            *(
                {
                    "expr": within("job:training_steps:rate5m", 0.5, 1.1),
                    "eval_time": t,
                    "exp_samples": [{"labels": '{job="train"}', "value": 1}],
                }
                for t in ("12m", "14m")
            ),
        ],
    },
    {
        "name": "a resume from a checkpoint (the step goes back) is progress, not a stall",
        "interval": "1m",
        "input_series": [
            {"series": f"training_step{{{SERIES}}}", "values": "0+60x10 300+60x10"},
            {"series": f"training_steps_total{{{SERIES}}}", "values": "0+60x20"},
            {"series": f"training_last_step_timestamp_seconds{{{SERIES}}}", "values": "0+60x20"},
            {"series": f"training_loss{{{SERIES}}}", "values": "2.5+0x20"},
            {"series": f"up{{{SERIES}}}", "values": "1+0x20"},
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": name, "exp_alerts": []}
            for name in ("TrainingStalled", "TrainingExporterDown", "TrainingLossNaN")
        ],
    },
]


def test_counters_reset_and_steps_going_back(tmp_path):
    promtool = require_binary("promtool")
    groups = [g["name"] for g in yaml.safe_load(RULES.read_text())["groups"]]
    path = tmp_path / "restart.yml"
    path.write_text(
        yaml.safe_dump(
            {"rule_files": [str(RULES)], "evaluation_interval": "1m", "group_eval_order": groups, "tests": TESTS},
            sort_keys=False,
        )
    )
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
