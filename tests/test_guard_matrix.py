"""The guard on real training loops, case by case: optimizers x GradScalers x how the decision
reaches monitor.step (on the host, or still on the device) x skip/stop x how the loop calls it
(every step observed, some not, a failing observe, a closure, accumulation, a scheduler, an
optimizer stepped behind the guard's back). Each skip leaves every parameter and every optimizer
state tensor bitwise as it was, is counted exactly once, and training goes on; each stop raises
TrainingHalted at the bad step with nothing of it applied."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lossbeat import Monitor, MonitorConfig, TrainingHalted

BAD = 5  # the step whose loss is NaN
STEPS = 9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(16, 6, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.1


OPTIMIZERS = {
    "sgd-momentum": lambda m: [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)],
    "adamw": lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2)],
    "adamw-foreach": lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)],
    "adamw-fused": lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)],
    "rmsprop": lambda m: [torch.optim.RMSprop(m.parameters(), lr=1e-3)],  # no device strategy: one host read
    "param-groups": lambda m: [
        torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 1e-3}], lr=1e-2)
    ],
    "two-optimizers": lambda m: [
        torch.optim.AdamW(m[0].parameters(), lr=1e-2),
        torch.optim.SGD(m[2].parameters(), lr=1e-2, momentum=0.9),
    ],
}
SCALERS = ("none", "disabled", "enabled")


def _scaler(kind: str):
    if kind == "none":
        return None
    return torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2, enabled=kind == "enabled")


def _snapshot(model: nn.Module, optimizers) -> list[torch.Tensor]:
    """Every parameter and every optimizer state tensor (step counters included), cloned."""
    out = [p.detach().clone() for p in model.parameters()]
    for optimizer in optimizers:
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            for _k, v in sorted(optimizer.state.get(p, {}).items()):
                out.append(v.clone() if torch.is_tensor(v) else torch.tensor(float(v)))
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _device_path(monitor, monkeypatch) -> None:
    """As on CUDA with deferred reads: the step's flags are not on the host when monitor.step runs."""
    guard = monitor._guard
    real = guard.step

    def step(*args, **kwargs):
        guard._host = None
        return real(*args, **kwargs)

    monkeypatch.setattr(guard, "step", step)


def _run(opt: str, scaler_kind: str, mode: str, path: str, loop: str, monkeypatch):
    model = _model()
    optimizers = OPTIMIZERS[opt](model)
    scaler = _scaler(scaler_kind)
    monitor = Monitor(MonitorConfig(port=0, guard=mode), serve=False)
    if path == "device":
        _device_path(monitor, monkeypatch)
    if loop == "observe-fails":  # an internal failure of observe() at the bad step: counted, never raised
        submit = monitor._transfer.submit

        def failing_submit(step, *args, **kwargs):
            if step == BAD:
                raise RuntimeError("injected")
            return submit(step, *args, **kwargs)

        monkeypatch.setattr(monitor._transfer, "submit", failing_submit)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in optimizers] if loop == "scheduler" else []
    snaps: dict[float, list] = {}
    halted = None
    try:
        for step in range(STEPS):
            for o in optimizers:
                o.zero_grad()

            def forward_backward(step=step):
                micro = 2 if loop == "accumulation" else 1
                total = 0.0
                for i in range(micro):
                    x, y = _batch(step * 2 + i)
                    loss = nn.functional.mse_loss(model(x), y) / micro
                    if step == BAD:
                        loss = loss * math.nan
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    total = total + loss.detach()
                if scaler is not None:
                    for o in optimizers:
                        scaler.unscale_(o)
                if not (loop == "observe-some" and step % 2 == 1):
                    monitor.observe(step, loss=total, model=model, optimizer=optimizers[0], grad_scaler=scaler)
                return total

            if loop == "closure":
                (o,) = optimizers

                def closure(step=step, o=o):
                    total = forward_backward()
                    snaps[step] = _snapshot(model, optimizers)  # the gradients are in: nothing stepped yet
                    return total

                monitor.step(o, grad_scaler=scaler, closure=closure)
            else:
                forward_backward()
                snaps[step] = _snapshot(model, optimizers)
                if scaler is not None and len(optimizers) > 1:
                    monitor.step(optimizers, grad_scaler=scaler)  # one scaler: stepped together, one update
                else:
                    for o in optimizers:
                        monitor.step(o, grad_scaler=scaler)
            for s in schedulers:
                s.step()
            snaps[step + 0.5] = _snapshot(model, optimizers)
    except TrainingHalted as e:
        halted = e
        snaps[BAD + 0.5] = _snapshot(model, optimizers)
    monitor.flush()
    return model, monitor, snaps, halted


CASES = [
    (opt, scaler, mode, path, "every-step")
    for opt in OPTIMIZERS
    for scaler in SCALERS
    for mode in ("skip", "stop")
    for path in ("host", "device")
]
CASES += [
    (opt, "none", "skip", path, loop)
    for loop in ("observe-some", "observe-fails", "accumulation", "scheduler")
    for opt in ("adamw", "two-optimizers", "sgd-momentum")
    for path in ("host", "device")
]
CASES += [(opt, scaler, "skip", "host", "closure") for opt in ("adamw", "sgd-momentum") for scaler in SCALERS]


@pytest.mark.parametrize("opt,scaler,mode,path,loop", CASES, ids=["-".join(c) for c in CASES])
def test_a_bad_step_is_withheld_everywhere_and_counted_once(opt, scaler, mode, path, loop, monkeypatch):
    model, monitor, snaps, halted = _run(opt, scaler, mode, path, loop, monkeypatch)
    assert _same(snaps[BAD], snaps[BAD + 0.5]), "the bad step reached the parameters or the optimizer state"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    state = monitor.state
    if mode == "stop":
        assert isinstance(halted, TrainingHalted) and halted.reason == "nonfinite" and state.halted
    else:
        assert halted is None
        assert sum(state.skipped_steps.values()) == 1 and state.skipped_steps["nonfinite"] == 1
        assert state.nonfinite_loss_total == 0  # absorbed: a skip, not a fault the model took in
        for step in (BAD - 1, BAD + 1, STEPS - 1):  # the steps around it trained
            assert not _same(snaps[step], snaps[step + 0.5]), step
    undecided = {"observe-some": STEPS // 2, "observe-fails": 1}.get(loop, 0)
    assert state.guard_undecided_steps == undecided
    monitor.close(completed=halted is None)


def test_an_optimizer_stepped_behind_the_guard_is_a_fault_not_a_skip():
    """observe() decided, but the loop called optimizer.step() itself: the NaN reached the weights,
    and the exporter says so (a non-finite loss), never that it was skipped."""
    model = _model()
    (optimizer,) = OPTIMIZERS["adamw"](model)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y) * (math.nan if step == BAD else 1.0)
        loss.backward()
        monitor.observe(step, loss=loss, model=model)
        optimizer.step()
    monitor.flush()
    assert monitor.state.skipped_steps == {}
    assert monitor.state.nonfinite_loss_total >= 1
    monitor.close()


def test_lbfgs_is_refused_at_its_first_step_naming_the_optimizer():
    model = _model()
    optimizer = torch.optim.LBFGS(model.parameters())
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    before = _snapshot(model, [optimizer])
    with pytest.raises(ValueError, match="optimizer: LBFGS"):
        monitor.step(optimizer, closure=lambda: 0.0)
    assert _same(before, _snapshot(model, [optimizer]))
    monitor.close()


def test_two_optimizers_on_one_scaler_stepped_apart_are_refused_naming_the_scaler():
    """Both unscaled, then stepped one by one: the scaler's update after the first would make the
    second's step unscale its gradients again. Refused before anything is applied."""
    model = _model()
    opt_a, opt_b = OPTIMIZERS["two-optimizers"](model)
    scaler = _scaler("enabled")
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    x, y = _batch(0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    monitor.observe(0, loss=1.0, model=model)
    before = _snapshot(model, [opt_a, opt_b])
    with pytest.raises(ValueError, match="grad_scaler: another optimizer"):
        monitor.step(opt_a, grad_scaler=scaler)
    assert _same(before, _snapshot(model, [opt_a, opt_b]))
    monitor.close()


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_guarded_step_reads_the_host_at_most_once(path, monkeypatch):
    """Two optimizers, a NaN at an observed and at an unobserved step: the observed steps' one read
    is the monitor's transfer (the guard's flags ride it); an unobserved step's is its decision."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.counting import StepCounts, count_host_reads

    model = _model()
    # SGD: its step reads nothing itself (CPU Adam reads its step counters), so every read is lossbeat's
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model[0], model[2])]
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    if path == "device":
        _device_path(monitor, monkeypatch)
    reads = {}
    for step in range(12):
        for o in optimizers:
            o.zero_grad()
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y) * (math.nan if step in (4, 7) else 1.0)
        loss.backward()
        grad_norm = monitor.clip_grad_norm_(model, 1.0)
        counts = StepCounts()
        with count_host_reads(counts):
            if step % 2 == 0:
                monitor.observe(step, loss=loss, grad_norm=grad_norm, model=model)
            for o in optimizers:
                monitor.step(o)
        reads[step] = counts.host_reads
    assert reads == {step: 1 for step in range(12)}
    assert monitor.state.skipped_steps == {"nonfinite": 2} and monitor.state.guard_undecided_steps == 6
    monitor.close()


def test_stop_at_an_unobserved_step_raises_at_once_even_where_halts_wait_for_the_device():
    """The decision of a step observe() did not see is on the host on every rank when it is made:
    the stop is raised at that step, not MAX_PENDING decisions later."""
    model = _model()
    (optimizer,) = OPTIMIZERS["adamw"](model)
    monitor = Monitor(MonitorConfig(port=0, guard="stop"), serve=False)
    monitor._guard.lag = lambda: 4  # as on CUDA with deferred reads
    with pytest.raises(TrainingHalted, match="nonfinite"):
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y) * (math.nan if step == BAD else 1.0)
            loss.backward()
            if step != BAD:
                monitor.observe(step, loss=loss, model=model)
            before = _snapshot(model, [optimizer])
            monitor.step(optimizer)
    assert step == BAD and _same(before, _snapshot(model, [optimizer]))
    assert monitor.state.halted and monitor.state.guard_undecided_steps == 1
    monitor.close(completed=False)


def test_the_guard_does_not_keep_a_finished_runs_optimizer_alive():
    """A sweep trains several models in one process under one monitor: the guard remembers the
    optimizers it stepped (for steps observe() did not decide) without keeping them alive."""
    import gc
    import weakref

    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    model = _model()
    (optimizer,) = OPTIMIZERS["adamw"](model)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    monitor.observe(0, loss=1.0, model=model)
    monitor.step(optimizer)
    gone = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert gone() is None
    monitor.close()
