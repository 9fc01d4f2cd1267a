"""A run whose steps stop pages TrainingStalled; a killed trainer pages TrainingExporterDown."""

from __future__ import annotations

import time

from .e2e_harness import exporter_samples, wait_for_page, wait_until

STALLED_AFTER_S = 15  # alerts.stalled_after in conftest.E2E_THRESHOLDS
EXPORTER_DOWN_FOR_S = 5  # alerts.exporter_down_for


def test_stalled_run_then_killed_trainer_pages_on_call(demo, receiver, prometheus):
    # Training ends after 30 steps, but the exporter keeps serving: the last step ages.
    run = demo("--steps", "30", "--step-delay", "0.05", "--linger", "300")
    run.wait_serving()

    def last_step_time():
        samples = exporter_samples(run.port)
        if samples.get('training_steps_total{rank="0"}') == 30:
            return samples['training_last_step_timestamp_seconds{rank="0"}']
        return None

    last_step = wait_until(last_step_time, 120, "the run's 30th step")
    stalled = wait_for_page(receiver, "TrainingStalled", run.job, timeout=STALLED_AFTER_S + 45)
    age = stalled.received_at - last_step
    print(f"\nTrainingStalled paged {age:.1f}s after the last step (alert after {STALLED_AFTER_S}s)")
    assert stalled.labels["rank"] == "0" and stalled.labels["severity"] == "critical"
    assert STALLED_AFTER_S <= age < STALLED_AFTER_S + 30
    assert prometheus.target_health(run.job) == ["up"]  # stalled, not dead

    killed_at = time.time()
    run.kill()
    down = wait_for_page(receiver, "TrainingExporterDown", run.job, timeout=EXPORTER_DOWN_FOR_S + 45)
    latency = down.received_at - killed_at
    print(f"TrainingExporterDown paged {latency:.1f}s after SIGKILL (alert after {EXPORTER_DOWN_FOR_S}s down)")
    assert down.labels["rank"] == "0" and down.labels["severity"] == "critical"
    assert down.labels["instance"] == run.target
    assert EXPORTER_DOWN_FOR_S <= latency < EXPORTER_DOWN_FOR_S + 30
