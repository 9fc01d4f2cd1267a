"""The callbacks pass what the trainers log (TRL's reward, reward_std, kl, rewards/margins; the
eval metrics; Lightning's self.log) to observe(metrics=...): real tiny runs on CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import registry_samples, require_module, sample_value

from lossbeat.integrations._common import task_metrics
from lossbeat.monitor import Monitor, MonitorConfig


def _profile(samples: dict) -> dict[str, str]:
    (labels,) = samples["training_profile_info"]
    return dict(labels)


def _hf_trainer(tmp_path, extra_logs, *, custom_loss: bool, compute_metrics=None):
    """A tiny GPT-2 Trainer whose ``log`` adds ``extra_logs(step)`` as TRL's trainers add their
    metrics; ``custom_loss``: its own ``compute_loss`` (no model loss: the callback's fallback mode)."""
    require_module("transformers")
    require_module("accelerate")
    from transformers import Trainer
    from workers.hf_ddp_worker import Tokens, cpu_args, tiny_gpt2

    from lossbeat.integrations.hf import LossbeatCallback

    class TaskTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not custom_loss:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            logits = model(input_ids=inputs["input_ids"]).logits  # no labels: the output has no loss
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), inputs["labels"][:, 1:].reshape(-1)
            )
            return (loss, logits) if return_outputs else loss

        def log(self, logs, start_time=None):
            if "loss" in logs:  # a training log, as GRPOTrainer/DPOTrainer merge theirs
                logs = {**logs, **extra_logs(self.state.global_step)}
            super().log(logs, start_time)

    monitor = Monitor(MonitorConfig(port=0), serve=False)
    callback = LossbeatCallback(monitor)
    args = cpu_args(tmp_path, max_steps=6, logging_steps=1, eval_strategy="steps", eval_steps=3, learning_rate=1e-3)
    trainer = TaskTrainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(32, 1),
        eval_dataset=Tokens(8, 2),
        callbacks=[callback],
        compute_metrics=compute_metrics,
    )
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    return monitor, callback, logged, evals


def test_hf_trainer_grpo_like_logs_detect_rl_and_export_the_collapsed_reward_spread(tmp_path):
    """A custom compute_loss (as GRPO's): the callback observes each step from the loss the Trainer
    backpropagates; each log's reward, reward_std, frac_reward_zero_std and kl go with the next step,
    and the last log's, which no step follows, at the end of training: the last logged values are exported."""

    def rl(step):
        return {
            "reward": 0.25 + 0.01 * step,
            "reward_std": 0.0,
            "frac_reward_zero_std": 1.0,
            "kl": 0.002 * step,
            "completions/mean_length": 64.0,
            "clip_ratio/region_mean": 0.0,
        }

    monitor, callback, logged, _ = _hf_trainer(tmp_path, rl, custom_loss=True)
    s = registry_samples(monitor)
    assert callback.observed_steps == 6 and sample_value(s, "training_steps_total") == len(logged) == 6
    assert sample_value(s, "training_loss") == pytest.approx(logged[-1]["loss"], rel=1e-3)
    info = _profile(s)
    assert info["profile"] == "rl" and info["source"] == "detected"
    assert info["fields"].split(",")[:2] == ["reward", "reward_std"]
    last = logged[-1]  # step 6's log has no step after it: passed at the end of training
    assert last["reward"] != logged[-2]["reward"]
    assert sample_value(s, "training_signal", signal="reward") == pytest.approx(last["reward"])
    assert sample_value(s, "training_signal", signal="reward_std") == 0.0
    assert sample_value(s, "training_signal", signal="frac_reward_zero_std") == 1.0
    assert sample_value(s, "training_signal", signal="kl") == pytest.approx(last["kl"])
    assert monitor.history.signals["reward"].count == 6
    assert monitor._judge.thresholds.profile.name == "rl"
    monitor.close()


def test_hf_trainer_per_step_passes_dpo_logs_with_the_next_step_and_eval_metrics_with_the_eval(tmp_path):
    """The model's own loss (per-step mode): a log follows its step's observe, so its values go
    with the next step's (the last log's at the end of training); compute_metrics' eval_accuracy goes with
    observe_eval."""

    def accuracy(pred):
        logits, labels = pred.predictions, pred.label_ids
        logits = logits[0] if isinstance(logits, tuple) else logits
        return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}

    def dpo(step):
        return {
            "rewards/chosen": 0.1 * step,
            "rewards/rejected": -0.1 * step,
            "rewards/margins": 0.2 * step,
            "rewards/accuracies": 0.5 + 0.05 * step,
            "logps/chosen": -40.0,
        }

    monitor, callback, logged, evals = _hf_trainer(tmp_path, dpo, custom_loss=False, compute_metrics=accuracy)
    s = registry_samples(monitor)
    assert callback.observed_steps == 6
    info = _profile(s)
    assert info["profile"] == "preference" and info["source"] == "detected"
    passed = logged[-1]  # step 6's log has no step after it: passed at the end of training
    assert sample_value(s, "training_signal", signal="margins") == pytest.approx(passed["rewards/margins"])
    assert sample_value(s, "training_signal", signal="preference_accuracy") == pytest.approx(
        passed["rewards/accuracies"]
    )
    assert monitor.history.signals["margins"].count == 6
    assert len(evals) == 2 and "eval_accuracy" in evals[-1]
    assert sample_value(s, "training_signal", signal="eval_accuracy") == pytest.approx(evals[-1]["eval_accuracy"])
    assert monitor.history.signals["eval_accuracy"].count == 2  # once per evaluation, never with a step
    monitor.close()


def test_lightning_logged_values_reach_the_monitor_each_step():
    L = require_module("lightning")
    from lossbeat.integrations.lightning import LossbeatCallback

    class Policy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.rewards: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.rewards.append(0.1 * self.global_step)
            self.log("mean_loss", loss)  # a loss under its own name: a name only
            self.log("reward", self.rewards[-1])
            self.log("reward_std", 0.0)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))
            self.log("val_acc", 0.75)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    x = torch.randn(48, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    module = Policy()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        max_steps=6,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LossbeatCallback(monitor)],
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data, data)
    s = registry_samples(monitor)
    assert _profile(s)["profile"] == "rl"
    assert sample_value(s, "training_signal", signal="reward") == pytest.approx(module.rewards[-1])
    assert sample_value(s, "training_signal", signal="reward_std") == 0.0
    assert monitor.history.signals["reward"].count == 6  # every step, the step's own value
    assert sample_value(s, "training_signal", signal="eval_accuracy") == 0.75
    assert monitor.history.signals["eval_accuracy"].count == 2
    assert "mean_loss" in monitor._profile.names_seen and "val_acc" in monitor._profile.names_seen
    monitor.close()


def test_task_metrics_passes_signals_each_time_other_names_once_and_keeps_train_and_eval_apart():
    passed: set[str] = set()
    logs = {
        "loss": 0.7,
        "grad_norm": 1.0,
        "learning_rate": 1e-4,
        "epoch": 0.1,
        "reward": 0.5,
        "completions/mean_length": 80.0,
        "eval_loss": 0.6,
        "note": "text",
        "kl": torch.tensor(0.01),
    }
    first = task_metrics(logs, passed)
    assert list(first) == ["reward", "kl", "completions/mean_length", "note"]  # signals first
    assert first["reward"] == 0.5 and first["completions/mean_length"] is None and first["note"] is None
    assert isinstance(first["kl"], torch.Tensor)  # not read: the step's transfer carries it
    assert task_metrics(logs, passed) == {"reward": 0.5, "kl": first["kl"]}
    assert task_metrics({"reward": "high"}, passed) == {"reward": None}  # not a number: absent, never raised
    evaluation = task_metrics(
        {"eval_loss": 0.6, "eval_accuracy": 0.8, "eval_runtime": 1.0, "epoch": 1.0},
        passed,
        evaluation=True,
        skip="eval_loss",
    )
    assert evaluation == {"eval_accuracy": 0.8, "eval_runtime": None}
    assert task_metrics({"loss": 1.0, "epoch": 1.0}, passed) is None
