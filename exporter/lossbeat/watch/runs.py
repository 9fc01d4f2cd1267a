"""Following an MLflow run folder and a W&B run as they are written (``lossbeat watch``).

**MLflow** (file store): each metric file of the run (``metrics/<name>``) is followed on its own
(:class:`~lossbeat.watch.follow.Follower`: appended lines, never re-read); a step's values are
gathered from every file and handed on as one row once a later step has been written, or once
nothing new came for :func:`settle_seconds`. The run folder is the latest run (by start time) under the path; a newer
run appearing is a new run. The run's ``meta.yaml`` turning FINISHED completes it; FAILED or KILLED
ends the watch as not completed.

**W&B**: the run's ``.wandb`` file is read as it grows (:class:`~lossbeat.logs.wandb_run.RecordStream`
holds a record half written until its end arrives); each history record is a row; the exit record
ends the run (completed when its exit code is 0). A ``wandb`` folder is followed at its latest run.

Rows go to the table reader (:mod:`lossbeat.logs.tables`), whose records go to the Monitor. ``w`` is
the :class:`~lossbeat.watch.command.Watcher` (its path, feed, stop and idle state). Torch-free.
"""

from __future__ import annotations

import logging
import os
import time
from typing import BinaryIO

from lossbeat.logs.live import LiveBuilder
from lossbeat.logs.mlflow_store import STEP_KEY, metric_files, mlflow_runs, read_metric_line, run_start, run_status
from lossbeat.logs.tables import TableReader
from lossbeat.logs.wandb_run import WandbRows, wandb_file
from lossbeat.watch.follow import Follower

__all__ = ["follow_mlflow", "follow_wandb", "settle_seconds"]

_log = logging.getLogger("lossbeat.watch")
_CHUNK = 1 << 20
_SETTLE_S = 0.5


def settle_seconds(poll_interval: float) -> float:
    """How long nothing new must come before a step written piece by piece (a TensorBoard event
    per scalar, an MLflow file per metric) is handed on: a poll that falls between two of its
    pieces finds nothing new, and handing it on then would lose the rest."""
    return max(_SETTLE_S, 2 * poll_interval)


def _latest_run(path: str) -> str | None:
    runs = mlflow_runs(path)
    return max(runs, key=run_start) if runs else None


def follow_mlflow(w) -> None:
    """Follow the latest MLflow run under ``w.path`` until it finishes, the watch idles or is stopped."""
    feed = w.feed
    w.builder = builder = LiveBuilder(w.path, "mlflow", feed)
    builder.column_map = w.column_map
    _log.info("lossbeat watch: following %s (mlflow) on port %s", w.path, w.monitor.port)
    run: str | None = None
    reader: TableReader | None = None
    followers: dict[str, Follower] = {}
    pending: dict[int, dict[str, str]] = {}
    finishing = False
    settle, last_got = settle_seconds(w.poll_interval), time.monotonic()
    while w.following():
        latest = _latest_run(w.path)
        if latest is None:
            time.sleep(w.poll_interval)
            continue
        if latest != run:
            if run is not None:
                _log.warning("lossbeat watch: a newer MLflow run %s: a new run", os.path.basename(latest))
                feed.new_run(0)
            for f in followers.values():
                f.close()
            run, followers, pending = latest, {}, {}
            reader = TableReader(builder, step=(STEP_KEY,))
        for name, file in metric_files(run).items():
            if name not in followers:
                followers[name] = Follower(file, from_start=w.follower.from_start)
        assert reader is not None  # set with the run, above
        got = False
        for name, follower in followers.items():
            lines, _ = follower.poll()
            for line in lines:
                builder.counts.read += 1
                point = read_metric_line(line)
                if point is None or point[1] is None:
                    builder.skip("metric lines that are not 'timestamp value step'")
                    continue
                pending.setdefault(point[1], {})[name] = point[0]
                got = True
        if got:
            w.saw_data()
            last_got = time.monotonic()
        # A step is whole once a later one was written (each file is written in step order), or
        # once nothing new came for `settle` seconds, or the run finished.
        settled = not got and (finishing or time.monotonic() - last_got >= settle)
        ready = [s for s in sorted(pending) if settled or s < max(pending)]
        for step in ready:
            reader.row({STEP_KEY: step, **pending.pop(step)}, f"step {step}")
        if got:
            continue
        if feed.replaying:
            feed.end_replay(os.path.getmtime(run) if os.path.exists(run) else None)
        status = run_status(run)
        if status == "FINISHED" and finishing:
            builder.complete("the MLflow run's status is FINISHED")
        elif status == "FINISHED":
            finishing = True  # one more poll: lines written just before the status changed are read first
            continue
        elif status in ("FAILED", "KILLED"):
            _log.warning("lossbeat watch: the MLflow run ended %s", status)
            w.stop()
        if feed.completed:
            break
        time.sleep(w.poll_interval)
    for f in followers.values():
        f.close()


def follow_wandb(w) -> None:
    """Follow the W&B run at ``w.path`` (a ``.wandb`` file, a run folder, a ``wandb`` folder)."""
    feed = w.feed
    w.builder = builder = LiveBuilder(w.path, "wandb", feed)
    builder.column_map = w.column_map
    _log.info("lossbeat watch: following %s (wandb) on port %s", w.path, w.monitor.port)
    file: str | None = None
    fh: BinaryIO | None = None
    rows: WandbRows | None = None
    try:
        while w.following():
            if fh is None:
                file = wandb_file(w.path)
                if file is None:
                    time.sleep(w.poll_interval)
                    continue
                fh = open(file, "rb")
                rows = WandbRows(builder)  # from the start, --tail or not: the framing is read from there
                builder.counts.unit = "records"
            assert rows is not None and file is not None  # both set when fh was opened
            data = fh.read(_CHUNK)
            if data:
                w.saw_data()
                rows.feed(data)
                if rows.exit is not None:
                    if rows.exit != 0:
                        _log.warning("lossbeat watch: the W&B run exited with code %s", rows.exit)
                        w.stop()
                    break
                continue
            if feed.replaying:
                feed.end_replay(os.path.getmtime(file) if os.path.exists(file) else None)
            newer = wandb_file(w.path) if os.path.isdir(w.path) else file
            if newer is not None and newer != file:
                _log.warning("lossbeat watch: a newer W&B run %s: a new run", newer)
                fh.close()
                fh = None
                feed.new_run(0)
                continue
            time.sleep(w.poll_interval)
    finally:
        if fh is not None:
            fh.close()
