"""RESULTS.md from the raw results of run.py."""

from __future__ import annotations

from typing import Any

__all__ = ["render_markdown", "targets"]

TARGET_MODEL = "10M"


def _f(value: Any, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def targets(results: dict) -> list[dict]:
    """Each target: what, the measured value, pass/miss (None when not measured)."""
    rows = []
    overhead = results.get("overhead", {}).get("cpu", {}).get(TARGET_MODEL, {}).get("variants", {})
    for name, limit, what in (
        ("lossbeat_scalars", 0.5, "scalars-only overhead, 10M model"),
        ("lossbeat_layers_every_10", 1.0, "per-layer every 10 steps, 10M model"),
        ("lossbeat_layers_every_step", 3.0, "per-layer every step, 10M model"),
    ):
        r = overhead.get(name)
        if not r or not r.get("available"):
            rows.append({"target": f"{what} < {limit}%", "measured": "not measured", "ok": None})
            continue
        direct, paired = r["direct_overhead_pct"], r["paired_overhead_pct"]
        rows.append(
            {
                "target": f"{what} < {limit}%",
                "measured": f"direct {direct:+.2f}%; paired {paired:+.2f}% "
                f"(IQR {(r['paired_ratio_p25'] - 1) * 100:+.1f}..{(r['paired_ratio_p75'] - 1) * 100:+.1f}%)",
                "ok": direct < limit,
            }
        )

    worst = None
    for model_counts in results.get("counts", {}).get("cpu", {}).values():
        for name, c in model_counts.items():
            if name.startswith("lossbeat"):
                worst = max(worst or 0.0, c["host_reads_delta_per_step"])
    rows.append(
        {
            "target": "<= 1 host read per observed step (CPU)",
            "measured": "not measured" if worst is None else f"max {worst:.2f} over lossbeat variants",
            "ok": None if worst is None else worst <= 1.0,
        }
    )
    cuda_counts = results.get("counts", {}).get("cuda")
    deferred = None
    if cuda_counts:  # every lossbeat variant but the one that turns deferral off
        deferred = max(
            c[name]["device_syncs_delta_per_step"]
            for c in cuda_counts.values()
            for name in c
            if name in DEFERRED_VARIANTS
        )
    rows.append(
        {
            "target": "0 blocking syncs per step on the deferred CUDA path",
            "measured": "not measured: no GPU on this machine"
            if deferred is None
            else f"max {deferred:.2f} a step over the deferred lossbeat variants (vs baseline)",
            "ok": None if deferred is None else deferred <= 0.0,
        }
    )
    us = results.get("observe_us", {})
    for kind, limit in OBSERVE_US.items():
        if kind in us:
            rows.append(
                {
                    "target": f"observe() <= {limit} µs (median), scalars as {kind}",
                    "measured": f"{us[kind]['us']:.1f} µs (min {us[kind]['us_min']:.1f})",
                    "ok": us[kind]["us"] <= limit,
                }
            )
    memory = results.get("memory", {})
    if memory.get("traced_steps"):
        left = memory["tracemalloc_growth_kb"] * 1024 / memory["traced_steps"]
        rows.append(
            {
                "target": f"Python heap left per step <= {HEAP_LEFT_BYTES} B",
                "measured": f"{left:.1f} B (tracemalloc over {memory['traced_steps']:,} steps)",
                "ok": left <= HEAP_LEFT_BYTES,
            }
        )
    moe = results.get("moe")
    if moe:
        rows.append(
            {
                "target": f"expert_load ({moe['layers']} layers x {moe['experts']} experts) adds no host read (CPU)",
                "measured": f"{moe['host_reads_per_step']:.2f} host reads per step with it, "
                f"{moe['host_reads_per_step_without']:.2f} without",
                "ok": moe["host_reads_per_step"] <= moe["host_reads_per_step_without"],
            }
        )
    for r in results.get("render", []):
        if r["layers"] == 1000:
            rows.append(
                {
                    "target": f"render of 1,000 layers <= {RENDER_MS} ms",
                    "measured": f"{r['render_ms']:.2f} ms",
                    "ok": r["render_ms"] <= RENDER_MS,
                }
            )
    return rows


# The budget for the step's own cost (benchmarks/observe_cost.py).
OBSERVE_US = {"float": 15, "tensor_0d": 25}
HEAP_LEFT_BYTES = 100
RENDER_MS = 5


DEFERRED_VARIANTS = ("lossbeat_scalars", "lossbeat_layers_every_step", "lossbeat_layers_every_10", "lossbeat_clip")


def _overhead_table(device: str, models: dict) -> list[str]:
    lines = []
    for model_name, m in models.items():
        lines += [
            f"#### {model_name} model on {device}: {m['parameters']:,} parameters in {m['tensors']} tensors, "
            f"batch {m['batch']}x{m['context']} tokens; {m['rounds']} rounds of {m['block']} step(s) per variant, "
            f"interleaved",
            "",
            "| variant | step ms | clip + monitoring ms | direct overhead | paired overhead (median; IQR over windows) "
            "| per-step paired median |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for _name, r in m["variants"].items():
            if not r["available"]:
                lines.append(f"| {r['title']} | {r['reason']} | | | | |")
                continue
            direct = "n/a (in backward hooks)" if r["work_in_backward"] else f"{r['direct_overhead_pct']:+.2f}%"
            lines.append(
                f"| {r['title']} | {r['step_ms']:.1f} | {r['section_ms']:.2f} | {direct} | "
                f"{r['paired_overhead_pct']:+.2f}% ({(r['paired_ratio_p25'] - 1) * 100:+.1f}.."
                f"{(r['paired_ratio_p75'] - 1) * 100:+.1f}%) | {(r['step_ratio_median'] - 1) * 100:+.2f}% |"
            )
        lines.append("")
    return lines


def _counts_table(device: str, models: dict) -> list[str]:
    lines = []
    syncs = device != "cpu"
    for model_name, counts in models.items():
        lines += [
            f"#### {model_name} model on {device} (per step, averaged over {next(iter(counts.values()))['steps']} steps)",
            "",
            "| variant | host reads (+ vs baseline) | .item() | .tolist/.cpu/.numpy | torch.tensor(list) | "
            + ("device syncs (+) | lossbeat waits | " if syncs else "")
            + "lossbeat host_transfers | aten ops (+ vs baseline) | of which not views (+) |",
            "| --- | ---: | ---: | ---: | ---: | " + ("---: | ---: | " if syncs else "") + "---: | ---: | ---: |",
        ]
        for name, c in counts.items():
            sync_cell = (
                f"{c['device_syncs_per_step']:.1f} ({c['device_syncs_delta_per_step']:+.1f}) | "
                f"{_f(c.get('lossbeat_blocking_waits_per_step'), '.2f')} | "
                if syncs
                else ""
            )
            lines.append(
                f"| {name} | {c['host_reads_per_step']:.1f} ({c['host_reads_delta_per_step']:+.1f}) | "
                f"{c['scalar_reads_per_step']:.1f} | {c['method_reads_per_step']:.1f} | {c['list_reads_per_step']:.1f} | "
                + sync_cell
                + f"{_f(c['lossbeat_host_transfers_per_step'], '.1f')} | "
                f"{c['ops_per_step']:.0f} ({c['ops_delta_per_step']:+.1f}) | "
                + (
                    f"{c['compute_ops_per_step']:.0f} ({c['compute_ops_delta_per_step']:+.1f}) |"
                    if "compute_ops_per_step" in c
                    else "- |"
                )
            )
        lines.append("")
    return lines


def _moe_section(m: dict) -> list[str]:
    env = m.get("environment", {})
    return [
        f"## Mixture of experts: observe(expert_load=...) at {m['layers']} layers x {m['experts']} experts",
        "",
        f"`benchmarks/moe_cost.py` on {m['device']} (measured {env.get('date', '?')}, lossbeat at "
        f"{env.get('lossbeat_commit') or '?'}; no GPU here, so the device side is CPU time), {m['steps']} steps "
        "of one routing each (4,096 tokens, top-8):",
        "",
        "| figure | with expert_load | without |",
        "| --- | ---: | ---: |",
        f"| host reads per step | {m['host_reads_per_step']:.2f} | {m['host_reads_per_step_without']:.2f} |",
        f"| device reads per step (`.item()`, `.tolist()`) | {m['device_reads_per_step']:.2f} | - |",
        f"| aten ops added per step (kernels) | {m['ops_per_step_added']:.0f} ({m['kernel_ops_per_step_added']:.0f}) | - |",
        f"| observe() µs (median of 3 runs) | {m['observe_us']:.0f} | {m['observe_us_without']:.0f} |",
        f"| values packed into the step's one transfer | {m['packed_values_per_step']} | - |",
        f"| moe_router check µs (one judgment) | {m['moe_router_check_us']:.0f} | - |",
        f"| training_moe_* series per rank (per layer, never per expert) | {m['moe_series_per_rank']} | 0 |",
        f"| scrape ms (whole registry) | {m['scrape_ms_with_moe']:.2f} | {m['scrape_ms_without']:.2f} |",
        f"| dead-expert window on the device | {m['window_bytes'] / 1024:.0f} KiB | - |",
        "",
    ]


def render_markdown(results: dict, notes: str = "") -> str:
    env = results["environment"]
    lines = [
        "# lossbeat overhead benchmarks",
        "",
        f"Generated by `python benchmarks/run.py{' --quick' if results['quick'] else ''}` on {env['date']}.",
        "",
        f"- machine: {env['cpu_model']}, {env['cores']} cores (shared with other jobs while measured), "
        f"torch threads {env['torch_threads']}",
        f"- lossbeat at {env.get('lossbeat_commit') or '?'}"
        + (" (with uncommitted changes in exporter/lossbeat)" if env.get("lossbeat_core_dirty") else ""),
        f"- python {env['python']}, torch {env['torch']}, prometheus-client {env['prometheus_client']}",
        f"- optional: lightning {env['lightning'] or 'not installed'}, wandb {env['wandb'] or 'not installed'}",
        f"- GPU: {env['gpu'] or 'none: the GPU tables were not measured here'}",
    ]
    gpu_env = results.get("gpu_environment")
    if gpu_env:  # measured apart (run.py --gpu-only) and merged
        lines.append(
            f"- GPU tables: `run.py --gpu-only` on {gpu_env['date']}, {gpu_env.get('gpu')}, {gpu_env['cores']} cores, "
            f"python {gpu_env['python']}, torch {gpu_env['torch']}, lossbeat at {gpu_env.get('lossbeat_commit') or '?'}"
        )
    lines += [
        f"- wall time of this run: {results['seconds']:.0f} s",
        "",
        "## Targets",
        "",
        "| target | measured | result |",
        "| --- | --- | --- |",
    ]
    for row in targets(results):
        verdict = {True: "pass", False: "**miss**", None: "not measured"}[row["ok"]]
        lines.append(f"| {row['target']} | {row['measured']} | {verdict} |")
    lines += [
        "",
        "Overhead targets are judged on the *direct* estimate (time in the clip + monitoring section minus the "
        "baseline's, over the baseline step), which is precise; the *paired* estimate (whole-step means over windows "
        "of 10 steps per variant, variant over baseline in the same window, variants alternating step by step) "
        "also catches indirect costs but carries one to three percent of noise on this shared machine. Both are "
        "in the tables.",
        "",
    ]
    if notes:
        lines += [notes.strip(), ""]
    lines += ["## Per-step overhead", ""]
    for device, models in results.get("overhead", {}).items():
        lines += _overhead_table(device, models)
    if "cuda_error" in results:
        lines += [f"GPU run failed: `{results['cuda_error']}`", ""]
    if "cuda" not in results.get("overhead", {}):
        lines += [
            "GPU table: not measured yet (no CUDA device here). `run.py` runs it wherever CUDA is present; "
            "`benchmarks/gpu.sh` runs it alone on a lent GPU machine, `run.py --merge-gpu` adds it here.",
            "",
        ]
    lines += [
        "## Host reads and aten ops per step (counted, not timed)",
        "",
        "A host read on CPU waits for nothing; on an accelerator each read of a device tensor is a "
        "blocking sync. The baseline's own reads are AdamW's step counters.",
        "",
    ]
    for device, models in results.get("counts", {}).items():
        lines += _counts_table(device, models)
    if "render" in results:
        lines += [
            "## /metrics render",
            "",
            "| layers | series | render ms (median) | p90 ms | bytes | observe(model=...) ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in results["render"]:
            lines.append(
                f"| {r['layers']:,} | {r['layer_series']:,} | {r['render_ms']:.2f} | {r['render_ms_p90']:.2f} | "
                f"{r['bytes']:,} | {r['observe_model_ms']:.2f} |"
            )
        lines.append("")
    if "scrape" in results:
        s = results["scrape"]
        lines += [
            "## Training while scraped",
            "",
            f"{s['model']} model, lossbeat per-layer every step, served on 127.0.0.1 and scraped over HTTP every "
            f"{s['interval_s']:g} s in alternate blocks: step {s['step_ms_unscraped']:.1f} ms unscraped vs "
            f"{s['step_ms_scraped']:.1f} ms scraped, paired ratio {s['paired_ratio']:.3f} "
            f"(range {s['paired_ratio_min']:.3f}..{s['paired_ratio_max']:.3f}); {s['scrapes']} scrapes, "
            f"median scrape latency {_f(s['scrape_latency_ms'])} ms, {s['scrape_failures']} failed.",
            "",
        ]
    if "observe_us" in results:
        u = results["observe_us"]
        lines += [
            "## observe() in Python time (scalars only: loss, grad_norm, learning_rate)",
            "",
            f"- float inputs: {u['float']['us']:.1f} µs median (min {u['float']['us_min']:.1f})",
            f"- 0-d CPU tensor inputs: {u['tensor_0d']['us']:.1f} µs median (min {u['tensor_0d']['us_min']:.1f})",
            "",
        ]
    if "moe" in results:
        lines += _moe_section(results["moe"])
    if "memory" in results:
        m = results["memory"]
        lines += [
            "## Memory over a long run",
            "",
            f"{m['steps']:,} scalars-only observe() calls with float loss took {m['seconds']:.1f} s "
            f"({m['us_per_observe']:.1f} µs each, loss generation included). RSS {m['rss_start_mb']:.1f} MiB -> "
            f"{m['rss_end_mb']:.1f} MiB ({m['rss_growth_mb']:+.2f} MiB); checkpoints: "
            + ", ".join(f"{c['step']:,}: {c['rss_mb']:.1f}" for c in m["rss_checkpoints"])
            + f". tracemalloc over {m['traced_steps']:,} further calls: {m['tracemalloc_growth_kb']:+.1f} KiB.",
            "",
        ]
    return "\n".join(lines) + "\n"
