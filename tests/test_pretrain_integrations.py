"""The pretraining frameworks' integrations, driven by their real trainers on CPU.

OLMo-core: its ``Trainer`` with a ``TransformerTrainModule`` (the 1M-parameter OLMo-2 debug
model), a ``NumpyFSLDataLoader`` over a token file the test writes, its default callbacks and
an ``EvaluatorCallback``: every exported value is checked against what the trainer passed to
its callbacks' ``log_metrics``. torchtitan: see its section below.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import registry_samples, require_module, sample_value

from lossbeat.monitor import Monitor, MonitorConfig


def test_lossbeat_imports_without_the_frameworks():
    code = (
        "import sys; sys.modules['olmo_core'] = None; sys.modules['torchtitan'] = None\n"
        "import lossbeat, lossbeat.integrations\n"
        "for name in ('lossbeat.integrations.olmo_core', 'lossbeat.integrations.torchtitan'):\n"
        "    try:\n        __import__(name)\n    except ImportError:\n        pass\n"
        "    else:\n        raise SystemExit(name + ' imported without its framework')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --- OLMo-core -------------------------------------------------------------------------------


def _olmo_run(tmp_path, *, nan_at: int | None = None, steps: int = 6, grads: dict | None = None):
    require_module("olmo_core")
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDataset
    from olmo_core.eval import Evaluator
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback, EvaluatorCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    from lossbeat.integrations.olmo_core import LossbeatCallback

    seq, vocab = 32, 256
    tokens = np.random.default_rng(0).integers(1, vocab - 1, size=seq * 64, dtype=np.uint16)
    path = tmp_path / "tokens.npy"
    tokens.tofile(path)
    dataset = NumpyFSLDataset(path, sequence_length=seq, pad_token_id=0, eos_token_id=vocab - 1, vocab_size=vocab)
    dataset.work_dir = tmp_path
    dataset.prepare()
    loader = NumpyDataLoaderConfig(global_batch_size=4 * seq, seed=0, num_workers=0, work_dir=str(tmp_path)).build(
        dataset
    )
    torch.manual_seed(0)
    model = TransformerConfig.olmo2_1M(vocab_size=vocab).build(init_device="cpu")
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * seq,
        max_sequence_length=seq,
        optim=AdamWConfig(lr=1e-3),
        max_grad_norm=1.0,
    ).build(model, device=torch.device("cpu"))

    class MeanCE(Evaluator):  # an in-loop evaluator: the mean CE loss over fixed batches
        def __init__(self):
            gen = torch.Generator().manual_seed(1)
            super().__init__(
                name="heldout",
                batches=[{"input_ids": torch.randint(1, vocab - 1, (2, seq), generator=gen)} for _ in range(2)],
            )
            self.reset_metrics()

        def update_metrics(self, batch, ce_loss, logits):
            self.sum, self.n = self.sum + ce_loss.float().sum(), self.n + ce_loss.numel()

        def compute_metrics(self):
            return {"CE loss": self.sum / self.n}

        def reset_metrics(self):
            self.sum, self.n = torch.zeros(()), 0

    logged: dict[int, dict[str, float]] = {}
    phases: list[str] = []
    monitor = Monitor(MonitorConfig(port=0, linger_seconds=0), serve=False)

    class Record(Callback):  # what the trainer passed on, and the phase the eval ran in
        def log_metrics(self, step, metrics):
            logged.setdefault(step, {}).update(metrics)

        def pre_optim_step(self):  # the norms of the gradients the optimizer is about to get, per module
            if grads is not None:
                squares: dict[str, float] = {}
                for name, p in model.named_parameters():
                    if p.grad is not None:
                        layer = name.rsplit(".", 1)[0] if "." in name else name
                        squares[layer] = squares.get(layer, 0.0) + float(p.grad.double().square().sum())
                grads[self.step] = {layer: math.sqrt(x) for layer, x in squares.items()}

        def pre_step(self, batch):
            if nan_at is not None and self.step == nan_at:
                model.embeddings.register_forward_hook(lambda mod, args, out: out * float("nan"))

    class SeePhase(Callback):
        priority = -5  # after the EvaluatorCallback (0) has evaluated in its post_step

        def post_step(self):
            phases.append(monitor.state.phase[0])

    callback = LossbeatCallback(monitor)
    config = TrainerConfig(
        save_folder=str(tmp_path / "save"),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=2,
        no_checkpoints=True,
    )
    config = config.with_callback("lossbeat", callback).with_callback("record", Record())
    config = config.with_callback("evaluator", EvaluatorCallback(evaluators=[MeanCE()], eval_interval=3))
    config = config.with_callback("phase", SeePhase())
    trainer = config.build(train_module, loader)
    error = None
    try:
        trainer.fit()
    except RuntimeError as e:
        error = e
    return monitor, callback, logged, phases, error, train_module


def test_olmo_core_trainer_exports_what_it_logs(tmp_path):
    monitor, callback, logged, phases, error, train_module = _olmo_run(tmp_path)
    assert error is None
    samples = registry_samples(monitor)
    last = logged[6]
    assert sample_value(samples, "training_steps_total") == 6
    assert sample_value(samples, "training_step") == 6
    assert sample_value(samples, "training_loss") == pytest.approx(last["train/CE loss"], rel=1e-6)
    assert sample_value(samples, "training_grad_norm") == pytest.approx(last["optim/total grad norm"], rel=1e-6)
    assert sample_value(samples, "training_learning_rate", param_group="0") == pytest.approx(1e-3)
    eval_steps = sorted(s for s, m in logged.items() if "eval/heldout/CE loss" in m)
    assert eval_steps == [3, 6]
    assert sample_value(samples, "training_eval_loss") == pytest.approx(logged[6]["eval/heldout/CE loss"], rel=1e-6)
    first = min(s for s, m in logged.items() if "throughput/total tokens" in m)  # the speed monitor's first
    assert 1 < first < 6
    assert sample_value(samples, "training_tokens_total") == pytest.approx(
        last["throughput/total tokens"] - logged[first]["throughput/total tokens"]
    )
    assert sample_value(samples, "training_nonfinite_loss_total") == 0
    # The evaluator's steps ran in the eval phase (set before the EvaluatorCallback's post_step).
    assert phases[2] == "eval" and phases[5] == "eval" and phases[0] == "train"
    assert sample_value(samples, "training_phase", phase="train") == 1
    assert monitor.closed is False  # a monitor given to the callback is the caller's to close
    monitor.close()


def test_olmo_core_trainer_exports_per_layer_norms_of_each_step(tmp_path):
    # Measured in pre_optim_step (before the train module clips), observed when the trainer's
    # metrics reach log_metrics two steps at a time: each step gets its own norms.
    grads: dict[int, dict[str, float]] = {}
    monitor, callback, logged, phases, error, train_module = _olmo_run(tmp_path, grads=grads)
    assert error is None
    samples = registry_samples(monitor)
    exported = {dict(labels)["layer"]: v for labels, v in samples["training_layer_grad_norm"].items()}
    assert len(grads[6]) > 10 and "blocks.0.attention.w_q" in grads[6]
    assert sorted(exported) == sorted(grads[6])
    for layer, norm in grads[6].items():
        assert exported[layer] == pytest.approx(norm, rel=1e-5), layer
    history = dict(monitor.state.layer_history.snapshot())
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert history[step] == pytest.approx(grads[step], rel=1e-5), step
    assert grads[5] != pytest.approx(grads[6], rel=1e-3)
    # The global norm is still the trainer's (it clips: max_grad_norm), and the total of the layers.
    total = math.sqrt(sum(x * x for x in grads[6].values()))
    assert sample_value(samples, "training_grad_norm") == pytest.approx(logged[6]["optim/total grad norm"], rel=1e-6)
    assert logged[6]["optim/total grad norm"] == pytest.approx(total, rel=1e-4)
    assert sample_value(samples, "training_exporter_errors_total", where="gradients") == 0
    assert monitor.host_transfers <= 6  # one packed read per step, none in pre_optim_step
    monitor.close()


def test_olmo_core_nan_loss_is_counted_before_the_trainer_stops(tmp_path):
    monitor, callback, logged, phases, error, _ = _olmo_run(tmp_path, nan_at=4)
    assert error is not None and "nan loss encountered at step 4" in str(error)
    samples = registry_samples(monitor)
    assert sample_value(samples, "training_nonfinite_loss_total") == 1
    assert math.isnan(sample_value(samples, "training_loss"))
    assert sample_value(samples, "training_step") == 4
    assert sample_value(samples, "training_steps_total") == 4
    assert sample_value(samples, "training_loss") != logged.get(3, {}).get("train/CE loss")
    # The NaN step's gradients, measured before the trainer stopped: every layer non-finite.
    assert sample_value(samples, "training_nonfinite_grad_total") == 1
    assert monitor.state.first_nonfinite_layer == "all layers"
    monitor.close(completed=False)


# --- torchtitan --------------------------------------------------------------------------------
# torchtitan's Trainer cannot run on this CPU-only machine: `torchtitan.trainer` imports triton at
# module level (torchtitan/distributed/minimal_async_ep/kernels.py, `import triton`), and
# `torchtitan.tools.utils.device_type` is "cuda" on any machine, so Trainer.__init__
# (`device_module.set_device`) and MetricsProcessor.__init__ (DeviceMemoryMonitor:
# `torch.cuda.get_device_name`) need a GPU. On CPU the logger backend is driven through
# torchtitan's real LoggerContainer with the metric dicts MetricsProcessor.log builds (its keys,
# imported from the integration, are checked against torchtitan's source); the processor itself
# is tested on a GPU by benchmarks/gpu.sh (benchmarks/gpu_checks.py), never skipped here.


def _titan_metrics(step: int, loss: float, grad_norm: float, tokens: int) -> dict:
    """The dict MetricsProcessor.log hands its backends (torchtitan 0.3.0), with the trainer's extras."""
    return {
        "loss_metrics/global_avg_loss": loss,
        "loss_metrics/global_max_loss": loss * 1.1,
        "grad_norm": grad_norm,
        "throughput(tps)": 1000.0,
        "tflops": 1.0,
        "memory/max_reserved(GiB)": 1.0,
        "n_tokens_seen": tokens,
        "lr/AdamW": 3e-4 * step,
    }


def test_torchtitan_logger_keys_are_those_torchtitan_logs():
    metrics = require_module("torchtitan.components.metrics")
    import inspect

    from lossbeat.integrations import torchtitan as tt

    source = inspect.getsource(metrics.MetricsProcessor)
    for key in (tt.LOSS_KEY, tt.GRAD_NORM_KEY, tt.EVAL_LOSS_KEY):
        assert f'"{key}"' in source
    trainer_source = open(os.path.join(os.path.dirname(metrics.__file__), "..", "trainer.py")).read()
    assert f'"{tt.TOKENS_KEY}"' in trainer_source
    assert 'f"Loss is not finite (global_avg_loss={global_avg_loss}) at "' in trainer_source
    assert tt.LossbeatMetricsProcessor.Config()._owner is tt.LossbeatMetricsProcessor
    assert tt.LossbeatMetricsProcessor.Config(lossbeat_port=9100).log_freq == 10


def test_torchtitan_logger_exports_what_torchtitan_logs():
    metrics = require_module("torchtitan.components.metrics")
    from lossbeat.integrations.torchtitan import LossbeatLogger

    monitor = Monitor(MonitorConfig(port=0, linger_seconds=0), serve=False)
    container = metrics.LoggerContainer()
    logger = LossbeatLogger(monitor)
    container.add_logger(logger)
    for step, loss in ((1, 5.5), (10, 5.0), (20, 4.5)):
        container.log(_titan_metrics(step, loss, 0.5 + step / 100, tokens=step * 2048), step)
    container.log({"validation_metrics/loss": 4.8, "validation_metrics/throughput(tps)": 10.0}, 20)
    try:  # the trainer's stop on a NaN, as torchtitan's train.py closes the trainer: inside the except
        raise RuntimeError("Loss is not finite (global_avg_loss=nan) at step 30. Stopping training.")
    except RuntimeError:
        container.close()
    samples = registry_samples(monitor)
    assert sample_value(samples, "training_nonfinite_loss_total") == 1
    assert math.isnan(sample_value(samples, "training_loss"))
    assert sample_value(samples, "training_step") == 30
    assert sample_value(samples, "training_steps_total") == 4
    assert sample_value(samples, "training_eval_loss") == pytest.approx(4.8)
    assert sample_value(samples, "training_learning_rate", param_group="0") == pytest.approx(3e-4 * 20)
    assert sample_value(samples, "training_tokens_total") == pytest.approx(20 * 2048 - 2048)
    assert monitor.closed is False  # given: flushed, the caller closes it
    monitor.close(completed=False)


def test_torchtitan_placeholder_loss_of_a_pipeline_stage_is_no_loss():
    require_module("torchtitan.components.metrics")
    from lossbeat.integrations.torchtitan import LossbeatLogger

    monitor = Monitor(MonitorConfig(port=0, linger_seconds=0), serve=False)
    logger = LossbeatLogger(monitor)
    logger.log(_titan_metrics(1, -1.0, 0.7, tokens=1024), 1)
    logger.close()
    samples = registry_samples(monitor)
    assert "training_loss" not in samples or not samples["training_loss"]
    assert sample_value(samples, "training_grad_norm") == pytest.approx(0.7)
    monitor.close()


@pytest.mark.parametrize("framework", ["olmo_core", "torchtitan"])
def test_a_callback_that_cannot_apply_the_guard_refuses_it_naming_the_argument(framework):
    """These callbacks see the trainer's metrics, never its optimizer step: guard= would be a no-op."""
    require_module(framework)
    import importlib

    module = importlib.import_module(f"lossbeat.integrations.{framework}")
    callback = module.LossbeatCallback if framework == "olmo_core" else module.LossbeatLogger
    with pytest.raises(ValueError, match="guard: the .* callback .* guard='skip' would never withhold"):
        callback(guard="skip", port=0)
    monitor = Monitor(MonitorConfig(port=0, guard="stop"), serve=False)
    with pytest.raises(ValueError, match="guard="):
        callback(monitor)
    monitor.close()
