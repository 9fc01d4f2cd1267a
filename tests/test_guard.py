"""The optimizer guard: a bad step never reaches the optimizer, on real training loops."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import lossbeat
from lossbeat import Monitor, MonitorConfig, TrainingHalted
from lossbeat.monitor import guard as guard_module


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(
        {
            i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for i, s in enumerate(optimizer.state.values())
        }
    )
    return params, state


def _equal(a, b) -> bool:
    pa, sa = a
    pb, sb = b
    if len(pa) != len(pb) or any(not torch.equal(x, y) for x, y in zip(pa, pb)):
        return False
    if sa.keys() != sb.keys():
        return False
    for i in sa:
        if sa[i].keys() != sb[i].keys():
            return False
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            if torch.is_tensor(x) != torch.is_tensor(y) or (torch.is_tensor(x) and not torch.equal(x, y)):
                return False
            if not torch.is_tensor(x) and x != y:
                return False
    return True


def _train(monitor, model, optimizer, steps, fault_at=None, fault="nan", scaler=None, after_step=None):
    """A real loop: forward, backward, clip through the monitor, observe, monitor.step."""
    losses, snapshots = [], {}
    for step in range(steps):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        if step == fault_at:
            loss = loss * (math.nan if fault == "nan" else 1e6)
        optimizer.zero_grad()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = monitor.clip_grad_norm_(model, 1e9 if fault == "explode" else 1.0)
        monitor.observe(step, loss=loss, grad_norm=grad_norm, optimizer=optimizer, model=model, grad_scaler=scaler)
        snapshots[step] = _snapshot(model, optimizer)
        monitor.step(optimizer, grad_scaler=scaler)
        snapshots[step + 0.5] = _snapshot(model, optimizer)
        losses.append(float(loss))
        if after_step:
            after_step(step)
    return losses, snapshots


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_step_leaves_parameters_and_optimizer_state_bitwise_untouched(fused):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    losses, snaps = _train(monitor, model, optimizer, 30, fault_at=20)
    assert _equal(snaps[20], snaps[20.5])  # the NaN step changed nothing
    assert not _equal(snaps[19], snaps[19.5]) and not _equal(snaps[21], snaps[21.5])  # the others trained
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != 20)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert monitor.state.skipped_steps == {"nonfinite": 1}
    assert monitor.state.nonfinite_loss_total == 0  # absorbed: a skip, not a fault the model took in
    assert monitor.state.guard_consecutive_skips == 0
    assert monitor._guard.host_reads == 0
    monitor.close()


def test_off_is_optimizer_step_exactly():
    a, b = _model(), _model()
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    for step in range(10):
        for model, opt, guarded in ((a, oa, True), (b, ob, False)):
            x, y = _batch(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if guarded:
                monitor.observe(step, loss=loss, model=model)
                monitor.step(opt)
            else:
                opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    parsed = "".join(str(m) for m in monitor.registry.collect())
    assert "training_skipped_steps" not in parsed  # no guard series while it is off
    monitor.close()


def test_an_explosion_is_skipped_once_the_baseline_is_established():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    _, snaps = _train(monitor, model, optimizer, 80, fault_at=70, fault="explode")
    assert _equal(snaps[70], snaps[70.5])
    assert monitor.state.skipped_steps == {"explosion": 1}
    assert monitor.state.grad_explosions_total == 0
    monitor.close()


def test_a_healthy_run_skips_nothing():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(port=0, guard="skip", guard_spikes=True), serve=False)
    _train(monitor, model, optimizer, 300)
    assert monitor.state.skipped_steps == {}
    monitor.close()


def test_the_device_path_masks_the_update_exactly(monkeypatch):
    """The CUDA path (flags not on the host at step time), driven on CPU: masked updates and
    fused found_inf restore everything bitwise, with no host read of the decision."""
    for fused, optimizer_cls in ((False, torch.optim.AdamW), (True, torch.optim.AdamW), (False, torch.optim.SGD)):
        model = _model()
        kwargs = {"fused": True} if fused else ({"momentum": 0.9} if optimizer_cls is torch.optim.SGD else {})
        optimizer = optimizer_cls(model.parameters(), lr=1e-2, **kwargs)
        monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
        g = monitor._guard
        real_step = g.step

        def device_step(opt, scaler=None, sched=None, closure=None, _g=g, _real=real_step):
            _g._host = None  # as if the step's flags were still on their way from the device
            return _real(opt, scaler, sched, closure)

        monkeypatch.setattr(g, "step", device_step)
        _, snaps = _train(monitor, model, optimizer, 12, fault_at=0)  # a bad first step: fresh state kept fresh
        _, snaps2 = _train(monitor, model, optimizer, 12, fault_at=8)
        assert _equal(snaps2[8], snaps2[8.5]), optimizer_cls
        assert torch.equal(snaps[0][0][0], snaps[0.5][0][0])
        assert g.host_reads == 0
        monitor.close()


def test_under_a_grad_scaler_a_guard_skip_leaves_the_scaler_as_it_was():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    scales = {}
    _, snaps = _train(
        monitor,
        model,
        optimizer,
        40,
        fault_at=35,
        fault="explode",
        scaler=scaler,
        after_step=lambda s: scales.__setitem__(s, (scaler.get_scale(), int(scaler._growth_tracker))),
    )
    assert _equal(snaps[35], snaps[35.5])
    assert scales[35] == scales[34]  # neither backed off nor grown by the skipped step
    assert monitor.state.skipped_steps == {"explosion": 1}
    monitor.close()


def test_stop_raises_with_what_happened_and_the_run_reads_as_halted():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(port=0, guard="stop"), serve=False)
    with pytest.raises(TrainingHalted, match="at step 5: nonfinite") as info:
        _train(monitor, model, optimizer, 10, fault_at=5)
    assert info.value.step == 5 and info.value.reason == "nonfinite" and math.isnan(info.value.values["loss"])
    assert monitor.state.halted and all(torch.isfinite(p).all() for p in model.parameters())
    text = "\n".join(f"{s.name} {s.value}" for m in monitor.registry.collect() for s in m.samples)
    assert "training_halted 1.0" in text
    monitor.close(completed=False)
    assert not monitor.state.completed


def test_skip_stops_after_too_many_skips_in_a_row():
    t = lossbeat.load_thresholds()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    steps = 0
    with pytest.raises(TrainingHalted) as info:
        for step in range(100):
            x, y = _batch(step)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * (math.nan if step >= 10 else 1.0)
            loss.backward()
            monitor.observe(step, loss=loss, model=model)
            monitor.step(optimizer)
            steps += 1
    assert info.value.step == 10 + t.guard.max_consecutive
    assert info.value.consecutive == t.guard.max_consecutive + 1
    assert monitor.state.skipped_steps == {"nonfinite": t.guard.max_consecutive + 1}
    monitor.close(completed=False)


def test_the_schedule_advances_or_holds():
    for schedule, expected in (("advance", 10), ("hold", 9)):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        monitor = Monitor(MonitorConfig(port=0, guard="skip", guard_schedule=schedule), serve=False)
        for step in range(10):
            x, y = _batch(step)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * (math.nan if step == 4 else 1.0)
            loss.backward()
            monitor.observe(step, loss=loss, model=model)
            monitor.step(optimizer, scheduler=scheduler)
        assert scheduler.last_epoch == expected, schedule
        monitor.close()


def test_bad_settings_and_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="guard: expected"):
        MonitorConfig(guard="maybe")
    with pytest.raises(ValueError, match="guard_schedule"):
        MonitorConfig(guard_schedule="later")
    with pytest.raises(TypeError, match="guard_spikes"):
        MonitorConfig(guard_spikes="yes")
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    with pytest.raises(TypeError, match="optimizer: expected a torch optimizer"):
        monitor.step(object())
    monitor.close()


def test_the_null_monitor_steps_plainly():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    lossbeat.NullMonitor().step(optimizer)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert guard_module.REASONS == ("nonfinite", "explosion", "spike")


def test_the_demo_survives_one_nan_batch_with_the_guard(tmp_path):
    """`lossbeat demo --guard skip --fault nan`: the NaN batch is skipped and counted, the loss
    stays finite after it, and nothing counts as a non-finite step the model took in."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lossbeat",
            "demo",
            "--port",
            "0",
            "--steps",
            "80",
            "--fault",
            "nan",
            "--fault-step",
            "60",
            "--guard",
            "skip",
            "--eval-every",
            "0",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    events = out.stdout.strip().splitlines()[-1]
    assert "skipped_steps 1" in events and "nonfinite_loss 0" in events and "nonfinite_grad 0" in events, events
    assert "ok   nonfinite" in out.stdout


class _Unfreezing(nn.Module):
    """A head trained from the start, and a branch on large-scale features frozen (at zero)
    until it is unfrozen: once it trains, the pre-clip grad norm settles far higher for good."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head, self.side = nn.Linear(8, 1), nn.Linear(8, 1)
        nn.init.zeros_(self.side.weight)
        nn.init.zeros_(self.side.bias)
        self.side.requires_grad_(False)

    def forward(self, x):
        return self.head(x) + self.side(x * 100.0)


def _noisy_batch(step: int):
    x, y = _batch(step)
    return x, y + 0.3 * torch.randn(y.shape, generator=torch.Generator().manual_seed(step))


def _unfreezing_run(monitor, steps, unfreeze_at, loss_factor_after=1.0):
    model = _Unfreezing()
    optimizer = torch.optim.AdamW(
        [{"params": model.head.parameters()}, {"params": model.side.parameters(), "lr": 1e-4}], lr=1e-2
    )
    applied_after, losses = 0, []
    for step in range(steps):
        if step == unfreeze_at:
            model.side.requires_grad_(True)
        x, y = _noisy_batch(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y) * (loss_factor_after if step >= unfreeze_at else 1.0)
        loss.backward()
        grad_norm = monitor.clip_grad_norm_(model, 1.0)
        before = _snapshot(model, optimizer)
        monitor.observe(step, loss=loss, grad_norm=grad_norm, model=model)
        monitor.step(optimizer)
        if step >= unfreeze_at and not _equal(before, _snapshot(model, optimizer)):
            applied_after += 1
        losses.append(float(loss.detach()))
    return applied_after, losses


def test_a_lasting_new_grad_norm_level_with_a_healthy_loss_becomes_the_baseline():
    t = lossbeat.load_thresholds()
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    steps, unfreeze_at = 140, 60
    applied_after, losses = _unfreezing_run(monitor, steps, unfreeze_at)  # no TrainingHalted
    accepted = t.guard.accept_level_after
    assert monitor.state.skipped_steps == {"explosion": accepted}
    assert monitor.state.guard_level_changes == 1
    assert applied_after == steps - unfreeze_at - accepted  # every step after the new level's acceptance
    assert monitor.history.grad.median > 10  # the new level (~30; ~0.3 before the branch trained)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-20:]) / 20 < 1.5 * sum(losses[unfreeze_at - 20 : unfreeze_at]) / 20  # it trains on
    text = "\n".join(f"{s.name} {s.value}" for m in monitor.registry.collect() for s in m.samples)
    assert "training_guard_level_changes_total 1" in text.splitlines()
    monitor.close()


def test_a_new_grad_norm_level_with_a_loss_gone_bad_keeps_skipping_and_stops():
    t = lossbeat.load_thresholds()
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    with pytest.raises(TrainingHalted) as info:
        _unfreezing_run(monitor, 140, 60, loss_factor_after=1e4)
    assert info.value.reason == "explosion" and info.value.step == 60 + t.guard.max_consecutive
    assert monitor.state.guard_level_changes == 0
    monitor.close(completed=False)


def test_stop_at_one_of_the_last_steps_of_a_deferred_run_still_stops_it():
    """With deferred device reads (CUDA) a halt is raised MAX_PENDING decisions after its bad step,
    so every rank raises at the same one: a bad step among the last ones halts at flush()/close(),
    and the run does not read as completed."""
    for end in ("flush", "close"):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor = Monitor(MonitorConfig(port=0, guard="stop"), serve=False)
        monitor._guard.lag = lambda: guard_module.MAX_PENDING  # as on CUDA with deferred reads
        _, snaps = _train(monitor, model, optimizer, 10, fault_at=8)  # no raise from the last steps' monitor.step
        assert _equal(snaps[8], snaps[8.5])
        with pytest.raises(TrainingHalted, match="at step 8: nonfinite"):
            getattr(monitor, end)()
        assert monitor.state.halted
        if end == "flush":
            monitor.close(completed=False)
        assert not monitor.state.completed


def test_a_disabled_grad_scaler_is_no_scaler():
    """nanoGPT's GradScaler(enabled=False) in a bf16/fp32 run: the skip works and nothing raises."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    _, snaps = _train(monitor, model, optimizer, 10, fault_at=4, scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert _equal(snaps[4], snaps[4.5]) and not _equal(snaps[5], snaps[5.5])
    assert monitor.state.skipped_steps == {"nonfinite": 1}
    monitor.close()


GUARD_DOC = Path(__file__).resolve().parents[1] / "docs" / "guard.md"


def documented_save(marker: str) -> str:
    """The code block of docs/guard.md's "Saving the last good state" that contains ``marker``."""
    section = GUARD_DOC.read_text().split("### Saving the last good state", 1)[1].split("\n### ", 1)[0]
    blocks = [b.split("\n", 1)[1] for b in section.split("```")[1::2] if b.startswith("python")]
    (block,) = [b for b in blocks if marker in b]
    return block


@pytest.mark.parametrize("bad_at,deferred", [(3, False), (7, True)], ids=["mid-run", "last-step-deferred"])
def test_the_documented_plain_loop_saves_the_last_good_state(tmp_path, monkeypatch, bad_at, deferred):
    """docs/guard.md's plain-loop example, run as written (its `...` is this loop's forward and
    backward): TrainingHalted is caught, the checkpoint holds the state before the bad step, and
    the run reads as halted. With deferred reads (as on CUDA) a bad last step halts at close()."""
    code = documented_save("for step, batch in enumerate(loader)")
    body = (
        "        loss = nn.functional.mse_loss(model(batch[0]), batch[1]) * (math.nan if step == bad_at else 1.0)\n"
        "        optimizer.zero_grad()\n"
        "        loss.backward()\n"
        "        grad_norm = monitor.clip_grad_norm_(model, 1.0)\n"
    )
    assert code.count("        ...\n") == 1
    code = code.replace("        ...\n", body)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(port=0, guard="stop"), serve=False)
    if deferred:
        monitor._guard.lag = lambda: guard_module.MAX_PENDING  # as on CUDA with deferred reads
    loader = [_batch(step) for step in range(bad_at + 1)]  # the bad step is the last one
    names = {"torch": torch, "nn": nn, "math": math, "bad_at": bad_at}
    names.update(model=model, optimizer=optimizer, monitor=monitor, loader=loader)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainingHalted) as raised:
        exec(compile(code, str(GUARD_DOC), "exec"), names)
    assert (raised.value.step, raised.value.reason) == (bad_at, "nonfinite")
    saved = torch.load(tmp_path / "halted.pt")
    assert saved["step"] == bad_at
    # The last good state: every step before the bad one applied, the bad one not.
    assert saved["optimizer"]["state"][0]["step"].item() == bad_at
    reference = _model()
    reference.load_state_dict(saved["model"])
    assert all(torch.isfinite(p).all() for p in reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    assert monitor.closed and monitor.state.halted and not monitor.state.completed
