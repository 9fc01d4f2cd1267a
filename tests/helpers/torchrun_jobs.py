"""Torchrun jobs that several tests share: the variants of one world size run in one job.

Every rank of a torchrun job pays its imports (torch 3-4 CPU-s, the Trainer 7-10 more) and
the launcher its start-up: tests/workers/variants_worker.py runs the variants of a job one after the
other in the same ranks, and :class:`SharedJobs` runs each job once a session (the first test
that needs one starts it) and gives each test its own variant's results, or fails it with
that variant's own error. A variant that raises ends its job; the variants after it run in
a new job, so one failure shows in its own test and hides no other's results.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.processes import kill_tree

RUNNER = Path(__file__).resolve().parents[1] / "workers" / "variants_worker.py"
STALL_S = 300.0
"""A job is stopped when no variant started or finished for this long (a job of its own had 300 s)."""


def torchrun(ranks: int, script: str | os.PathLike, *args: str) -> list[str]:
    """The command that runs ``script`` with ``args`` in ``ranks`` local processes (torchrun, standalone)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(script),
        *args,
    ]


@dataclass(frozen=True)
class Job:
    """``variants``: {name: (worker module in tests/, its arguments without --dir)}, run in this order."""

    ranks: int
    variants: dict[str, tuple[str, list[str]]]


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def _run_once(folder: Path, ranks: int, variants: list) -> tuple[int | None, float, str]:
    """One torchrun job of ``variants``: (exit code or None when stalled, launch time, output file)."""
    folder.mkdir(parents=True)
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"dir": str(folder), "variants": variants}))
    log = folder / "output.log"
    cmd = torchrun(ranks, RUNNER, "--spec", str(spec))
    launched = time.time()
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            seen, deadline = -1, time.monotonic() + STALL_S
            while job.poll() is None:
                progress = sum(1 for p in folder.glob("*/*") if p.name.startswith(("started.", "result.")))
                if progress != seen:
                    seen, deadline = progress, time.monotonic() + STALL_S
                elif time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        finally:
            stalled = job.poll() is None
            if stalled:  # the launcher with its ranks, which run in sessions of their own
                kill_tree(job)
            job.wait()
    return (None if stalled else job.returncode), launched, log


def run_job(folder: Path, job: Job) -> dict[str, dict]:
    """Each variant's outcome: ``{"results": [rank 0's, ...], "seconds": s}``, s its own time plus its
    job's start-up (what a job of its own would have taken), or ``{"error": text}``."""
    outcomes: dict[str, dict] = {}
    left = [[name, worker, list(args)] for name, (worker, args) in job.variants.items()]
    attempt = 0
    while left:
        attempt += 1
        job_dir = folder / f"job-{attempt}"
        rc, launched, log = _run_once(job_dir, job.ranks, left)
        ended = f"stalled: no progress in {STALL_S:.0f} s, killed" if rc is None else f"exit code {rc}"
        first_start = min((p.stat().st_mtime for p in job_dir.glob("*/started.*")), default=launched)
        not_started, failed = [], False
        for name, worker, args in left:
            vdir = job_dir / name
            errors = sorted(vdir.glob("error.*.txt"))
            results = [vdir / f"result.{r}.json" for r in range(job.ranks)]
            alone = (
                f"alone: python -m torch.distributed.run --standalone --nproc-per-node {job.ranks} "
                f"tests/{worker}.py {' '.join(args)} --dir DIR"
            )
            if errors:
                failed = True
                tracebacks = "\n".join(f"--- rank {p.name.split('.')[1]}:\n{p.read_text()}" for p in errors)
                outcomes[name] = {
                    "error": f"variant {name} raised ({alone}):\n{tracebacks}\n"
                    f"--- the job's output ({ended}):\n{_tail(log)}"
                }
            elif all(p.exists() for p in results) and (vdir / "seconds").exists():
                outcomes[name] = {
                    "results": [json.loads(p.read_text()) for p in results],
                    "seconds": first_start - launched + float((vdir / "seconds").read_text()),
                }
            elif vdir.exists():
                failed = True
                outcomes[name] = {
                    "error": f"the job ended ({ended}) in variant {name}, no error recorded ({alone}):\n{_tail(log)}"
                }
            else:
                not_started.append([name, worker, args])
        if not failed and (rc != 0 or not_started):  # no variant explains the job's end: every one fails
            for name, _, _ in left:
                outcomes[name] = {
                    "error": f"the job of {[v[0] for v in left]} ended with {ended} after "
                    f"its variants ran:\n{_tail(log)}"
                }
            not_started = []
        left = not_started
    return outcomes


class SharedJobs:
    """Each job run once a session, by the first test that needs one of its variants: in this process
    without xdist; under xdist in whichever worker asks first (a lock in the session's temp folder,
    which the workers share), the others waiting for it and reading its outcomes."""

    def __init__(self, jobs: dict[str, Job], tmp_path_factory: pytest.TempPathFactory) -> None:
        self.jobs, self.factory, self.outcomes = jobs, tmp_path_factory, {}
        self.job_of = {variant: name for name, job in jobs.items() for variant in job.variants}

    def outcome(self, variant: str) -> dict:
        name = self.job_of[variant]
        if name not in self.outcomes:
            self.outcomes[name] = self._run(name)
        return self.outcomes[name][variant]

    def results(self, variant: str) -> list[dict]:
        """Each rank's result of ``variant``; the test fails with the variant's error if it has one."""
        outcome = self.outcome(variant)
        if "error" in outcome:
            pytest.fail(outcome["error"], pytrace=False)
        return outcome["results"]

    def seconds(self, variant: str) -> float:
        """What ``variant``'s job would have taken alone: its own time and its job's start-up."""
        self.results(variant)
        return self.outcome(variant)["seconds"]

    def _run(self, name: str) -> dict[str, dict]:
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            return run_job(self.factory.mktemp(f"job-{name}"), self.jobs[name])
        shared = self.factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwN/
        done = shared / f"torchrun-job-{name}.json"
        with open(shared / f"torchrun-job-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                done.write_text(json.dumps(run_job(shared / f"torchrun-job-{name}", self.jobs[name])))
            return json.loads(done.read_text())
