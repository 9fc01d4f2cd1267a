"""Smoke test of the benchmark harness (benchmarks/): tiny model, a handful of steps.

Counts are exact and asserted; timings are only checked for shape, never for value.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import variants as variants_module
from benchmarks.counting import StepCounts, count_host_reads
from benchmarks.models import TINY_SPEC, build_workload
from benchmarks.observe_cost import measure_memory, measure_observe_us
from benchmarks.overhead import count_variants, measure_overhead
from benchmarks.render import measure_render
from benchmarks.report import render_markdown, targets
from benchmarks.run import environment

LOSSBEAT = ("lossbeat_scalars", "lossbeat_layers_every_step", "lossbeat_layers_every_10", "lossbeat_clip")


@pytest.fixture(scope="module")
def workload():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add time
    try:
        yield build_workload(TINY_SPEC)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def counts(workload):
    variants = variants_module.default_variants(workload.device, third_party=False)
    try:
        yield count_variants(workload, variants, steps=10)
    finally:
        for v in variants:
            v.close()


def test_lossbeat_reads_the_host_once_per_step(counts):
    assert counts["baseline"]["host_reads_delta_per_step"] == 0
    for name in LOSSBEAT:
        assert counts[name]["host_reads_delta_per_step"] == 1, name
        assert counts[name]["method_reads_per_step"] == 1, name  # the one .tolist() of the packed values
        assert counts[name]["lossbeat_host_transfers_per_step"] <= 1, name


def test_naive_monitor_reads_every_parameter(counts, workload):
    # One .item() per parameter tensor, plus the loss.
    assert counts["naive_per_param"]["host_reads_delta_per_step"] == workload.tensors + 1


def test_per_layer_work_launches_more_ops_and_every_10_amortises_it(counts):
    scalars = counts["lossbeat_scalars"]["ops_delta_per_step"]
    every_step = counts["lossbeat_layers_every_step"]["ops_delta_per_step"]
    every_10 = counts["lossbeat_layers_every_10"]["ops_delta_per_step"]
    assert 0 < scalars < every_10 < every_step


def test_counter_restores_what_it_wraps():
    original_tensor, original_tolist = torch.tensor, torch.Tensor.tolist
    counts = StepCounts()
    with count_host_reads(counts):
        torch.tensor([torch.tensor(1.0), torch.tensor(2.0)]).tolist()
        torch.tensor(3.0).item()
    assert (counts.list_reads, counts.method_reads, counts.scalar_reads) == (2, 1, 1)
    counts = StepCounts()
    with count_host_reads(counts):
        x = torch.ones(3)
        x.detach().view(3).add_(1)  # two views, one in-place op that writes (not a view)
    assert (counts.ops - counts.view_ops, counts.view_ops) == (2, 2)  # ones + add_; detach + view
    assert torch.tensor is original_tensor and torch.Tensor.tolist is original_tolist


def test_overhead_results_have_the_expected_shape(workload, monkeypatch):
    monkeypatch.setattr(variants_module, "package_version", lambda module: None)  # as if not installed
    variants = variants_module.default_variants(workload.device)
    try:
        results = measure_overhead(workload, variants, rounds=4, window_steps=2, warmup_steps=1)
    finally:
        for v in variants:
            v.close()
    assert list(results) == [v.name for v in variants]
    for name in ("lightning_grad_norm", "wandb_watch"):
        assert not results[name].available and "not installed" in results[name].reason
    for name in ("baseline", "naive_per_param") + LOSSBEAT:
        r = results[name]
        assert r.available and len(r.windows.step_ms) == 2 and len(r.windows.section_ms) == 2
        assert r.step_ms > 0 and r.paired_ratio > 0 and r.step_ratio_median > 0
        assert r.direct_overhead_pct is not None
    assert results["baseline"].paired_ratio == 1.0


def test_render_memory_observe_and_report_shapes(counts):
    render = measure_render((3,), repeats=2)
    assert render[0]["layer_series"] == 3 and render[0]["bytes"] > 0
    observe_us = measure_observe_us(calls=50, repeats=1)
    assert set(observe_us) == {"float", "tensor_0d"}
    memory = measure_memory(steps=400, traced_steps=50)
    assert memory["steps"] == 400 and len(memory["rss_checkpoints"]) == 4
    results = {
        "quick": True,
        "seconds": 1.0,
        "environment": environment(),
        "observe_us": observe_us,
        "render": render,
        "memory": memory,
        "counts": {"cpu": {"tiny": counts}},
    }
    markdown = render_markdown(results)
    assert "## Targets" in markdown
    assert torch.cuda.is_available() or "not measured: no GPU" in markdown
    verdicts = {row["target"]: row["ok"] for row in targets(results)}
    assert verdicts["<= 1 host read per observed step (CPU)"] is True


def test_blocks_of_several_steps_as_on_cuda(workload):
    variants = variants_module.default_variants(workload.device, third_party=False)[:2]
    try:
        results = measure_overhead(workload, variants, rounds=2, block=3, window_steps=3, warmup_steps=0)
    finally:
        for v in variants:
            v.close()
    assert [len(r.windows.step_ms) for r in results.values()] == [2, 2]


def test_deferred_cuda_target_reads_the_cuda_counts():
    cuda_counts = {"10M": {"lossbeat_layers_every_step": {"device_syncs_delta_per_step": 0.0}}}
    rows = {row["target"]: row for row in targets({"counts": {"cuda": cuda_counts}})}
    assert rows["0 blocking syncs per step on the deferred CUDA path"]["ok"] is True
    rows = {row["target"]: row for row in targets({})}
    assert rows["0 blocking syncs per step on the deferred CUDA path"]["ok"] is None


def test_gpu_plan_rehearsed_on_cpu_in_bf16_then_merged(tmp_path):
    """The GPU part's code path (bf16 model, counts, timings, merge) on the CPU, in seconds."""
    from benchmarks.run import main as run_main

    gpu_json, gpu_md = tmp_path / "results-gpu.json", tmp_path / "RESULTS-gpu.md"
    assert (
        run_main(
            [
                "--gpu-only",
                "--device",
                "cpu",
                "--gpu-models",
                "tiny-bf16:2",
                "--json",
                str(gpu_json),
                "--out",
                str(gpu_md),
            ]
        )
        == 0
    )
    gpu = json.loads(gpu_json.read_text())
    assert gpu["gpu_only"] and "cuda_error" not in gpu
    counts = gpu["counts"]["cpu"]["tiny-bf16"]
    for name in LOSSBEAT:
        assert counts[name]["host_reads_delta_per_step"] == 1, name
        assert counts[name]["lossbeat_blocking_waits_per_step"] == 0, name
    assert gpu["overhead"]["cpu"]["tiny-bf16"]["variants"]["lossbeat_scalars"]["available"]
    assert "tiny-bf16 model on cpu" in gpu_md.read_text()

    # As if measured on CUDA: the tables move under "cuda" with their device syncs.
    for section in ("counts", "overhead"):
        gpu[section] = {"cuda": gpu[section].pop("cpu")}
    for c in gpu["counts"]["cuda"]["tiny-bf16"].values():
        c["device_syncs_per_step"] = c["scalar_reads_per_step"]
        c["device_syncs_delta_per_step"] = c["scalar_reads_per_step"] - counts["baseline"]["scalar_reads_per_step"]
    gpu["environment"]["gpu"] = "Rehearsal GPU"
    gpu_json.write_text(json.dumps(gpu))
    cpu_json, cpu_md = tmp_path / "results.json", tmp_path / "RESULTS.md"
    cpu = {"quick": True, "seconds": 1.0, "environment": environment()}
    cpu_json.write_text(json.dumps(cpu))
    assert run_main(["--merge-gpu", str(gpu_json), "--json", str(cpu_json), "--out", str(cpu_md)]) == 0
    merged = json.loads(cpu_json.read_text())
    assert set(merged["counts"]) == {"cuda"} and merged["environment"]["gpu"] == "Rehearsal GPU"
    markdown = cpu_md.read_text()
    assert "tiny-bf16 model on cuda" in markdown and "GPU tables: `run.py --gpu-only`" in markdown
    verdicts = {row["target"]: row for row in targets(merged)}
    assert verdicts["0 blocking syncs per step on the deferred CUDA path"]["ok"] is True


def test_moe_cost_at_64_layers_by_128_experts_folded_into_the_results(tmp_path):
    """``run.py --moe-only``: observe(expert_load=...) for 64 MoE layers x 128 experts, counted and
    timed, added to a results file and rendered with its target."""
    from benchmarks.run import main as run_main

    cpu_json, cpu_md = tmp_path / "results.json", tmp_path / "RESULTS.md"
    cpu_json.write_text(json.dumps({"quick": True, "seconds": 1.0, "environment": environment()}))
    assert run_main(["--moe-only", "--json", str(cpu_json), "--out", str(cpu_md)]) == 0
    moe = json.loads(cpu_json.read_text())["moe"]
    assert (moe["layers"], moe["experts"]) == (64, 128)
    assert moe["host_reads_per_step"] == moe["host_reads_per_step_without"] == 1.0  # in the step's one read
    assert moe["device_reads_per_step"] == 0 and moe["packed_values_per_step"] == 2 * 64
    assert moe["moe_series_per_rank"] == 3 * 64  # per layer, never per expert
    assert moe["window_bytes"] == 64 * 1024
    markdown = cpu_md.read_text()
    assert "## Mixture of experts: observe(expert_load=...) at 64 layers x 128 experts" in markdown
    verdicts = {row["target"]: row for row in targets(json.loads(cpu_json.read_text()))}
    assert verdicts["expert_load (64 layers x 128 experts) adds no host read (CPU)"]["ok"] is True
