"""Finished or died, end to end: a run that ends with close() pages nobody though its target
stays (static targets); a killed run whose target service discovery removed still pages."""

from __future__ import annotations

import time

from lossbeat.stack.local import write_target_groups

from .e2e_harness import wait_for_page, wait_until

EXPORTER_DOWN_FOR_S = 5  # alerts.exporter_down_for in stack_config.E2E_THRESHOLDS


def _scraped(prometheus, run) -> None:
    wait_until(
        lambda: prometheus.query(f'training_steps_total{{job="{run.job}"}} > 0'), 60, f"Prometheus to scrape {run.job}"
    )


def test_a_finished_run_with_its_target_kept_pages_nobody(demo, receiver, prometheus):
    run = demo("--steps", "80", "--step-delay", "0.05", "--batch-size", "8")
    run.wait_serving()
    _scraped(prometheus, run)
    assert run.wait_exit(timeout=180) == 0, run.log_tail()
    ended = time.time()
    # The target stays in service discovery and goes down, as a static target would ...
    wait_until(lambda: prometheus.target_health(run.job) == ["down"], 30, "the finished target to be down")
    # ... and Prometheus scraped the completion marker before the process left.
    completed = prometheus.query(f'last_over_time(training_run_completed{{job="{run.job}"}}[5m])')
    assert [float(c["value"][1]) for c in completed] == [1.0]
    # Well past exporter_down_for: not even pending.
    time.sleep(EXPORTER_DOWN_FOR_S + 10)
    window = f"{int(time.time() - ended) + 5}s"
    down = prometheus.query(f'ALERTS{{alertname="TrainingExporterDown", job="{run.job}"}}[{window}]')
    assert down == [], [d["metric"] for d in down]
    assert not receiver.received(alertname="TrainingExporterDown", job=run.job)


def test_a_killed_run_whose_target_was_removed_pages(demo, receiver, prometheus, stack):
    run = demo("--steps", "5000", "--step-delay", "0.05", "--batch-size", "8")
    run.wait_serving()
    _scraped(prometheus, run)
    killed_at = time.time()
    run.kill()
    write_target_groups(stack.targets_file, [])  # the scheduler's clean-up removes the target
    page = wait_for_page(receiver, "TrainingExporterDown", run.job, timeout=EXPORTER_DOWN_FOR_S + 45)
    latency = page.received_at - killed_at
    print(f"\nTrainingExporterDown paged {latency:.1f}s after SIGKILL with the target removed")
    assert page.labels["instance"] == run.target and page.labels["rank"] == "0"
    assert prometheus.target_health(run.job) == []  # removed, not down
    assert EXPORTER_DOWN_FOR_S <= latency < EXPORTER_DOWN_FOR_S + 30
