"""The optimizer guard on real gloo jobs: every rank skips the same step, and stays in step."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import require
from helpers.torchrun_jobs import Job, SharedJobs

# The worker's faults: a NaN in one rank's local loss (step 30), a NaN in one rank's gradient
# before the all-reduce (40), and a x1e4 loss on one rank only (50).
FAULT_STEPS = [30, 40, 50]

# The 2-rank variants in one torchrun job (torchrun_jobs.py); one alone:
# python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/guard_worker.py --wrap W --dir DIR
TWO_EVEN = ["--optimizers", "two", "--observe", "even"]
# The callbacks' faults (guard_callbacks_worker.py), on the last rank only: a NaN loss at optimizer
# step 3, and a x1e4 loss at step 28 (its gradients, averaged into every rank's, explode).
NAN_AT, SPIKE_AT = 3, 28
# Without the framework the tests skip (CI fails them) before they ask: the job leaves its variants out.
FRAMEWORKS = [
    f
    for f, modules in (("hf", ("transformers", "accelerate")), ("lightning", ("lightning",)))
    if all(importlib.util.find_spec(m) for m in modules)
]
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
            # guard="skip": the same loss gone bad on one rank for 30 steps in a row.
            "guard-2-ddp-sustained": ("guard_worker", ["--wrap", "ddp", "--sustained"]),
        },
    ),
    "guard-4-ranks": Job(4, {"guard-4-ddp": ("guard_worker", ["--wrap", "ddp"])}),
    # The HF Trainer's and Lightning's callbacks on DDP (guard_callbacks_worker.py); one alone:
    # python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/guard_callbacks_worker.py
    #   --framework F --mode M --dir DIR
    "guard-callbacks-2-ranks": Job(
        2,
        {
            f"callbacks-{framework}-{mode}": (
                "guard_callbacks_worker",
                ["--framework", framework, "--mode", mode],
            )
            for framework in FRAMEWORKS
            for mode in ("skip", "stop")
        },
    ),
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


def test_a_loss_gone_bad_on_one_rank_for_good_is_no_new_level_on_any_rank(jobs):
    """Only the last rank's loss is x1e4, from step 30 on: every rank skips the explosions, none
    takes them in as a healthy new level (judged from its own loss, rank 0 did, after 8, and went
    on alone while the last rank stopped), and every rank stops at the same step, after
    guard.max_consecutive (16) skips in a row."""
    results = jobs.results("guard-2-ddp-sustained")
    for r in results:
        assert r["halted"] == {"step": 46, "reason": "explosion", "loop_step": 46}, r
        assert r["skipped_at"] == list(range(30, 46)) and r["skipped"] == {"explosion": 17}, r
        assert r["unchanged_at_faults"] == [True] * 17, r
        assert r["level_changes"] == 0, r
        assert r["params_equal_across_ranks"] and r["params_finite"] and r["completed"] is False, r


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_the_callbacks_skip_a_bad_step_on_every_rank_and_train_on(jobs, framework):
    """A NaN loss on one rank, then a x1e4 loss on one rank: each optimizer step is withheld on
    both ranks (parameters and AdamW state bitwise as before it), the weights stay equal across
    ranks and finite, and both ranks export the same skips."""
    require(framework in FRAMEWORKS, f"{framework}'s trainer not importable; pip install -e .[test]")
    results = jobs.results(f"callbacks-{framework}-skip")
    assert [r["world"] for r in results] == [2, 2]
    for r in results:
        assert r["withheld_at"] == [NAN_AT, SPIKE_AT], r
        assert r["global_step"] == SPIKE_AT + 4 and r["steps_observed"] == SPIKE_AT + 4, r  # trained on
        assert r["halted"] is None and r["completed"], r
        assert r["params_equal_across_ranks"] and r["params_finite"], r
        assert r["undecided"] == 0, r
        # The NaN, then the explosion (only one rank's loss is bad: a fault, not a new level).
        assert r["exported_skips"] == {"nonfinite": 1.0, "explosion": 1.0, "spike": 0.0}, r


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_the_callbacks_stop_every_rank_at_the_same_step_and_the_documented_save_works(jobs, framework):
    """A x1e4 loss on one rank under guard="stop": TrainingHalted leaves train()/fit() on both ranks
    at that step with nothing of it applied, and docs/guard.md's except block saves the weights
    before it (the HF Trainer's save_model and save_state, Lightning's save_checkpoint)."""
    require(framework in FRAMEWORKS, f"{framework}'s trainer not importable; pip install -e .[test]")
    results = jobs.results(f"callbacks-{framework}-stop")
    for r in results:
        assert r["halted"] == {"step": SPIKE_AT, "reason": "explosion"}, r
        assert r["global_step"] == SPIKE_AT - 1 and r["unchanged_at_halt"], r
        assert r["params_equal_across_ranks"] and r["params_finite"], r
        assert r["exported_skips"] == {"nonfinite": 0.0, "explosion": 1.0, "spike": 0.0}, r
        assert r["completed"] is False, r
    assert results[0]["saved_equal"] is True and results[0]["saved_state"] is True, results[0]
