"""Real components for the end-to-end tests: a webhook receiver, a Prometheus client,
a demo training process and bounded waits. No mocks: these talk HTTP on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, TypeVar

import pytest
from conftest import free_ports
from helpers.processes import kill_tree
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "free_port",
    "wait_until",
    "WebhookReceiver",
    "Delivery",
    "Prometheus",
    "DemoRun",
    "exporter_samples",
    "wait_for_page",
    "AlertmanagerProcess",
    "alertmanager_alerts",
]

T = TypeVar("T")


def free_port() -> int:
    """A free loopback port for a server the test starts (conftest.free_ports: never one bind(0) hands out)."""
    return free_ports(1)


def wait_until(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class Delivery:
    """One alert as Alertmanager delivered it to the webhook."""

    path: str
    received_at: float  # time.time()
    status: str  # firing | resolved
    labels: dict


class WebhookReceiver:
    """An Alertmanager webhook receiver on 127.0.0.1 that records every alert it is sent."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                now = time.time()
                payload = json.loads(body)
                with receiver._lock:
                    for alert in payload.get("alerts", []):
                        receiver.deliveries.append(
                            Delivery(self.path, now, alert.get("status", ""), dict(alert.get("labels", {})))
                        )
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def received(self, **labels: str) -> list[Delivery]:
        """Firing deliveries whose labels include all of ``labels``."""
        with self._lock:
            return [
                d
                for d in self.deliveries
                if d.status == "firing" and all(d.labels.get(k) == v for k, v in labels.items())
            ]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Prometheus:
    """The few Prometheus HTTP API calls the tests need."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _get(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant vector/scalar result of ``expr`` (now, or at Unix time ``at``)."""
        data = self._get("/api/v1/query", query=expr, **({"time": f"{at:.3f}"} if at else {}))
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self._get("/api/v1/query_range", query=expr, start=str(start), end=str(end), step=step)["result"]

    def alerts(self, **labels: str) -> list[dict]:
        """Pending and firing alerts whose labels include all of ``labels``."""
        return [
            a for a in self._get("/api/v1/alerts")["alerts"] if all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def firing(self, alertname: str, **labels: str) -> list[dict]:
        return [a for a in self.alerts(alertname=alertname, **labels) if a["state"] == "firing"]

    def rule_queries(self, name: str) -> list[str]:
        """The PromQL of every loaded alerting or recording rule called ``name``."""
        return [r["query"] for g in self._get("/api/v1/rules")["groups"] for r in g["rules"] if r["name"] == name]

    def target_health(self, job: str) -> list[str]:
        return [t["health"] for t in self._get("/api/v1/targets")["activeTargets"] if t["labels"].get("job") == job]


def exporter_samples(port: int) -> dict[str, float]:
    """The exporter's current samples as {name{labels}: value}; {} if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "run_id")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


@dataclass
class DemoRun:
    """A real ``lossbeat demo`` training process with its exporter on a free port."""

    job: str
    log_path: Path
    args: list[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> DemoRun:
        cmd = [sys.executable, "-m", "lossbeat", "demo", "--port", str(self.port), "--no-progress", *self.args]
        log = open(self.log_path, "wb")
        with log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started_at = time.time()
        return self

    def wait_serving(self, timeout: float = 180) -> None:  # a hang guard: torch's import is slow on a busy machine
        def serving():
            if self.proc.poll() is not None:
                pytest.fail(f"demo exited early ({self.proc.returncode}):\n{self.log_tail()}")
            announced = self.announced_port()
            if announced is not None and announced != self.port:
                # Another process took the port: whatever answers on it is not this run.
                pytest.fail(f"the demo serves on :{announced}, not the :{self.port} given:\n{self.log_tail()}")
            return announced is not None and exporter_samples(self.port)

        wait_until(serving, timeout, f"the demo exporter on :{self.port}")

    def announced_port(self) -> int | None:
        """The port the demo says it serves on (its first line), once it has said so."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        match = re.search(r"metrics on http://[^:/]+:(\d+)/metrics", text)
        return int(match.group(1)) if match else None

    def first_time(self, metric_prefix: str, timeout: float) -> float:
        """Wall time at which the exporter first shows a sample starting with ``metric_prefix`` > 0.

        Polled at 10 Hz straight from the exporter: the moment the fault is observable.
        """

        def seen():
            for name, value in exporter_samples(self.port).items():
                if name.startswith(metric_prefix) and value > 0:
                    return time.time()
            if self.proc.poll() is not None:
                pytest.fail(f"demo exited before {metric_prefix} rose:\n{self.log_tail()}")
            return None

        return wait_until(seen, timeout, f"{metric_prefix} > 0 on the exporter", interval=0.1)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"demo still running after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the process by PID: SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None:
            terminate(self.proc)

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed trainer would die."""
        self.proc.kill()
        self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def terminate(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Stop a child we started: SIGTERM, then SIGKILL after ``timeout`` seconds, with everything it
    started (a launcher's ranks)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)


def wait_for_page(receiver: WebhookReceiver, alertname: str, job: str, timeout: float, path: str = "/page") -> Delivery:
    """The first firing ``alertname`` for ``job`` delivered on ``path`` (the paging route)."""

    def delivered():
        return [d for d in receiver.received(alertname=alertname, job=job) if d.path == path]

    return wait_until(delivered, timeout, f"{alertname} for job {job} delivered to {path}")[0]


class AlertmanagerProcess:
    """A bare Alertmanager on a free loopback port, for a control next to the stack's own."""

    def __init__(self, config: Path, workdir: Path) -> None:
        from lossbeat.stack.local import find_binary

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log = open(workdir / "alertmanager-control.log", "wb")
        self.proc = subprocess.Popen(
            [
                find_binary("alertmanager"),
                f"--config.file={config}",
                f"--storage.path={workdir / 'am-control'}",
                f"--web.listen-address={self.address}",
                "--cluster.listen-address=",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        def ready():
            if self.proc.poll() is not None:
                pytest.fail(f"control alertmanager exited: {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_until(ready, timeout, "the control alertmanager")

    def stop(self) -> None:
        terminate(self.proc)
        self._log.close()


def alertmanager_alerts(url: str, alertname: str) -> list[dict]:
    """Alerts named ``alertname`` as Alertmanager's v2 API reports them (with status)."""
    query = urllib.parse.urlencode({"filter": f'alertname="{alertname}"'})
    with urllib.request.urlopen(f"{url}/api/v2/alerts?{query}", timeout=5) as resp:
        return json.load(resp)
