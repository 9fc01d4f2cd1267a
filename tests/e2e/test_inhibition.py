"""While TrainingLossNaN fires for a rank, its loss symptoms reach nobody (inhibition,
``equal: [job, run_id, instance, rank]``), end to end.

The symptom: the exporter itself stops judging the loss while it is NaN, so the judged
loss alerts fall silent on their own; the inhibition covers what still reads raw series.
The demo runs with a learning rate of 0 (``--lr 0``): TrainingLearningRateSuspect (a
loss-derived alert: a zero LR shows as a loss that does not move) fires after
``learning_rate_for: 30s``, well after TrainingLossNaN has reached Alertmanager. A control
Alertmanager, fed by the same Prometheus with the same routes but no inhibit rules, proves
it would be delivered.
"""

from __future__ import annotations

import time

import pytest
import yaml

from .e2e_harness import AlertmanagerProcess, alertmanager_alerts, wait_for_page, wait_until
from .stack_config import E2E_THRESHOLDS, SHIPPED_ALERTMANAGER, retimed_alertmanager_config

SYMPTOM = "TrainingLearningRateSuspect"


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    return {
        **E2E_THRESHOLDS,
        "alerts": {**E2E_THRESHOLDS["alerts"], "learning_rate_for": "30s"},
    }


@pytest.fixture(scope="module")
def control_alertmanager(servers, receiver, tmp_path_factory):
    """The shipped routing without inhibit rules, delivering under /control/ on the receiver."""
    workdir = tmp_path_factory.mktemp("am-control")
    config = retimed_alertmanager_config(SHIPPED_ALERTMANAGER, f"{receiver.url}/control")
    assert config.pop("inhibit_rules"), "the shipped config should inhibit symptoms of a NaN loss"
    path = workdir / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    am = AlertmanagerProcess(path, workdir)
    try:
        am.wait_ready()
        yield am
    finally:
        am.stop()


@pytest.fixture(scope="module")
def extra_alertmanagers(control_alertmanager) -> list[str]:
    return [control_alertmanager.address]


def test_nan_loss_inhibits_its_symptom_alerts(demo, receiver, prometheus, stack):
    # Paced steps: the NaN at step 40 comes 4 s in whatever the machine's load, well inside the
    # symptom's 30 s `for` (unpaced, a busy machine reached step 40 after the symptom fired).
    run = demo(
        "--steps", "600", "--step-time", "0.1", "--batch-size", "8", "--fault", "nan", "--fault-step", "40", "--lr", "0"
    )
    run.wait_serving()
    wait_for_page(receiver, "TrainingLossNaN", run.job, timeout=90)

    firing = wait_until(lambda: prometheus.firing(SYMPTOM, job=run.job), 90, f"{SYMPTOM} to fire in Prometheus")
    assert firing[0]["labels"]["rank"] == "0"
    assert prometheus.firing("TrainingLossNaN", job=run.job), "the NaN alert must still fire"

    # Without the inhibit rule the symptom reaches the ticket queue ...
    control = wait_until(
        lambda: [d for d in receiver.received(alertname=SYMPTOM, job=run.job) if d.path.startswith("/control/")],
        30,
        f"{SYMPTOM} via the control",
    )
    assert control[0].path == "/control/ticket"
    # ... with the shipped config Alertmanager holds it as inhibited by the NaN alert ...
    held = [a for a in alertmanager_alerts(stack.alertmanager_url, SYMPTOM) if a["labels"]["job"] == run.job]
    assert held and held[0]["status"]["state"] == "suppressed" and held[0]["status"]["inhibitedBy"], held
    # ... and delivers nothing, even after group_wait + group_interval have passed twice over.
    time.sleep(4)
    delivered = [d for d in receiver.received(alertname=SYMPTOM, job=run.job) if not d.path.startswith("/control/")]
    assert delivered == [], delivered


def test_a_forward_nan_pages_once(demo, receiver, prometheus, stack):
    """The NaN loss makes every gradient NaN: TrainingGradientNonFinite fires in Prometheus
    and the control pages it, but the shipped config pages only TrainingLossNaN."""
    echo = "TrainingGradientNonFinite"
    run = demo("--steps", "600", "--step-delay", "0.1", "--batch-size", "8", "--fault", "nan", "--fault-step", "40")
    run.wait_serving()
    wait_for_page(receiver, "TrainingLossNaN", run.job, timeout=90)
    wait_until(lambda: prometheus.firing(echo, job=run.job), 60, f"{echo} to fire in Prometheus")
    wait_for_page(receiver, echo, run.job, timeout=30, path="/control/page")
    held = [a for a in alertmanager_alerts(stack.alertmanager_url, echo) if a["labels"]["job"] == run.job]
    assert held and held[0]["status"]["state"] == "suppressed", held
    time.sleep(4)
    pages = [
        d.labels["alertname"]
        for d in receiver.deliveries
        if d.labels.get("job") == run.job and d.path == "/page" and d.status == "firing"
    ]
    assert pages and set(pages) == {"TrainingLossNaN"}, pages
