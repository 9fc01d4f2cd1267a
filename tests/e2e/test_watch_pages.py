"""`lossbeat watch` end to end on real Hugging Face Trainer runs (tests/e2e/hf_log_trainer.py): a
healthy run and one whose loss turns NaN at step NAN_AT train at once, each writing its printed
output, a LLaMA-Factory-style ``trainer_log.jsonl`` and a TensorBoard directory (the Trainer's own
SummaryWriter). A watcher follows each of the six logs into the module's real Prometheus (the
generated rules) and Alertmanager (the shipped routing). The NaN pages TrainingLossNaN from every
log; the faulty trainer then killed, TrainingStalled pages from the log's last record while the
watchers stay up; the healthy run fires no alert at all, through its completion and its watchers'
exit. The printed logs are followed by the `lossbeat watch` command; the other four by the
Watcher it runs, in this process (four fewer interpreters to start).

Pacing is by the clock (the trainer sleeps between steps); the waits are hang guards.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import require_module

from lossbeat.exposition.server import RankContext
from lossbeat.logs.tensorboard import event_files
from lossbeat.monitor import MonitorConfig
from lossbeat.stack.local import write_target_groups

from .e2e_harness import free_port, terminate, wait_for_page

ROOT = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("hf_log_trainer.py")
STALLED_AFTER_S = 15  # alerts.stalled_after in stack_config.E2E_THRESHOLDS
EXPORTER_DOWN_FOR_S = 5  # alerts.exporter_down_for there
HEALTHY_STEPS = 40
NAN_AT = 8
STEP_S = 0.25
LINGER_S = 10  # a completed watcher stays until Prometheus (1 s scrapes) has read its marker
LOGS = ("printed", "jsonl", "tensorboard")


class Trainer:
    def __init__(self, folder: Path, *args: str) -> None:
        folder.mkdir()
        self.folder = folder
        self.printed = folder / "train.log"
        self.paths = {"printed": self.printed, "jsonl": folder / "trainer_log.jsonl", "tensorboard": folder / "tb"}
        with open(self.printed, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(TRAINER), "--dir", str(folder), "--step-s", str(STEP_S), *args],
                env={**os.environ, "PYTHONPATH": str(ROOT / "exporter"), "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def last_growth(self, log: str) -> float:
        """When the log last grew: the file's mtime (TensorBoard: its newest event file's)."""
        path = self.paths[log]
        return os.path.getmtime(event_files(str(path))[-1] if log == "tensorboard" else path)

    def tail(self) -> str:
        return self.printed.read_text(errors="replace")[-3000:]


class CommandWatch:
    """``lossbeat watch PATH`` as a user runs it."""

    def __init__(self, path: Path, job: str, thresholds: Path, err: Path) -> None:
        self.port = free_port()
        self._err = open(err, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lossbeat",
                "watch",
                str(path),
                "--port",
                str(self.port),
                "--addr",
                "127.0.0.1",
                "--job",
                job,
                "--thresholds",
                str(thresholds),
                "--linger",
                str(LINGER_S),
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT / "exporter")},
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ended(self, timeout: float) -> str:
        return "completed" if self.proc.wait(timeout) == 0 else f"exit {self.proc.returncode}"

    def stop(self) -> None:
        terminate(self.proc)
        self._err.close()


class ThreadWatch:
    """The Watcher ``lossbeat watch`` runs, in a thread of this process."""

    def __init__(self, path: Path, job: str, thresholds: Path) -> None:
        from lossbeat.watch import Watcher

        config = MonitorConfig(
            port=0, addr="127.0.0.1", run_name=job, thresholds=str(thresholds), linger_seconds=LINGER_S
        )
        self.watcher = Watcher(path, config, rank_context=RankContext(0, 0, 1, "log"))
        self.port = self.watcher.monitor.port
        self.ended: list[str] = []
        self.thread = threading.Thread(target=lambda: self.ended.append(self.watcher.run()), daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def wait_ended(self, timeout: float) -> str:
        self.thread.join(timeout)
        return self.ended[0] if self.ended else "still running"

    def stop(self) -> None:
        self.watcher.stop()
        self.thread.join(30)


def test_real_trainer_logs_page_nan_then_stalled_and_a_healthy_run_pages_nothing(
    stack, e2e_thresholds, receiver, prometheus, tmp_path
):
    require_module("transformers")
    require_module("tensorboard")
    started = time.time()
    healthy = Trainer(tmp_path / "healthy", "--steps", str(HEALTHY_STEPS))
    faulty = Trainer(tmp_path / "faulty", "--steps", "2000", "--nan-at", str(NAN_AT))  # runs until killed
    watches: dict[tuple[str, str], CommandWatch | ThreadWatch] = {}
    try:
        for run, trainer in (("healthy", healthy), ("nan", faulty)):
            for log in LOGS:
                job = f"e2e-watch-{log}-{run}"
                watches[log, run] = (
                    CommandWatch(trainer.printed, job, e2e_thresholds, tmp_path / f"{job}.err")
                    if log == "printed"
                    else ThreadWatch(trainer.paths[log], job, e2e_thresholds)
                )
        write_target_groups(
            stack.targets_file,
            [
                {"targets": [f"127.0.0.1:{w.port}"], "labels": {"job": f"e2e-watch-{log}-{run}"}}
                for (log, run), w in watches.items()
            ],
        )

        # The NaN at step NAN_AT pages from each of the faulty run's logs. The page's wait counts from
        # the NaN's line in the log: what a busy machine slows first is the trainers' start (the
        # transformers import), which is not what this test judges (a hang guard, never a verdict).
        printed_nan = time.monotonic() + 900
        while (
            not re.search(r"\bnan\b", faulty.printed.read_text(errors="replace"), re.IGNORECASE)
            and faulty.proc.poll() is None
            and time.monotonic() < printed_nan
        ):
            time.sleep(0.5)
        for log in LOGS:
            page = wait_for_page(receiver, "TrainingLossNaN", f"e2e-watch-{log}-nan", timeout=300)
            assert page.labels["rank"] == "0"
        assert faulty.proc.poll() is None, faulty.tail()  # still training when it is killed
        faulty.proc.send_signal(signal.SIGKILL)
        faulty.proc.wait(10)

        # The healthy run completed; each watcher saw the end in its log and left with the marker.
        assert healthy.proc.wait(120) == 0, healthy.tail()
        for log in LOGS:
            assert watches[log, "healthy"].wait_ended(LINGER_S + 60) == "completed", log
        watchers_left = time.time()

        # Killed: the logs stand still, TrainingStalled pages from their last record; the watchers serve on.
        for log in LOGS:
            job = f"e2e-watch-{log}-nan"
            stalled = wait_for_page(receiver, "TrainingStalled", job, timeout=STALLED_AFTER_S + 60)
            assert stalled.received_at - faulty.last_growth(log) >= STALLED_AFTER_S - 1, log
            assert watches[log, "nan"].alive(), log
            assert prometheus.target_health(job) == ["up"], log

        # The healthy run: every step scraped, completed, and no alert of its jobs firing at any
        # evaluation from the start to well past its watchers' exit (TrainingExporterDown would fire
        # exporter_down_for after it, were the marker not read).
        time.sleep(max(0.0, watchers_left + EXPORTER_DOWN_FOR_S + 5 - time.time()))
        window = f"{int(time.time() - started) + 5}s"
        for log in LOGS:
            job = f"e2e-watch-{log}-healthy"
            steps = prometheus.query(f'max_over_time(training_steps_total{{job="{job}"}}[{window}])')
            assert [float(s["value"][1]) for s in steps] == [HEALTHY_STEPS], log
            completed = prometheus.query(f'max_over_time(training_run_completed{{job="{job}"}}[{window}])')
            assert [float(c["value"][1]) for c in completed] == [1.0], log
            firing = prometheus.query(f'ALERTS{{job="{job}", alertstate="firing"}}[{window}]')
            assert firing == [], [f["metric"]["alertname"] for f in firing]
            assert not receiver.received(job=job), log
    finally:
        write_target_groups(stack.targets_file, [])
        for trainer in (healthy, faulty):
            terminate(trainer.proc)
        for watch in watches.values():
            watch.stop()
