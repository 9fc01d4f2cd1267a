"""The phases the framework callbacks know about: a slow validation in a real
Lightning fit and a slow evaluation in a real HF Trainer run, sampled over HTTP while they run.
Each evaluation batch must show ``training_phase{phase="eval"} 1`` and a fresh heartbeat, so
a long validation pages TrainingStalled only past ``stalled_phase_after``; training resumes in
"train". Without the hooks the phase stayed "train" and the heartbeat froze for the whole
evaluation. After training the callbacks leave the run in "checkpoint" (the final save, an
upload: no steps), and a test or prediction run afterwards is "eval" and returns there; before,
the phase was "train" after training, so 10 minutes of wrap-up paged TrainingStalled."""

from __future__ import annotations

import time
import urllib.request

import torch
from conftest import require_module
from prometheus_client.parser import text_string_to_metric_families

from lossbeat.monitor import Monitor, MonitorConfig


def sample(port: int) -> dict[str, float]:
    """One scrape over HTTP: the current phase's name and the heartbeat."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "training_phase" and s.value == 1:
                out["phase"] = s.labels["phase"]
            elif s.name == "training_last_heartbeat_timestamp_seconds":
                out["heartbeat"] = s.value
    return out


def _check_eval(during: list[dict]) -> None:
    assert len(during) >= 3, during
    assert [s["phase"] for s in during] == ["eval"] * len(during), during
    beats = [s["heartbeat"] for s in during]
    # Every batch heartbeats: each sample's heartbeat is newer than the one before.
    assert all(b > a for a, b in zip(beats, beats[1:])), beats


def _check(during: list[dict], resumed: list[dict], finished: dict) -> None:
    _check_eval(during)
    assert resumed and [s["phase"] for s in resumed] == ["train"] * len(resumed), resumed
    assert finished["phase"] == "checkpoint"  # the wrap-up after training takes no steps


def test_a_slow_lightning_validation_is_in_the_eval_phase_and_heartbeats():
    L = require_module("lightning")
    from lossbeat.integrations.lightning import LossbeatCallback

    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1", linger_seconds=0))
    during: list[dict] = []
    resumed: list[dict] = []
    tested: list[dict] = []
    predicted: list[dict] = []

    class SlowValidation(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if during:
                resumed.append(sample(monitor.port))  # training again after the validation
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            time.sleep(0.05)  # a slow evaluation batch
            if not self.trainer.sanity_checking and batch_idx >= 1:
                during.append(sample(monitor.port))  # Prometheus scraping mid-validation
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def test_step(self, batch, batch_idx):
            time.sleep(0.05)
            if batch_idx >= 1:
                tested.append(sample(monitor.port))
            x, y = batch
            self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def predict_step(self, batch, batch_idx):
            time.sleep(0.05)
            if batch_idx >= 1:
                predicted.append(sample(monitor.port))
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(32, 4)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=4,
        num_sanity_val_steps=0,
        limit_val_batches=5,
        val_check_interval=2,
        callbacks=[LossbeatCallback(monitor)],
    )
    model = SlowValidation()
    try:
        trainer.fit(model, data, data)
        _check(during, resumed, sample(monitor.port))
        trainer.test(model, data, verbose=False)  # after fit: an evaluation in "eval", back to the wrap-up
        _check_eval(tested)
        assert sample(monitor.port)["phase"] == "checkpoint"
        trainer.predict(model, data)
        _check_eval(predicted)
        assert sample(monitor.port)["phase"] == "checkpoint"
    finally:
        monitor.close()


def test_a_slow_hf_evaluation_is_in_the_eval_phase_and_heartbeats(tmp_path):
    require_module("transformers")
    require_module("accelerate")
    from transformers import Trainer, TrainerCallback
    from workers.hf_ddp_worker import Tokens, cpu_args, tiny_gpt2

    from lossbeat.integrations.hf import LossbeatCallback

    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1", linger_seconds=0))
    during: list[dict] = []
    resumed: list[dict] = []

    class AfterEvaluation(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if during:
                resumed.append(sample(monitor.port))  # training again after the evaluation

    class SlowEval(Tokens):
        def __getitem__(self, i):
            time.sleep(0.05)  # a slow evaluation set, read between the evaluation batches
            if i >= 2:
                during.append(sample(monitor.port))
            return super().__getitem__(i)

    args = cpu_args(
        tmp_path,
        max_steps=3,
        per_device_eval_batch_size=1,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-3,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(32, 1),
        eval_dataset=SlowEval(5, 2),
        callbacks=[LossbeatCallback(monitor), AfterEvaluation()],
    )
    try:
        trainer.train()
        assert trainer.state.global_step == 3
        _check(during, resumed, sample(monitor.port))
        evaluated = len(during)
        trainer.predict(SlowEval(5, 3))  # after train(): prediction batches in "eval", back to the wrap-up
        _check_eval(during[evaluated:])
        assert sample(monitor.port)["phase"] == "checkpoint"
    finally:
        monitor.close()


def test_an_hf_save_at_the_end_of_an_epoch_runs_in_the_checkpoint_phase(tmp_path):
    """``save_strategy="epoch"``: the Trainer saves after ``on_epoch_end``, where no step-end hook
    runs. The phase is ``checkpoint`` as the save starts (sampled by a callback after lossbeat's),
    and ``train`` once it is written; before, the save ran in ``train`` with no heartbeat."""
    require_module("transformers")
    require_module("accelerate")
    from transformers import Trainer, TrainerCallback
    from workers.hf_ddp_worker import Tokens, cpu_args, tiny_gpt2

    from lossbeat.integrations.hf import LossbeatCallback

    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1", linger_seconds=0))
    seen: dict[str, str] = {}

    class Sampler(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            seen.setdefault("epoch_end", sample(monitor.port)["phase"])  # the save comes next

        def on_save(self, args, state, control, **kwargs):
            seen.setdefault("saved", sample(monitor.port)["phase"])

    args = cpu_args(
        tmp_path,
        max_steps=3,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="epoch",
        save_only_model=True,
        learning_rate=1e-3,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(8, 1),  # 2 steps an epoch
        callbacks=[LossbeatCallback(monitor), Sampler()],
    )
    try:
        trainer.train()
        assert seen == {"epoch_end": "checkpoint", "saved": "train"}, seen
    finally:
        monitor.close()
