"""The run memory: a resumed run is judged against the best its earlier steps reached."""

from __future__ import annotations

import math
import random

from conftest import require_module
from prometheus_client import CollectorRegistry

from lossbeat import Monitor, MonitorConfig
from lossbeat.diagnosis import Status


def _monitor() -> Monitor:
    return Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False, registry=CollectorRegistry())


def _resume(monitor: Monitor, start: int, steps: int, level: float) -> None:
    noise = random.Random(1)
    for step in range(start, start + steps):
        monitor.observe(step, loss=level + noise.gauss(0, 0.02), grad_norm=0.5, learning_rate=1e-3)


EARLIER = [(step, 1.0 + 3.0 * math.exp(-step / 150) + random.Random(step).gauss(0, 0.02)) for step in range(1000)]


def test_a_resumed_run_settled_above_its_earlier_best_is_a_danger():
    """Resumed at step 1000 (its log gives steps 0-999, best about 1.0), the run settles at 2.0: the
    level a resume that lost its optimizer or scheduler state can land at. Judged against its
    own start alone it is a flat loss; against the run's best it went wrong at the resume."""
    restored = _monitor()
    read = restored.history.memory.restore(restored.thresholds, EARLIER, [(999, 1.1)])
    assert read == 1000
    _resume(restored, 1000, 400, 2.0)
    trend = next(f for f in restored.report().findings if f.check == "loss_trend")
    memory = restored.history.memory
    assert 0.95 < memory.best < 1.05 and memory.best_step < 1000  # the best is one before the resume
    assert trend.status is Status.DANGER, trend.message
    assert f"above its best {memory.best:.4g} (step {memory.best_step})" in trend.message
    assert restored.history.memory.best_eval == 1.1 and restored.history.memory.best_eval_step == 999

    alone = _monitor()  # the same resumed steps with no earlier ones: nothing to compare with
    _resume(alone, 1000, 400, 2.0)
    assert next(f for f in alone.report().findings if f.check == "loss_trend").status is not Status.DANGER


def test_restoring_is_bounded_and_skips_what_is_not_a_loss():
    monitor = _monitor()
    memory = monitor.history.memory
    read = memory.restore(monitor.thresholds, [(0, math.nan), (1, "x"), (2, math.inf), *EARLIER[:50]])
    assert read == 50 and memory.first == EARLIER[0][1]
    assert not any(isinstance(getattr(memory, slot), (list, dict, tuple)) for slot in memory.__slots__)


def test_the_hf_callback_restores_the_memory_at_a_resume():
    """A Trainer resumed from a checkpoint restores state.log_history (the earlier logged steps)
    before on_train_begin: the callback gives them to the run memory."""

    require_module("transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lossbeat.integrations.hf import LossbeatCallback

    monitor = _monitor()
    callback = LossbeatCallback(monitor)
    args = TrainingArguments(output_dir="/tmp/lossbeat-hf-resume", report_to=[], use_cpu=True)
    state = TrainerState()
    state.global_step = 1000
    state.log_history = [{"step": s, "loss": x, "learning_rate": 1e-3} for s, x in EARLIER[9::10]] + [
        {"step": 1000, "eval_loss": 1.2}
    ]
    callback.on_train_begin(args, state, TrainerControl())
    memory = monitor.history.memory
    assert memory.best_step is not None and memory.best_step < 1000 and 0.95 < memory.best < 1.1
    assert memory.best_eval == 1.2 and memory.first == EARLIER[9][1]


def test_a_resume_that_goes_back_to_a_checkpoint_keeps_the_run_memory():
    """One stream (lossbeat watch of a log, a monitor fed again from a checkpoint): steps 0-999 reach
    about 1.0, then the run goes back to its checkpoint at step 800 and settles at 2.0. The windows
    restart there; the first loss and the best level stay, and the end is judged against them."""
    resumed = _monitor()
    for step, loss in EARLIER:
        resumed.observe(step, loss=loss, grad_norm=0.5, learning_rate=1e-3)
    _resume(resumed, 800, 400, 2.0)
    memory = resumed.history.memory
    assert resumed.history.resets == 1
    assert 0.95 < memory.best < 1.05 and memory.best_step < 1000 and memory.first > 3.5  # the first segment's
    trend = next(f for f in resumed.report().findings if f.check == "loss_trend")
    assert trend.status is Status.DANGER and "above its best" in trend.message, trend.message

    restarted = _monitor()  # back to step 0: a restart or another run, which owes nothing to the first
    for step, loss in EARLIER:
        restarted.observe(step, loss=loss, grad_norm=0.5, learning_rate=1e-3)
    _resume(restarted, 0, 400, 2.0)
    assert restarted.history.memory.best > 1.9
    assert next(f for f in restarted.report().findings if f.check == "loss_trend").status is not Status.DANGER


def test_analyze_of_a_log_with_a_resume_keeps_the_first_segments_memory(tmp_path):
    """A metrics.csv that goes back from step 999 to the checkpoint at 800 and settles at 2.0: the
    resumed steps replace the abandoned ones in one run, judged against the best of the first."""
    from lossbeat.analyze import analyze_runs

    noise = random.Random(1)
    rows = [f"{step},{loss!r}" for step, loss in EARLIER]
    rows += [f"{step},{2.0 + noise.gauss(0, 0.02)!r}" for step in range(800, 1200)]
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,train_loss\n" + "\n".join(rows) + "\n")
    (run,) = analyze_runs(csv).runs
    assert run.status is Status.DANGER
    trend = next(f for f in run.findings if f.check == "loss_trend")
    assert "above its best" in trend.message and "(step 7" in trend.message, trend.message  # a step before 800


def test_the_lightning_callback_keeps_the_run_memory_in_the_checkpoint(tmp_path):
    """A Lightning fit resumed from its checkpoint: the callback's state in the checkpoint (a few
    numbers) gives the resumed fit's monitor the run memory of the earlier fit: its first loss and
    best levels, which the resumed steps alone cannot give. Without that state (an earlier fit run
    without the callback), the ModelCheckpoint's best eval loss is what the checkpoint has."""

    L = require_module("lightning")
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lossbeat.integrations.lightning import LossbeatCallback

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, 3 * x.sum(1, keepdim=True)), batch_size=8)

    def fit(where, steps: int, callbacks: list, resume: bool = False) -> None:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            val_check_interval=10,
            limit_val_batches=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=where, monitor="val_loss", save_last=True), *callbacks],
        )
        trainer.fit(Regressor(), data, data, ckpt_path=str(where / "last.ckpt") if resume else None)

    earlier = _monitor()
    fit(tmp_path / "a", 30, [LossbeatCallback(earlier)])
    before = earlier.history.memory
    assert before.first > 10 and before.best_step is not None  # a loss of ~70 falling fast
    resumed = _monitor()
    fit(tmp_path / "a", 40, [LossbeatCallback(resumed)], resume=True)
    memory = resumed.history.memory
    assert memory.first == before.first  # the earlier fit's first loss, not the resumed one's
    assert memory.best <= before.best  # the earlier best stays unless the resumed fit did better
    assert memory.best_eval_step is not None and memory.best_eval_step <= 30  # an earlier evaluation
    assert sum(resumed.state.errors.values()) == 0

    fit(tmp_path / "b", 30, [])  # no callback in the earlier fit: the checkpoint has no run memory
    bare = _monitor()
    fit(tmp_path / "b", 40, [LossbeatCallback(bare)], resume=True)
    assert bare.history.memory.best_eval_step is not None and bare.history.memory.best_eval_step <= 30
    assert math.isnan(bare.history.memory.first) or bare.history.memory.first < before.first
