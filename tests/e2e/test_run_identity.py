"""Two concurrent 2-rank torchrun jobs (gloo, real DDP) under one ``job`` label, as a sweep
submitted from one sbatch script: each run's ranks carry their own ``run_id`` (torchrun's run
id), and a real Prometheus with the shipped rules fires no cross-rank alert. Before run
identities the four ranks were one population: "only 4 of the 2 ranks" (TrainingRankDown)."""

from __future__ import annotations

import json
import os
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
CROSS_RANK = ("TrainingStraggler", "TrainingRankGradientMismatch", "TrainingLossRankSpread", "TrainingRankDown")


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    # Short `for`s, yet longer than a scrape or two missed on a loaded machine (1 s timeouts):
    # a missed scrape makes a rank look down for a moment; comparing two runs does for good.
    return {
        "alerts": {
            **E2E_THRESHOLDS["alerts"],
            "straggler_for": "5s",
            "grad_mismatch_for": "5s",
            "rank_down_for": "5s",
            "loss_spread_for": "5s",
        }
    }


def _start(folder: Path, job: str, thresholds: Path) -> subprocess.Popen:
    folder.mkdir()
    cmd = torchrun(
        2, WORKER, "--dir", str(folder), "--job", job, "--thresholds", str(thresholds), "--align-every", "10"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "LOSSBEAT_RUN_ID")}
    with open(folder / "torchrun.log", "wb") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**env, "LOSSBEAT_FILE_SD_DIR": str(folder / "sd")},
        )


def test_two_concurrent_runs_under_one_job_label_fire_no_cross_rank_alert(stack, prometheus, e2e_thresholds, tmp_path):
    job = "sweep"
    folders = [tmp_path / "run-a", tmp_path / "run-b"]
    procs = [_start(folder, job, e2e_thresholds) for folder in folders]
    try:

        def registered():
            for proc, folder in zip(procs, folders):
                if proc.poll() is not None:
                    pytest.fail(f"torchrun ended ({proc.returncode}):\n{(folder / 'torchrun.log').read_text()[-3000:]}")
            entries = [e for f in folders if (f / "sd").is_dir() for e in read_entries(f / "sd")]
            return len(entries) == 4 and entries

        targets = [
            json.loads(path.read_text())[0]["targets"][0] for path, _, _ in wait_until(registered, 120, "4 ranks")
        ]
        write_target_groups(stack.targets_file, [{"targets": targets, "labels": {"job": job}}])

        def both_compared():
            steps = prometheus.query(f'training_grad_norm_aligned_step{{job="{job}"}} >= 20')
            return len({s["metric"]["run_id"] for s in steps}) == 2 and len(steps) == 4 and steps

        steps = wait_until(both_compared, 120, "both runs' ranks at an aligned step")
        run_ids = {s["metric"]["run_id"] for s in steps}
        assert len(run_ids) == 2 and "" not in run_ids  # one identity per run, shared by its ranks
        deadline = time.monotonic() + 15  # several evaluations past every cross-rank `for` (5 s)
        while time.monotonic() < deadline:
            for name in CROSS_RANK:
                assert not prometheus.firing(name, job=job), f"{name} fired for two healthy runs"
            time.sleep(1)
        info = prometheus.query(f'count by (run_id) (training_run_info{{job="{job}"}})')
        assert sorted(float(s["value"][1]) for s in info) == [2.0, 2.0]
    finally:
        for folder in folders:
            (folder / "done").write_text("")
        write_target_groups(stack.targets_file, [])
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                terminate(proc)
