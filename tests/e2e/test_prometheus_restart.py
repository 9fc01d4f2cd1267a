"""An old event does not page again after a Prometheus restart, end to end: a real Prometheus
(its own, on the generated rules) scrapes a real exporter whose only NaN fired and ended; it is
stopped for longer than its lookback delta (20 s here, 5 m by default: nothing before the
outage is an instant sample any more) and started again on the same TSDB. The NaN counter comes
back at its value: no new event (the rules before read it as a new series and fired at once).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lossbeat.stack.local import find_binary

from .e2e_harness import Prometheus, free_port, terminate, wait_until
from .scaled_memory import e2e_overrides, lookback_interval  # noqa: F401 (this module's stack)
from .stack_config import MEMORY_WATCH_SECONDS

ROOT = Path(__file__).resolve().parents[2]


LOOKBACK_DELTA = 20
"""Prometheus's --query.lookback-delta here (default 300 s): the outage needs to outlast it, and it
must outlast the lookback group's interval, whose rules read their own previous sample."""
EXPORTER = """
import math, sys, time
from lossbeat import start_exporter
m = start_exporter(int(sys.argv[1]), addr="127.0.0.1", port_per_local_rank=False, run_id="restart", linger_seconds=0)
step = 0
while True:
    step += 1
    m.observe(step, loss=math.nan if step == 5 else 2.0 - step * 1e-5)
    time.sleep(0.1)
"""


def _ask(probe):
    """``probe()``, or nothing while Prometheus is down or starting."""
    try:
        return probe()
    except OSError:
        return []


def _prometheus(config: Path, data: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                find_binary("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--query.lookback-delta={LOOKBACK_DELTA}s",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def test_an_old_nan_does_not_page_after_a_prometheus_restart(servers, e2e_rules, tmp_path):
    exporter_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(e2e_rules)],
                "scrape_configs": [
                    {"job_name": "restart", "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]}
                ],
            }
        )
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOSSBEAT_"))},
        "PYTHONPATH": str(ROOT / "exporter"),
    }
    with open(tmp_path / "exporter.log", "wb") as out:
        exporter = subprocess.Popen(
            [sys.executable, "-c", EXPORTER, str(exporter_port)], env=env, stdout=out, stderr=out
        )
    prom = Prometheus(f"http://127.0.0.1:{prom_port}")
    server = _prometheus(config, tmp_path / "data", prom_port, tmp_path / "prometheus.log")
    try:
        wait_until(lambda: _ask(lambda: prom.firing("TrainingLossNaN", job="restart")), 180, "the NaN to fire")
        wait_until(lambda: not prom.alerts(alertname="TrainingLossNaN", job="restart"), 240, "the NaN alert to end")
        # The rules that remember the counter (the lookback group's) have done so.
        memory = "job_run_id_instance_rank:training_nonfinite_loss:last_nonzero"
        if prom.rule_queries(memory):
            wait_until(lambda: prom.query(f'{memory}{{job="restart"}} == 1'), 120, "the counter remembered")
        terminate(server)
        time.sleep(LOOKBACK_DELTA + 10)
        server = _prometheus(config, tmp_path / "data", prom_port, tmp_path / "prometheus.log")
        wait_until(
            lambda: _ask(lambda: prom.query('training_nonfinite_loss_total{job="restart"} == 1')), 120, "scrapes again"
        )
        deadline = time.monotonic() + MEMORY_WATCH_SECONDS
        while time.monotonic() < deadline:
            again = prom.alerts(alertname="TrainingLossNaN", job="restart")
            assert not again, f"the old NaN fired again after the restart: {again}"
            time.sleep(1)
    finally:
        terminate(server)
        terminate(exporter)
