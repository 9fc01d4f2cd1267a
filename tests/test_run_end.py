"""How a run ends and what it is doing: the completion marker close() publishes and keeps
scrapeable, the phase, and the heartbeat TrainingStalled watches
(docs/decisions.md#only-close-marks-a-run-finished).

Real monitors serving real HTTP, scraped by a thread that plays Prometheus.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers.scrape import flat, metrics_text

from lossbeat.monitor import Monitor, MonitorConfig, NullMonitor


def scrape(port: int, source: str | None = None) -> dict[str, float]:
    """One scrape, from the loopback address ``source`` when given (one HA replica each)."""
    return flat(metrics_text(port, source=source))


class Scraper:
    """Scrapes /metrics every ``interval`` seconds, as Prometheus would, keeping every answer
    (from the loopback address ``source``, after ``delay`` seconds: a replica of an HA pair)."""

    def __init__(self, port: int, interval: float, source: str | None = None, delay: float = 0.0) -> None:
        self.port, self.interval, self.source, self.delay = port, interval, source, delay
        self.answers: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._stop.wait(self.delay)
        while not self._stop.is_set():
            try:
                self.answers.append((time.monotonic(), scrape(self.port, self.source)))
            except OSError:
                pass  # the exporter is gone: what Prometheus records as up == 0
            self._stop.wait(self.interval)

    def wait_for(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < count:
            assert time.monotonic() < deadline, f"only {len(self.answers)} scrapes"
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def serving(**settings) -> Monitor:
    return Monitor(MonitorConfig(port=0, addr="127.0.0.1", **settings))


def test_close_publishes_the_completion_marker_and_lingers_one_scrape_interval():
    monitor = serving()
    scraper = Scraper(monitor.port, interval=0.4)
    try:
        monitor.observe(1, loss=2.5)
        scraper.wait_for(3)
        assert scraper.answers[-1][1]["training_run_completed"] == 0
        monitor.observe(2, loss=1.75)  # the last step: close() flushes it, a scrape must see it
        started = time.monotonic()
        monitor.close()
        took = time.monotonic() - started
    finally:
        scraper.stop()
    after = [answer for at, answer in scraper.answers if at >= started]
    finished = [a for a in after if a.get("training_run_completed") == 1]
    assert finished, f"no scrape saw the completion marker in {took:.2f}s"
    assert finished[-1]["training_loss"] == 1.75 and finished[-1]["training_steps_total"] == 2
    # Until the scraper read the marker (within its next scrape), not the 90 s bound.
    assert took < 3.0, took


def test_an_ha_pair_of_scrapers_each_reads_the_completion_marker():
    """Two Prometheus replicas (HA), told apart by address, every 3 s at opposite phases. close()
    right after replica A scraped: lingering one merged gap (1.5 s x 1.2 + 0.5) ends before A
    scrapes again, and A would page TrainingExporterDown. Each replica must read the marker."""
    monitor = serving()
    a = Scraper(monitor.port, interval=3.0, source="127.0.0.1")
    b = Scraper(monitor.port, interval=3.0, source="127.0.0.2", delay=1.5)
    try:
        monitor.observe(1, loss=2.5)
        a.wait_for(3)
        b.wait_for(2)
        seen = len(a.answers)
        a.wait_for(seen + 1)  # A has just scraped: its next scrape is 3 s away
        started = time.monotonic()
        monitor.close()
        took = time.monotonic() - started
    finally:
        a.stop()
        b.stop()
    for name, replica in (("A", a), ("B", b)):
        assert replica.answers[-1][1]["training_run_completed"] == 1, (name, took, replica.answers[-1])
    assert took <= 2 * 3.0 + 1 + 1, took  # within each one's next scrape (+ slack), not linger_seconds


def test_close_without_periodic_scrapes_returns_at_once():
    monitor = serving()
    monitor.observe(1, loss=1.0)
    scrape(monitor.port)  # one look by hand is not a Prometheus
    started = time.monotonic()
    monitor.close()
    assert time.monotonic() - started < 1.0  # stopping the server polls every 0.5 s
    assert monitor.state.completed


def test_linger_seconds_bounds_the_wait_and_zero_disables_it():
    # One interval would be 3 s (x1.2 + 0.5); stopping the server itself takes up to 0.5 s.
    for limit, most in ((0.3, 1.3), (0, 1.0)):
        monitor = serving(linger_seconds=limit)
        scraper = Scraper(monitor.port, interval=3.0)
        try:
            scraper.wait_for(2)
            started = time.monotonic()
            monitor.close()
            took = time.monotonic() - started
        finally:
            scraper.stop()
        assert took < most, (limit, took)


def test_leaving_a_with_block_on_an_exception_is_no_completion():
    monitor = serving()
    scraper = Scraper(monitor.port, interval=0.3)
    try:
        scraper.wait_for(2)
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            with monitor:
                monitor.observe(1, loss=1.0)
                raise RuntimeError("the training loop crashed")
        took = time.monotonic() - started
    finally:
        scraper.stop()
    assert monitor.closed and not monitor.state.completed
    assert took < 1.0  # no marker to deliver: no wait (one interval would be 0.86 s + the 0.5 s stop)
    assert all(a["training_run_completed"] == 0 for _, a in scraper.answers)


def test_close_is_idempotent_and_observe_after_close_raises():
    monitor = serving()
    monitor.close()
    monitor.close()
    with pytest.raises(RuntimeError, match="closed"):
        monitor.observe(1, loss=1.0)


@pytest.mark.parametrize("value", [-1, 601, "30", True, float("nan")])
def test_linger_seconds_is_validated(value):
    with pytest.raises(ValueError, match="linger_seconds"):
        MonitorConfig(linger_seconds=value)


def test_phase_sets_at_once_and_restores_as_a_context_manager():
    monitor = Monitor(MonitorConfig(), serve=False)
    state = monitor.state
    assert state.phase[0] == "train"
    with monitor.phase("eval") as scope:
        assert state.phase[0] == "eval" and scope.previous == "train"
        with monitor.phase("checkpoint"):
            assert state.phase[0] == "checkpoint"
            time.sleep(0.2)
        assert state.phase[0] == "eval"
    assert state.phase[0] == "train"
    monitor.phase("eval")  # a framework hook: validation starts ...
    assert state.phase[0] == "eval"
    monitor.phase("train")  # ... and ends
    values = flat(_render(monitor))
    assert values['training_phase{phase="train"}'] == 1
    assert values['training_phase{phase="eval"}'] == 0
    assert values['training_phase_seconds_total{phase="checkpoint"}'] >= 0.2
    assert values['training_phase_seconds_total{phase="train"}'] > 0
    with pytest.raises(ValueError, match="phase"):
        monitor.phase("evaluate")
    with NullMonitor().phase("checkpoint"):
        pass
    with pytest.raises(ValueError, match="phase"):
        NullMonitor().phase("paused")


def test_heartbeat_follows_steps_evaluations_phases_and_heartbeat_calls():
    monitor = Monitor(MonitorConfig(), serve=False)
    assert "training_last_heartbeat_timestamp_seconds" not in flat(_render(monitor))  # no sign yet
    monitor.observe(1, loss=2.0)
    beat = lambda: flat(_render(monitor))["training_last_heartbeat_timestamp_seconds"]  # noqa: E731
    first = beat()
    assert first == monitor.state.last_step_time
    for sign in (lambda: monitor.observe_eval(1, 1.5), lambda: monitor.phase("checkpoint"), monitor.heartbeat):
        time.sleep(0.02)
        before = beat()
        sign()
        assert beat() > before
    assert flat(_render(monitor))["training_last_step_timestamp_seconds"] == first  # steps unchanged


def _render(monitor: Monitor) -> str:
    from prometheus_client import generate_latest

    return generate_latest(monitor.registry).decode()


# --- a script that never calls close() ------------------------------------------------

_SCRIPT = """
import os, signal, sys, time
from lossbeat.monitor import Monitor, MonitorConfig
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the usual handler (docs/reliability.md)
monitor = Monitor(MonitorConfig(port=int(sys.argv[1]), addr="127.0.0.1"))
monitor.observe(1, loss=1.0)
print("serving", flush=True)
time.sleep(float(sys.argv[2]))
if sys.argv[3] == "crash":
    raise RuntimeError("the training loop crashed")
if sys.argv[3] == "exit1":  # a crash caught by main(), as Hydra's run_and_report or click do
    try:
        raise RuntimeError("CUDA out of memory")
    except RuntimeError:
        sys.exit(1)
if sys.argv[3] == "sigterm":  # scancel, a time limit, an eviction
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
if sys.argv[3] == "exit0":
    sys.exit(0)
"""


def _free_port() -> int:
    from conftest import free_ports

    return free_ports(1)


@pytest.mark.parametrize("ending", ["exit", "exit0", "crash", "exit1", "sigterm"])
def test_a_script_without_close_says_completed_at_exit_unless_it_crashed(ending):
    """Only a normal end completes a run: an exception, sys.exit(1) and SIGTERM handled by
    sys.exit(143) publish no completion marker."""
    import subprocess
    import sys

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(port), "3", ending],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "serving", proc.stderr.read()
        scraper = Scraper(port, interval=0.3)
        try:
            proc.wait(timeout=60)
        finally:
            scraper.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    completed = [a["training_run_completed"] for _, a in scraper.answers]
    assert completed and completed[0] == 0
    if ending in ("exit", "exit0"):
        assert proc.returncode == 0 and completed[-1] == 1, completed
    else:
        assert proc.returncode == {"crash": 1, "exit1": 1, "sigterm": 143}[ending]
        if ending == "crash":
            assert "the training loop crashed" in proc.stderr.read()
        assert 1 not in completed, completed
