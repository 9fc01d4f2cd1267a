"""A real training run, a real Prometheus and a real Alertmanager: the faults page the
on-call receiver with the job and the rank, within a bounded time; a healthy run pages nobody."""

from __future__ import annotations

import time

import pytest

from .e2e_harness import exporter_samples, wait_for_page, wait_until

STEP_DELAY = "0.1"  # ~7 steps/s: the run outlives startup, target discovery and a few scrapes
FAULT_STEP = "60"  # ~8 s into training, after Prometheus has found and scraped the target
MAX_PAGE_LATENCY_S = 30  # scrape 1s + evaluation 1s + group_wait 1s, with room for a busy CI box


def _assert_paged(page, run, alertname: str) -> None:
    assert page.labels["alertname"] == alertname
    assert page.labels["severity"] == "critical"
    assert page.labels["job"] == run.job
    assert page.labels["rank"] == "0"


@pytest.mark.parametrize(
    "fault, counter, alertname",
    [
        ("nan", "training_nonfinite_loss_total", "TrainingLossNaN"),
        ("explode", "training_grad_explosions_total", "TrainingGradientExplosion"),
    ],
)
def test_fault_pages_on_call_with_job_and_rank(demo, receiver, fault, counter, alertname):
    run = demo(
        "--steps", "600", "--step-delay", STEP_DELAY, "--batch-size", "8", "--fault", fault, "--fault-step", FAULT_STEP
    )
    run.wait_serving()
    onset = run.first_time(counter, timeout=120)
    page = wait_for_page(receiver, alertname, run.job, timeout=60)
    latency = page.received_at - onset
    print(f"\n{alertname} paged {latency:.1f}s after the exporter first counted {counter}")
    _assert_paged(page, run, alertname)
    assert latency < MAX_PAGE_LATENCY_S
    # Critical alerts go to the paging route only, never to the ticket queue (an explosion's first
    # departures may open a ticket first, `trigger=isolated`: a warning, routed as one).
    deliveries = receiver.received(alertname=alertname, job=run.job)
    assert all(d.path == "/page" for d in deliveries if d.labels["severity"] == "critical")
    assert all(d.path == "/ticket" for d in deliveries if d.labels["severity"] == "warning")


def test_healthy_run_pages_nobody(demo, receiver, prometheus):
    # --linger: a critical alert raised near the end still has time to be delivered.
    run = demo("--steps", "150", "--step-delay", "0.05", "--batch-size", "8", "--eval-every", "30", "--linger", "6")
    run.wait_serving()
    wait_until(
        lambda: prometheus.query(f'training_steps_total{{job="{run.job}"}}'), 30, "Prometheus to scrape the healthy run"
    )
    assert run.wait_exit(timeout=180) == 0, run.log_tail()
    ended = time.time()
    lifetime = f"{int(ended - run.started_at) + 1}s"
    # Prometheus watched the run to its end ...
    steps = prometheus.query(f'max_over_time(training_steps_total{{job="{run.job}"}}[{lifetime}])', at=ended)
    assert float(steps[0]["value"][1]) == 150
    # ... fired no critical alert while it lived (its exporter going away at exit is not part of the run) ...
    critical = prometheus.query(
        f'ALERTS{{job="{run.job}", severity="critical", alertstate="firing"}}[{lifetime}]', at=ended
    )
    assert critical == [], [c["metric"] for c in critical]
    # ... and nobody was paged.
    pages = [d for d in receiver.deliveries if d.labels.get("job") == run.job and d.path == "/page"]
    assert pages == [], pages
    assert exporter_samples(run.port) == {}  # the run ended and its exporter with it
