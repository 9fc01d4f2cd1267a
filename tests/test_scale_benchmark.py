"""Smoke test of benchmarks/scale.py: a handful of synthetic ranks from real expositions,
scraped and judged by the shipped sharded set-up at 1 s; one rank turns NaN and fires."""

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
    assert "training_layer_grad_norm{" in templates["layers"]
    assert "training_layer_grad_norm{" not in templates["scalars"]
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
    assert (
        'training_nonfinite_loss_total{rank="4",run_id="scale-benchmark"} 3.0' in nan
    )  # 2 steps/s since the flip, and the first


def test_the_sharded_set_up_scrapes_every_rank_once_and_the_nan_fires_on_its_shard(templates):
    """deploy/sharding in miniature (2 shards + global, 1 s): every rank up on exactly one shard,
    the global holds what its rules read, a NaN fires on the rank's shard; no other alert."""
    require_binary("prometheus")
    result = measure(6, warmup_cycles=3, templates=templates, interval=1.0, shards=2, kill=False)
    assert result["up"] == 6
    servers = result["servers"]
    assert set(servers) == {"global", "shard-0", "shard-1"}
    assert sum(servers[s]["head_series"] for s in ("shard-0", "shard-1")) >= 6 * series_count(templates["scalars"])
    assert 0 < servers["global"]["head_series"] < sum(servers[s]["head_series"] for s in ("shard-0", "shard-1"))
    assert "lossbeat.recording" in servers["shard-0"]["rule_group_duration_s"]
    assert set(servers["global"]["rule_group_duration_s"]) == {
        "lossbeat.recording.global",
        "lossbeat.summary.global",
        "lossbeat.summary.checks.global",
        "lossbeat.cross_rank",
    }
    # The global holds the shards' partials and a few series a rank, not the ranks' raw series.
    assert servers["global"]["head_series"] < 0.5 * sum(servers[s]["head_series"] for s in ("shard-0", "shard-1"))
    assert result["nan_to_firing_s"] is not None and result["nan_to_firing_s"] < 10
    assert result["nan_rank_shard"] in ("shard-0", "shard-1")
    assert result["other_alerts"] == [] and result["rule_iterations_missed"] == 0
    table = report([result])
    assert "| 6 | 2 shards + global | 1 | 6 |" in table and "| global |" in table
