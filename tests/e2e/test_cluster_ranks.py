"""A 4-process torchrun job (gloo, CPU, real DDP training) scraped by a real Prometheus with the
shipped rules: a rank slowed in its data loading fires TrainingStraggler naming it, a rank whose
gradients are changed after the all-reduce fires TrainingRankGradientMismatch naming it, and the
healthy ranks fire neither. The ranks register themselves (file_sd entries with their real ports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lossbeat.registration import read_entries
from lossbeat.stack import write_target_groups

from .e2e_harness import terminate, wait_until
from .stack_config import E2E_THRESHOLDS

WORKER = Path(__file__).with_name("cluster_worker.py")
RANKS = 4
CROSS_RANK = ("TrainingStraggler", "TrainingRankGradientMismatch", "TrainingLossRankSpread", "TrainingRankDown")


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    return {"alerts": {**E2E_THRESHOLDS["alerts"], "straggler_for": "5s", "grad_mismatch_for": "5s",
                       "rank_down_for": "5s"}}


def test_straggler_and_gradient_mismatch_name_their_ranks(stack, prometheus, e2e_thresholds, tmp_path):
    job = "cluster-faults"
    sd = tmp_path / "sd"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               str(WORKER), "--dir", str(tmp_path), "--job", job, "--thresholds", str(e2e_thresholds),
               "--slow-rank", "3", "--slow-s", "0.15", "--corrupt-rank", "2"]
    log = open(tmp_path / "torchrun.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "LOSSBEAT_FILE_SD_DIR": str(sd)})
    try:
        def registered():
            if proc.poll() is not None:
                pytest.fail(f"torchrun ended ({proc.returncode}):\n{(tmp_path / 'torchrun.log').read_text()[-3000:]}")
            entries = read_entries(sd) if sd.is_dir() else []
            return len(entries) == RANKS and entries
        entries = wait_until(registered, 120, "all 4 ranks registered")
        targets = [json.loads(path.read_text())[0]["targets"][0] for path, _, _ in entries]
        write_target_groups(stack.targets_file, [{"targets": targets, "labels": {"job": job}}])

        straggler = wait_until(lambda: prometheus.firing("TrainingStraggler", job=job), 120,
                               "TrainingStraggler for the slowed rank")
        # Aligned every 50 steps (~10 s here): several scrapes see every rank at the same aligned step.
        mismatch = wait_until(lambda: prometheus.firing("TrainingRankGradientMismatch", job=job), 120,
                              "TrainingRankGradientMismatch for the corrupted rank")
        assert [a["labels"]["rank"] for a in straggler] == ["3"]
        assert float(straggler[0]["value"]) > 1.5  # its work time over the job's median
        assert straggler[0]["labels"]["instance"] in targets
        assert [a["labels"]["rank"] for a in mismatch] == ["2"]
        # The healthy ranks fire no cross-rank alert.
        for name in CROSS_RANK:
            assert not [a for a in prometheus.alerts(alertname=name, job=job) if a["labels"].get("rank") in ("0", "1")]
    finally:
        (tmp_path / "done").write_text("")
        write_target_groups(stack.targets_file, [])
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            terminate(proc)
        log.close()
    assert not list(sd.glob("*.json")), "ranks left file_sd entries behind after a clean exit"
