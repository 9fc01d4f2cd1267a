"""Real tiny training runs through the HF Trainer and Lightning callbacks, read back from /metrics text."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import registry_samples, require_module, sample_value

from lossbeat.monitor import Monitor, MonitorConfig


def _layers(samples: dict) -> dict[str, float]:
    return {dict(k)["layer"]: v for k, v in samples.get("training_layer_grad_norm", {}).items()}


# --- Hugging Face Trainer ---------------------------------------------------------------


def _hf_run(tmp_path, *, per_step: bool, max_grad_norm: float = 0.05):
    require_module("transformers")
    require_module("accelerate")
    from transformers import Trainer
    from workers.hf_ddp_worker import Tokens, cpu_args, tiny_gpt2  # imports transformers: only once it is known present

    from lossbeat.integrations.hf import LossbeatCallback

    model = tiny_gpt2()
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    measure = monitor.measure_gradients
    monitor.measured_calls = 0

    def counted_measure(model, **kwargs):  # counts how often the gradients are read at the end of backward
        monitor.measured_calls += 1
        return measure(model, **kwargs)

    monitor.measure_gradients = counted_measure
    callback = LossbeatCallback(monitor, per_step=per_step)
    args = cpu_args(
        tmp_path,
        max_steps=6,
        gradient_accumulation_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        learning_rate=1e-3,
        max_grad_norm=max_grad_norm,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(64, 1), eval_dataset=Tokens(8, 2), callbacks=[callback]
    )
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    return monitor, callback, model, logged, evals


def test_hf_trainer_per_step_feeds_loss_grad_norms_and_eval(tmp_path):
    monitor, callback, model, logged, evals = _hf_run(tmp_path, per_step=True)
    s = registry_samples(monitor)
    assert callback.observed_steps == 6
    assert sample_value(s, "training_steps_total") == 6
    assert sample_value(s, "training_step") == 6
    last = logged[-1]
    assert last["step"] == 6
    # Gradient accumulation 2: the model returns each micro-batch's share; their sum is the logged loss.
    assert sample_value(s, "training_loss") == pytest.approx(last["loss"], rel=1e-5)
    # The global norm is measured before the Trainer clips: it equals the Trainer's own (pre-clip) grad_norm.
    assert last["grad_norm"] > 0.05
    assert sample_value(s, "training_grad_norm") == pytest.approx(last["grad_norm"], rel=1e-4)
    # Measured once per optimizer step (on the micro-batch that completes it), not once per micro-batch.
    assert monitor.measured_calls == 6
    layers = _layers(s)
    expected = {n.rsplit(".", 1)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert set(layers) == expected and "transformer.h.0.mlp.c_fc" in layers
    # Layer norms are measured with the global norm, before the Trainer clips to 0.05: they make it up.
    assert math.sqrt(sum(v * v for v in layers.values())) == pytest.approx(last["grad_norm"], rel=1e-4)
    lrs = s["training_learning_rate"]
    assert all(v == pytest.approx(last["learning_rate"]) for v in lrs.values())
    assert sample_value(s, "training_epoch") == pytest.approx(last["epoch"])  # the epoch the Trainer gives the step
    assert sample_value(s, "training_eval_total") == len(evals) == 2
    assert sample_value(s, "training_eval_loss") == pytest.approx(evals[-1]["eval_loss"])
    assert callback._hook is None  # removed at on_train_end


def test_hf_trainer_log_fallback_observes_logged_records(tmp_path):
    monitor, callback, _, logged, evals = _hf_run(tmp_path, per_step=False, max_grad_norm=1.0)
    s = registry_samples(monitor)
    assert callback.observed_steps == 0
    assert sample_value(s, "training_steps_total") == len(logged) == 6
    assert sample_value(s, "training_loss") == pytest.approx(logged[-1]["loss"])
    assert sample_value(s, "training_grad_norm") == pytest.approx(logged[-1]["grad_norm"])
    assert sample_value(s, "training_epoch") == pytest.approx(logged[-1]["epoch"])
    assert "training_layer_grad_norm" not in s  # gradients are gone by on_log
    assert sample_value(s, "training_eval_total") == 2


def test_hf_fp16_scaler_is_passed_and_unscales_when_the_trainer_does_not_clip():
    """accelerate's optimizer carries the GradScaler (on CUDA; built here on CPU): without
    clipping nothing unscaled the gradients before on_pre_optimizer_step, so the callback does."""
    require_module("transformers")
    accelerate_optimizer = require_module("accelerate.optimizer")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lossbeat.integrations.hf import LossbeatCallback

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    # The process state accelerate's optimizer reads, fresh, as a Trainer sets it up.
    AcceleratorState._reset_state(reset_partial_state=True)
    Accelerator(cpu=True)
    optimizer = accelerate_optimizer.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    callback = LossbeatCallback(monitor)
    args = TrainingArguments(output_dir="/tmp/lossbeat-hf-fp16", max_grad_norm=0.0, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    x = torch.randn(16, 8)
    for _step, poison in enumerate((False, True)):
        callback.on_step_begin(args, state, control)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        callback._loss_sum, callback._micro_batches = loss.detach(), 1  # what the forward hook keeps
        scaler.scale(loss).backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item() / 2.0**10
        if poison:
            model[0].weight.grad[0, 0] = math.inf
        callback.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
        monitor.flush()
        if not poison:  # unscaled by the callback: the real norm, not 1024 times it
            assert monitor.state.grad_norm == pytest.approx(expected, rel=1e-5)
        scaler.step(optimizer.optimizer)  # AcceleratedOptimizer.step(): the gradients are already unscaled
        scaler.update()
        optimizer.zero_grad()
        state.global_step += 1
    s = registry_samples(monitor)
    assert sample_value(s, "training_grad_scaler_overflows_total") == 1
    assert sample_value(s, "training_nonfinite_grad_total") == 0
    assert sample_value(s, "training_grad_scale") == 2.0**10  # read before update() halved it


def test_hf_eval_key_picks_named_eval_set():
    from lossbeat.integrations._common import eval_loss_from

    metrics = {"eval_b_loss": 2.0, "eval_a_loss": 1.0, "eval_a_accuracy": 0.5}
    assert eval_loss_from(metrics, None) == ("eval_a_loss", 1.0)
    assert eval_loss_from(metrics, "eval_b_loss") == ("eval_b_loss", 2.0)
    assert eval_loss_from({"eval_loss": 3.0, "eval_a_loss": 1.0}, None) == ("eval_loss", 3.0)
    assert eval_loss_from({"eval_runtime": 1.0}, None) is None


# --- Lightning ---------------------------------------------------------------------------


def _lightning_module():
    """The small regressor LightningModule the Lightning tests train (requires lightning)."""
    L = require_module("lightning")

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            self.losses: list[float] = []
            self.val_runs = 0

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def on_validation_epoch_end(self) -> None:
            if not self.trainer.sanity_checking:
                self.val_runs += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regressor


def _fit_lightning(make_module, samples: int, *, validate: bool = False, **trainer_args):
    """Fits ``make_module()`` on ``samples`` rows of x -> sum(x) with a quiet CPU Trainer and a
    LossbeatCallback on a fresh monitor; returns (trainer, module, monitor, callback)."""
    L = require_module("lightning")
    from lossbeat.integrations.lightning import LossbeatCallback

    torch.manual_seed(0)
    x = torch.randn(samples, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    callback = LossbeatCallback(monitor)
    module = make_module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **trainer_args,
    )
    trainer.fit(module, data, data if validate else None)
    return trainer, module, monitor, callback


def test_lightning_callback_observes_each_optimizer_step_with_unclipped_norms():
    Regressor = _lightning_module()
    trainer, module, monitor, callback = _fit_lightning(
        Regressor,
        64,
        validate=True,
        max_steps=6,
        val_check_interval=4,
        limit_val_batches=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.01,
    )

    s = registry_samples(monitor)
    assert trainer.global_step == 6 and callback.observed_steps == 6
    assert sample_value(s, "training_steps_total") == 6
    assert sample_value(s, "training_step") == 6
    # Lightning divides each micro-batch loss by accumulate_grad_batches: the step's loss is their mean.
    assert sample_value(s, "training_loss") == pytest.approx(sum(module.losses[-2:]) / 2, rel=1e-5)
    layers = _layers(s)
    assert set(layers) == {"net.0", "net.2"}
    global_norm = sample_value(s, "training_grad_norm")
    # Read before Lightning clips to 0.01: the real norms, consistent with each other.
    assert global_norm > 0.1
    assert math.sqrt(sum(v * v for v in layers.values())) == pytest.approx(global_norm, rel=1e-5)
    assert list(s["training_learning_rate"].values()) == [pytest.approx(0.05)]
    assert module.val_runs >= 1
    assert sample_value(s, "training_eval_total") == module.val_runs
    assert sample_value(s, "training_eval_loss") == pytest.approx(float(trainer.callback_metrics["val_loss"]))


def test_lightning_loss_is_read_as_it_was_at_backward_not_after_an_in_place_change():
    """The callback keeps a copy of the loss it sees in on_before_backward: code that changes the
    loss tensor in place after backward (the HF Trainer does) must not change the exported loss."""
    Regressor = _lightning_module()

    class RescalesAfterBackward(Regressor):
        def backward(self, loss, *args, **kwargs):
            super().backward(loss, *args, **kwargs)
            with torch.no_grad():
                loss.mul_(100.0)

    _, module, monitor, _ = _fit_lightning(RescalesAfterBackward, 32, max_steps=4, limit_val_batches=0)
    assert sample_value(registry_samples(monitor), "training_loss") == pytest.approx(module.losses[-1], rel=1e-5)


def test_lightning_fp16_scaler_overflow_is_counted_not_paged():
    """16-mixed precision's GradScaler, on CPU: a step whose gradients overflow is skipped by the
    scaler and counted as an overflow; the loss scale is exported."""
    Regressor = _lightning_module()
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Overflowing(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e30 if batch_idx == 2 else loss  # overflows fp16 in backward

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # small enough for this loss in fp16
    _, _, monitor, _ = _fit_lightning(
        Overflowing, 48, max_epochs=1, limit_val_batches=0, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )

    s = registry_samples(monitor)
    assert sample_value(s, "training_steps_total") == 6
    assert sample_value(s, "training_grad_scaler_overflows_total") == 1
    assert sample_value(s, "training_nonfinite_grad_total") == 0
    assert sample_value(s, "training_grad_scale") == 2.0**7 == scaler.get_scale()  # halved once, at the overflow
    assert math.isfinite(sample_value(s, "training_grad_norm"))


def test_lightning_fallback_uses_train_batch_outputs_when_backward_bypasses_lightning():
    Regressor = _lightning_module()

    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            loss.backward()  # plain backward: on_before_backward never sees this loss
            opt.step()
            self.losses.append(loss.item())
            return {"loss": loss.detach()}

    _, module, monitor, callback = _fit_lightning(Manual, 32, max_steps=4, limit_val_batches=0)
    s = registry_samples(monitor)
    assert callback.observed_steps == 0
    assert sample_value(s, "training_steps_total") == 4
    assert sample_value(s, "training_loss") == pytest.approx(module.losses[-1], rel=1e-6)
    assert "training_layer_grad_norm" not in s


# --- end of backward under fp16, the step's epoch, failures at the end of training ------------


def test_hf_fp16_with_clipping_measures_before_the_clip_and_exports_each_steps_epoch(tmp_path):
    """fp16=True with max_grad_norm: the norms are read at the end of backward, where the
    gradients carry the loss scale, and divided by it: the Trainer's own pre-clip grad_norm, not
    at most max_grad_norm. On CPU accelerate builds no GradScaler (its fp16 needs an
    accelerator), so the real Trainer's accelerator is given a CPU GradScaler as accelerate
    gives one on CUDA (scaler and native_amp): backward scales the loss, the clip unscales the
    gradients, the optimizer step goes through the scaler.
    The exported epoch is the one the Trainer gives each step, across epoch ends."""
    require_module("transformers")
    require_module("accelerate")
    from transformers import Trainer, TrainerCallback
    from workers.hf_ddp_worker import Tokens, cpu_args, tiny_gpt2

    from lossbeat.integrations.hf import LossbeatCallback

    monitor = Monitor(MonitorConfig(port=0), serve=False)
    epochs: list[tuple[float, float]] = []

    class Epochs(TrainerCallback):  # after each step: (exported epoch, the Trainer's)
        def on_step_end(self, args, state, control, **kwargs):
            epochs.append((monitor.state.epoch, state.epoch))

    args = cpu_args(
        tmp_path,
        max_steps=7,
        gradient_accumulation_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=0.05,
        fp16=True,
    )
    # 20 samples: 5 micro-batches per epoch, the last step of each epoch has one.
    trainer = Trainer(
        model=tiny_gpt2(), args=args, train_dataset=Tokens(20, 1), callbacks=[LossbeatCallback(monitor), Epochs()]
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True
    trainer.train()

    logged = [r for r in trainer.state.log_history if "loss" in r]
    s = registry_samples(monitor)
    assert sample_value(s, "training_steps_total") == len(logged) == 7
    last = logged[-1]
    assert last["grad_norm"] > 0.05
    assert sample_value(s, "training_grad_norm") == pytest.approx(last["grad_norm"], rel=1e-4)
    layers = _layers(s)
    assert math.sqrt(sum(v * v for v in layers.values())) == pytest.approx(last["grad_norm"], rel=1e-4)
    assert sample_value(s, "training_grad_scale") == 2.0**12
    assert sample_value(s, "training_grad_scaler_overflows_total") == 0
    assert [e for e, _ in epochs] == pytest.approx([t for _, t in epochs])
    assert [t for _, t in epochs] == pytest.approx([0.4, 0.8, 1.0, 1.4, 1.8, 2.0, 2.4])
    assert sample_value(s, "training_epoch") == pytest.approx(last["epoch"])


class _FailingFlush(Monitor):
    """A monitor whose last deferred read fails, as a device error surfaces there on CUDA."""

    def flush(self) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")


def test_a_failing_flush_at_train_end_is_counted_not_raised_into_the_trainer(tmp_path):
    Regressor = _lightning_module()
    L = require_module("lightning")
    from lossbeat.integrations.lightning import LossbeatCallback as LightningCallback

    monitor = _FailingFlush(MonitorConfig(port=0), serve=False)
    x = torch.randn(32, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LightningCallback(monitor)],
    )
    trainer.fit(Regressor(), data)  # on_train_end flushes: no exception escapes
    assert trainer.global_step == 3
    assert monitor.state.errors["observe"] == 1

    require_module("transformers")
    from transformers import Trainer
    from workers.hf_ddp_worker import Tokens, cpu_args, tiny_gpt2

    from lossbeat.integrations.hf import LossbeatCallback as HFCallback

    hf_monitor = _FailingFlush(MonitorConfig(port=0), serve=False)
    args = cpu_args(tmp_path, max_steps=2)
    Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(16, 1), callbacks=[HFCallback(hf_monitor)]).train()
    assert sample_value(registry_samples(hf_monitor), "training_steps_total") == 2
    assert hf_monitor.state.errors["observe"] == 1


def test_hf_callback_starts_its_exporter_when_training_begins_with_the_trainers_ranks(tmp_path):
    """Built with settings, the callback starts no server until on_train_begin, in the process
    that trains (a forked or spawned rank's own), labelled with the Trainer's ranks."""
    require_module("transformers")
    import urllib.request

    from transformers import Trainer
    from workers.hf_ddp_worker import Tokens, cpu_args, tiny_gpt2

    from lossbeat.integrations.hf import LossbeatCallback

    with pytest.raises(TypeError, match="unknown exporter setting 'run'"):
        LossbeatCallback(run="x")
    callback = LossbeatCallback(port=0, addr="127.0.0.1", run_name="hf-rank-process")
    assert callback.monitor is None
    args = cpu_args(tmp_path, max_steps=2)
    Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(16, 1), callbacks=[callback]).train()
    monitor = callback.monitor
    try:
        assert monitor.rank_context.source == "trainer"
        assert (monitor.rank_context.rank, monitor.rank_context.world_size) == (args.process_index, args.world_size)
        body = urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=10).read().decode()
        assert (
            re.search(r'training_steps_total{rank="0",run_id="[^"]*"} 2\.0', body) and 'run="hf-rank-process"' in body
        )
    finally:
        monitor.close()
