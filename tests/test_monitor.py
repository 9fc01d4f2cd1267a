"""The Monitor on real training loops, read back through real HTTP scrapes."""

from __future__ import annotations

import gc
import logging
import math
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from conftest import require, require_module
from helpers.scrape import metrics_text
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lossbeat
from lossbeat import Monitor, MonitorConfig, NullMonitor, start_exporter
from lossbeat.demo import ModelSize, SyntheticCorpus, TinyLM
from lossbeat.diagnosis import Status
from lossbeat.exposition.metrics import HEALTH_CHECKS, METRICS

SIZE = ModelSize(vocab=32, context=16, width=32, layers=2, heads=2)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without rank): value}"""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("rank", "run_id")))
            out[(s.name, labels)] = s.value
    return out


def value(parsed, name, **labels):
    return parsed[(name, tuple(sorted(labels.items())))]


class Trainer:
    """A real little training loop (TinyLM on the synthetic corpus)."""

    def __init__(self, seed=0, lr=3e-3):
        torch.manual_seed(seed)
        self.model = TinyLM(SIZE)
        self.corpus = SyntheticCorpus(SIZE.vocab, SIZE.context, seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def backward(self, poison_layer: str | None = None, grad_scale_layer: str | None = None):
        tokens, targets = self.corpus.batch(8)
        loss = self.model(tokens, targets)
        loss.backward()
        if poison_layer:
            next(self.model.get_submodule(poison_layer).parameters()).grad.view(-1)[0] = math.nan
        if grad_scale_layer:
            for p in self.model.get_submodule(grad_scale_layer).parameters():
                p.grad.mul_(1e4)
        return loss, tokens.numel()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@pytest.fixture
def monitor():
    m = Monitor(MonitorConfig(port=0, addr="127.0.0.1"), registry=CollectorRegistry(), rank_context=None)
    yield m
    m.close()


def test_every_metric_is_exported_with_its_value(monitor):
    trainer = Trainer()
    losses = []
    for step in range(60):
        loss, tokens = trainer.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
        monitor.observe(
            step,
            loss=loss,
            optimizer=trainer.optimizer,
            grad_norm=grad_norm,
            model=trainer.model,
            tokens=tokens,
            losses={"lm": loss, "aux": 0.5},
            epoch=step / 30,
        )
        losses.append(loss.item())
        last_grad_norm = grad_norm.item()
        trainer.step()
    monitor.observe_eval(59, 1.25)
    parsed = samples(metrics_text(monitor.port))

    assert value(parsed, "training_loss") == pytest.approx(losses[-1], rel=1e-6)
    assert value(parsed, "training_eval_loss") == 1.25
    assert value(parsed, "training_loss_component", component="lm") == pytest.approx(losses[-1], rel=1e-6)
    assert value(parsed, "training_loss_component", component="aux") == 0.5
    assert value(parsed, "training_grad_norm") == pytest.approx(last_grad_norm, rel=1e-6)
    assert value(parsed, "training_learning_rate", param_group="0") == 3e-3
    assert value(parsed, "training_step") == 59
    assert value(parsed, "training_epoch") == pytest.approx(59 / 30)
    assert value(parsed, "training_steps_total") == 60
    assert value(parsed, "training_tokens_total") == 60 * 8 * SIZE.context
    last50 = torch.tensor(losses[-50:], dtype=torch.float64)
    assert value(parsed, "training_loss_cv") == pytest.approx(
        (last50.std(unbiased=False) / last50.mean()).item(), rel=1e-6
    )
    recent, previous = sum(losses[-20:]) / 20, sum(losses[-40:-20]) / 20
    assert value(parsed, "training_loss_trend_ratio") == pytest.approx((previous - recent) / previous, rel=1e-6)
    assert 0 < value(parsed, "training_step_duration_seconds") < 5
    assert value(parsed, "training_last_step_timestamp_seconds") > 1.7e9
    layers = {dict(k[1])["layer"]: v for k, v in parsed.items() if k[0] == "training_layer_grad_norm"}
    assert set(layers) == set(monitor._meter.grouping.layer_names)
    assert "blocks.1.attn.qkv" in layers and all(v > 0 for v in layers.values())
    for check in HEALTH_CHECKS:
        assert value(parsed, "training_health_status", check=check, component="") in (0, 1, 2)
    assert ("training_health_status", (("check", "loss_trend"), ("component", "aux"))) in parsed
    assert value(parsed, "training_memory_allocated_bytes", device="cpu") > 10e6
    assert (
        value(parsed, "training_memory_peak_bytes", device="cpu")
        >= value(parsed, "training_memory_allocated_bytes", device="cpu") * 0.5
    )
    info = [dict(k[1]) for k in parsed if k[0] == "training_run_info"]
    assert info and info[0]["profile"] == "causal-lm" and info[0]["version"] == lossbeat.__version__
    assert info[0]["feed"] == "process"  # the training process itself (lossbeat watch: "log")
    for counter in ("nonfinite_loss", "nonfinite_grad", "loss_spikes", "grad_explosions", "grad_scaler_overflows"):
        assert value(parsed, f"training_{counter}_total") == 0
    # Every name in the contract is present: the first-bad-layer info only after a NaN, the clip
    # coefficient with monitor.clip_grad_norm_, the loss scale with a GradScaler, the work time
    # with work_time=True, the loss-curve pattern once the trend can be judged, the aligned norms
    # under DDP, the guard's series with guard on, the task's signals with observe(metrics=...),
    # the MoE routers' with observe(expert_load=...) (their own tests).
    exported = {name for name, _ in parsed}
    for spec in METRICS.values():
        name = spec.name + ("_info" if spec.kind == "info" else "")
        if name in (
            "training_nonfinite_grad_first_layer_info",
            "training_grad_clip_coefficient",
            "training_grad_scale",
            "training_rank_work_seconds",
            "training_loss_pattern",
            "training_loss_pattern_since_step",
            "training_grad_norm_aligned",
            "training_grad_norm_aligned_step",
            "training_skipped_steps_total",
            "training_guard_consecutive_skips",
            "training_guard_undecided_steps_total",
            "training_guard_level_changes_total",
            "training_halted",
            "training_signal",
        ) or name.startswith("training_moe_"):  # with observe(expert_load=...): tests/test_moe.py
            continue
        assert name in exported, name


def test_a_nan_counts_once_per_bad_step_and_names_the_first_bad_layer(monitor, caplog):
    trainer = Trainer()
    bad_steps = {20, 21, 35}
    with caplog.at_level(logging.WARNING, logger="lossbeat"):
        for step in range(40):
            poison = "blocks.1.mlp.fc" if step in bad_steps else None
            loss, _ = trainer.backward(poison_layer=poison)
            if step in bad_steps:
                loss = loss * math.nan
            monitor.observe(step, loss=loss, optimizer=trainer.optimizer, model=trainer.model)
            trainer.optimizer.zero_grad(set_to_none=True)  # no update: keep the model finite
            if step == 20:
                parsed = samples(metrics_text(monitor.port))
                assert value(parsed, "training_nonfinite_loss_total") == 1
                assert math.isnan(value(parsed, "training_loss"))
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_nonfinite_loss_total") == 3
    assert value(parsed, "training_nonfinite_grad_total") == 3
    assert value(parsed, "training_nonfinite_grad_first_layer_info", layer="blocks.1.mlp.fc") == 1
    assert math.isfinite(value(parsed, "training_loss"))  # step 39 was fine again
    # 3 non-finite records, recovered, within 10 % of the window: judged isolated, a warning that
    # says so (docs/decisions.md#events-are-findings); ongoing or repeated would be a danger.
    assert value(parsed, "training_health_status", check="nonfinite", component="") == 1
    assert "it starts at layer blocks.1.mlp.fc" in caplog.text


class Chain(nn.Module):
    """Four blocks and a head; ``blocks.2`` takes sqrt(h*h) of an output that is exactly 0 in
    one column: a finite forward whose backward is 0/0, as a real fault (no .grad written)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(8, 8)}) for _ in range(4))
        self.head = nn.Linear(8, 3)
        self.faulty = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block["fc"](x)
            x = torch.sqrt(x * x) if (self.faulty and i == 2) else torch.tanh(x)
        return self.head(x)

    def backward(self, fault=False, nan_loss=False):
        self.zero_grad(set_to_none=True)
        self.faulty = fault
        with torch.no_grad():  # column 0 of blocks.2's output is exactly 0
            self.blocks[2]["fc"].weight[0].zero_()
            self.blocks[2]["fc"].bias[0] = 0.0
        loss = self(torch.randn(16, 8)).pow(2).mean()
        if nan_loss:
            loss = loss * math.nan
        loss.backward()
        return loss


def _origin(monitor):
    infos = [
        dict(k[1])["layer"]
        for k in samples(metrics_text(monitor.port))
        if k[0] == "training_nonfinite_grad_first_layer_info"
    ]
    return infos[0] if infos else None


def test_the_non_finite_layer_is_where_the_fault_started_not_the_input_end(monitor):
    model = Chain()
    loss = model.backward(fault=True)
    assert math.isfinite(loss.item())
    grads = {n: p.grad for n, p in model.named_parameters()}
    # Backprop spread the NaN from blocks.2 to every earlier layer: model order's first is blocks.0.
    assert not grads["blocks.0.fc.weight"].isfinite().all() and not grads["blocks.2.fc.weight"].isfinite().all()
    assert grads["blocks.3.fc.weight"].isfinite().all() and grads["head.weight"].isfinite().all()
    monitor.observe(0, loss=loss, model=model)
    assert _origin(monitor) == "blocks.2.fc"
    assert monitor.state.nonfinite_grad_total == 1

    loss = model.backward(nan_loss=True)  # a NaN loss poisons every gradient: no layer to blame
    monitor.observe(1, loss=loss, model=model)
    assert _origin(monitor) == "all layers"

    monitor.observe(2, loss=1.0, grad_norm=math.inf)  # the same event, without per-layer norms: its layer
    assert _origin(monitor) == "all layers"
    model.backward()
    monitor.observe(3, loss=1.0, model=model)  # finite again: the last event's layer stays on show
    assert _origin(monitor) == "all layers"
    monitor.observe(4, loss=1.0, grad_norm=math.inf)  # a new event without per-layer norms: not the old layer
    assert _origin(monitor) is None and monitor.state.nonfinite_grad_total == 4


def test_the_non_finite_layer_is_set_before_the_counter_moves(monitor):
    """A scrape between the two must never see the new count without its layer."""
    seen = []

    class Watched(type(monitor.state)):
        def __setattr__(self, name, value):
            if name == "nonfinite_grad_total":
                seen.append((value, self.first_nonfinite_layer))
            super().__setattr__(name, value)

    monitor.state.__class__ = Watched
    model = Chain()
    loss = model.backward(fault=True)
    monitor.observe(0, loss=loss, model=model)
    assert seen == [(1, "blocks.2.fc")]


def test_layers_without_a_gradient_are_left_out_and_counted(monitor):
    """An unused head has no gradient: not a vanishing 0 norm (no layer check firing), a count."""
    trainer = Trainer()
    trainer.model.unused_head = nn.Linear(SIZE.width, 4)  # e.g. BERT's pooler under MLM
    for step in range(40):
        loss, _ = trainer.backward()
        monitor.observe(step, loss=loss, optimizer=trainer.optimizer, model=trainer.model)
        trainer.step()
    parsed = samples(metrics_text(monitor.port))
    layers = {dict(k[1])["layer"] for k in parsed if k[0] == "training_layer_grad_norm"}
    assert "unused_head" not in layers and "blocks.0.attn.qkv" in layers
    assert value(parsed, "training_layers_without_grad") == 1
    layer_check = next(f for f in monitor.report().findings if f.check == "layer_grad_norm")
    assert layer_check.status is Status.GOOD and "unused_head" not in layer_check.message
    assert value(parsed, "training_health_status", check="layer_grad_norm", component="") == 0


def test_an_exploding_layer_counts_and_tops_the_layer_norms(monitor):
    trainer = Trainer()
    for step in range(30):
        layer = "blocks.0.attn.proj" if step >= 25 else None
        loss, _ = trainer.backward(grad_scale_layer=layer)
        grad_norm = monitor.clip_grad_norm_(trainer.model, 1.0)
        monitor.observe(step, loss=loss, optimizer=trainer.optimizer, grad_norm=grad_norm, model=trainer.model)
        trainer.step()
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_grad_explosions_total") == 5
    assert value(parsed, "training_grad_norm") > 10
    layers = {dict(k[1])["layer"]: v for k, v in parsed.items() if k[0] == "training_layer_grad_norm"}
    assert max(layers, key=layers.get) == "blocks.0.attn.proj"
    assert value(parsed, "training_grad_clip_coefficient") < 0.1


def test_bad_arguments_raise_and_name_the_argument(monitor):
    trainer = Trainer()
    with pytest.raises(TypeError, match="loss: expected a float or a 0-d tensor, got str"):
        monitor.observe(0, loss="2.0")
    # A loss tensor of several values is per-step data, not a wrong type: reduced and counted
    # (tests/test_integration_faults.py); a complex one is still a wrong type.
    with pytest.raises(TypeError, match="loss: expected a single value, got a tensor of shape"):
        monitor.observe(0, loss=torch.ones(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="loss: expected a float or a 0-d tensor, got list"):
        monitor.observe(0, loss=[2.0])  # None is no error: a rank without a loss (test_stage_without_loss.py)
    with pytest.raises(TypeError, match="step: expected an int"):
        monitor.observe(1.5, loss=1.0)
    with pytest.raises(TypeError, match="grad_norm"):
        monitor.observe(0, loss=1.0, grad_norm=[1.0])
    with pytest.raises(TypeError, match="optimizer"):
        monitor.observe(0, loss=1.0, optimizer=object())
    with pytest.raises(TypeError, match="model"):
        monitor.observe(0, loss=1.0, model=trainer.optimizer)
    with pytest.raises(TypeError, match="losses"):
        monitor.observe(0, loss=1.0, losses=[1.0, 2.0])
    with pytest.raises(ValueError, match="max_norm"):
        monitor.clip_grad_norm_(trainer.model, -1)
    with pytest.raises(ValueError, match="port"):
        MonitorConfig(port=70000)
    with pytest.raises(ValueError, match="layer_every"):
        MonitorConfig(layer_every=0)
    with pytest.raises(ValueError, match="feed: expected one of process, log, got 'file'"):
        MonitorConfig(feed="file")
    with pytest.raises(ValueError, match="layer_ranks: expected 'first', 'all'"):
        MonitorConfig(layer_ranks="rank0")
    with pytest.raises(TypeError, match="layer_ranks"):
        MonitorConfig(layer_ranks=[-1])
    with pytest.raises(TypeError, match="reduce_shards: expected True or False, got 'no'"):
        MonitorConfig(reduce_shards="no")
    with pytest.raises(
        TypeError, match="pipeline_group: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got list"
    ):
        MonitorConfig(pipeline_group=[0, 1])  # ranks, not a group
    with pytest.raises(TypeError, match="pipeline_group: .* got str"):
        MonitorConfig(pipeline_group="pp")
    with pytest.raises(TypeError, match="unknown setting 'layer_evry'"):
        start_exporter(0, layer_evry=3)
    assert monitor.state.steps_total == 0  # nothing half-recorded


def test_data_anomalies_are_counted_never_raised(monitor):
    trainer = Trainer()
    monitor.observe(5, loss=math.inf, learning_rate=0.0, grad_norm=math.nan)
    monitor.observe(6, loss=float("nan"), learning_rate=math.nan)
    monitor.observe(3, loss=2.0)  # the step goes backwards: resumed from a checkpoint
    trainer.model.head.requires_grad_(False)  # a frozen layer
    loss, _ = trainer.backward()
    monitor.observe(4, loss=loss, model=trainer.model)
    layers = {dict(k[1])["layer"] for k in samples(metrics_text(monitor.port)) if k[0] == "training_layer_grad_norm"}
    assert "head" not in layers and "blocks.0.attn.qkv" in layers
    trainer.optimizer.zero_grad(set_to_none=True)
    monitor.observe(5, loss=2.0, model=trainer.model)  # no parameter has a gradient
    half = TinyLM(SIZE).to(torch.bfloat16)
    half(*trainer.corpus.batch(2)).backward()
    monitor.observe(6, loss=torch.tensor(2.0, dtype=torch.bfloat16), model=half)
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_steps_total") == 6
    assert value(parsed, "training_nonfinite_loss_total") == 2
    assert value(parsed, "training_nonfinite_grad_total") == 1
    assert value(parsed, "training_step") == 6
    assert sum(v for (name, _), v in parsed.items() if name == "training_exporter_errors_total") == 0
    assert value(parsed, "training_layer_grad_norm", layer="head") > 0  # the bf16 model's layers


def _amp_run(monitor, steps, overflow_steps, scaler):
    """A loss-scaled loop (the fp16 recipe) on CPU; overflows are injected as inf gradients."""
    trainer = Trainer()
    scales = []
    for step in range(steps):
        tokens, targets = trainer.corpus.batch(8)
        loss = trainer.model(tokens, targets)
        scaler.scale(loss).backward()
        if step in overflow_steps:  # what an fp16 overflow leaves in the gradients
            next(trainer.model.get_submodule("blocks.1.mlp.fc").parameters()).grad.view(-1)[0] = math.inf
        scaler.unscale_(trainer.optimizer)
        grad_norm = monitor.clip_grad_norm_(trainer.model, 1.0)
        scales.append(scaler.get_scale())
        monitor.observe(
            step, loss=loss, optimizer=trainer.optimizer, grad_norm=grad_norm, model=trainer.model, grad_scaler=scaler
        )
        scaler.step(trainer.optimizer)
        scaler.update()
        trainer.optimizer.zero_grad(set_to_none=True)
    return scales


def test_loss_scaler_overflows_are_counted_apart_from_non_finite_gradients(monitor):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scales = _amp_run(monitor, 15, {3, 11}, scaler)
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_grad_scaler_overflows_total") == 2
    assert value(parsed, "training_nonfinite_grad_total") == 0  # routine under loss scaling: no page
    assert ("training_nonfinite_grad_first_layer_info", (("layer", "blocks.1.mlp.fc"),)) not in parsed
    assert value(parsed, "training_grad_scale") == scales[-1] == 2.0**14  # halved at each overflow
    assert math.isfinite(value(parsed, "training_grad_norm")) and value(parsed, "training_grad_norm") > 0
    assert all(math.isfinite(v) for (name, _), v in parsed.items() if name == "training_layer_grad_norm")
    assert len(monitor.history.grad_norms) == 13  # the skipped steps are no gradient samples
    nonfinite = next(f for f in monitor.report().findings if f.check == "nonfinite")
    assert nonfinite.status is Status.GOOD


def test_a_collapsing_loss_scale_is_danger():
    m = Monitor(MonitorConfig(port=0), serve=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    _amp_run(m, 8, set(range(8)), scaler)  # every step overflows: the scale halves to 2**-3
    assert m.state.grad_scaler_overflows_total == 8 and m.state.nonfinite_grad_total == 0
    assert m.state.grad_scale == 2.0**-3
    nonfinite = next(f for f in m.report().findings if f.check == "nonfinite")
    assert nonfinite.status is Status.DANGER and "loss scale collapsed" in nonfinite.message
    m.close()


def test_without_an_enabled_scaler_an_overflow_is_a_non_finite_gradient(monitor):
    _amp_run(monitor, 6, {5}, torch.amp.GradScaler("cpu", enabled=False))  # last: no NaN weights after
    assert monitor.state.nonfinite_grad_total == 1 and monitor.state.grad_scaler_overflows_total == 0
    assert monitor.state.grad_scale is None
    with pytest.raises(TypeError, match="grad_scaler: expected a torch.amp.GradScaler, got object"):
        monitor.observe(7, loss=1.0, grad_scaler=object())


def test_an_internal_error_is_counted_and_training_goes_on(monitor, monkeypatch):
    for way_in in ("add_step", "defer"):  # the history's two ways in: any record, the usual one (batched)
        monkeypatch.setattr(monitor.history, way_in, lambda *a, **k: 1 / 0)
    monitor.observe(0, loss=1.0)  # must not raise
    monkeypatch.undo()
    monitor.observe(1, loss=1.0)
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_exporter_errors_total", where="observe") == 1
    assert value(parsed, "training_steps_total") == 1


class CountHostSyncs(TorchDispatchMode):
    """Counts ops that read a device value on the host, and all ops."""

    SYNCS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}

    def __init__(self):
        super().__init__()
        self.syncs = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func._schema.name in self.SYNCS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def test_one_observe_causes_at_most_one_host_transfer_and_no_item_calls(monitor):
    trainer = Trainer()
    for step in range(12):
        loss, tokens = trainer.backward()
        grad_norm = monitor.clip_grad_norm_(trainer.model, 1.0)
        counter = CountHostSyncs()
        transfers_before = monitor.host_transfers
        with counter:
            monitor.observe(
                step,
                loss=loss,
                optimizer=trainer.optimizer,
                grad_norm=grad_norm,
                model=trainer.model,
                tokens=torch.tensor(tokens),
                losses={"lm": loss},
            )
        assert counter.syncs == 0, "observe() called .item() or an implicit bool() on a tensor"
        assert monitor.host_transfers - transfers_before == 1  # the one packed .tolist()
        trainer.step()
    # The per-parameter alternative the hot path avoids: one sync per parameter.
    loss, _ = trainer.backward()
    naive = CountHostSyncs()
    with naive:
        [p.grad.norm().item() for p in trainer.model.parameters()]
    assert naive.syncs == len(list(trainer.model.parameters()))


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_per_layer_norms_come_from_one_fused_reduction(monitor):
    trainer = Trainer()
    loss, _ = trainer.backward()

    counter = CountOps()
    with counter:
        monitor.observe(0, loss=loss, model=trainer.model)
    assert counter.names.count("aten::_foreach_norm") == 1
    assert "aten::linalg_vector_norm" not in counter.names and "aten::norm" not in counter.names


def test_measured_gradients_are_reported_unclipped_without_a_second_read(monitor):
    trainer = Trainer()
    loss, _ = trainer.backward()
    total = torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters()]).item()
    measured = monitor.measure_gradients(trainer.model)
    assert measured.dim() == 0 and measured.item() == pytest.approx(total, rel=1e-5)
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 0.01)  # what a framework does next
    counter = CountOps()
    with counter:
        monitor.observe(0, loss=loss, model=trainer.model)
    assert "aten::_foreach_norm" not in counter.names  # the gradients are not read again
    assert monitor.state.grad_norm == pytest.approx(total, rel=1e-5)
    layers = monitor.state.layer_norms
    assert math.sqrt(sum(v * v for v in layers.values())) == pytest.approx(total, rel=1e-5)
    # Used once: the next observe reads the (clipped) gradients itself.
    monitor.observe(1, loss=loss, model=trainer.model)
    assert monitor.state.grad_norm == pytest.approx(0.01, rel=1e-3)
    # Measured for another model: ignored.
    monitor.measure_gradients(TinyLM(SIZE))
    monitor.observe(2, loss=loss, model=trainer.model)
    assert monitor.state.grad_norm == pytest.approx(0.01, rel=1e-3)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        monitor.measure_gradients(trainer.optimizer)
    assert NullMonitor().measure_gradients(trainer.model) is None


def test_a_failed_measurement_is_counted_not_raised(monitor, monkeypatch):
    """measure_gradients may run inside an autograd callback: raising there would break backward."""
    trainer = Trainer()
    loss, _ = trainer.backward()
    monkeypatch.setattr("lossbeat.measure.gradients.compute_grad_norms", lambda *a, **k: 1 / 0)
    assert monitor.measure_gradients(trainer.model) is None
    monkeypatch.undo()
    monitor.observe(0, loss=loss, model=trainer.model)
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_exporter_errors_total", where="gradients") == 1
    assert value(parsed, "training_grad_norm") > 0  # observe measured the gradients itself


def test_a_failing_gradient_measurement_still_records_the_step(monitor, monkeypatch):
    """The step's loss, LR, counters and timestamp (what TrainingStalled needs) survive."""
    trainer = Trainer()
    loss, tokens = trainer.backward()
    monkeypatch.setattr("lossbeat.measure.gradients.compute_grad_norms", lambda *a, **k: 1 / 0)
    monitor.observe(7, loss=loss, optimizer=trainer.optimizer, model=trainer.model, tokens=tokens)
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_steps_total") == 1 and value(parsed, "training_step") == 7
    assert value(parsed, "training_loss") == pytest.approx(loss.item(), rel=1e-6)
    assert value(parsed, "training_learning_rate", param_group="0") == 3e-3
    assert value(parsed, "training_last_step_timestamp_seconds") > 1.7e9
    assert value(parsed, "training_exporter_errors_total", where="gradients") == 1
    assert value(parsed, "training_exporter_errors_total", where="observe") == 0
    assert ("training_grad_norm", ()) not in parsed


def test_models_with_fp64_complex_and_sparse_gradients_are_observed_and_clipped(monitor):
    from test_gradients import OddDtypes, dense_reference, odd_backward

    model, reference_model = OddDtypes(), OddDtypes()
    reference_model.load_state_dict(model.state_dict())
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss = odd_backward(model, seed=step)
        if step < 2:
            monitor.observe(step, loss=loss, model=model)
        else:
            reference = dense_reference(model)
            returned = monitor.clip_grad_norm_(model, 1e-3)
            monitor.observe(step, loss=loss, model=model, grad_norm=returned)
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_steps_total") == 3
    assert sum(v for (name, _), v in parsed.items() if name == "training_exporter_errors_total") == 0
    total = math.sqrt(sum(v * v for v in reference.values()))
    assert value(parsed, "training_grad_norm") == pytest.approx(total, rel=1e-5)
    layers = {dict(k[1])["layer"]: v for k, v in parsed.items() if k[0] == "training_layer_grad_norm"}
    assert layers == pytest.approx(reference, rel=1e-5)
    clipped = math.sqrt(sum(v * v for v in dense_reference(model).values()))
    assert clipped == pytest.approx(1e-3, rel=1e-3)


def test_clip_grad_norm_clips_like_torch_when_the_measurement_fails(monitor, monkeypatch):
    trainer, reference = Trainer(), Trainer()
    loss, _ = trainer.backward()
    reference.backward()
    monkeypatch.setattr("lossbeat.measure.gradients.clip_with_norms", lambda *a, **k: 1 / 0)
    returned = monitor.clip_grad_norm_(trainer.model, 0.01)
    expected = torch.nn.utils.clip_grad_norm_(reference.model.parameters(), 0.01)
    assert returned.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(trainer.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert monitor.state.errors["gradients"] == 1


def test_layer_every_limits_per_layer_work(monitor):
    m = Monitor(MonitorConfig(port=0, layer_every=5), serve=False)
    trainer = Trainer()
    computed = []
    for step in range(10):
        loss, _ = trainer.backward()
        m.observe(step, loss=loss, model=trainer.model)
        computed.append(bool(m.state.layer_norms) and m.state.step == step and id(m.state.layer_norms))
        trainer.step()
    assert len({c for c in computed if c}) == 2  # layer norms refreshed at steps 0 and 5 only
    assert m.state.grad_norm is not None and m.state.grad_norm > 0  # the global norm every step
    m.close()


def test_only_the_chosen_ranks_export_per_layer_norms():
    from lossbeat.exposition.server import RankContext

    trainer = Trainer()
    loss, _ = trainer.backward()
    exported = {}
    for layer_ranks, rank in (("first", 0), ("first", 3), ("all", 3), ((1, 3), 3), ((1, 3), 2)):
        m = Monitor(
            MonitorConfig(port=0, layer_ranks=layer_ranks),
            serve=False,
            rank_context=RankContext(rank=rank, local_rank=rank % 2, world_size=4),
        )
        counter = CountOps()
        with counter:
            m.observe(0, loss=loss, model=trainer.model)
        exported[(str(layer_ranks), rank)] = (bool(m.state.layer_norms), counter.names.count("aten::index_add_"))
        assert m.state.grad_norm > 0  # the global norm on every rank
        m.close()
    # (exports layers, per-layer work): a rank that exports none does no per-layer work either.
    assert exported == {
        ("first", 0): (True, 1),
        ("first", 3): (False, 0),
        ("all", 3): (True, 1),
        ("(1, 3)", 3): (True, 1),
        ("(1, 3)", 2): (False, 0),
    }


def test_layers_unfrozen_mid_run_are_picked_up():
    from lossbeat.measure.meter import REGROUP_CHECK_EVERY as _REGROUP_CHECK_EVERY

    trainer = Trainer()
    trainer.model.head.requires_grad_(False)  # gradual unfreezing: the head joins later
    m = Monitor(MonitorConfig(port=0), serve=False)
    seen = []
    for step in range(2 * _REGROUP_CHECK_EVERY + 1):
        if step == _REGROUP_CHECK_EVERY // 2:
            trainer.model.head.requires_grad_(True)
        loss, _ = trainer.backward()
        m.observe(step, loss=loss, model=trainer.model)
        seen.append("head" in m.state.layer_norms)
        trainer.optimizer.zero_grad(set_to_none=True)
    # Picked up at the first check after unfreezing, not before; never lost after.
    assert seen.index(True) == _REGROUP_CHECK_EVERY and all(seen[_REGROUP_CHECK_EVERY:])
    m.close()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def test_memory_stays_bounded_over_55k_steps():
    """tracemalloc over 10,000 steps (precise: one leaked object a step is 10,000 objects, but it
    slows Python ~5x), and RSS over 40,000 more (coarse: any leak of 40 bytes a step or more,
    outside what tracemalloc sees too; benchmarks/ watches RSS over a million steps). After
    5,000 steps every ring is full: what tracemalloc sees over 10,000 or 40,000 steps is the
    same ~30 KiB of churn."""
    m = Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False)
    logging.getLogger("lossbeat").setLevel(logging.ERROR)

    def observe(steps):
        for step in steps:
            m.observe(
                step,
                loss=2.0 + (step % 17) * 0.01 if step % 1000 else math.nan,
                learning_rate=1e-4,
                grad_norm=1.0,
                tokens=512,
            )

    try:
        observe(range(5_000))
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        observe(range(5_000, 15_000))
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        rss_before = _resident_bytes()
        observe(range(15_000, 55_000))
        gc.collect()
        rss_grown = _resident_bytes() - rss_before
    finally:
        logging.getLogger("lossbeat").setLevel(logging.NOTSET)
    # Only what lossbeat's own code allocated: threads a previous test of this worker left
    # running (servers, xdist) allocate too, and are not this monitor's memory.
    own = [tracemalloc.Filter(True, str(Path(lossbeat.__file__).parent / "*"))]
    grown = sum(stat.size_diff for stat in after.filter_traces(own).compare_to(before.filter_traces(own), "filename"))
    # The bounded rings (loss windows, memory samples, step-time blocks) replace their floats:
    # what they hold now was allocated inside the span, a few KiB of churn that never grows.
    # One leaked object per step would be 10,000 objects, a quarter of a megabyte or more.
    assert grown < 100_000, f"traced memory grew by {grown} bytes over 10,000 steps"
    # 40 bytes a step (a float in a list) is 1.5 MiB over these 40,000 steps.
    assert rss_grown < 1.5 * 2**20, f"resident memory grew by {rss_grown} bytes over 40,000 steps"
    assert m.state.steps_total == 55_000
    assert m.state.nonfinite_loss_total == 55
    m.close()


def test_start_exporter_twice_returns_the_running_monitor():
    first = start_exporter(0, addr="127.0.0.1")
    try:
        second = start_exporter(0, addr="127.0.0.1")
        assert second is first
        assert isinstance(first.port, int) and first.port > 0
        first.observe(0, loss=1.0)
        assert "training_steps_total" in metrics_text(first.port)
    finally:
        first.close()
    third = start_exporter(0, addr="127.0.0.1")
    assert third is not first
    third.close()


def test_port_follows_local_rank(monkeypatch):
    with Monitor(MonitorConfig(port=0), serve=False) as probe:
        pass
    import socket

    with socket.socket() as s:  # find two free consecutive ports
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with Monitor(MonitorConfig(port=base - 1, addr="127.0.0.1")) as m:
        assert m.port == base
        m.observe(0, loss=1.0)
        text = metrics_text(m.port)
    assert re.search(r'training_steps_total\{rank="5",run_id="[^"]*"\} 1\.0', text)
    assert 'world_size="8"' in text and 'local_rank="1"' in text
    assert probe.closed


def test_disabled_monitor_is_a_no_op(monkeypatch):
    monkeypatch.setenv("LOSSBEAT_DISABLED", "1")
    m = start_exporter(0)
    assert isinstance(m, NullMonitor)
    with m:
        m.observe(0, loss="not even checked")
        m.observe_eval(0, 1.0)
        assert m.report().findings == ()


def test_a_closed_monitor_refuses_observations(monitor):
    monitor.close()
    with pytest.raises(RuntimeError, match="closed"):
        monitor.observe(0, loss=1.0)
    monitor.close()  # idempotent


def test_report_summarises_findings_and_events(monitor):
    for step in range(60):
        monitor.observe(step, loss=4.0 - step * 0.05 if step != 30 else math.nan, grad_norm=50.0 if step == 40 else 1.0)
    report = monitor.report()
    text = str(report)
    assert "lossbeat report (last step 59)" in text
    assert "nonfinite_loss 1" in text and "grad_explosions 1" in text
    assert report.counters["steps"] == 60
    # The router and policy checks speak only for runs with expert loads or the rl profile.
    assert {f.check for f in report.findings} >= set(HEALTH_CHECKS) - {"moe_router", "rl_entropy", "rl_kl"}


def test_exposition_passes_promtool_check_metrics(monitor):
    require(shutil.which("promtool") is not None, "promtool not installed (apt-get install prometheus)")
    trainer = Trainer()
    for step in range(25):
        loss, tokens = trainer.backward(poison_layer="blocks.0.mlp.fc" if step == 20 else None)
        monitor.observe(
            step, loss=loss, optimizer=trainer.optimizer, model=trainer.model, tokens=tokens, losses={"lm": loss}
        )
        trainer.optimizer.zero_grad(set_to_none=True)
    monitor.observe_eval(24, 1.0)
    text = metrics_text(monitor.port)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "" and result.stderr.strip() == "", (
        result.stdout + result.stderr
    )


def test_large_token_counts_stay_exact(monitor):
    monitor.observe(0, loss=1.0, tokens=torch.tensor(2**24 + 1))
    monitor.observe(1, loss=1.0, tokens=2**24 + 1)
    assert monitor.state.tokens_total == 2 * (2**24 + 1)


class _StubEvent:
    """Stands in for torch.cuda.Event (no GPU here): 'done' once the test says so."""

    def __init__(self):
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


def _in_flight(step: int, loss: float, event: _StubEvent):
    """A step whose one value, its loss, is still on its way to the host until ``event`` is done."""
    from lossbeat.monitor.record import StepValues
    from lossbeat.monitor.transfer import PendingStep

    return PendingStep(
        step,
        wall_time=0.0,
        duration=None,
        epoch=None,
        values=StepValues(),
        layout=[("loss", None, 1)],
        packed=torch.tensor([loss], dtype=torch.float64),
        event=event,
    )


def test_deferred_reads_apply_steps_in_order_once_their_copy_is_done(monitor):
    """The CUDA path's bookkeeping, driven with stub events: a step whose copy is still
    in flight is applied later, in order, and only flush() (or too many in flight) waits."""
    from lossbeat.monitor.transfer import MAX_PENDING as _MAX_PENDING

    events = []
    for step in range(3):
        event = _StubEvent()
        events.append(event)
        monitor._transfer.pending.append(_in_flight(step, float(step + 1), event))
    monitor._transfer.drain(block=False)
    assert monitor.state.steps_total == 0  # nothing ready: nothing applied, nothing waited for
    events[1].done = True
    monitor._transfer.drain(block=False)
    assert monitor.state.steps_total == 0  # step 1 is ready but step 0 is not: order is kept
    events[0].done = True
    monitor._transfer.drain(block=False)
    assert monitor.state.steps_total == 2 and monitor.state.loss == 2.0
    assert not any(e.waited for e in events)
    for step in range(3, 3 + _MAX_PENDING + 1):
        event = _StubEvent()
        events.append(event)
        monitor._transfer.pending.append(_in_flight(step, 1.0, event))
    assert monitor.blocking_waits == 0
    monitor._transfer.drain(block=False)  # too many in flight: the oldest are waited for, down to the cap
    assert events[2].waited and len(monitor._transfer.pending) == _MAX_PENDING
    assert monitor.state.steps_total == 3 + _MAX_PENDING + 1 - _MAX_PENDING
    assert monitor.blocking_waits == 2  # steps 2 and 3 were waited for, one wait each
    monitor.flush()
    assert monitor.state.steps_total == 3 + _MAX_PENDING + 1 and not monitor._transfer.pending
    assert monitor.blocking_waits == 2  # flush() waits on purpose: not counted


def test_layer_every_counts_submitted_steps_while_reads_are_in_flight(monkeypatch):
    """On CUDA a step's values arrive a step late: the per-layer cadence must not follow them."""
    import lossbeat.measure.gradients as monitor_module  # the meter imports it when it measures

    m = Monitor(MonitorConfig(port=0, layer_every=3), serve=False)
    per_layer = []
    real = monitor_module.compute_grad_norms
    monkeypatch.setattr(
        monitor_module,
        "compute_grad_norms",
        lambda grouping, layers, *a: per_layer.append(layers) or real(grouping, layers, *a),
    )
    # A step still in flight holds every later step back until the cap makes observe() wait.
    m._transfer.pending.append(_in_flight(-1, 1.0, _StubEvent()))
    trainer = Trainer()
    loss, _ = trainer.backward()
    for step in range(9):
        m.observe(step, loss=loss, model=trainer.model)
    assert per_layer == [True, False, False] * 3
    m.close()


def test_status_changes_are_logged_with_the_fix(monitor, caplog):
    # Once the baseline is established (windows.baseline_min_records), a x50 jump is a danger.
    with caplog.at_level(logging.WARNING, logger="lossbeat"):
        for step in range(50):
            monitor.observe(step, loss=2.0, grad_norm=50.0 if step >= 40 else 1.0)
        assert "lossbeat: grad_norm GOOD -> DANGER at step 49: gradient norm 50 jumped" in caplog.text
        assert "fix: clip gradients" in caplog.text
        # Recoveries are logged at WARNING too (visible by default), after the hysteresis' dwell.
        for step in range(50, 300):
            monitor.observe(step, loss=2.0, grad_norm=1.0)
    assert "lossbeat: grad_norm DANGER -> GOOD at step" in caplog.text
    assert caplog.text.count("grad_norm GOOD -> DANGER") == 1


def test_a_scrape_applies_deferred_values_that_arrived_while_the_loop_is_away(monitor, monkeypatch):
    """A NaN just before a long evaluation shows at the next scrape, not at the next observe();
    the scrape never waits for the device (a pending copy stays pending)."""
    import lossbeat.monitor.transfer as monitor_module

    # The loop's absence is the time since its last observe(): an hour for "it has just observed",
    # none for "it is away", so no scrape's verdict depends on how fast this machine is.
    monkeypatch.setattr(monitor_module, "SCRAPE_DRAIN_AFTER_S", 3600.0)
    monitor.observe(0, loss=1.0)
    events = [_StubEvent(), _StubEvent()]
    for step, (event, loss) in enumerate(zip(events, (math.nan, 2.0)), start=1):
        monitor._transfer.pending.append(_in_flight(step, loss, event))
    events[0].done = True
    parsed = samples(metrics_text(monitor.port))  # the loop has just observed: the scrape leaves it be
    assert value(parsed, "training_steps_total") == 1
    monkeypatch.setattr(monitor_module, "SCRAPE_DRAIN_AFTER_S", 0.0)  # the loop is away (evaluating)
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_steps_total") == 2 and value(parsed, "training_nonfinite_loss_total") == 1
    assert not events[1].waited and len(monitor._transfer.pending) == 1  # still in flight: not waited for
    events[1].done = True
    parsed = samples(metrics_text(monitor.port))
    assert value(parsed, "training_steps_total") == 3 and value(parsed, "training_loss") == 2.0


def test_scrapes_and_observe_apply_deferred_steps_once_and_in_order(monkeypatch):
    """Both threads drain: every step is applied exactly once, in order, under concurrent scrapes."""
    import threading

    import lossbeat.monitor.transfer as monitor_module

    monkeypatch.setattr(monitor_module, "SCRAPE_DRAIN_AFTER_S", 0.0)
    m = Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False)
    applied = []
    real_apply = m._transfer.apply
    monkeypatch.setattr(m._transfer, "apply", lambda record: applied.append(record.step) or real_apply(record))
    stop = threading.Event()

    def scrapes():
        while not stop.is_set():
            list(m.registry.collect())

    thread = threading.Thread(target=scrapes)
    thread.start()
    try:
        for step in range(2000):
            event = _StubEvent()
            event.done = step % 3 != 0  # some copies still in flight
            with m._transfer.lock:
                m._transfer.pending.append(_in_flight(step, 1.0, event))
            m._transfer.drain(block=False)
            if step % 3 == 0:
                event.done = True
    finally:
        stop.set()
        thread.join()
    m.flush()
    assert applied == list(range(2000)) and m.state.steps_total == 2000
    m.close()


def test_observe_during_cuda_graph_capture_raises_a_clear_error(monitor, monkeypatch):
    """Device-only condition (no GPU here): the capture query is faked at torch.cuda's seam."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="observe: called during CUDA graph capture"):
        monitor.observe(0, loss=torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="clip_grad_norm_: called during CUDA graph capture"):
        monitor.clip_grad_norm_(Trainer().model, 1.0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monitor.observe(0, loss=torch.tensor(1.0))
    assert monitor.state.steps_total == 1


def test_the_deferred_copy_and_its_event_use_the_source_devices_stream(monkeypatch):
    """Device-only path (no GPU here): torch.cuda's device guard, streams, events and the
    pinned allocation are replaced at the seam by recorders, ONLY for this test of which
    stream the event is recorded on. A tensor on cuda:1 while cuda:0 is current: the copy
    runs on cuda:1's current stream, so the event must be recorded there (recorded on the
    current device's stream it completes before the copy and the buffer is read early),
    and nothing may touch cuda:0 (no context on GPU 0)."""
    from lossbeat.monitor.transfer import start_host_copy as _start_host_copy

    current = [0]
    calls = []

    class DeviceGuard:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    class Buffer:
        def copy_(self, source, non_blocking=False):
            calls.append(("copy", current[0], non_blocking))

    class Event:
        def record(self, stream=None):
            calls.append(("record", current[0], stream))

    def empty(shape, dtype=None, pin_memory=False):
        calls.append(("pinned buffer", current[0], pin_memory))
        return Buffer()

    class Packed:
        device, shape, dtype = torch.device("cuda", 1), (3,), torch.float64

    monkeypatch.setattr(torch.cuda, "device", DeviceGuard)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", torch.device(device).index))
    monkeypatch.setattr(torch, "empty", empty)
    buffer, event = _start_host_copy(Packed())
    assert calls == [("pinned buffer", 1, True), ("copy", 1, True), ("record", 1, ("stream of", 1))]
    assert current[0] == 0 and isinstance(event, Event) and isinstance(buffer, Buffer)


def test_deepspeed_zero_partitioned_gradients_are_reported_once(monitor, caplog):
    """ZeRO-3 parameters carry ``ds_id`` and their gradients live in DeepSpeed's partitions, not
    in p.grad (DeepSpeed is not installed here: the marker attribute stands in for it)."""
    trainer = Trainer()
    for p in trainer.model.parameters():
        p.ds_id = 0
    with caplog.at_level(logging.WARNING, logger="lossbeat"):
        for step in range(3):
            monitor.observe(step, loss=1.0, model=trainer.model)  # p.grad stays None
    warnings = [r.getMessage() for r in caplog.records if "DeepSpeed" in r.getMessage()]
    assert len(warnings) == 1 and "ZeRO-3" in warnings[0] and "get_global_grad_norm" in warnings[0]
    assert monitor.state.steps_total == 3 and monitor.state.grad_norm is None


def test_status_change_lines_start_above_a_tqdm_bar(monitor, capsys):
    tqdm = require_module("tqdm")
    handler = logging.StreamHandler()  # stderr as it is now (captured)
    logger = logging.getLogger("lossbeat")
    level, disabled = logger.level, logger.disabled  # whatever an earlier test in this process left
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    logger.addHandler(handler)
    try:
        with tqdm.tqdm(total=100, file=sys.stderr, mininterval=0) as bar:
            for step in range(50):
                monitor.observe(
                    step, loss=2.0 + 0.01 * (step % 3), grad_norm=50.0 if step >= 40 else 1.0
                )  # a loss that moves: trained
                bar.update(1)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    err = capsys.readouterr().err
    lines = [part for part in err.replace("\r", "\n").split("\n") if "GOOD -> DANGER" in part]
    assert lines, (dict(monitor.state.errors), monitor.state.health, err[-2000:])
    line = lines[0]
    assert line.startswith("lossbeat: grad_norm GOOD -> DANGER")  # its own line, not after the bar's text


def test_norms_measured_ahead_are_dropped_by_an_observe_without_the_model():
    # observe() without a model skips the gradient meter, except while norms measured ahead
    # wait: a clip's norms belong to its own step, never to a later observe(model=...).
    model = torch.nn.Linear(4, 1)
    m = Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False)
    try:
        model(torch.ones(2, 4)).sum().backward()
        m.clip_grad_norm_(model, 1e9)  # measured, not clipped
        m.observe(0, loss=1.0)  # without the model: the clip's norms are this step's, unreported
        for p in model.parameters():
            p.grad = torch.full_like(p, 3.0)  # the next step's gradients
        m.observe(1, loss=1.0, model=model)
        m.flush()
        expected = math.sqrt(sum(9.0 * p.numel() for p in model.parameters()))
        assert m.state.grad_norm == pytest.approx(expected)
    finally:
        m.close()


class _Real:
    """A real number that is not a float: observe() takes it through its general path."""

    def __init__(self, x: float) -> None:
        self.x = x

    def __float__(self) -> float:
        return self.x


def test_the_float_shortcut_builds_what_the_general_path_builds():
    """Host floats alone skip the scans of the general path: the same state, events on the same
    steps, the same windows and findings, through NaN, spikes, explosions, zero gradients and
    steps without a grad norm or an LR."""
    import numbers

    numbers.Real.register(_Real)

    def loss_at(i: int) -> float:
        if i in (150, 151):
            return math.nan
        return 30.0 if i == 240 else 2.0 / (1 + i / 100) + 0.01 * (i % 7)

    def grad_at(i: int) -> float | None:
        return None if i % 13 == 0 else 0.0 if i == 90 else 500.0 if i == 300 else 0.5 + 0.01 * (i % 5)

    fed = []
    for wrap in (float, _Real):
        m = Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False)
        for i in range(400):
            g = grad_at(i)
            lr = None if i % 17 == 0 else 1e-3
            m.observe(
                i,
                loss=wrap(loss_at(i)),
                grad_norm=None if g is None else wrap(g),
                learning_rate=None if lr is None else wrap(lr),
            )
        m.flush()
        s, h = m.state, m.history
        fed.append(
            {
                "counts": (
                    s.steps_total,
                    s.nonfinite_loss_total,
                    s.nonfinite_grad_total,
                    s.loss_spikes_total,
                    s.grad_explosions_total,
                ),
                "event_steps": dict(s.event_steps),
                "lrs": dict(s.learning_rates),
                "loss": s.loss,
                "grad_norm": s.grad_norm,
                "recent": [tuple(str(x) for x in r) for r in s.recent.snapshot()],
                "windows": (h.steps_seen, h.grad_records, list(h.grad_norms.last(50)), h.loss.noise, h.grad.median),
                "findings": [  # steps/s and memory are the machine's and the process's, not the record's
                    (f.check, f.status, f.message)
                    for f in m.report().findings
                    if f.check not in ("throughput", "memory")
                ],
                "errors": dict(s.errors),
            }
        )
        m.close()
    floats, general = fed
    assert floats["counts"][1:] == (2, 0, 2, 1) and not any(
        floats["errors"].values()
    )  # NaN twice, 2 spikes, 1 explosion
    assert floats == general
