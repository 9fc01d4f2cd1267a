"""`lossbeat stack`: the rendered config is valid for the real promtool, and up/status/down
start, report and stop real Prometheus and Alertmanager processes by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from lossbeat.stack import Stack, render_prometheus_config, write_targets_file

from conftest import require_binary
from e2e.e2e_harness import Prometheus, free_port, wait_until

RULES = """\
groups:
- name: stack-test
  rules:
  - alert: TargetDown
    expr: up == 0
"""
ALERTMANAGER = """\
route:
  receiver: nobody
receivers:
- name: nobody
"""


@pytest.fixture
def config_files(tmp_path) -> tuple[Path, Path]:
    rules, am = tmp_path / "rules.yml", tmp_path / "alertmanager.yml"
    rules.write_text(RULES)
    am.write_text(ALERTMANAGER)
    return rules, am


@pytest.fixture
def exporter():
    """A real HTTP endpoint serving one metric in the exposition format."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'# TYPE training_step gauge\ntraining_step{rank="0"} 42\n'
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _lossbeat(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lossbeat", "stack", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_rendered_config_passes_promtool(tmp_path, config_files):
    promtool = require_binary("promtool")
    rules, _ = config_files
    targets = tmp_path / "targets.json"
    write_targets_file(targets, ["127.0.0.1:8470", "127.0.0.1:8471"], job="train-a")
    config = render_prometheus_config(targets_file=targets, rule_files=[rules], alertmanagers=["127.0.0.1:9093"],
                                      scrape_interval="1s")
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert config["global"]["evaluation_interval"] == "1s"


def test_stack_python_api_scrapes_targets_under_their_job_label(tmp_path, config_files, exporter):
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    rules, am = config_files
    stack = Stack(workdir=tmp_path / "stack", prometheus_port=free_port(), alertmanager_port=free_port(),
                  targets=[exporter], job="train-b", scrape_interval="1s", rule_files=[rules],
                  alertmanager_config=am)
    with stack:
        prom = Prometheus(stack.prometheus_url)
        result = wait_until(lambda: prom.query('training_step{job="train-b"}'), 20, "a scrape of the exporter")
        assert result[0]["value"][1] == "42"
        assert result[0]["metric"]["instance"] == exporter
        # A live change of the targets file is picked up without a restart.
        stack.set_targets([exporter], job="train-c")
        wait_until(lambda: prom.query('training_step{job="train-c"}'), 20, "the relabelled target")
        pids = dict(stack.pids)
    for pid in pids.values():
        assert not Path(f"/proc/{pid}/exe").exists(), f"pid {pid} still running after stop()"


def test_stack_cli_up_status_down(tmp_path, config_files, exporter):
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    rules, am = config_files
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text("alerts:\n  stalled_after: 15s\n")
    workdir = tmp_path / "cli-stack"
    prom_port, am_port = free_port(), free_port()
    up = _lossbeat("up", "--dir", str(workdir), "--prometheus-port", str(prom_port),
                   "--alertmanager-port", str(am_port), "--targets", exporter, "--scrape-interval", "1s",
                   "--thresholds", str(thresholds), "--alertmanager-config", str(am))
    try:
        assert up.returncode == 0, up.stderr
        assert f"http://127.0.0.1:{prom_port}" in up.stdout
        assert f"http://127.0.0.1:{am_port}" in up.stdout
        again = _lossbeat("up", "--dir", str(workdir), "--rules", str(rules))
        assert again.returncode == 1 and "already running" in again.stderr

        prom = Prometheus(f"http://127.0.0.1:{prom_port}")
        # The rules were generated from the thresholds file given to `up`.
        stalled = prom.rule_queries("TrainingStalled")
        assert stalled and "> 15" in stalled[0], stalled
        wait_until(lambda: prom.target_health("training") == ["up"], 20, "the target to be scraped")
        status = _lossbeat("status", "--dir", str(workdir))
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"http://{exporter}/metrics" in status.stdout and " up" in status.stdout
    finally:
        down = _lossbeat("down", "--dir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert not (workdir / "state.json").exists()
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    live = [line for line in out.splitlines() if str(workdir) in line and " Z" not in line]
    assert not live, f"processes survived `stack down`: {live}"


def test_stack_up_says_how_to_install_missing_binaries(tmp_path, config_files):
    rules, am = config_files
    env = {**os.environ, "PATH": str(tmp_path)}  # no prometheus on this PATH
    env.pop("LOSSBEAT_PROMETHEUS", None)
    result = _lossbeat("up", "--dir", str(tmp_path / "s"), "--rules", str(rules),
                       "--alertmanager-config", str(am), env=env)
    assert result.returncode == 2
    assert "apt-get install prometheus prometheus-alertmanager" in result.stderr
