"""An unknown task is unknown: with no profile named or detected, the loss is explained in a
vocabulary's or a class count's terms only where the numbers fit one (a first loss near ln V for
a plausible V); a regression on raw units is described in its own numbers, live and offline."""

from __future__ import annotations

import torch
from torch import nn

from lossbeat import Monitor, MonitorConfig
from lossbeat.analyze import analyze_runs

# Words that explain a loss as a prediction over tokens or classes, or as a fine-tune's start.
_TASK_WORDS = ("= ln", "uniform prediction", "tokens or classes", "vocabular", "fine-tun")


def _regression_losses(steps: int = 200) -> list[tuple[int, torch.Tensor, nn.Module, torch.optim.Optimizer]]:
    """A linear regression on raw units (targets of variance ~25): its MSE starts near 24."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    weights = torch.tensor([[3.0], [4.0], [0.0], [0.0]])
    out = []
    for step in range(steps):
        x = torch.randn(64, 4)
        y = x @ weights + 0.3 * torch.randn(64, 1)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        out.append((step, loss, model, optimizer))
        optimizer.step()
    return out


def _loss_range(findings) -> str:
    return next(f for f in findings if f.check == "loss_range" and not f.component).message


def test_a_regression_run_live_with_no_task_named_is_not_explained_as_a_vocabulary():
    monitor = Monitor(MonitorConfig(run_name="regression"), serve=False)
    first = None
    for step, loss, model, optimizer in _regression_losses():
        first = float(loss.detach()) if first is None else first
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
    report = monitor.report()
    monitor.close()
    assert first > 15  # above ln of any plausible vocabulary: the numbers fit none
    message = _loss_range(report.findings)
    assert f"initial loss {first:.4g}" in message and "no task named or detected" in message, message
    for f in report.findings:
        assert not any(w in f.message for w in _TASK_WORDS), f"{f.check}: {f.message}"


def test_analyze_of_a_regression_log_with_no_task_named_says_only_what_its_numbers_show(tmp_path):
    csv = tmp_path / "metrics.csv"
    rows = [f"{step},{float(loss)!r}" for step, loss, _, _ in _regression_losses()]
    csv.write_text("step,train_loss\n" + "\n".join(rows) + "\n")
    (run,) = analyze_runs(csv).runs
    assert "the default" in run.profile_reason  # no field names a task
    message = _loss_range(run.findings)
    assert "no task named or detected" in message, message
    for f in run.findings:
        assert not any(w in f.message for w in _TASK_WORDS), f"{f.check}: {f.message}"


def test_a_start_near_ln_v_is_still_read_as_a_uniform_prediction():
    """Where the numbers fit (a 64-way prediction from scratch starts at ln 64 = 4.16), they explain it."""
    torch.manual_seed(0)
    model = nn.Linear(16, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = Monitor(MonitorConfig(run_name="classes"), serve=False)
    for step in range(60):
        x = torch.randn(32, 16)
        loss = nn.functional.cross_entropy(model(x) * 0.01, torch.randint(0, 64, (32,)))
        optimizer.zero_grad()
        loss.backward()
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
        optimizer.step()
    report = monitor.report()
    monitor.close()
    message = _loss_range(report.findings)
    assert "= ln 6" in message and "uniform prediction" in message, message  # ln 64 (+- its noise)
