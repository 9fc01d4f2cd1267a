"""``observe(step, loss=None)``: a rank that computes no loss (a pipeline stage before the last).

A real two-stage training loop in one process, as a pipeline splits a model: stage 0 (the body)
gets its gradients through stage 1 (the head, which computes the loss). Each stage has its own
optimizer and its own monitor, as each pipeline rank would; stage 0 observes without a loss.
"""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from lossbeat import Monitor, MonitorConfig
from lossbeat.diagnosis import Status
from lossbeat.monitor.apply import ALL_LAYERS

LOSS_CHECKS = ("loss_range", "loss_trend", "loss_volatility", "warmup", "overfitting")
LOSS_SERIES = ("training_loss", "training_loss_cv", "training_loss_trend_ratio", "training_loss_pattern")
STEPS, BATCH, WIDTH, CLASSES, LR = 240, 16, 16, 4, 1e-2


def exposition(monitor: Monitor) -> dict[str, list[tuple[dict, float]]]:
    """{sample name: [(labels, value)]} of what a scrape of the monitor's registry serves."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(monitor.registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(metrics, name: str) -> float:
    ((_, value),) = metrics[name]
    return value


def health(metrics) -> dict[str, float]:
    return {labels["check"]: v for labels, v in metrics["training_health_status"] if not labels["component"]}


class TwoStages:
    """A classifier split in two pipeline stages; the labels come from a fixed random teacher."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, CLASSES)
        self.teacher = torch.randn(WIDTH, CLASSES)
        self.opt_body = torch.optim.SGD(self.body.parameters(), lr=LR, momentum=0.9)
        self.opt_head = torch.optim.SGD(self.head.parameters(), lr=LR, momentum=0.9)

    def backward(self, poison_loss: bool = False) -> torch.Tensor:
        x = torch.randn(BATCH, WIDTH)
        loss = nn.functional.cross_entropy(self.head(self.body(x)), (x @ self.teacher).argmax(1))
        if poison_loss:  # a NaN loss: backprop makes every gradient of both stages NaN
            loss = loss * math.nan
        loss.backward()
        return loss.detach()

    def body_norm(self) -> float:
        return float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in self.body.parameters()])))

    def step(self) -> None:
        for opt in (self.opt_body, self.opt_head):
            opt.step()
            opt.zero_grad(set_to_none=True)


def new_monitor() -> Monitor:
    return Monitor(
        MonitorConfig(port=0, addr="127.0.0.1", log_status_changes=False), registry=CollectorRegistry(), serve=False
    )


def test_a_stage_without_a_loss_exports_everything_but_the_loss():
    stages = TwoStages()
    first, last = new_monitor(), new_monitor()
    losses, norms = [], []
    for step in range(STEPS):
        loss = stages.backward()
        norms.append(stages.body_norm())
        losses.append(float(loss))
        first.observe(step, model=stages.body, optimizer=stages.opt_body, tokens=BATCH)  # no loss on this stage
        last.observe(step, loss=loss, model=stages.head, optimizer=stages.opt_head, tokens=BATCH)
        stages.step()
    assert losses[-1] < 0.8 * losses[0]  # it learns: the loss judgments below see a real run
    report = first.report()
    metrics = exposition(first)

    assert not set(LOSS_SERIES) & set(metrics)  # absent, neither 0 nor NaN
    assert one(metrics, "training_step") == STEPS - 1
    assert one(metrics, "training_steps_total") == STEPS
    assert one(metrics, "training_tokens_total") == STEPS * BATCH
    assert one(metrics, "training_learning_rate") == LR
    assert one(metrics, "training_grad_norm") == pytest.approx(norms[-1], rel=1e-6)
    layers = {labels["layer"] for labels, _ in metrics["training_layer_grad_norm"]}
    assert layers == {"0", "2"}
    assert one(metrics, "training_nonfinite_loss_total") == 0
    assert one(metrics, "training_nonfinite_grad_total") == 0
    assert one(metrics, "training_loss_spikes_total") == 0
    assert sum(v for _, v in metrics["training_exporter_errors_total"]) == 0
    assert "training_step_duration_seconds" in metrics

    status = health(metrics)
    assert all(status[check] == Status.GOOD for check in LOSS_CHECKS)
    loss_findings = [f for f in report.findings if f.check in LOSS_CHECKS]
    assert loss_findings and all(not f.known and f.status is Status.GOOD for f in loss_findings)
    assert report.worst is Status.GOOD
    assert report.counters["steps"] == STEPS and report.counters["nonfinite_loss"] == 0
    assert first.history.finite_losses_seen == 0 and len(first.history.loss) == 0
    grad = next(f for f in report.findings if f.check == "grad_norm")
    assert grad.known and grad.status is Status.GOOD  # the gradients are judged as on any rank

    # The last stage, which has the loss, is judged on it.
    last_metrics = exposition(last)
    assert one(last_metrics, "training_loss") == pytest.approx(losses[-1])
    trend = next(f for f in last.report().findings if f.check == "loss_trend")
    assert trend.known
    first.close()
    last.close()


def test_a_nan_from_the_next_stage_is_a_gradient_event_named_all_layers_not_a_loss_event():
    stages = TwoStages(seed=1)
    first, last = new_monitor(), new_monitor()
    for step in range(30):
        loss = stages.backward(poison_loss=step == 20)
        first.observe(step, model=stages.body, optimizer=stages.opt_body)
        last.observe(step, loss=loss, model=stages.head, optimizer=stages.opt_head)
        if step == 20:  # skip the poisoned update, as a trainer that checks its gradients does
            stages.opt_body.zero_grad(set_to_none=True)
            stages.opt_head.zero_grad(set_to_none=True)
        else:
            stages.step()
    metrics, last_metrics = exposition(first), exposition(last)
    assert one(metrics, "training_nonfinite_loss_total") == 0  # no loss here to be non-finite
    assert one(metrics, "training_nonfinite_grad_total") == 1
    # Every layer of the stage is NaN: the NaN came from the next stage (the loss), not from its last layer.
    assert metrics["training_nonfinite_grad_first_layer_info"][0][0]["layer"] == ALL_LAYERS
    assert "training_loss" not in metrics
    assert one(last_metrics, "training_nonfinite_loss_total") == 1
    assert last_metrics["training_nonfinite_grad_first_layer_info"][0][0]["layer"] == ALL_LAYERS
    first.close()
    last.close()


def test_a_run_mixing_steps_with_and_without_a_loss_judges_the_losses_given():
    """A loss every other step (the rest None): the given ones fill the windows and are judged."""
    monitor = new_monitor()
    given = []
    for step in range(600):
        # Flat at 2.0 with a little noise, then rising steadily from step 300: a diverging loss.
        loss = 2.0 + 0.02 * math.sin(step) + (0.004 * (step - 300) if step >= 300 else 0.0)
        if step == 150:
            loss = math.nan
        if step % 2 == 0:
            given.append(loss)
        monitor.observe(step, loss=loss if step % 2 == 0 else None, learning_rate=1e-3, grad_norm=1.0)
    report = monitor.report()
    metrics = exposition(monitor)
    assert one(metrics, "training_loss") == pytest.approx(given[-1])
    assert one(metrics, "training_steps_total") == 600
    assert one(metrics, "training_nonfinite_loss_total") == 1  # the NaN was on a step that gave a loss
    assert monitor.history.finite_losses_seen == len(given) - 1  # every finite loss given, nothing for the None steps
    trend = next(f for f in report.findings if f.check == "loss_trend" and not f.component)
    assert trend.known and trend.status is Status.DANGER, trend
    assert health(metrics)["loss_trend"] == Status.DANGER
    monitor.close()


def test_observe_without_a_loss_keyword_records_the_step():
    """No loss at all: a step of a stage without one (wrong loss types still raise: test_monitor.py)."""
    monitor = new_monitor()
    monitor.observe(0)
    monitor.flush()
    assert monitor.state.steps_total == 1 and monitor.state.loss is None
    monitor.close()
