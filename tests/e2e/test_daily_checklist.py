"""The daily checklist against a real Prometheus and Alertmanager: a run whose memory
grows fires TrainingMemoryGrowing, a run slowed on purpose fires TrainingThroughputDropped,
a healthy run fires neither, and `lossbeat checklist --prometheus` reads the live job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .e2e_harness import wait_for_page, wait_until
from .stack_config import E2E_THRESHOLDS

# Seconds, not hours: the rules' windows shrunk, the same expressions. The memory test
# leaks 4 MiB a step on a machine with tens of GiB: growth is judged against 0.2 % of it,
# and any growth reaches the limit within a year.
OVERRIDES = {
    **E2E_THRESHOLDS,
    "memory": {"growth_fraction": 0.002, "window": "20s", "oom_horizon": "1y", "growing_for": "3s"},
    "throughput": {"rate_window": "5s", "baseline": "60s", "for": "5s"},
}


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    return OVERRIDES


def _fires(prometheus, alertname: str, job: str, timeout: float) -> dict:
    return wait_until(lambda: prometheus.firing(alertname, job=job), timeout, f"{alertname} to fire for {job}")[0]


def test_a_leaking_run_fires_memory_growing_and_opens_a_ticket(demo, prometheus, receiver):
    run = demo("--steps", "400", "--step-delay", "0.05", "--batch-size", "8", "--fault", "leak", "--fault-step", "100")
    run.wait_serving()
    alert = _fires(prometheus, "TrainingMemoryGrowing", run.job, timeout=300)
    assert alert["labels"]["severity"] == "warning" and alert["labels"]["device"] == "cpu"
    # A warning: Alertmanager routes it to the ticket queue, never to the pager.
    ticket = wait_for_page(receiver, "TrainingMemoryGrowing", run.job, timeout=60, path="/ticket")
    assert ticket.labels["rank"] == "0"
    assert not [d for d in receiver.received(alertname="TrainingMemoryGrowing", job=run.job) if d.path == "/page"]


def test_a_slowed_run_fires_throughput_dropped_and_the_checklist_crosses_item_8(demo, prometheus, receiver):
    # Paced steps (--step-time): the rate the rule judges is the demo's, not the machine's load.
    run = demo(
        "--steps",
        "2000",
        "--step-time",
        "0.1",
        "--batch-size",
        "8",
        "--fault",
        "slow",
        "--fault-step",
        "300",
        "--eval-every",
        "0",
    )
    run.wait_serving()
    alert = _fires(prometheus, "TrainingThroughputDropped", run.job, timeout=300)
    assert alert["labels"]["rank"] == "0"
    # The checklist while the alert fires: once the slow rate fills the baseline window, the
    # run's new level is its own and the alert resolves (the ticket stays).
    result = subprocess.run(
        [sys.executable, "-m", "lossbeat", "checklist", "--prometheus", prometheus.url, "--job", run.job, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    wait_for_page(receiver, "TrainingThroughputDropped", run.job, timeout=60, path="/ticket")
    assert result.returncode == 1, result.stderr
    items = {i["number"]: i for i in json.loads(result.stdout)["items"]}
    assert items[8]["ok"] is False and "TrainingThroughputDropped" in items[8]["value"]
    assert items[6]["ok"] is True  # no NaN in this run


def test_a_healthy_run_fires_neither_and_the_checklist_reads_it(demo, prometheus):
    # Paced steps: a busy machine slows the work inside a step, not the steps/s the rule reads.
    run = demo("--steps", "600", "--step-time", "0.1", "--batch-size", "8", "--eval-every", "50")
    run.wait_serving()
    wait_until(
        lambda: prometheus.query(f'training_steps_total{{job="{run.job}"}} > 300'),
        300,
        "the healthy run to pass step 300",
    )
    assert not prometheus.alerts(alertname="TrainingThroughputDropped", job=run.job)
    assert not prometheus.alerts(alertname="TrainingMemoryGrowing", job=run.job)
    result = subprocess.run(
        [sys.executable, "-m", "lossbeat", "checklist", "--prometheus", prometheus.url, "--job", run.job],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == f"lossbeat checklist: job {run.job} at {prometheus.url}", result.stderr
    assert "\u2713 6. no NaN/Inf" in result.stdout
    assert "\u2713 8. training speed normal" in result.stdout
