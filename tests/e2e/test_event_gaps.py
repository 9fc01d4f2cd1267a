"""An old event does not page again after a scrape gap, end to end: a real exporter whose only
NaN paged once is paused (SIGSTOP: its scrapes time out, as in a GC pause or a checkpoint
holding the GIL, and Prometheus writes staleness markers for its series), then goes on. Its
counter comes back at the value it had: no new event, no second page, however long we watch
past the event window (the rules before read the series as new one window after the gap).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lossbeat.stack.local import write_target_groups

from .e2e_harness import free_port, terminate, wait_for_page, wait_until
from .scaled_memory import e2e_overrides, lookback_interval  # noqa: F401 (this module's stack)
from .stack_config import MEMORY_WATCH_SECONDS

ROOT = Path(__file__).resolve().parents[2]
JOB = "e2e-event-gap"


# One NaN loss at step 5, then a healthy run (10 steps/s) until killed.
EXPORTER = """
import math, sys, time
from lossbeat import start_exporter
m = start_exporter(int(sys.argv[1]), addr="127.0.0.1", port_per_local_rank=False, run_id="gap", linger_seconds=0)
step = 0
while True:
    step += 1
    m.observe(step, loss=math.nan if step == 5 else 2.0 - step * 1e-5)
    time.sleep(0.1)
"""


def test_a_nan_pages_once_across_a_scrape_gap(stack, prometheus, receiver, tmp_path):
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOSSBEAT_"))},
        "PYTHONPATH": str(ROOT / "exporter"),
    }
    with open(tmp_path / "exporter.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", EXPORTER, str(port)], env=env, stdout=out, stderr=out)
    try:
        write_target_groups(stack.targets_file, [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": JOB}}])
        wait_for_page(receiver, "TrainingLossNaN", JOB, timeout=120)
        # The NaN's window passes: the alert resolves.
        wait_until(lambda: not prometheus.alerts(alertname="TrainingLossNaN", job=JOB), 180, "the NaN alert to end")
        # The gap: scrapes time out for a few seconds.
        proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: prometheus.query(f'up{{job="{JOB}"}} == 0'), 60, "a failed scrape", interval=0.2)
        time.sleep(2)
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: prometheus.query(f'up{{job="{JOB}"}} == 1'), 60, "scrapes answered again")
        deadline = time.monotonic() + MEMORY_WATCH_SECONDS
        while time.monotonic() < deadline:
            again = prometheus.alerts(alertname="TrainingLossNaN", job=JOB)
            assert not again, f"the old NaN paged again after the gap: {again}"
            time.sleep(1)
        pages = [d for d in receiver.received(alertname="TrainingLossNaN", job=JOB) if d.status == "firing"]
        assert len(pages) == 1, pages
        assert prometheus.query(f'training_nonfinite_loss_total{{job="{JOB}"}} == 1')
    finally:
        write_target_groups(stack.targets_file, [])
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        terminate(proc)
