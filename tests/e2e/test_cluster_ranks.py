"""4-process torchrun jobs (gloo, CPU, real DDP training) scraped by a real Prometheus with the
shipped rules: a rank slowed in its data loading fires TrainingStraggler naming it, a rank fed
labels from another distribution fires TrainingLossRankSpread naming it, a rank whose
gradients are changed after the all-reduce fires TrainingRankGradientMismatch naming it, a rank
that hangs without serving (SIGSTOP) fires TrainingRankDown naming it while the others wait for
it in the all-reduce, and the healthy ranks fire none of these; a healthy job fires none at all.
The ranks register themselves (file_sd entries with their real ports)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.torchrun_jobs import torchrun

from lossbeat.exposition.registration import read_entries
from lossbeat.stack.local import write_target_groups

from .e2e_harness import terminate, wait_until
from .stack_config import E2E_THRESHOLDS

WORKER = Path(__file__).with_name("cluster_worker.py")
RANKS = 4
CROSS_RANK = ("TrainingStraggler", "TrainingRankGradientMismatch", "TrainingLossRankSpread", "TrainingRankDown")


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    return {
        "alerts": {
            **E2E_THRESHOLDS["alerts"],
            "straggler_for": "5s",
            "grad_mismatch_for": "5s",
            "rank_down_for": "5s",
            "loss_spread_for": "5s",
        }
    }


def _start(tmp_path: Path, job: str, thresholds: Path, *faults: str) -> tuple[subprocess.Popen, Path]:
    sd = tmp_path / "sd"
    cmd = torchrun(RANKS, WORKER, "--dir", str(tmp_path), "--job", job, "--thresholds", str(thresholds), *faults)
    with open(tmp_path / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "LOSSBEAT_FILE_SD_DIR": str(sd)},
        )
    return proc, sd


def _scrape_registered(proc: subprocess.Popen, sd: Path, tmp_path: Path, stack, job: str) -> dict[str, tuple[str, int]]:
    """Wait for the 4 entries, point Prometheus at their real ports; {rank: (target, pid)}."""

    def registered():
        if proc.poll() is not None:
            pytest.fail(f"torchrun ended ({proc.returncode}):\n{(tmp_path / 'torchrun.log').read_text()[-3000:]}")
        entries = read_entries(sd) if sd.is_dir() else []
        return len(entries) == RANKS and entries

    ranks = {}
    for path, owner, labels in wait_until(registered, 120, "all 4 ranks registered"):
        ranks[labels["__meta_lossbeat_rank"]] = (json.loads(path.read_text())[0]["targets"][0], owner.pid)
    write_target_groups(stack.targets_file, [{"targets": [t for t, _ in ranks.values()], "labels": {"job": job}}])
    return ranks


def _stop(proc: subprocess.Popen, tmp_path: Path, stack) -> None:
    (tmp_path / "done").write_text("")
    write_target_groups(stack.targets_file, [])
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        terminate(proc)


def test_straggler_spread_mismatch_and_a_hung_rank_are_named(stack, prometheus, e2e_thresholds, tmp_path):
    job = "cluster-faults"
    proc, sd = _start(
        tmp_path,
        job,
        e2e_thresholds,
        "--slow-rank",
        "3",
        "--slow-s",
        "0.15",
        "--corrupt-rank",
        "2",
        "--odd-data-rank",
        "0",
    )
    stopped = None
    try:
        ranks = _scrape_registered(proc, sd, tmp_path, stack, job)
        straggler = wait_until(
            lambda: prometheus.firing("TrainingStraggler", job=job), 120, "TrainingStraggler for the slowed rank"
        )
        # Aligned every 50 steps (~10 s here): several scrapes see every rank at the same aligned step.
        mismatch = wait_until(
            lambda: prometheus.firing("TrainingRankGradientMismatch", job=job),
            120,
            "TrainingRankGradientMismatch for the corrupted rank",
        )
        assert [a["labels"]["rank"] for a in straggler] == ["3"]
        assert float(straggler[0]["value"]) > 1.5  # its work time over the job's median
        assert straggler[0]["labels"]["instance"] == ranks["3"][0]
        assert [a["labels"]["rank"] for a in mismatch] == ["2"]
        # The others learn, rank 0's loss stays high: its 5m mean departs from the job's median.
        spread = wait_until(
            lambda: prometheus.firing("TrainingLossRankSpread", job=job),
            180,
            "TrainingLossRankSpread for the rank with other data",
        )
        assert [a["labels"]["rank"] for a in spread] == ["0"] and float(spread[0]["value"]) > 3.5
        # The healthy rank fires no cross-rank alert. Firing, not pending: while the ranks' scrapes
        # straddle a new aligned step, the job's latest step holds only the ranks scraped since
        # (the corrupted one and the healthy one, say), and their median flags both for one
        # evaluation; the `for` is what keeps that from a page (docs/tests.md, "Under load").
        for name in CROSS_RANK:
            assert not [a for a in prometheus.firing(name, job=job) if a["labels"].get("rank") == "1"]

        # Rank 1 hangs hard (SIGSTOP: no steps, no scrapes); the others wait for it in the
        # all-reduce and keep serving: TrainingRankDown names it.
        stopped = ranks["1"][1]
        os.kill(stopped, signal.SIGSTOP)
        down = wait_until(lambda: prometheus.firing("TrainingRankDown", job=job), 120, "TrainingRankDown for rank 1")
        assert [(a["labels"]["rank"], a["labels"]["world_size"], float(a["value"])) for a in down] == [("1", "4", 3.0)]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        _stop(proc, tmp_path, stack)
    assert not list(sd.glob("*.json")), "ranks left file_sd entries behind after a clean exit"


def test_a_healthy_job_fires_no_cross_rank_alert(stack, prometheus, e2e_thresholds, tmp_path):
    job = "cluster-healthy"
    proc, sd = _start(tmp_path, job, e2e_thresholds, "--align-every", "10")
    try:
        _scrape_registered(proc, sd, tmp_path, stack, job)
        wait_until(
            lambda: prometheus.query(f'training_grad_norm_aligned_step{{job="{job}"}} >= 20'),
            120,
            "two aligned steps compared",
        )
        deadline = time.monotonic() + 30  # longer than every cross-rank `for` here
        while time.monotonic() < deadline:
            for name in CROSS_RANK:
                assert not prometheus.alerts(alertname=name, job=job), f"{name} on a healthy job"
            time.sleep(1)
        assert len(prometheus.query(f'training_rank_work_seconds{{job="{job}"}}')) == RANKS
    finally:
        _stop(proc, tmp_path, stack)
