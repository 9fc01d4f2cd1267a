"""`lossbeat watch` end to end: a log written line by line, the real command following it, a real
Prometheus on the shipped (generated) rules and Alertmanager. A NaN in the log pages
TrainingLossNaN; the log then stopping pages TrainingStalled while the watcher stays up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lossbeat.stack.local import write_target_groups

from .e2e_harness import exporter_samples, free_port, terminate, wait_for_page, wait_until

ROOT = Path(__file__).resolve().parents[2]
STALLED_AFTER_S = 15  # alerts.stalled_after in stack_config.E2E_THRESHOLDS


def test_watched_log_pages_nan_then_stalled(stack, e2e_thresholds, receiver, prometheus, tmp_path):
    job = "e2e-watch"
    log = tmp_path / "train.log"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lossbeat", "watch", str(log), "--port", str(port), "--addr", "127.0.0.1",
         "--job", job, "--thresholds", str(e2e_thresholds), "--linger", "0"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "exporter")},
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "watch.err", "w"))
    try:
        write_target_groups(stack.targets_file, [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": job}}])
        wait_until(lambda: _serving(port), 60, "the watcher's /metrics")
        with open(log, "w", encoding="utf-8") as fh:
            for i in range(1, 31):
                loss = "nan" if i == 20 else f"{2.5 - i / 100:.4f}"
                fh.write(f"{{'loss': {loss}, 'grad_norm': 1.1, 'learning_rate': 1e-4, 'epoch': {i / 100}}}\n")
                fh.flush()
                time.sleep(0.1)
        last_record = time.time()  # the log stops growing here; the watcher stays up
        wait_until(lambda: exporter_samples(port).get('training_nonfinite_loss_total{rank="0"}') == 1, 30,
                   "the NaN counted")
        nan = wait_for_page(receiver, "TrainingLossNaN", job, timeout=60)
        assert nan.labels["rank"] == "0"
        stalled = wait_for_page(receiver, "TrainingStalled", job, timeout=STALLED_AFTER_S + 60)
        assert stalled.received_at - last_record >= STALLED_AFTER_S - 1  # from the log's last record
        assert prometheus.target_health(job) == ["up"]  # stalled, not dead: the watcher serves
        assert proc.poll() is None
    finally:
        write_target_groups(stack.targets_file, [])
        terminate(proc)


def _serving(port: int) -> bool:
    try:
        exporter_samples(port)
        return True
    except OSError:
        return False
