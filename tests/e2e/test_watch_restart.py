"""A restarted `lossbeat watch` does not page old events again, end to end: a real watcher
follows a growing nanoGPT log whose only NaN paged once; it is killed (an OOM kill, a sidecar
restarted) and started again on the same log. The replay brings the same run's counters back at
their values: a real Prometheus on the generated rules sees no new event (before, the restart
was a fresh run identity whose counters were all new, and the NaN paged again).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lossbeat.stack.local import write_target_groups

from .e2e_harness import free_port, terminate, wait_for_page, wait_until
from .scaled_memory import e2e_overrides, lookback_interval  # noqa: F401 (this module's stack)
from .stack_config import MEMORY_WATCH_SECONDS

ROOT = Path(__file__).resolve().parents[2]
JOB = "e2e-watch-restart"


def _line(step: int) -> str:
    loss = "nan" if step == 50 else f"{3 - step / 10000:.4f}"
    return f"iter {step}: loss {loss}, time 12.00ms, mfu 1.00%\n"


def _watch(log: Path, port: int, out: Path) -> subprocess.Popen:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOSSBEAT_", "TORCHELASTIC_"))},
        "PYTHONPATH": str(ROOT / "exporter"),
    }
    env.pop("MASTER_ADDR", None)
    cmd = [sys.executable, "-m", "lossbeat", "watch", str(log), "--port", str(port), "--addr", "127.0.0.1"]
    with open(out, "ab") as fh:
        return subprocess.Popen([*cmd, "--linger", "0"], env=env, stdout=fh, stderr=subprocess.STDOUT)


def test_a_restarted_watcher_does_not_page_an_old_nan(stack, prometheus, receiver, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(_line(s) for s in range(1, 101)), encoding="utf-8")
    stop = threading.Event()

    def write_on():  # the run goes on: a record every 0.2 s
        step = 100
        with open(log, "a", encoding="utf-8") as fh:
            while not stop.wait(0.2):
                step += 1
                fh.write(_line(step))
                fh.flush()

    writer = threading.Thread(target=write_on, daemon=True)
    writer.start()
    port = free_port()
    watcher = _watch(log, port, tmp_path / "watch.log")
    try:
        write_target_groups(stack.targets_file, [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": JOB}}])
        wait_for_page(receiver, "TrainingLossNaN", JOB, timeout=120)
        wait_until(lambda: not prometheus.alerts(alertname="TrainingLossNaN", job=JOB), 180, "the NaN alert to end")
        watcher.send_signal(signal.SIGKILL)
        watcher.wait(10)
        wait_until(lambda: prometheus.query(f'up{{job="{JOB}"}} == 0'), 60, "a failed scrape", interval=0.2)
        watcher = _watch(log, port, tmp_path / "watch.log")
        wait_until(
            lambda: prometheus.query(f'training_nonfinite_loss_total{{job="{JOB}"}} == 1'),
            120,
            "the restarted watcher scraped",
        )
        deadline = time.monotonic() + MEMORY_WATCH_SECONDS
        while time.monotonic() < deadline:
            again = prometheus.alerts(alertname="TrainingLossNaN", job=JOB)
            assert not again, f"the old NaN paged again after the watcher's restart: {again}"
            time.sleep(1)
        series = prometheus.query(f'last_over_time(training_nonfinite_loss_total{{job="{JOB}"}}[10m])')
        assert len({s["metric"]["run_id"] for s in series}) == 1, series
    finally:
        stop.set()
        write_target_groups(stack.targets_file, [])
        terminate(watcher)
        writer.join(5)
