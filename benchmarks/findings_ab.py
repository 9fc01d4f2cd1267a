"""Do two lossbeat commits judge alike? Every run of the evaluation, through both, compared finding by finding.

    python -m benchmarks.findings_ab --against main

A speed-up of the hot path or of the diagnosis must leave every judgment as it was. This
replays each run of ``python -m lossbeat.analyze.evaluation`` (the real logs of
``tests/data/real-logs``, the healthy shapes and the synthetic faults; not the demo, which
trains for minutes) two ways on each side, in one process (``benchmarks/observe_ab.py``'s
side-by-side import):

* ``lossbeat analyze``'s replay: every status change (step, check, component, status,
  message), the final findings, the event counters and their steps;
* a live :class:`~lossbeat.monitor.Monitor` fed the same records with ``observe(step,
  loss=..., grad_norm=..., learning_rate=...)`` and ``observe_eval``: its findings after every
  record that was judged, and its event counters after *every* record (an event counted on
  its own step, never a step later).

Prints one line per run and exits 1 on the first difference it lists.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.observe_ab import ROOT, Side, extract

__all__ = ["main"]

_MODULES = ("lossbeat.analyze.evaluation", "lossbeat.analyze.replay", "lossbeat.diagnosis.thresholds")
_COUNTERS = ("nonfinite_loss_total", "nonfinite_grad_total", "loss_spikes_total", "grad_explosions_total")


def _runs(side: Side, logs: Path) -> list[Any]:
    with side.active():
        evaluation = sys.modules["lossbeat.analyze.evaluation"]
        runs = evaluation.real_runs(logs) if logs.is_dir() else []
        runs += evaluation.healthy_shapes() + evaluation.synthetic_faults()
    return runs


def _f(f: Any) -> tuple:
    return (f.check, f.component, int(f.status), f.message, f.known)


def _num(x: Any) -> Any:
    return "nan" if isinstance(x, float) and math.isnan(x) else x


def _replayed(side: Side, run: Any) -> dict:
    with side.active():
        replay = sys.modules["lossbeat.analyze.replay"]
        thresholds = sys.modules["lossbeat.diagnosis.thresholds"]
        t = thresholds.load_thresholds(profile=run.profile) if run.profile else thresholds.load_thresholds()
        a = replay.replay(run.log, t)
        return {
            "changes": [(c.step, int(c.previous), _f(c.finding)) for c in a.changes],
            "final": [_f(f) for f in a.findings],
            "counters": dict(a.counters),
            "event_steps": {k: list(v) for k, v in a.event_steps.items()},
            "pattern": a.pattern.name if a.pattern else None,
        }


def _live(side: Side, run: Any) -> dict:
    """The records through a real Monitor: findings whenever they change, counters after each record."""
    with side.active():
        thresholds = sys.modules["lossbeat.diagnosis.thresholds"]
        t = thresholds.load_thresholds(profile=run.profile) if run.profile else thresholds.load_thresholds()
        monitor = side.Monitor(
            side.MonitorConfig(port=0, thresholds=t, log_status_changes=False, profile=t.profile.name), serve=False
        )
        trail: list = []
        last_findings: tuple = ()
        train, evals = list(run.log.train), list(run.log.evals)
        i = j = 0
        try:
            while i < len(train) or j < len(evals):
                if j < len(evals) and (i >= len(train) or evals[j].step < train[i].step):
                    e = evals[j]
                    j += 1
                    if not e.group:
                        monitor.observe_eval(e.step, e.loss)
                    step = e.step
                else:
                    r = train[i]
                    i += 1
                    if r.loss is None:
                        continue
                    monitor.observe(r.step, loss=r.loss, grad_norm=r.grad_norm, learning_rate=r.learning_rate)
                    step = r.step
                    s = monitor.state
                    trail.append(("counters", step, tuple(getattr(s, c) for c in _COUNTERS)))
                findings = tuple(_f(f) for f in monitor.findings if f.check not in ("memory", "throughput"))
                if findings != last_findings:
                    trail.append(("findings", step, findings))
                    last_findings = findings
            list(monitor.registry.collect())  # a scrape: the gauges a scrape derives are derived
            s = monitor.state
            # The raw gauges to 9 digits: summed in another order (exactly now, a running sum before),
            # they differ in the last bits.
            trail.append(
                (
                    "end",
                    tuple(
                        _num(x if not isinstance(x, float) else float(f"{x:.9g}"))
                        for x in (s.loss, s.grad_norm, s.step, s.loss_cv, s.loss_trend_ratio, s.grad_norm_baseline)
                    ),
                )
            )
        finally:
            monitor.close()
        return {"trail": trail}


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if type(a) is not type(b) and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=str):
            d = _first_difference(a.get(k), b.get(k), f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        for k, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{k}]")
            if d:
                return d
        return None if len(a) == len(b) else f"{path}: {len(a)} items != {len(b)}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", metavar="REV")
    parser.add_argument("--logs", type=Path, default=ROOT.parent / "shared" / "data" / "real-logs")
    parser.add_argument("--no-live", action="store_true", help="compare the replays only")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args(argv)
    logging.getLogger("lossbeat").setLevel(logging.ERROR)  # the faults' own warnings, thousands of them
    logs = args.logs if args.logs.is_dir() else Path("/nonexistent")
    started = time.time()
    tmp = tempfile.mkdtemp(prefix="lossbeat-findings-")
    try:
        return _compare(args, logs, Path(tmp), started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _compare(args: argparse.Namespace, logs: Path, tmp: Path, started: float) -> int:
    this = Side("this", ROOT / "exporter", _MODULES)
    other = Side(args.against, extract(args.against, tmp / "other"), _MODULES)
    runs_this, runs_other = _runs(this, logs), _runs(other, logs)
    names = [r.name for r in runs_this]
    if names != [r.name for r in runs_other]:
        print("the two sides evaluate different runs:", names, [r.name for r in runs_other])
        return 1
    differences, compared, seen_logs = [], 0, set()
    for mine, theirs in zip(runs_this, runs_other):
        key = mine.name if id(mine.log) not in seen_logs else None
        seen_logs.add(id(mine.log))
        if key is None:
            continue
        results = {"replay": (_replayed(this, mine), _replayed(other, theirs))}
        if not args.no_live:
            results["live"] = (_live(this, mine), _live(other, theirs))
        for how, (a, b) in results.items():
            compared += 1
            d = _first_difference(b, a)
            status = "same" if d is None else f"DIFFERENT: {d}"
            print(f"{how:6s} {mine.name}: {status}", flush=True)
            if d:
                differences.append({"run": mine.name, "how": how, "difference": d})
    summary = {
        "against": args.against,
        "compared": compared,
        "differences": differences,
        "seconds": round(time.time() - started, 1),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "exporter"))
    raise SystemExit(main())
