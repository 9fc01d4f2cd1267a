"""Smoke test of benchmarks/scale.py: a handful of synthetic ranks from real expositions,
scraped by a real Prometheus with the shipped rules at 1 s; one rank turns NaN and pages."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import require_binary

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.scale import SyntheticRank, measure, real_expositions, report, series_count  # noqa: E402


@pytest.fixture(scope="module")
def templates():
    return real_expositions(world_size=6, steps=3, model="1M")


def test_expositions_are_real_and_only_rank_0_has_layers(templates):
    scalars, layers = series_count(templates["scalars"]), series_count(templates["layers"])
    assert 20 <= scalars <= 60, scalars
    assert 'training_layer_grad_norm{' in templates["layers"]
    assert 'training_layer_grad_norm{' not in templates["scalars"]
    assert layers > scalars and 'world_size="6"' in templates["scalars"]


def test_a_synthetic_rank_moves_and_turns_nan(templates):
    rank = SyntheticRank(templates["scalars"], rank=4, started=1000.0, seed=4)
    early, later = rank.render(1010.0).decode(), rank.render(1040.0).decode()
    assert re.search(r'[{,]rank="4"', early) and not re.search(r'[{,]rank="1"', early)
    assert 'local_rank="4"' in early
    assert early != later and " NaN\n" not in later
    rank.nan_since = 1050.0
    nan = rank.render(1051.0).decode()
    assert 'training_loss{rank="4",run_id="scale-benchmark"} NaN' in nan
    assert 'training_nonfinite_loss_total{rank="4",run_id="scale-benchmark"} 3.0' in nan  # 2 steps/s since the flip, and the first


def test_a_real_prometheus_scrapes_the_ranks_and_the_nan_fires(templates):
    require_binary("prometheus")
    result = measure(6, warmup_cycles=4, rules=REPO / "alerting" / "rules.yml", templates=templates, interval=1.0)
    assert result["up"] == 6
    assert result["head_series"] >= 6 * series_count(templates["scalars"])
    assert result["nan_to_firing_s"] is not None and result["nan_to_firing_s"] < 10
    assert "lossbeat.recording" in result["rule_group_duration_s"]
    assert result["other_alerts"] == []  # healthy synthetic ranks fire nothing
    table = report([result])
    assert "| 6 | 6 |" in table and "at 10,000 ranks" in table
