"""One fault, one page: a NaN loss on one DDP rank is named on the other ranks as
coming through the all-reduce, not as starting at the model's last layer (a real 2-rank gloo
job under torchrun)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers.processes import kill_tree
from helpers.torchrun_jobs import torchrun

from lossbeat.monitor.apply import ALL_LAYERS, FROM_ANOTHER_RANK, _nonfinite_origin

WORKER = Path(__file__).resolve().parent / "workers" / "ddp_nan_worker.py"


def test_a_nan_on_one_ddp_rank_is_named_as_coming_from_another_rank_on_the_others(tmp_path):
    cmd = torchrun(2, WORKER, str(tmp_path))
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            kill_tree(job)
    assert job.returncode == 0, output[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # Rank 1 holds the fault: its NaN loss (TrainingLossNaN pages; it poisons all its layers).
    assert not rank1["loss_finite"] and rank1["nonfinite_loss_total"] == 1
    assert rank1["first_nonfinite_layer"] == ALL_LAYERS
    # Rank 0's loss is finite; every gradient is NaN after the all-reduce: not "starting at module.4".
    assert rank0["loss_finite"] and rank0["nonfinite_loss_total"] == 0 and rank0["nonfinite_grad_total"] == 1
    assert rank0["first_nonfinite_layer"] == FROM_ANOTHER_RANK


def test_the_origin_inside_one_process_is_still_the_last_bad_layer():
    nan = float("nan")
    assert _nonfinite_origin({"a": nan, "b": nan, "c": 1.0}, 2.0, several_ranks=True) == "b"
    assert _nonfinite_origin({"a": nan, "b": nan}, 2.0, several_ranks=False) == "b"  # one process: its last layer
    assert _nonfinite_origin({"a": nan, "b": nan}, nan, several_ranks=True) == ALL_LAYERS
