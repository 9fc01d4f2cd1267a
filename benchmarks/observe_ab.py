"""observe() side by side: this checkout's lossbeat against other commits', in one process, interleaved.

    python -m benchmarks.observe_ab --against main --against f7a0381 --json benchmarks/observe_ab_results.json

Each commit's ``exporter/lossbeat`` is extracted with ``git archive`` and imported under its
own set of ``sys.modules`` entries (swapped in while that side runs), so every side shares one
interpreter, one torch and one prometheus_client, and the rounds alternate A B C, B C A, ...:
on a machine whose speed drifts from minute to minute, only such paired rounds compare.

Figures per side (medians and minima over the rounds; the paired ratio against this checkout):

* ``float`` / ``tensor_0d``: mean µs per scalars-only ``observe()`` over a round of calls
  (``benchmarks/observe_cost.py``'s inputs: a slowly falling noisy loss, grad norm 0.5, LR 1e-3),
  after a warm-up that fills every window; ``*_cpu``: the same in the thread's CPU time, which
  a thread waiting for a core does not count (the steadier figure on a loaded machine);
* ``heap_churn_bytes``: the Python heap a step allocates beyond what it started with,
  ``tracemalloc``'s peak during one ``observe()`` minus the traced size before it, averaged
  over the steps (what the allocator turns over per step, freed or not);
* ``render_ms``: ``generate_latest`` of a monitor holding 1,000 per-layer norms.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

__all__ = ["Side", "compare"]

_PREFIX = "lossbeat"


def _owned(name: str) -> bool:
    return name == _PREFIX or name.startswith(_PREFIX + ".")


def _loss_at(step: int) -> float:
    # The same inputs as benchmarks/observe_cost.py: the diagnosis stays on its ordinary path.
    return 2.0 / (1.0 + step * 1e-4) + 0.01 * ((step * 7919) % 13) / 13


class Side:
    """One lossbeat package (a source folder holding ``lossbeat/``), importable beside the others."""

    def __init__(self, label: str, source: Path, also: tuple[str, ...] = ()) -> None:
        self.label, self.source = label, source
        saved = {k: sys.modules.pop(k) for k in list(sys.modules) if _owned(k)}
        sys.path.insert(0, str(source))
        try:
            importlib.invalidate_caches()
            core = importlib.import_module("lossbeat.monitor")  # a package now, one module in older commits
            for name in also:
                importlib.import_module(name)
            self.modules = {k: sys.modules[k] for k in list(sys.modules) if _owned(k)}
        finally:
            sys.path.remove(str(source))
            for k in [k for k in sys.modules if _owned(k)]:
                del sys.modules[k]
            sys.modules.update(saved)
        if not Path(core.__file__).resolve().is_relative_to(source.resolve()):
            raise RuntimeError(f"{label}: imported {core.__file__}, not the copy in {source}")
        self.Monitor, self.MonitorConfig = core.Monitor, core.MonitorConfig

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This side's modules in ``sys.modules`` and its folder first on ``sys.path`` (a lazy
        import inside lossbeat finds its own; one made now is kept for the next time)."""
        saved = {k: sys.modules.pop(k) for k in list(sys.modules) if _owned(k)}
        sys.modules.update(self.modules)
        sys.path.insert(0, str(self.source))
        try:
            yield
        finally:
            sys.path.remove(str(self.source))
            self.modules = {k: sys.modules.pop(k) for k in list(sys.modules) if _owned(k)}
            sys.modules.update(saved)

    def monitor(self, **config: Any) -> Any:
        with self.active():
            return self.Monitor(self.MonitorConfig(port=0, log_status_changes=False, **config), serve=False)


def extract(rev: str, into: Path) -> Path:
    """``exporter/lossbeat`` of commit ``rev`` under ``into`` (returns the folder holding ``lossbeat/``)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "exporter/lossbeat"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "exporter"


class _Stream:
    """One monitor fed one kind of input, step after step across rounds."""

    def __init__(self, side: Side, kind: str, warmup: int) -> None:
        import torch

        self.side, self.kind = side, kind
        self.monitor = side.monitor()
        self.step = 0
        self.make = (
            (lambda i: (_loss_at(i), 0.5))
            if kind == "float"
            else (lambda i: (torch.tensor(_loss_at(i)), torch.tensor(0.5)))
        )
        self.run(warmup)

    def inputs(self, calls: int) -> list[tuple[Any, Any]]:
        return [self.make(i) for i in range(self.step, self.step + calls)]

    def run(self, calls: int) -> tuple[float, float]:
        """Mean µs per call over ``calls`` observes (inputs built before the clock starts): wall
        time, and the CPU time of this thread (what a descheduled thread does not count)."""
        args = self.inputs(calls)
        observe, step = self.monitor.observe, self.step
        with self.side.active():
            start, cpu = time.perf_counter(), time.thread_time()
            for loss, grad_norm in args:
                observe(step, loss=loss, grad_norm=grad_norm, learning_rate=1e-3)
                step += 1
            elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        self.step = step
        return elapsed / calls * 1e6, cpu / calls * 1e6

    def churn(self, calls: int) -> float:
        """Mean bytes a step allocates beyond what it started with (tracemalloc's per-step peak)."""
        args = self.inputs(calls)
        observe, step, total = self.monitor.observe, self.step, 0
        with self.side.active():
            tracemalloc.start()
            try:
                for loss, grad_norm in args:
                    tracemalloc.reset_peak()
                    before = tracemalloc.get_traced_memory()[0]
                    observe(step, loss=loss, grad_norm=grad_norm, learning_rate=1e-3)
                    total += tracemalloc.get_traced_memory()[1] - before
                    step += 1
            finally:
                tracemalloc.stop()
        self.step = step
        return total / calls


class _Render:
    """What /metrics serves with ``layers`` per-layer norms: ``exposition.render.bake`` where the
    side has it, else prometheus_client's ``generate_latest`` (what its endpoint served)."""

    def __init__(self, side: Side, layers: int) -> None:
        import torch
        from prometheus_client import generate_latest

        render = side.modules.get("lossbeat.exposition.render")
        self.side = side
        self.generate = (lambda registry: render.bake(registry, None, None)) if render else generate_latest
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(layers)))
        model(torch.randn(2, 4)).square().mean().backward()
        self.monitor = side.monitor(max_layers=layers)
        with side.active():
            for step in range(3):
                self.monitor.observe(step, loss=1.0, learning_rate=1e-3, model=model)
        self.series = len(self.monitor.state.layer_norms)

    def run(self, repeats: int) -> tuple[float, float]:
        with self.side.active():
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(repeats):
                self.generate(self.monitor.registry)
            return (time.perf_counter() - start) / repeats * 1e3, (time.thread_time() - cpu) / repeats * 1e3


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def compare(
    sides: list[Side], rounds: int, calls: int, warmup: int, churn_calls: int, render_layers: int, render_repeats: int
) -> dict:
    """Every figure for every side, the sides' order rotated round by round."""
    streams = {(s.label, kind): _Stream(s, kind, warmup) for s in sides for kind in ("float", "tensor_0d")}
    renders = {s.label: _Render(s, render_layers) for s in sides}
    samples: dict[tuple[str, str], list[float]] = {}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for kind in ("float", "tensor_0d"):
            for side in order:
                wall, cpu = streams[side.label, kind].run(calls)
                samples.setdefault((side.label, kind), []).append(wall)
                samples.setdefault((side.label, kind + "_cpu"), []).append(cpu)
        for side in order:
            wall, cpu = renders[side.label].run(render_repeats)
            samples.setdefault((side.label, "render_ms"), []).append(wall)
            samples.setdefault((side.label, "render_ms_cpu"), []).append(cpu)
        for side in order:
            samples.setdefault((side.label, "heap_churn_bytes"), []).append(
                streams[side.label, "float"].churn(churn_calls)
            )
        loads.append(os.getloadavg()[0])
    base = sides[0].label
    out: dict[str, Any] = {}
    for side in sides:
        figures = {}
        for metric in (
            "float",
            "float_cpu",
            "tensor_0d",
            "tensor_0d_cpu",
            "render_ms",
            "render_ms_cpu",
            "heap_churn_bytes",
        ):
            values = samples[side.label, metric]
            figures[metric] = _summary(values)
            if side.label != base:
                ratios = [a / b for a, b in zip(samples[base, metric], values)]
                figures[metric]["ratio_new_over_this"] = statistics.median(ratios)
        figures["render_layers"] = renders[side.label].series
        out[side.label] = figures
    for s in list(streams.values()) + list(renders.values()):
        with s.side.active():
            s.monitor.close()
    return {"sides": out, "load_average_1m": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="REV",
        help="a commit to compare with (repeatable; e.g. main, f7a0381)",
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000, help="observe() calls per round and input kind")
    parser.add_argument("--warmup", type=int, default=3000, help="steps before the first round (windows full)")
    parser.add_argument("--churn-calls", type=int, default=500)
    parser.add_argument("--render-layers", type=int, default=1000)
    parser.add_argument("--render-repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lossbeat-ab-") as tmp:
        sides = [Side("this", ROOT / "exporter")]
        for rev in args.against:
            commit = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
            ).stdout.strip()
            sides.append(Side(f"{rev} ({commit})" if commit != rev else rev, extract(rev, Path(tmp) / commit)))
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        started = time.time()
        results = compare(
            sides, args.rounds, args.calls, args.warmup, args.churn_calls, args.render_layers, args.render_repeats
        )
    results.update(
        {
            "this": f"{head} (+ working tree)",
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "seconds": round(time.time() - started, 1),
            "settings": {
                k: getattr(args, k)
                for k in ("rounds", "calls", "warmup", "churn_calls", "render_layers", "render_repeats")
            },
        }
    )
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "exporter"))
    raise SystemExit(main())
