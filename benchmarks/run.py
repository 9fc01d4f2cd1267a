"""Runs every lossbeat benchmark and writes RESULTS.md and results.json into a results folder.

    python benchmarks/run.py            # full: 1M, 10M, 50M models (about half an hour on 2 cores)
    python benchmarks/run.py --quick    # under ~3 minutes: 1M and 10M, fewer rounds
    python benchmarks/run.py --gpu-only --json gpu.json --out gpu.md   # the CUDA part alone (~5 min)
    python benchmarks/run.py --merge-gpu gpu.json --update-committed   # adds those GPU tables to the committed ones
    python benchmarks/run.py --moe-only --update-committed   # the expert_load cost alone (64 layers x 128 experts)

Results go to ``--results-dir`` (default ``benchmarks/results/``, ignored by git), never over
the committed ``benchmarks/RESULTS.md`` and ``results.json`` unless ``--update-committed``
says so (or ``--out``/``--json`` name them).

The GPU part (the 10M model in float32 and a 1.3B model in bf16, blocks of 10
steps synchronized at their end) runs wherever CUDA is present; ``--gpu-only``
runs it alone, on a machine lent for minutes (``benchmarks/gpu.sh``), and
``--merge-gpu`` folds its JSON into the CPU results here. NOTES.md (the causes
of missed targets, written by hand) is copied into RESULTS.md when it exists.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS_DIR = HERE / "results"
sys.path.insert(0, str(HERE.parent))  # `python benchmarks/run.py` from anywhere

import torch  # noqa: E402

from benchmarks.models import MODEL_SPECS, build_workload  # noqa: E402
from benchmarks.moe_cost import measure as measure_moe  # noqa: E402
from benchmarks.observe_cost import measure_memory, measure_observe_us  # noqa: E402
from benchmarks.overhead import count_variants, measure_overhead  # noqa: E402
from benchmarks.render import measure_render, measure_scrape_overhead  # noqa: E402
from benchmarks.report import render_markdown  # noqa: E402
from benchmarks.variants import default_variants, package_version  # noqa: E402

# Timing: (model, rounds); on CPU a round is one step per variant, on CUDA a block of CUDA_BLOCK.
PLANS = {
    "quick": {
        "overhead": [("1M", 30), ("10M", 10)],
        "counted": ["1M"],
        "count_steps": 10,
        "scrape": ("1M", 2, 2.5),
        "render_repeats": 20,
        "observe_calls": 5_000,
        "memory": (100_000, 20_000),
        "moe_steps": 100,
        "cuda": [("10M", 3), ("1.3B", 2)],
    },
    # Seconds: proves every path of the harness (tests/test_readme_clean.py) on the tiny model; measures nothing.
    "smoke": {
        "overhead": [("tiny", 2)],
        "counted": ["tiny"],
        "count_steps": 2,
        "scrape": ("tiny", 1, 0.5),
        "render_repeats": 2,
        "observe_calls": 200,
        "memory": (2_000, 1_000),
        "moe_steps": 10,
        "cuda": [("10M", 1)],
        "third_party": False,
    },
    "full": {
        "overhead": [("1M", 200), ("10M", 80), ("50M", 40)],
        "counted": ["1M", "10M", "50M"],
        "count_steps": 10,
        "scrape": ("10M", 6, 5.0),
        "render_repeats": 50,
        "observe_calls": 20_000,
        "memory": (1_000_000, 100_000),
        "moe_steps": 300,
        "cuda": [("10M", 10), ("1.3B", 4)],
    },
}
GPU_COUNT_STEPS = 5
CUDA_BLOCK = 10


def environment() -> dict:
    cpu_model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu_model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "lossbeat_commit": _git("rev-parse", "--short", "HEAD"),
        "lossbeat_core_dirty": bool(_git("status", "--porcelain", "--", "exporter/lossbeat")),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "prometheus_client": package_version("prometheus_client"),
        "lightning": package_version("lightning"),
        "wandb": package_version("wandb"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True, timeout=10)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_overhead(device: str, plan: list[tuple[str, int]], results: dict, checkpoint, third_party: bool = True) -> None:
    block = CUDA_BLOCK if device == "cuda" else 1
    for model_name, rounds in plan:
        spec = MODEL_SPECS[model_name]
        workload = build_workload(spec, device)
        variants = default_variants(workload.device, third_party=third_party)
        _log(f"overhead {model_name} on {device}: {len(variants)} variants, {rounds} rounds of {block} step(s)")
        try:
            measured = measure_overhead(workload, variants, rounds, block)
        finally:
            for v in variants:
                v.close()
        results.setdefault("overhead", {}).setdefault(device, {})[model_name] = {
            "parameters": workload.parameters,
            "tensors": workload.tensors,
            "batch": spec.batch,
            "context": spec.size.context,
            "rounds": rounds,
            "block": block,
            "variants": {name: r.as_dict() for name, r in measured.items()},
        }
        checkpoint()


def run_counts(device: str, models: list[str], steps: int, results: dict, third_party: bool = True) -> None:
    for model_name in models:
        workload = build_workload(MODEL_SPECS[model_name], device)
        variants = default_variants(workload.device, third_party=third_party)
        _log(f"counting ops and host reads: {model_name} on {device}")
        try:
            counted = count_variants(workload, variants, steps)
        finally:
            for v in variants:
                v.close()
        results.setdefault("counts", {}).setdefault(device, {})[model_name] = counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a run of under ~3 minutes")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a run of seconds that only exercises the harness (the numbers mean nothing)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        help="folder for RESULTS.md and results.json (default: %(default)s, ignored by git)",
    )
    parser.add_argument(
        "--update-committed",
        action="store_true",
        help="write the committed benchmarks/RESULTS.md and results.json instead",
    )
    parser.add_argument("--out", type=Path, default=None, help="the Markdown file (overrides the folder)")
    parser.add_argument("--json", type=Path, default=None, help="the JSON file (overrides the folder)")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite RESULTS.md from the JSON and NOTES.md, measuring nothing"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine more threads only add noise)",
    )
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU part (counts and overhead)")
    parser.add_argument("--device", default="cuda", help="with --gpu-only: the device (cpu rehearses the plan)")
    parser.add_argument(
        "--gpu-models", default=None, help="with --gpu-only: MODEL:ROUNDS,... (default: the full plan's)"
    )
    parser.add_argument(
        "--merge-gpu",
        type=Path,
        default=None,
        metavar="GPU_JSON",
        help="fold a --gpu-only run's JSON into --json and rewrite --out; measures nothing",
    )
    parser.add_argument(
        "--moe-only",
        action="store_true",
        help="only observe(expert_load=...) at 64 layers x 128 experts, folded into --json's results",
    )
    args = parser.parse_args(argv)
    folder = HERE if args.update_committed else args.results_dir
    args.out = args.out or folder / "RESULTS.md"
    args.json = args.json or folder / "results.json"

    if args.render_only:
        base = args.json if args.json.exists() else HERE / "results.json"
        write_outputs(json.loads(base.read_text()), args.out, args.json)
        return 0
    if args.merge_gpu is not None:
        # Onto the CPU results of this folder, else the committed ones.
        base = args.json if args.json.exists() else HERE / "results.json"
        merged = merge_gpu(json.loads(base.read_text()), json.loads(args.merge_gpu.read_text()))
        write_outputs(merged, args.out, args.json)
        _log(f"merged {args.merge_gpu} into {args.json} and {args.out}")
        return 0
    if args.gpu_only:
        return run_gpu_only(args)
    if args.moe_only:
        return run_moe_only(args)
    plan = PLANS["smoke" if args.smoke else "quick" if args.quick else "full"]
    results, checkpoint = _start(args, quick=args.quick or args.smoke, **({"smoke": True} if args.smoke else {}))
    _log("observe() µs")
    results["observe_us"] = measure_observe_us(plan["observe_calls"])
    _log("/metrics render by layer count")
    results["render"] = measure_render((10, 100, 1000, 5000), plan["render_repeats"])
    steps, traced = plan["memory"]
    _log(f"memory over {steps:,} observe() calls")
    results["memory"] = measure_memory(steps, traced)
    checkpoint()
    run_moe(plan["moe_steps"], results)
    checkpoint()
    third_party = plan.get("third_party", True)
    run_counts("cpu", plan["counted"], plan["count_steps"], results, third_party)
    checkpoint()
    run_overhead("cpu", plan["overhead"], results, checkpoint, third_party)
    model_name, rounds, block_seconds = plan["scrape"]
    _log(f"training while scraped: {model_name}")
    results["scrape"] = {
        "model": model_name,
        **measure_scrape_overhead(build_workload(MODEL_SPECS[model_name]), rounds, block_seconds),
    }
    checkpoint()
    if torch.cuda.is_available():
        run_gpu_part("cuda", plan["cuda"], results, checkpoint)
    checkpoint()
    _log(f"wrote {args.out} and {args.json} in {results['seconds']:.0f} s")
    return 0


def _start(args: argparse.Namespace, **header) -> tuple[dict, Callable[[], None]]:
    """A measuring run's set-up: its results, and a checkpoint that writes them so far."""
    torch.set_num_threads(args.threads)
    logging.getLogger("lossbeat").setLevel(logging.ERROR)  # the synthetic losses trip status-change lines
    os.environ.setdefault("WANDB_MODE", "offline")
    started = time.perf_counter()
    results: dict = {**header, "environment": environment()}

    def checkpoint() -> None:  # a crash late in a long run keeps what was measured
        results["seconds"] = time.perf_counter() - started
        write_outputs(results, args.out, args.json)

    return results, checkpoint


def run_moe(steps: int, results: dict) -> None:
    """observe(expert_load=...) at 64 MoE layers x 128 experts (benchmarks/moe_cost.py), on this machine's CPU."""
    _log(f"expert_load at 64 layers x 128 experts: {steps} steps")
    results["moe"] = {**measure_moe(steps, "cpu"), "environment": environment()}


def run_moe_only(args: argparse.Namespace) -> int:
    """The MoE cost alone, folded into the results of --json (else the committed ones): RESULTS.md rewritten."""
    base = args.json if args.json.exists() else HERE / "results.json"
    results = json.loads(base.read_text())
    torch.set_num_threads(args.threads)
    logging.getLogger("lossbeat").setLevel(logging.ERROR)
    run_moe(PLANS["full"]["moe_steps"], results)
    write_outputs(results, args.out, args.json)
    _log(f"wrote the expert_load figures into {args.json} and {args.out}")
    return 0


def run_gpu_part(device: str, plan: list[tuple[str, int]], results: dict, checkpoint) -> None:
    """Counts, then interleaved timings, on ``device``; a failure is recorded, never raised."""
    try:
        run_counts(device, [m for m, _ in plan], GPU_COUNT_STEPS, results)
        checkpoint()
        run_overhead(device, plan, results, checkpoint)
    except Exception as exc:  # a GPU problem must not cost the results already measured
        results["cuda_error"] = f"{type(exc).__name__}: {exc}"
        checkpoint()


def run_gpu_only(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        _log("no CUDA device: nothing to measure")
        return 2
    if args.gpu_models:
        plan = [(name, int(rounds)) for name, rounds in (item.split(":") for item in args.gpu_models.split(","))]
    else:
        plan = PLANS["full"]["cuda"]
    results, checkpoint = _start(args, quick=False, gpu_only=True)
    run_gpu_part(args.device, plan, results, checkpoint)
    checkpoint()
    _log(f"wrote {args.out} and {args.json} in {results['seconds']:.0f} s")
    return 1 if "cuda_error" in results else 0


def merge_gpu(cpu: dict, gpu: dict) -> dict:
    """The CPU results with a --gpu-only run's device tables, error and GPU name added."""
    merged = json.loads(json.dumps(cpu))
    for section in ("overhead", "counts"):
        for device, models in gpu.get(section, {}).items():
            if device != "cpu":
                merged.setdefault(section, {})[device] = models
    merged["environment"]["gpu"] = gpu["environment"].get("gpu")
    merged["gpu_environment"] = gpu["environment"]
    merged.pop("cuda_error", None)
    if "cuda_error" in gpu:
        merged["cuda_error"] = gpu["cuda_error"]
    return merged


def write_outputs(results: dict, markdown: Path, raw: Path) -> None:
    markdown.parent.mkdir(parents=True, exist_ok=True)
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(results, indent=1, default=str) + "\n")
    notes_file = HERE / "NOTES.md"
    notes = notes_file.read_text() if notes_file.exists() else ""
    markdown.write_text(render_markdown(results, notes))


if __name__ == "__main__":
    sys.exit(main())
