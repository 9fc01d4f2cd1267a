"""Writes the measured part of docs/tests.md from the JUnit XML files the suite's runs wrote.

``make test-report`` runs ``make test`` and ``make test-prometheus3`` with ``--junitxml`` and then
this script, so the counts, times and slowest tests in the page are the ones just measured:

    python3 scripts/test_report.py --write docs/tests.md \\
        "Prometheus 2.42.0, Alertmanager 0.25.0=out/junit.xml" "Prometheus 3.5.3, ...=out/junit-3.xml"

Each argument is ``LABEL=FILE``: the servers the run used, and its JUnit file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

BEGIN, END = "<!-- measured:begin -->", "<!-- measured:end -->"
SLOWEST = 10


@dataclass(frozen=True)
class Run:
    label: str
    tests: int
    failed: int
    errors: int
    skipped: int
    seconds: float
    slowest: list[tuple[float, str]]

    @property
    def passed(self) -> int:
        return self.tests - self.failed - self.errors - self.skipped


def read_junit(label: str, path: Path) -> Run:
    """One run's counts, wall time and slowest tests from a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    cases = [case for suite in suites for case in suite.iter("testcase")]
    slowest = sorted(
        ((float(c.get("time", 0)), f"{c.get('classname', '').replace('.', '/')}.py::{c.get('name')}") for c in cases),
        reverse=True,
    )[:SLOWEST]
    return Run(
        label=label,
        tests=sum(int(s.get("tests", 0)) for s in suites),
        failed=sum(int(s.get("failures", 0)) for s in suites),
        errors=sum(int(s.get("errors", 0)) for s in suites),
        skipped=sum(int(s.get("skipped", 0)) for s in suites),
        seconds=sum(float(s.get("time", 0)) for s in suites),
        slowest=slowest,
    )


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return (out.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def render(runs: list[Run], commit: str, when: str, cores: int) -> str:
    """The measured block: one row a run, then each run's slowest tests."""
    lines = [
        BEGIN,
        f"Measured by `make test-report` on `{commit}`, {when}, on a machine with {cores} cores.",
        "",
        "| run | tests | passed | failed | errors | skipped | pytest wall time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run.label} | {run.tests} | {run.passed} | {run.failed} | {run.errors} | {run.skipped} "
            f"| {run.seconds:.1f} s |"
        )
    for run in runs:
        lines += ["", f"The slowest {len(run.slowest)} tests of the run on {run.label}:", ""]
        lines += ["| seconds | test |", "|---:|---|"]
        lines += [f"| {seconds:.2f} | `{name}` |" for seconds, name in run.slowest]
    lines.append(END)
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with its measured block replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} block to replace")
    return text[:start] + block + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=FILE", help="the servers a run used, and its JUnit XML")
    parser.add_argument("--write", type=Path, metavar="PAGE", help="replace the measured block of PAGE (else print)")
    args = parser.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, file = spec.rpartition("=")
        if not sep or not label:
            parser.error(f"runs: {spec!r} is not LABEL=FILE")
        runs.append(read_junit(label, Path(file)))
    block = render(runs, _commit(), datetime.date.today().isoformat(), os.cpu_count() or 0)
    if args.write is None:
        print(block)
    else:
        args.write.write_text(replace_block(args.write.read_text(encoding="utf-8"), block), encoding="utf-8")
    return 0 if all(run.failed == run.errors == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
