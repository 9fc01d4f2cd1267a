"""Integrations and per-step data that must not break the run: the HF callback under
nn.DataParallel (its forward hook in every replica's thread) and under DeepSpeed ZeRO (the
engine's norm), DDP layer names without `module.`, observe() counting per-step anomalies instead
of raising, and a second start_exporter() naming the settings it ignores."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import require_module
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lossbeat import start_exporter
from lossbeat.monitor import Monitor, MonitorConfig


def _samples(monitor: Monitor) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(monitor.registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[
                tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("rank", "run_id")))
            ] = s.value
    return out


def _errors(monitor: Monitor, where: str) -> float:
    return _samples(monitor).get("training_exporter_errors_total", {}).get((("where", where),), 0.0)


# --- observe(): per-step data is counted, never raised ------------------------------------


def test_a_component_that_is_none_on_some_steps_is_absent_there_not_an_error():
    m = Monitor(MonitorConfig(port=0), serve=False)
    for step in range(1, 6):
        aux = torch.tensor(0.1) if step % 4 else None  # an auxiliary loss some batches lack
        m.observe(step, loss=2.0, losses={"lm": 2.0, "aux": aux})
    m.flush()
    s = _samples(m)
    assert s["training_steps_total"][()] == 5
    assert s["training_loss_component"][(("component", "aux"),)] == pytest.approx(0.1)
    assert _errors(m, "input") == 0
    with pytest.raises(TypeError, match=r"losses\['aux'\]: expected a float or a 0-d tensor, got str"):
        m.observe(6, loss=2.0, losses={"aux": "0.1"})  # a wrong type is still a programming error
    m.close()


def test_a_dataparallel_loss_vector_is_observed_as_its_mean_and_counted(caplog):
    m = Monitor(MonitorConfig(port=0), serve=False)
    with caplog.at_level(logging.WARNING, logger="lossbeat"):
        m.observe(1, loss=torch.tensor([2.0, 2.2]))  # nn.DataParallel: one loss per device
        m.flush()
        assert _samples(m)["training_loss"][()] == pytest.approx(2.1)
        m.observe(2, loss=torch.tensor([]), losses={"aux": torch.tensor([1.0, 3.0])})
    m.flush()
    s = _samples(m)
    assert s["training_steps_total"][()] == 2
    assert s["training_loss_component"][(("component", "aux"),)] == pytest.approx(2.0)
    assert _errors(m, "input") == 3  # each value that was not one: loss, empty loss, aux
    assert "loss: expected one value, got a tensor of several" in caplog.text
    m.close()


def test_a_second_start_exporter_names_the_settings_it_ignores(caplog):
    first = start_exporter(0, addr="127.0.0.1", run_name="script")
    try:
        with caplog.at_level(logging.WARNING, logger="lossbeat"):
            second = start_exporter(0, addr="127.0.0.1", run_name="callback", layer_depth=2)
        assert second is first
        assert "ignores these settings of this call" in caplog.text
        assert "run_name='callback' (running: 'script')" in caplog.text and "layer_depth=2" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lossbeat"):
            assert start_exporter(0, addr="127.0.0.1", run_name="script") is first  # the same: no warning
        assert "ignores" not in caplog.text
    finally:
        first.close()


# --- DDP layer names ------------------------------------------------------------------------

_DDP = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from lossbeat.monitor import Monitor, MonitorConfig
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(8, 1)))
    for name, wrapped in (("plain", model), ("ddp", DistributedDataParallel(model))):
        for depth in (None, 1):
            m = Monitor(MonitorConfig(port=0, layer_depth=depth), serve=False)
            model.zero_grad()
            wrapped(torch.randn(3, 4)).pow(2).mean().backward()
            m.observe(1, loss=1.0, model=wrapped)
            m.flush()
            print(name, depth, sorted(m.state.layer_norms))
            m.close()
    dist.destroy_process_group()
""")


def test_ddp_layer_names_are_the_models_own_without_module(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _DDP, str(tmp_path / "store")], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    lines = {" ".join(line.split(" ", 2)[:2]): line.split(" ", 2)[2] for line in done.stdout.splitlines()}
    assert lines["plain None"] == lines["ddp None"] == "['0', '2.0']"
    assert lines["plain 1"] == lines["ddp 1"] == "['0', '2']"  # layer_depth counts the model's levels


# --- HF Trainer callback: nn.DataParallel and DeepSpeed --------------------------------------


def _accelerator() -> None:
    """The process state accelerate's objects read, fresh, as a Trainer sets it up."""
    require_module("transformers")
    require_module("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    Accelerator(cpu=True)


def _hf_callback(monitor: Monitor, max_grad_norm: float, optimizer=None, model=None):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lossbeat.integrations.hf import LossbeatCallback

    callback = LossbeatCallback(monitor)
    args = TrainingArguments(
        output_dir="/tmp/lossbeat-hf-faults", max_grad_norm=max_grad_norm, report_to=[], use_cpu=True
    )
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    return callback, args, state, control


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        from types import SimpleNamespace

        return SimpleNamespace(loss=self.head(torch.relu(self.body(x))).pow(2).mean())


def _replicate(model: _Net) -> _Net:
    """What nn.DataParallel's replicate() does on each device: a __dict__ copy (the forward hooks
    included) marked as a replica, whose parameters are non-leaf copies of the model's."""
    replica = model._replicate_for_data_parallel()
    for name in ("body", "head"):
        sub = getattr(model, name)._replicate_for_data_parallel()
        sub.weight, sub.bias = getattr(model, name).weight * 1, getattr(model, name).bias * 1
        replica._modules[name] = sub
    return replica


def test_hf_callback_under_dataparallel_counts_replicas_in_threads_and_measures_the_model():
    torch.manual_seed(0)
    model = _Net().train()
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    measured = []
    real_measure = monitor.measure_gradients
    monitor.measure_gradients = lambda m, **k: measured.append(m) or real_measure(m, **k)
    _accelerator()
    callback, args, state, control = _hf_callback(monitor, max_grad_norm=1.0, model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback.on_step_begin(args, state, control)
    replicas = [_replicate(model) for _ in range(2)]
    chunks = torch.randn(8, 4).chunk(2)
    losses: list = [None, None]
    barrier = threading.Barrier(2)

    def forward(i):  # parallel_apply: one thread per replica, the hook runs in each
        barrier.wait()
        losses[i] = replicas[i](chunks[i]).loss

    threads = [threading.Thread(target=forward, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.stack(losses).mean().backward()  # gather, then the Trainer's loss.mean() for n_gpu > 1
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    callback.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
    monitor.flush()
    s = _samples(monitor)
    assert measured == [model]  # once per step, the model's own parameters: never a replica (none)
    assert s["training_grad_norm"][()] == pytest.approx(expected_norm, rel=1e-5)
    assert {dict(k)["layer"] for k in s["training_layer_grad_norm"]} == {"body", "head"}
    assert s["training_loss"][()] == pytest.approx(((losses[0] + losses[1]) / 2).item(), rel=1e-6)
    assert _errors(monitor, "observe") == 0
    monitor.close()


def test_hf_callback_under_deepspeed_zero_observes_the_engines_norm():
    accelerate_ds = require_module("accelerate.utils.deepspeed")
    torch.manual_seed(0)
    model = _Net().train()

    class ZeroOptimizer(torch.optim.SGD):
        """DeepSpeed's ZeRO optimizer keeps the step's norm in _global_grad_norm (set by engine.step());
        DeepSpeed itself is not installed here."""

    zero = ZeroOptimizer(model.parameters(), lr=0.1)
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    _accelerator()
    wrapped = accelerate_ds.DeepSpeedOptimizerWrapper(zero)  # what accelerate gives the Trainer under DeepSpeed
    callback, args, state, control = _hf_callback(monitor, max_grad_norm=1.0, optimizer=wrapped, model=model)
    callback.on_step_begin(args, state, control)
    model(torch.randn(8, 4))  # the forward hook keeps the loss; ZeRO-2/3 leave p.grad None
    zero._global_grad_norm = torch.tensor(3.5)
    callback.on_pre_optimizer_step(args, state, control, model=model, optimizer=wrapped)
    monitor.flush()
    s = _samples(monitor)
    assert s["training_grad_norm"][()] == pytest.approx(3.5)
    assert math.isfinite(s["training_loss"][()])
    monitor.close()
