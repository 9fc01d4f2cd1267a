"""``lossbeat watch``: follow a live log and feed each record to a real :class:`~lossbeat.monitor.Monitor`.

For runs whose code cannot change (a trainer launched from a YAML file, a vendor's job): the
log is the only thing there is. Each record read from it goes to ``Monitor.observe`` /
``observe_eval``, so ``/metrics``, the judgments, the shipped alert rules and the dashboards
work unchanged. What a log cannot give is absent: per-layer gradient norms, the memory
gauges (this process's memory is not the run's). The step time is the time between two
records read, divided by the steps between them.

Liveness: the heartbeat is the time of the last record (the time its line was read; for the
backlog replayed at start, the time the file last grew), so ``TrainingStalled`` fires when the
log stops growing. ``TrainingExporterDown`` keeps its meaning: the watcher died. The run
completes when the log says so (the HF Trainer's ``train_runtime`` summary, printed or in
TensorBoard; LLaMA-Factory's last of ``total_steps``): the monitor closes as completed and the
command exits 0; after ``--idle-timeout`` seconds without a new byte it exits 3, closed as not
completed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Callable, Iterator

from lossbeat.exposition.server import RankContext
from lossbeat.logs import COLUMN_FORMATS, FORMATS, LogFormatError, detect_format
from lossbeat.logs.columns import parse_column_map
from lossbeat.logs.live import LIVE_FORMATS, LiveBuilder, live_parser
from lossbeat.logs.source import SNIFF_BYTES, Source
from lossbeat.monitor import Monitor, MonitorConfig, identity
from lossbeat.monitor.config import DEFAULT_PORT
from lossbeat.watch.end import RunEnd
from lossbeat.watch.events import EventFollower
from lossbeat.watch.events import records as event_records
from lossbeat.watch.follow import Follower
from lossbeat.watch.ranks import RANK_FIELD, assign_ranks
from lossbeat.watch.runs import follow_mlflow, follow_wandb, settle_seconds

__all__ = ["Watcher", "MonitorFeed", "add_arguments", "make_watchers", "follow", "run", "EXIT_COMPLETED", "EXIT_IDLE"]

EXIT_COMPLETED = 0
EXIT_IDLE = 3
REPLAY_SCRAPE_WAIT = 5.0
"""Seconds a scrape waits for the backlog's replay to end (under Prometheus's 10 s scrape timeout)."""
_log = logging.getLogger("lossbeat.watch")


class MonitorFeed:
    """The :class:`~lossbeat.logs.live.LiveSink` that feeds a Monitor; a new run in the log gets a new Monitor."""

    def __init__(self, make_monitor: Callable[[int | None], Monitor], backlog: bool = True) -> None:
        self._make = make_monitor
        self._replayed = threading.Event()
        if not backlog:  # nothing to replay (no log yet, or --tail): served from the start, as before
            self._replayed.set()
        self.reading = False
        """The backlog's replay has begun (a scrape waits for its end, at most REPLAY_SCRAPE_WAIT)."""
        self.monitor = self._gated(make_monitor(None))
        self.replaying = True
        """Records of the backlog (what the file held at start): no step times, stamped at the file's mtime."""
        self.completed: str | None = None
        self.eval_group: str | None = None
        self.records = 0
        self._metrics: dict[str, float] = {}
        """Named values of the next record (a table's columns, signals): observe's ``metrics``."""
        self._last_read: tuple[float, int] | None = None
        """(perf_counter, step) of the last live record read."""

    def _gated(self, monitor: Monitor) -> Monitor:
        """Serve ``monitor``'s run series from the end of the backlog's replay: before it, they
        would show the counters at 0, or climbing again from 0, which Prometheus reads as a
        reset and new events (a restarted watcher re-paging old NaNs). A scrape during the
        replay waits for its end, at most :data:`REPLAY_SCRAPE_WAIT` seconds; before the end it
        gets no run series: a gap, after which the counters come back at their values, which
        the rules read as no new event. A watcher with nothing to replay (the log not written
        yet, ``--tail``) serves from the start."""
        monitor.hold_scrapes(
            lambda: self._replayed.is_set() or (self.reading and self._replayed.wait(REPLAY_SCRAPE_WAIT))
        )
        return monitor

    def release_scrapes(self) -> None:
        self._replayed.set()

    def resume(self, step: int, last: int) -> None:
        _log.warning(
            "lossbeat watch: the step went back from %d to %d: a run resumed from a checkpoint, appending to its "
            "log; its records are followed",
            last,
            step,
        )
        self._last_read = None

    def train(self, step, loss, grad_norm, learning_rate, epoch) -> None:
        m = self.monitor
        now = time.perf_counter()
        if self.replaying or self._last_read is None:
            m.time_next_step_from(None)  # a replayed record took no training time: no step duration
        elif step > self._last_read[1]:
            # The Monitor's step time is the time since its last observe: here, the time per step
            # over the logging interval (a record every N steps is N steps apart).
            last_time, last_step = self._last_read
            m.time_next_step_from(now - (now - last_time) / (step - last_step))
        self._last_read = None if self.replaying else (now, step)
        metrics, self._metrics = self._metrics or None, {}
        m.observe(step, loss=loss, grad_norm=grad_norm, learning_rate=learning_rate, epoch=epoch, metrics=metrics)
        self.records += 1

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """Values of the record that follows (its signals name the task and feed the RL checks)."""
        if len(self._metrics) < 64:
            self._metrics.update(values)

    def eval(self, step, loss, group) -> None:
        # observe_eval has one eval loss: the log's first (or unnamed) eval set
        if self.eval_group is None:
            self.eval_group = group
        if group == self.eval_group:
            self.monitor.observe_eval(step, loss)

    def new_run(self, step: int) -> None:
        _log.warning(
            "lossbeat watch: the step went back to %d: a new run in the same log (a restart); its metrics start again",
            step,
        )
        port = self.monitor.port  # the new run's monitor serves where the last one did (also when 0 was asked)
        self.monitor.close(completed=False)
        self.monitor = self._gated(self._make(port))
        self.eval_group = None
        self._last_read = None

    def complete(self, why: str) -> None:
        self.completed = why
        self.release_scrapes()  # the completion marker must be read

    def end_replay(self, last_growth: float | None) -> None:
        """The backlog is read: the heartbeat is the time the file last grew, not the time of the replay."""
        self.replaying = False
        m = self.monitor
        m.flush()
        self.release_scrapes()
        if last_growth is not None:
            m.state.backdate(last_growth)  # the last record's time is the log's


class Watcher:
    """Follows ``path`` and feeds each record to a Monitor until the log says the run ended,
    ``idle_timeout`` seconds pass without a new byte, or :meth:`stop` is called (another thread)."""

    def __init__(
        self,
        path: str | os.PathLike,
        config: MonitorConfig,
        *,
        fmt: str | None = None,
        from_start: bool = True,
        idle_timeout: float | None = None,
        poll_interval: float = 0.05,
        rank_context: RankContext | None = None,
        column_map: str | dict[str, str] | None = None,
        end: RunEnd | None = None,
    ) -> None:
        if fmt is not None and fmt not in FORMATS:
            raise ValueError(f"fmt: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
        self.column_map = parse_column_map(column_map)
        if self.column_map and fmt is not None and fmt not in COLUMN_FORMATS:
            raise ValueError(
                f"--map: the {fmt} reader chooses its own columns (--map applies to {', '.join(COLUMN_FORMATS)})"
            )
        if fmt is not None and fmt not in _RUN_FORMATS:
            try:
                live_parser(fmt)
            except LogFormatError as exc:  # a format that cannot be followed: a usage error
                raise ValueError(f"fmt: {exc}") from None
        if idle_timeout is not None and not idle_timeout > 0:
            raise ValueError(f"idle_timeout: expected a positive number of seconds, got {idle_timeout!r}")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval: expected a positive number of seconds, got {poll_interval!r}")
        self.path = os.fspath(path)
        self.config = dataclasses.replace(config, feed="log")  # training_run_info{feed="log"}
        self.format = fmt
        self.idle_timeout = idle_timeout
        self.poll_interval = poll_interval
        self.follower = Follower(self.path, from_start=from_start)
        self._rank_context = rank_context or RankContext.from_env()
        # A log that holds a backlog to replay: its run series are served once it is replayed.
        backlog = (
            from_start and os.path.exists(self.path) and (os.path.isdir(self.path) or os.path.getsize(self.path) > 0)
        )
        self.feed = MonitorFeed(self._new_monitor, backlog)
        self.builder: LiveBuilder | None = None
        self.end = end
        self.exit_status: int | None = None
        """The training step's exit status, once ``end`` told it."""
        self.ended: str | None = None
        """Why watching ended: 'completed', 'failed' (the training step's status was not 0),
        'idle' or 'stopped'."""
        self._stop = False
        self._last_data = time.monotonic()
        self._pending: list[str] = []
        self._reset = False

    def _new_monitor(self, port: int | None) -> Monitor:
        config = self.config if port is None else dataclasses.replace(self.config, port=port, port_per_local_rank=False)
        return Monitor(config, rank_context=self._rank_context)

    @property
    def monitor(self) -> Monitor:
        return self.feed.monitor

    def stop(self) -> None:
        self._stop = True

    def following(self) -> bool:
        """Whether to go on following: not stopped, and not idle past ``idle_timeout``."""
        return not (self._stop or self._idle())

    def saw_data(self) -> None:
        """New data was read: the idle timeout counts from now."""
        self._last_data = time.monotonic()

    def _idle(self) -> bool:
        return self.idle_timeout is not None and time.monotonic() - self._last_data > self.idle_timeout

    def _done(self) -> bool:
        return bool(self.feed.completed) or self._stop or self._idle() or self.exit_status is not None

    def _step_ended(self) -> bool:
        """Whether the training step ended (its status read), once the log is read to its end:
        an exit status 0 completes the run, any other closes it as not completed."""
        if self.end is None or self.exit_status is not None:
            return self.exit_status is not None
        status = self.end.status()
        if status is None:
            return False
        self.exit_status = status
        return True

    def _wait_for_format(self) -> str | None:
        """The file's format once it exists and holds a record of a known one (None: idle or stopped)."""
        while not self._stop and not self._idle():
            ended = self.end is not None and self._step_ended()
            try:
                return detect_format(self.path, self.column_map)
            except LogFormatError as exc:
                if ended:
                    return None  # the training step ended without a log of a known format
                size = os.path.getsize(self.path) if os.path.isfile(self.path) else 0
                if size >= SNIFF_BYTES or "compressed" in str(exc) or "binary" in str(exc):
                    raise  # the head is all there is to sniff: no format will turn up
            time.sleep(self.poll_interval)
        return None

    def _lines(self) -> Iterator[str]:
        """The lines as written, waiting for more; returns at a reset (the parser starts again),
        at completion, when idle, or when stopped."""
        follower, feed = self.follower, self.feed
        while True:
            if self._pending:
                lines, self._pending = self._pending, []
            else:
                if self._stop or self._idle():
                    return
                ended = self._step_ended() if self.end is not None else False
                lines, reset = follower.poll()
                feed.reading = feed.reading or bool(lines)
                if reset:
                    self._pending, self._reset = lines, True
                    _log.warning(
                        "lossbeat watch: %s was rotated or truncated: reading it again from its start", self.path
                    )
                    return
            if lines:
                self._last_data = time.monotonic()
                for line in lines:
                    yield line
                    if feed.completed:
                        return
            if feed.replaying and follower.opened and follower.offset >= (follower.replay_until or 0):
                feed.end_replay(follower.last_growth)
            if not lines:
                if ended:
                    return  # the step ended and the log is read to its end
                time.sleep(self.poll_interval)

    def run(self) -> str:
        """Watch until the run ends; returns why ('completed', 'idle' or 'stopped') and closes the monitor."""
        try:
            fmt = self.format or self._wait_for_format()
            if fmt is not None and self.column_map and fmt not in COLUMN_FORMATS:
                fmt = "jsonl" if fmt in ("llamafactory", "detectron2") else "csv" if fmt == "lightning" else "printout"
            if fmt in _RUN_FORMATS:
                self.format = fmt
                _RUN_FORMATS[fmt](self)
            elif fmt is not None:
                parser = live_parser(fmt)
                self.format = fmt
                _log.info("lossbeat watch: following %s (%s) on port %s", self.path, fmt, self.monitor.port)
                self.builder = LiveBuilder(self.path, fmt, self.feed)
                self.builder.column_map = self.column_map
                while not self._done():
                    self._reset = False
                    source = Source(self.path, 0, b"", "utf-8", "", lines=self._lines())
                    try:
                        parser(source, self.builder)
                    except LogFormatError:
                        raise  # the file cannot be read as asked (--map names a column it lacks): not a line's fault
                    except Exception:  # a line the parser chokes on: counted, the watch goes on
                        self.monitor.state.count_error("input")
                        _log.exception("lossbeat watch: cannot parse a line of %s; reading on", self.path)
        except BaseException:
            self.follower.close()
            self.feed.release_scrapes()
            self.monitor.close(completed=False)
            raise
        self.follower.close()
        self.feed.release_scrapes()
        if self.exit_status == 0 and not self.feed.completed:  # the log read to its end, no end marker
            self.feed.complete("the training step exited 0")
        if self.feed.completed:
            self.ended = "completed"
        else:
            self.ended = "failed" if self.exit_status is not None else ("stopped" if self._stop else "idle")
        self.monitor.close(completed=self.ended == "completed")
        return self.ended

    def _follow_events(self) -> None:
        """A TensorBoard run directory or event file: scalars grouped by step, fed as they arrive."""
        follower = EventFollower(self.path)
        self.builder = builder = LiveBuilder(self.path, "tensorboard", self.feed)
        builder.counts.unit = "events"
        pending: dict = {}
        # A step's scalars are events of their own, written one after another: a poll between two of
        # them finds nothing new. The step is handed on when another step's events arrive, or once
        # nothing new came for this long, not at the first empty poll (its grad norm would be lost).
        settle = settle_seconds(self.poll_interval)

        def hand_on(scalars: list, flush: bool) -> None:
            for kind, step, *rest in event_records(scalars, pending, flush=flush):
                builder.where = f"step {step}"
                if kind == "train":
                    builder.train(step, *rest)
                elif kind == "eval":
                    builder.eval(step, *rest)
                else:
                    builder.complete("the HF Trainer logged its final summary (train/train_runtime)")

        _log.info("lossbeat watch: following %s (tensorboard) on port %s", self.path, self.monitor.port)
        while not (self._stop or self._idle()):
            scalars = follower.poll()
            if scalars:
                self._last_data = time.monotonic()
                builder.counts.read += len(scalars)
            hand_on(scalars, flush=not scalars and time.monotonic() - self._last_data >= settle)
            if self.feed.completed:
                return
            if not scalars:
                if self.feed.replaying and follower.file is not None:
                    self.feed.end_replay(os.path.getmtime(follower.file) if os.path.exists(follower.file) else None)
                time.sleep(self.poll_interval)
        hand_on([], flush=True)  # the last step, read before the stop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="the log file or TensorBoard run directory to follow (it may not exist yet); several: "
        f"the ranks of one job (rank{{N}} in each name, else their order), or one path with "
        f"{RANK_FIELD} expanded over --world-size",
    )
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=sorted([*LIVE_FORMATS, *_RUN_FORMATS]),
        help="the log's format (default: detected from its first records)",
    )
    parser.add_argument(
        "--map",
        metavar="ROLE=COL,...",
        help="the columns of a table (CSV, JSON lines, printout, MLflow, W&B, sb3, detectron2): "
        "loss=COL,step=COL,lr=COL,grad_norm=COL,eval=COL,epoch=COL override the choice by name",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port of /metrics (default {DEFAULT_PORT}; + each log's rank, or LOCAL_RANK, as the in-process exporter)",
    )
    parser.add_argument("--addr", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument(
        "--job",
        default=None,
        help="run name in training_run_info (default: the file's name; "
        "several ranks: the first one's, its rank number as {rank})",
    )
    parser.add_argument("--profile", default=None, help="task profile (causal-lm, classification, ...)")
    parser.add_argument("--thresholds", default=None, help="a thresholds YAML overlaid on the defaults")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--from-start",
        dest="from_start",
        action="store_true",
        default=True,
        help="replay what the file holds, then follow (the default: the whole run is judged)",
    )
    where.add_argument("--tail", dest="from_start", action="store_false", help="start at the end of the file")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        metavar="S",
        help="exit (code 3) after S seconds without a new byte (default: follow forever)",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the rank this one log is (with --world-size; default: from the environment)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="the job's number of ranks, which every rank reports (with --rank, or to expand "
        f"{RANK_FIELD}; several logs: default their number)",
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=90.0,
        metavar="S",
        help="at completion, keep /metrics up at most S seconds for a last scrape (default 90)",
    )
    parser.add_argument("--poll-interval", type=float, default=0.05, metavar="S", help="seconds between reads")
    parser.add_argument(
        "--pid",
        type=int,
        default=None,
        help="the training process: the run ends when it does (its exit status cannot be read by another "
        "process: with --end-file, else closed as not completed)",
    )
    parser.add_argument(
        "--end-file",
        default=None,
        metavar="F",
        help="a file the launcher writes when the training step exited, holding its exit status "
        "(0: the run completed, once the log is read to its end)",
    )


def log_run_id(paths: list[str]) -> str:
    """The run identity of the logs followed, where the environment gives none: the host and
    the logs' absolute paths, so a watcher restarted on the same logs (a sidecar restarted, an
    OOM kill) serves the same run's series, and its replay brings them back at their values (no
    new events), where a fresh identity made every old event new."""
    key = "\0".join([socket.gethostname(), *(os.path.abspath(p) for p in paths)])
    return "log-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def make_watchers(args: argparse.Namespace, end: RunEnd | None = None) -> list[Watcher]:
    """One Watcher per log (each serving at once); raises ValueError or TypeError naming the argument."""
    watchers: list[Watcher] = []
    try:
        logs = assign_ranks(args.paths, args.rank, args.world_size)
        run_name = args.job or _run_name(args.paths[0], len(logs) > 1)
        # the ranks followed here are one run: one identity (the environment's, else the logs')
        run_id = identity.environment_identity() or log_run_id(args.paths)
        for log in logs:
            config = MonitorConfig(
                port=args.port,
                addr=args.addr,
                run_name=run_name,
                profile=args.profile,
                thresholds=args.thresholds,
                linger_seconds=args.linger,
                run_id=run_id,
            )
            ctx = RankContext(log.rank, log.rank, log.world_size, "log") if log.rank >= 0 else None
            watchers.append(
                Watcher(
                    log.path,
                    config,
                    fmt=args.fmt,
                    from_start=args.from_start,
                    idle_timeout=args.idle_timeout,
                    poll_interval=args.poll_interval,
                    rank_context=ctx,
                    column_map=getattr(args, "map", None),
                    end=end,
                )
            )
    except BaseException:
        for watcher in watchers:
            watcher.monitor.close(completed=False)
        raise
    return watchers


def follow(watchers: list[Watcher]) -> list[object]:
    """Run every watcher to its end (the ranks of a job each in its own thread); returns, per
    watcher, why it ended ('completed', 'idle', 'stopped') or the exception that ended it.
    Ctrl-C stops them all."""
    ended: list[object] = [None] * len(watchers)

    def watch(i: int) -> None:
        try:
            ended[i] = watchers[i].run()
        except Exception as exc:
            ended[i] = exc

    if len(watchers) == 1:
        watch(0)
        return ended
    threads = [
        threading.Thread(target=watch, args=(i,), name=f"lossbeat-watch-{i}", daemon=True) for i in range(len(watchers))
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except KeyboardInterrupt:
        for watcher in watchers:
            watcher.stop()
        for thread in threads:
            thread.join(30)
        raise
    return ended


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = getattr(args, "command_line", None) or None
    program = command[0] if command else None  # RunEnd starts a process only for a command
    try:
        end = RunEnd(command, getattr(args, "pid", None), getattr(args, "end_file", None))
    except OSError as exc:
        print(f"lossbeat watch: cannot run {program!r}: {exc}", file=sys.stderr)
        return 2
    try:
        watchers = make_watchers(args, end if end.watched else None)
    except (TypeError, ValueError) as exc:
        print(f"lossbeat watch: {exc}", file=sys.stderr)
        return 2
    try:
        ended = follow(watchers)
    except KeyboardInterrupt:
        return 130
    if end.child is not None:  # the command's status is the step's: the caller (sbatch) sees it
        code = end.child.wait()
        _report(watchers, ended)
        return code if code >= 0 else 128 - code
    _report(watchers, ended)
    errors = [why for why in ended if isinstance(why, Exception)]
    for error in errors:
        if not isinstance(error, LogFormatError):
            raise error  # not the log's fault: a bug, shown whole
    if errors:
        return 2
    return EXIT_COMPLETED if all(why == "completed" for why in ended) else EXIT_IDLE


def _report(watchers: list[Watcher], ended: list[object]) -> None:
    for watcher, why in zip(watchers, ended):
        who = f"rank {watcher.monitor.state.rank} ({watcher.path}): " if len(watchers) > 1 else ""
        if isinstance(why, BaseException):
            print(f"lossbeat watch: {who}{why}", file=sys.stderr)
            continue
        b = watcher.builder
        print(
            f"lossbeat watch: {who}{why}"
            + (f" ({watcher.feed.completed})" if watcher.feed.completed else "")
            + (f"; {b.counts.summary()}" if b else ""),
            file=sys.stderr,
        )


def _run_name(path: str, ranks: bool) -> str:
    """The default run name: the log's file name; for the ranks of a job, with ``{rank}`` for the number."""
    name = os.path.basename(os.path.normpath(path))
    return re.sub(r"(?i)(rank[-_]?)\d+", r"\1{rank}", name) if ranks and RANK_FIELD not in name else name


_RUN_FORMATS = {"tensorboard": Watcher._follow_events, "mlflow": follow_mlflow, "wandb": follow_wandb}
"""The formats followed by a reader of their own (a directory of files, a binary record log)."""
