"""The optimizer guard on real gloo jobs: every rank skips the same step, and stays in step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("guard_worker.py")
# The worker's faults: a NaN in one rank's local loss (step 30), a NaN in one rank's gradient
# before the all-reduce (40), and a x1e4 loss on one rank only (50).
FAULT_STEPS = [30, 40, 50]


def _run(tmp_path, ranks, wrap):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(WORKER), "--dir", str(tmp_path), "--wrap", wrap]
    job = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-4000:]
    return [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("ranks,wrap", [(2, "ddp"), (4, "ddp"), (2, "fsdp2")])
def test_every_rank_skips_the_same_steps_and_stays_equal(tmp_path, ranks, wrap):
    results = _run(tmp_path, ranks, wrap)
    for r in results:
        assert r["skipped_at"] == FAULT_STEPS, r  # the same steps on every rank, the faulty one or not
        assert r["params_equal_across_ranks"] and r["params_finite"] and r["last_loss_finite"], r
    # The flags are reduced: every rank counts the same reasons. The x1e4 loss is a spike, and
    # its gradients, averaged into every rank's, explode (the first reason set is counted).
    assert all(r["skipped"] == results[0]["skipped"] for r in results)
    assert results[0]["skipped"]["nonfinite"] == 2
    assert sum(results[0]["skipped"].values()) == 3
