"""observe() in instructions: a figure no other job on the machine can move.

    python -m benchmarks.observe_instructions --against main --against f7a0381

Re-runs itself under valgrind's callgrind (``apt-get install valgrind``), instrumentation off
while torch and each side load (``benchmarks/observe_ab.py``'s side-by-side import), on for
``--calls`` scalars-only ``observe()`` calls per side and input kind after a warm-up that fills
every window: the CPU instructions per call, counted by the simulated CPU. On a shared machine
wall-clock medians move 2x from one minute to the next; instruction counts repeat to the
thousandth. They are not time: a cache miss or a slow instruction costs more than one; the
µs of ``benchmarks/observe_ab.py`` and ``observe_cost.py`` are the time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

__all__ = ["main"]

_KINDS = ("float", "tensor_0d")


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)


def _measure(revs: list[str], calls: int, warmup: int) -> None:
    """Inside callgrind: each region is dumped under its own name (``side@kind``; ``empty`` first)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.observe_ab import Side, _Stream, extract

    tmp = Path(tempfile.mkdtemp(prefix="lossbeat-ir-"))
    try:
        sides = [Side("this", ROOT / "exporter")] + [
            Side(rev, extract(rev, tmp / str(i))) for i, rev in enumerate(revs)
        ]
        streams = {(s.label, kind): _Stream(s, kind, warmup) for s in sides for kind in _KINDS}
        for stream in streams.values():  # the calls' inputs, built outside the counted regions
            stream.args = stream.inputs(calls)
        _control("-i", "on")
        _control("-d", "empty")  # the control call itself, counted in every region: subtracted
        labels = {s.label: i for i, s in enumerate(sides)}
        for (label, kind), stream in streams.items():
            observe, step = stream.monitor.observe, stream.step
            with stream.side.active():
                for loss, grad_norm in stream.args:
                    observe(step, loss=loss, grad_norm=grad_norm, learning_rate=1e-3)
                    step += 1
            _control("-d", f"side{labels[label]}@{kind}")  # a plain name: callgrind_control reads others as options
        _control("-i", "off")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _totals(folder: Path) -> dict[str, int]:
    out = {}
    for path in glob.glob(str(folder / "cg.out*")):
        text = Path(path).read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: (.*)$", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if trigger and total:
            name = trigger.group(1).split("Client Request:")[-1].split("Dump Request:")[-1].strip()
            out[name] = int(total.group(1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", action="append", default=[], metavar="REV")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        _measure(args.against, args.calls, args.warmup)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="lossbeat-callgrind-"))
    try:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={folder}/cg.out",
            sys.executable,
            "-m",
            "benchmarks.observe_instructions",
            "--inside",
            "--calls",
            str(args.calls),
            "--warmup",
            str(args.warmup),
        ]
        for rev in args.against:
            command += ["--against", rev]
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}
        )
        if done.returncode:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        totals = _totals(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    empty = next(v for k, v in totals.items() if k.endswith("empty"))
    results: dict = {"calls": args.calls, "warmup": args.warmup, "instructions_per_call": {}}
    names = ["this", *args.against]
    for name, total in totals.items():
        if "@" in name:
            side, kind = name.removeprefix("dump ").rsplit("@", 1)
            label = names[int(side.removeprefix("side"))]
            results["instructions_per_call"].setdefault(label, {})[kind] = round((total - empty) / args.calls)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
