"""MLflow's file store: ``mlruns/<experiment>/<run>/metrics/<name>``, one file per metric, lines
``timestamp value step`` (a metric named ``train/loss`` is the file ``metrics/train/loss``).

A run's metric files are merged into one row per step (``name -> value``) and read as a table
(:class:`lossbeat.logs.tables.TableReader`: the loss, LR, grad-norm and eval metrics chosen by
name, or by ``--map``). The path may be a run folder, its ``metrics`` folder, an experiment
folder or the ``mlruns`` folder: each run found is a run of its own, in start order. The run's
``meta.yaml`` status (FINISHED, FAILED, KILLED, RUNNING) is noted; FINISHED completes it.
Torch-free (no mlflow import: the store is plain text).
"""

from __future__ import annotations

import os
import re

from lossbeat.logs.records import LogFormatError, RecordBuilder
from lossbeat.logs.tables import TableReader

__all__ = [
    "is_mlflow",
    "parse_mlflow",
    "mlflow_runs",
    "metric_files",
    "read_metric_line",
    "run_status",
    "run_start",
    "STEP_KEY",
]

STEP_KEY = "mlflow step"
"""The row key of the step MLflow stores beside each value (not a metric name: it has a space)."""
STATUS = {"1": "RUNNING", "2": "SCHEDULED", "3": "FINISHED", "4": "FAILED", "5": "KILLED"}
_META_STATUS = re.compile(r"^status:\s*'?(\w+)'?\s*$", re.M)
_META_START = re.compile(r"^start_time:\s*(\d+)\s*$", re.M)
_MAX_RUNS = 1000
_MAX_METRICS = 2000


def _is_run(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "metrics")) and os.path.isfile(os.path.join(path, "meta.yaml"))


def _children(path: str) -> list[str]:
    try:
        return sorted(os.path.join(path, n) for n in os.listdir(path) if not n.startswith("."))
    except OSError:
        return []


def mlflow_runs(path: str) -> list[str]:
    """The run folders at or under ``path`` (a run, its metrics folder, an experiment, ``mlruns``)."""
    path = os.path.normpath(path)
    if os.path.isfile(path):
        up = os.path.dirname(path)
        while up != os.path.dirname(up) and os.path.basename(up) != "metrics":
            up = os.path.dirname(up)
        return [os.path.dirname(up)] if _is_run(os.path.dirname(up)) else []
    if os.path.basename(path) == "metrics" and _is_run(os.path.dirname(path)):
        return [os.path.dirname(path)]
    if _is_run(path):
        return [path]
    if not os.path.isdir(path):
        return []
    runs = [c for c in _children(path) if _is_run(c)]
    if not runs and not os.path.isfile(os.path.join(path, "meta.yaml")):
        runs = [r for c in _children(path) if os.path.isfile(os.path.join(c, "meta.yaml")) for r in _children(c)]
        runs = [r for r in runs if _is_run(r)]
    return runs[:_MAX_RUNS]


def is_mlflow(path: str) -> bool:
    """A folder holding an MLflow file-store run (or runs), or a metric file of one."""
    path = os.fspath(path)
    if os.path.isfile(path):
        up = os.path.dirname(os.path.abspath(path))
        for _ in range(8):  # a metric file, maybe nested (metrics/train/loss)
            if os.path.basename(up) == "metrics" and _is_run(os.path.dirname(up)):
                return True
            up = os.path.dirname(up)
        return False
    return bool(mlflow_runs(path))


def _meta(run: str) -> str:
    try:
        with open(os.path.join(run, "meta.yaml"), encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 16)
    except OSError:
        return ""


def run_start(run: str) -> int:
    """The run's start time (ms) from its ``meta.yaml``; 0 when unknown."""
    m = _META_START.search(_meta(run))
    return int(m.group(1)) if m else 0


def run_status(run: str) -> str | None:
    """The run's status from its ``meta.yaml`` (FINISHED, RUNNING, FAILED, KILLED), or None."""
    m = _META_STATUS.search(_meta(run))
    return STATUS.get(m.group(1), m.group(1)) if m else None


def metric_files(run: str) -> dict[str, str]:
    """metric name -> file, for every metric of the run (nested folders are names with ``/``)."""
    root = os.path.join(run, "metrics")
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            found[os.path.relpath(full, root).replace(os.sep, "/")] = full
            if len(found) >= _MAX_METRICS:
                return found
    return found


def read_metric_line(line: str) -> tuple[str, int | None] | None:
    """``timestamp value step`` -> (value text, step); None for a line that is not one."""
    parts = line.split()
    if len(parts) not in (2, 3) or not parts[0].isdigit():
        return None
    if len(parts) == 2:
        return parts[1], None
    try:
        return parts[1], int(parts[2])
    except ValueError:
        return None


def _read_run(run: str, out: RecordBuilder) -> None:
    files = metric_files(run)
    rows: dict[int, dict[str, str]] = {}
    unstepped: list[str] = []
    for name, file in files.items():
        points: list[tuple[str, int | None]] = []
        with open(file, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                out.counts.read += 1
                got = read_metric_line(line)
                if got is None:
                    if line.strip():
                        out.skip("metric lines that are not 'timestamp value step'")
                    continue
                points.append(got)
        steps = {s for _, s in points}
        if len(points) > 1 and len(steps) == 1:
            unstepped.append(name)  # logged without a step (MLflow stores 0): the order is the step
            points = [(v, i) for i, (v, _) in enumerate(points)]
        for value, step in points:
            rows.setdefault(step or 0, {})[name] = value
    if unstepped:
        out.note(
            f"metrics logged without a step (MLflow stores step 0 for each): {', '.join(unstepped[:8])}: "
            "the order of logging is their step"
        )
    reader = TableReader(out, step=(STEP_KEY,), strict=True)
    reader.header([STEP_KEY, *files])
    for step in sorted(rows):
        reader.row({STEP_KEY: step, **rows[step]}, f"step {step}")
        if out.full:
            out.stop(f"step {step}")
            break
    reader.finish()


def parse_mlflow(path: str, out: RecordBuilder) -> None:
    """Every run at or under ``path``, in start order, each a run of its own."""
    runs = mlflow_runs(path)
    if not runs:
        raise LogFormatError(f"{path}: no MLflow run (a folder with meta.yaml and metrics/) here")
    runs.sort(key=run_start)
    empty = []
    for run in runs:
        if not metric_files(run):
            empty.append(os.path.basename(run))
            continue
        out.new_run(os.path.basename(run))
        try:
            _read_run(run, out)
        except OSError as exc:
            raise LogFormatError(f"{run}: cannot read: {exc.strerror or exc}") from None
        status = run_status(run)
        out.note(f"MLflow run {os.path.basename(run)}: status {status or 'unknown'}")
        if status == "FINISHED":
            out.complete("the MLflow run's status is FINISHED")
    if empty:
        out.note(f"MLflow runs without metrics, not read: {', '.join(empty[:8])}")
    if len(runs) - len(empty) > 1:
        out.note(f"{len(runs) - len(empty)} MLflow runs read in start order, each a run of its own")
