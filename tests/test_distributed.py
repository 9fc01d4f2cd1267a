"""Multi-rank: a real torchrun job on gloo, two processes, each rank serving its own port."""

import importlib.util
import math
import subprocess
import time
from pathlib import Path

import pytest
from conftest import free_ports, require_module
from helpers.processes import kill_tree
from helpers.scrape import scrape as scrape_series
from helpers.torchrun_jobs import Job, SharedJobs, torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "ddp_worker.py"


def free_port_pair() -> int:
    return free_ports(2)


def scrape(port):
    """{sample name: [(labels, value)]}, the labels without ``run_id`` (test_run_identity.py tests it)."""
    return scrape_series(port, drop=("run_id",))


def test_each_rank_serves_port_plus_local_rank_with_its_rank_label(tmp_path):
    base = free_port_pair()
    cmd = torchrun(2, WORKER, "--port", str(base), "--dir", str(tmp_path), "--steps", "20")
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"torchrun job ended or timed out:\n{job.stdout.read() if job.poll() is not None else ''}")
            time.sleep(0.2)
        assert [(tmp_path / f"ready.{r}").read_text() for r in (0, 1)] == [str(base), str(base + 1)]
        ranks = {r: scrape(base + r) for r in (0, 1)}
    finally:
        (tmp_path / "done").write_text("")
        try:
            job.wait(timeout=60)
        finally:
            if job.poll() is None:
                kill_tree(job)
    assert job.returncode == 0
    for r, metrics in ranks.items():
        steps = metrics["training_steps_total"]
        assert steps == [({"rank": str(r)}, 20.0)]
        info = metrics["training_run_info"][0][0]
        assert info["world_size"] == "2" and info["local_rank"] == str(r) and info["run"] == "ddp-test"
    # Per-layer norms from rank 0 only (layer_ranks="first"): the same on every data-parallel rank,
    # so the series grow with the layers, not layers x ranks.
    assert len(ranks[0]["training_layer_grad_norm"]) > 5
    assert all(labels["rank"] == "0" for labels, _ in ranks[0]["training_layer_grad_norm"])
    assert "training_layer_grad_norm" not in ranks[1]
    # Each rank saw its own data (different losses) but DDP averaged the gradients (same norms).
    loss0, loss1 = (ranks[r]["training_loss"][0][1] for r in (0, 1))
    assert loss0 != loss1
    norm0, norm1 = (ranks[r]["training_grad_norm"][0][1] for r in (0, 1))
    assert norm0 == pytest.approx(norm1, rel=1e-5)


# The tests below read their results from shared torchrun jobs: one job a world size (and one for the
# Trainer's variants, which import transformers), each variant run in it after the other (torchrun_jobs.py,
# variants_worker.py; a variant that raises fails its own test, and no other). Each worker still runs one
# variant alone: ``python -m torch.distributed.run --standalone --nproc-per-node N tests/<worker>.py ARGS --dir DIR``.
HF_FSDP_CASES = {"fsdp2-clipping": (2, 0.05), "fsdp1-clipping": (1, 0.05), "fsdp2-no-clipping": (2, 0.0)}
FSDP_CASES = {
    "fsdp2-2-shards": ("fsdp2", 2, 1),
    "hsdp-2x2": ("fsdp2", 4, 2),
    "fsdp1-orig-params": ("fsdp1", 2, 1),
    "fsdp1-flat-params": ("fsdp1-flat", 2, 1),
    "fsdp2-1-rank": ("fsdp2", 1, 1),
}


def _fsdp(case: str) -> tuple[str, list[str]]:
    wrap, _, replicas = FSDP_CASES[case]
    return "fsdp_worker", ["--replicas", str(replicas), "--wrap", wrap]


# Without the Trainer the tests skip (CI fails them) before they ask: the job leaves those variants out.
TRAINER_VARIANTS = (
    {
        "hf-ddp": ("hf_ddp_worker", []),
        **{
            f"hf-{case}": ("hf_fsdp_worker", ["--fsdp-version", str(version), "--max-grad-norm", str(max_norm)])
            for case, (version, max_norm) in HF_FSDP_CASES.items()
        },
    }
    if all(importlib.util.find_spec(m) for m in ("transformers", "accelerate"))
    else {}
)

# Variants in which one rank observes alone (its shard handshakes then run ahead of the others') go last.
JOBS = {
    "trainer-2-ranks": Job(
        2,
        {
            **TRAINER_VARIANTS,
            "pp-one-stage": ("pp_worker", ["--scenario", "one-stage"]),
        },
    ),
    "2-ranks": Job(
        2,
        {
            **{case: _fsdp(case) for case, (_, ranks, _) in FSDP_CASES.items() if ranks == 2},
            "tp-sp": ("tp_worker", ["--scenario", "tp-sp"]),
            "tp-rank0-only": ("tp_worker", ["--scenario", "rank0-only"]),
        },
    ),
    "4-ranks": Job(
        4,
        {
            "hsdp-2x2": _fsdp("hsdp-2x2"),
            "fsdp-tp": ("tp_worker", ["--scenario", "fsdp-tp"]),
            "pp-train": ("pp_worker", ["--scenario", "train"]),
        },
    ),
    "1-rank": Job(1, {"fsdp2-1-rank": _fsdp("fsdp2-1-rank")}),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return SharedJobs(JOBS, tmp_path_factory)


def test_hf_trainer_under_ddp_exports_the_all_reduced_unclipped_norms(jobs):
    """The end-of-backward measurement runs after DDP writes the averaged gradients back."""
    require_module("transformers")
    require_module("accelerate")
    results = jobs.results("hf-ddp")
    for r in results:
        assert r["steps"] == 4 and r["trainer_step"] == 4
        # The Trainer's grad_norm is taken after the all-reduce and before it clips to 0.05.
        assert r["trainer_grad_norm"] > 0.05
        assert r["grad_norm"] == pytest.approx(r["trainer_grad_norm"], rel=1e-5)
        layers = r["layer_norms"]
        assert "transformer.h.0.mlp.c_fc" in layers
        assert math.sqrt(sum(v * v for v in layers.values())) == pytest.approx(r["grad_norm"], rel=1e-4)
    # Each rank saw its own shard, yet both export the job's (averaged) norms, layer by layer.
    assert results[0]["layer_norms"] == pytest.approx(results[1]["layer_norms"], rel=1e-5)
    # Each rank exports its own loss; the Trainer logs their mean (num_items_in_batch counts both ranks' tokens,
    # and the Trainer scales the model's loss by the world size in place, after the callback read it).
    assert results[0]["loss"] != results[1]["loss"]
    assert (results[0]["loss"] + results[1]["loss"]) / 2 == pytest.approx(results[0]["trainer_loss"], rel=1e-5)


@pytest.mark.parametrize("case", HF_FSDP_CASES)
def test_hf_trainer_under_fsdp_exports_the_gathered_gradients_norms(jobs, case):
    """Sharded gradients: every rank exports the norms of the full gradients (not of its shard), measured
    after FSDP's reduce-scatter and before the Trainer clips; rank 0 the layers; each rank its loss."""
    require_module("transformers")
    require_module("accelerate")
    version, max_grad_norm = HF_FSDP_CASES[case]
    results = jobs.results(f"hf-{case}")
    for r in results:
        if version == 1:
            assert r["wrapped"] == "FullyShardedDataParallel"
        else:
            assert r["wrapped"] == "FSDPGPT2LMHeadModel" and r["placements"] == "(Shard(dim=0),)"
        assert r["errors"] == {"observe": 0, "gradients": 0, "collect": 0, "diagnose": 0}
        # Clipping: measured at the end of each step's last backward (accumulation 2), else in
        # on_pre_optimizer_step.
        assert len(r["measured_at_end_of_backward"]) == (3 if max_grad_norm else 0)
        assert [s["training_step"] for s in r["steps"]] == [1, 2, 3] and len(r["references"]) == 3
        for exported, reference in zip(r["steps"], r["references"]):
            assert exported["training_grad_norm"] == pytest.approx(reference["global"], rel=1e-5)
            assert exported["training_grad_norm"] == pytest.approx(reference["trainer_clip"], rel=1e-5)
            assert reference["global"] > 0.05  # a norm measured after the clip would be 0.05
            if r["rank"] == 0:
                assert set(exported["layers"]) == set(reference["layers"])
                assert "transformer.h.0.mlp.c_fc" in exported["layers"]
                assert exported["layers"] == pytest.approx(reference["layers"], rel=1e-5)
            else:
                assert exported["layers"] == {}
    # The Trainer logs the ranks' mean loss; each rank exports its own (its own data).
    assert [logged["step"] for logged in results[0]["logged"]] == [1, 2, 3]
    for i, logged in enumerate(results[0]["logged"]):
        losses = [r["steps"][i]["training_loss"] for r in results]
        assert losses[0] != losses[1]
        assert sum(losses) / 2 == pytest.approx(logged["loss"], rel=1e-5)
        assert logged["grad_norm"] == pytest.approx(results[0]["steps"][i]["training_grad_norm"], rel=1e-5)


@pytest.mark.parametrize("case", FSDP_CASES)
def test_sharded_gradients_give_the_models_norms_on_every_rank(jobs, case):
    """Shards: local squares summed over the shard group only (not over the replicas)."""
    wrap, ranks, _ = FSDP_CASES[case]
    results = jobs.results(case)
    assert len(results) == ranks
    for r in results:
        assert "Shard(dim=0)" in r["layout"] or r["layout"] == "ShardingStrategy.FULL_SHARD"
        assert r["errors"] == {"observe": 0, "gradients": 0, "collect": 0, "diagnose": 0} and r["steps"] == 3
        (ref_global, ref_layers), (global_norm, layers) = r["reference"], r["measured"]
        assert global_norm == pytest.approx(ref_global, rel=1e-5)
        assert math.sqrt(sum(v * v for v in layers.values())) == pytest.approx(global_norm, rel=1e-5)
        if wrap == "fsdp1-flat":  # one flat parameter per FSDP unit: the units are the layers
            assert set(layers) == {"_flat_param", "blocks.0", "blocks.1"}
        else:  # the model's own module paths, without the wrappers' components
            assert set(layers) == set(ref_layers) and "blocks.1.mlp.fc" in layers
            assert layers == pytest.approx(ref_layers, rel=1e-5)
        # monitor.clip_grad_norm_ returns the full norm and clips the shards to max_norm together.
        assert r["clip_returned"] == pytest.approx(r["clip_reference"], rel=1e-5)
        assert r["after_clip"] == pytest.approx(0.05, rel=1e-4)
        assert r["clip_coefficient"] == pytest.approx(0.05 / r["clip_reference"], rel=1e-4)
        # The framework's own clip (a DTensor under FSDP2) is taken as the grad norm, whole.
        assert r["torch_clip"][1] == pytest.approx(r["torch_clip"][0], rel=1e-6)
    assert all(r["measured"] == results[0]["measured"] for r in results)
    assert results[0]["first_only_layers"] == sorted(results[0]["measured"][1])
    assert all(r["first_only_layers"] == [] for r in results[1:])
    if ranks > 1:
        assert 0 < results[0]["local_only"] < results[0]["measured"][0]  # one shard of the whole
    else:  # DTensors on a one-rank mesh: nothing to reduce, the local shard is the whole
        assert results[0]["local_only"] == pytest.approx(results[0]["measured"][0], rel=1e-6)


def test_tensor_and_sequence_parallel_norms_reduce_partial_gradients(jobs):
    """SequenceParallel norms: replicated weights, Partial(sum) gradients. Measured as if each
    rank's summand were whole, the norm layers came out ~1/sqrt(2) of the truth and
    monitor.clip_grad_norm_ clipped with the wrong norm."""
    results = jobs.results("tp-sp")
    for r in results:
        assert r["placements"] == ["(Replicate(),)", "(Partial(sum),)"]  # the case at hand
        assert r["errors"] == {"observe": 0, "gradients": 0, "collect": 0, "diagnose": 0}
        (ref_global, ref_layers), (global_norm, layers) = r["reference"], r["measured"]
        assert global_norm == pytest.approx(ref_global, rel=1e-5)  # torch.nn.utils.get_total_norm
        assert (
            set(layers)
            == set(ref_layers)
            == {
                "blocks.0.norm",
                "blocks.0.up",
                "blocks.0.down",
                "blocks.1.norm",
                "blocks.1.up",
                "blocks.1.down",
                "norm",
            }
        )
        assert layers == pytest.approx(ref_layers, rel=1e-5)
        assert r["clip_returned"] == pytest.approx(r["torch_clip"], rel=1e-5)
        assert r["after_clip"] == pytest.approx(r["after_torch_clip"], rel=1e-5)
        assert r["after_clip"] == pytest.approx(0.05, rel=1e-4)
    assert results[0]["measured"] == results[1]["measured"]


def test_2d_fsdp_x_tensor_parallel_gives_the_models_norms_on_every_rank(jobs):
    """torchtitan's layout: TP on mesh["tp"], then fully_shard on mesh["dp"] (4 ranks, a 2 x 2 mesh).
    Each gradient is sharded over both dimensions (or over dp alone): squares summed over each of
    its groups. Each rank's groups span 3 ranks, a different 3 on each rank: the first-time
    handshake, keyed by those, used to make every rank give up and export no norm."""
    results = jobs.results("fsdp-tp")
    assert [r["dp_tp"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    placements = results[0]["placements"]
    # FSDP over dp times TP's placement, parameters and gradients alike (FSDP2 makes the SequenceParallel
    # norm's Partial gradient Replicate before its reduce-scatter).
    up = placements["blocks.0.up.weight"]  # FSDP's dim-0 shard of TP's dim-0 shard: strided
    assert up[0] == up[1] and up[0].startswith("(_StridedShard(dim=0") and up[0].endswith(", Shard(dim=0))")
    assert placements["blocks.0.down.weight"] == ["(Shard(dim=0), Shard(dim=1))"] * 2
    assert placements["blocks.0.norm.weight"] == ["(Shard(dim=0), Replicate())"] * 2
    layers = {"blocks.0.norm", "blocks.0.up", "blocks.0.down", "blocks.1.norm", "blocks.1.up", "blocks.1.down", "norm"}
    for r in results:
        assert r["errors"] == r["local_errors"] == {"observe": 0, "gradients": 0, "collect": 0, "diagnose": 0}
        assert r["steps_total"] == 3
        for step, s in enumerate(r["steps"]):
            assert s["grad_norm"] == pytest.approx(s["reference"], rel=1e-5)  # observe (step 0) or the clip's
            if r["rank"] == 0:  # layer_ranks="first"
                assert set(s["layers"]) == set(s["reference_layers"]) == layers
                assert s["layers"] == pytest.approx(s["reference_layers"], rel=1e-5)
            else:
                assert s["layers"] == {}
            if step:  # monitor.clip_grad_norm_: the model's norm, every shard scaled to max_norm together
                assert s["clip_returned"] == pytest.approx(s["reference"], rel=1e-5)
                assert s["after_clip"] == pytest.approx(s["max_norm"], rel=1e-4)
        torch_step = r["steps"][1]  # torch.nn.utils.clip_grad_norm_ on the DTensors, the same gradients
        assert torch_step["torch_clip"] == pytest.approx(torch_step["reference"], rel=1e-5)
        assert torch_step["max_diff_from_torch"] < 1e-6
        # Unreduced, a rank's norm is that of its shards only: the reductions are what makes it whole.
        assert 0 < r["steps"][0]["local_only"] < 0.9 * r["steps"][0]["reference"]
    for step in range(3):  # the gradients are the whole model's, the losses each rank's own
        assert len({r["steps"][step]["grad_norm"] for r in results}) == 1
        losses = [r["steps"][step]["loss"] for r in results]
        assert losses[0] != losses[2] and losses[1] != losses[3]  # dp ranks: their own data


def test_observing_a_sharded_model_on_rank_0_alone_fails_fast_with_a_clear_message(jobs):
    """`if rank == 0: monitor.observe(model=...)`: rank 0 used to wait alone in the all-reduce
    (gloo: until its 30-minute timeout; NCCL: pairing with the next all-gather or a hang)."""
    results = jobs.results("tp-rank0-only")
    assert jobs.seconds("tp-rank0-only") < 200  # its own time and its job's start-up
    r = results[0]
    assert 2.5 < r["seconds"] < 30  # the 3 s handshake, once: the second step does not wait again
    assert r["steps"] == 2 and r["loss"] > 0 and r["grad_norm"] is None  # the steps are still recorded
    assert r["errors"]["gradients"] == 3 and r["errors"]["observe"] == 0
    assert len(r["log"]) == 1 and "not every rank measured them" in r["log"][0]
    assert "if rank == 0: monitor.observe" in r["log"][0] and "reduce_shards=False" in r["log"][0]
    assert "not every rank measured them" in r["clip_error"]  # torch's clip would hang there too


def test_pipeline_stages_export_the_models_norm_and_clip_alike(jobs):
    """2 stages (PipelineStage + ScheduleGPipe) x 2 FSDP2 replicas: every rank's /metrics serves the
    norm of all stages' gathered gradients; each stage's own norm used to be exported instead."""
    results = jobs.results("pp-train")
    assert [r["pp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for r in results:
        assert r["errors"] == {"observe": 0, "gradients": 0, "collect": 0, "diagnose": 0} and r["steps"] == 3
        assert r["grad_norm"] == pytest.approx(r["reference"], rel=1e-5)
        assert r["aligned"] == pytest.approx(r["reference"], rel=1e-5)  # TrainingRankGradientMismatch: no false page
        assert r["measure_gradients"] == pytest.approx(r["reference"], rel=1e-5)
        assert abs(r["stage_only"] - r["reference"]) > 0.05 * r["reference"]  # the old, stage-local value
        # One coefficient on every stage, from the model's norm: the same clip as torch's of the whole.
        clip = r["clip"]
        assert clip["returned"] == pytest.approx(clip["torch_total"], rel=1e-5)
        assert clip["stage_ratio"] == pytest.approx(clip["max_norm"] / clip["torch_total"], rel=1e-4)
        assert clip["after"] == pytest.approx(clip["max_norm"], rel=1e-4)
        assert clip["max_diff_from_torch"] < 1e-6
        assert r["nan_grad_norm"] == "nan"  # NaN in stage 1's gradient reaches stage 0 too
        if r["stage"] == 0:  # observed with loss=None: no loss exported, judged or counted
            assert r["loss"] is None and r["exported_loss"] is None and r["nonfinite_loss"] == 0
            assert r["loss_findings"] and all(status == 0 and not known for _, status, known in r["loss_findings"])
        else:
            assert r["exported_loss"] == pytest.approx(r["loss"]) and r["loss"] > 0
    # layer_ranks="first": the pipeline group holding rank 0 exports each stage's own layers, once.
    assert set(results[0]["layers"]) == {"layers.0.0", "layers.1.0"}
    assert set(results[1]["layers"]) == {"layers.2.0", "layers.3.0", "head"}
    for r in results[:2]:
        assert r["layers"] == pytest.approx(r["reference_layers"], rel=1e-5)
    assert results[2]["layers"] == results[3]["layers"] == {}


def test_observing_one_pipeline_stage_alone_fails_fast_with_a_clear_message(jobs):
    """`if stage == 0: monitor.observe(model=...)` would wait alone in the stages' all-reduce."""
    results = jobs.results("pp-one-stage")
    assert jobs.seconds("pp-one-stage") < 200  # its own time and its job's start-up
    r = results[0]
    assert 2.5 < r["seconds"] < 30  # the 3 s handshake, once
    assert r["steps"] == 2 and r["grad_norm"] is None  # the steps are still recorded
    assert r["errors"]["gradients"] == 3 and r["errors"]["observe"] == 0
    assert len(r["log"]) == 1 and "not every rank measured them" in r["log"][0]
    assert "pipeline" in r["log"][0]
    assert "not every rank measured them" in r["clip_error"]
