"""The optimizer guard on real gloo jobs: every rank skips the same step, and stays in step."""

from __future__ import annotations

import pytest
from helpers.torchrun_jobs import Job, SharedJobs

# The worker's faults: a NaN in one rank's local loss (step 30), a NaN in one rank's gradient
# before the all-reduce (40), and a x1e4 loss on one rank only (50).
FAULT_STEPS = [30, 40, 50]

# The 2-rank variants in one torchrun job (torchrun_jobs.py); one alone:
# python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/guard_worker.py --wrap W --dir DIR
TWO_EVEN = ["--optimizers", "two", "--observe", "even"]
JOBS = {
    "guard-2-ranks": Job(
        2,
        {
            "guard-2-ddp": ("guard_worker", ["--wrap", "ddp"]),
            "guard-2-fsdp2": ("guard_worker", ["--wrap", "fsdp2"]),
            # Two optimizers sharing each step's decision; odd steps not observed (decided from the gradients).
            "guard-2-ddp-two-even": ("guard_worker", ["--wrap", "ddp", *TWO_EVEN]),
            "guard-2-fsdp2-two-even": ("guard_worker", ["--wrap", "fsdp2", *TWO_EVEN]),
            # guard="stop": a x1e4 loss on one rank only, its exploding gradients averaged into every rank's.
            "guard-2-ddp-stop": ("guard_worker", ["--wrap", "ddp", "--mode", "stop"]),
        },
    ),
    "guard-4-ranks": Job(4, {"guard-4-ddp": ("guard_worker", ["--wrap", "ddp"])}),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return SharedJobs(JOBS, tmp_path_factory)


@pytest.mark.parametrize(
    "ranks,wrap,variant",
    [(2, "ddp", ""), (4, "ddp", ""), (2, "fsdp2", ""), (2, "ddp", "-two-even"), (2, "fsdp2", "-two-even")],
)
def test_every_rank_skips_the_same_steps_and_stays_equal(jobs, ranks, wrap, variant):
    results = jobs.results(f"guard-{ranks}-{wrap}{variant}")
    assert [r["world"] for r in results] == [ranks] * ranks
    expected = sorted(FAULT_STEPS + ([45] if variant else []))  # 45: a NaN at a step observe() did not see
    for r in results:
        assert r["skipped_at"] == expected, r  # the same steps on every rank, the faulty one or not
        assert r["unchanged_at_faults"] == [True] * len(expected), r  # parameters and optimizer state bitwise
        assert r["undecided"] == (30 if variant else 0), r  # the odd steps of 60
        assert r["params_equal_across_ranks"] and r["params_finite"] and r["last_loss_finite"], r
    # The flags are reduced: every rank counts the same reasons. The x1e4 loss is a spike, and
    # its gradients, averaged into every rank's, explode (the first reason set is counted).
    assert all(r["skipped"] == results[0]["skipped"] for r in results)
    assert results[0]["skipped"]["nonfinite"] == 2 + bool(variant)
    assert sum(results[0]["skipped"].values()) == 3 + bool(variant)


def test_stop_on_a_loss_gone_bad_on_one_rank_halts_every_rank_at_the_same_step(jobs):
    """Only the last rank's loss is x1e4; the explosion it causes is in every rank's averaged gradients.
    Whether the explosion is a healthy new level (skipped) or a fault (stop) is one judgement for
    the world: judged from each rank's own loss, the last rank stopped alone and rank 0 waited
    for it in the next step's collective."""
    results = jobs.results("guard-2-ddp-stop")
    assert [r["world"] for r in results] == [2, 2]
    for r in results:
        assert r["halted"] == {"step": 30, "reason": "explosion", "loop_step": 30}, r
        assert r["unchanged_at_faults"] == [True], r  # nothing of the bad step applied
        assert r["skipped"] == {"explosion": 1} and r["skipped_at"] == [], r  # counted; the loop left at it
        assert r["params_equal_across_ranks"] and r["params_finite"], r
        assert r["completed"] is False, r
