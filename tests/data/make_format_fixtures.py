"""Regenerate the fixtures of tests/data/formats (run by hand, not by the tests).

Each run is a real one, written by the library named (no download, CPU, a few seconds each):

* ``sb3-healthy/progress.csv``, ``sb3-nan/progress.csv``: stable-baselines3 PPO on CartPole-v1 with the
  CSV logger; the NaN run's value head is set to NaN before its last logged update (the update's
  losses are NaN; the weights are put back so that the rollout after it can run);
* ``mlflow-healthy/mlruns``, ``mlflow-nan/mlruns``: MLflow's own file store (``MLFLOW_ALLOW_FILE_STORE``),
  a small torch classifier trained 60 steps, ``mlflow.log_metrics`` each step (loss, learning_rate,
  grad_norm; an eval_loss every 10 steps); the NaN run's weights are poisoned at step 50;
* ``wandb-healthy/wandb``, ``wandb-nan/wandb``: the same runs logged with ``wandb`` in offline mode (only the
  ``run-<id>.wandb`` file of each run folder is kept);
* ``detectron2-healthy/metrics.json``, ``detectron2-diverging/metrics.json``: detectron2 does not install
  here (no wheel for this torch); these are written exactly as its ``JSONWriter`` writes (one
  ``json.dumps(sort_keys=True)`` object per logging period: ``iteration``, ``total_loss``, the ``loss_*``
  terms, ``lr``, timing, and the evaluator's ``bbox/AP`` line), with the values of a Mask R-CNN run
  (healthy) and of one whose loss climbs from iteration 600 (diverging);
* ``openrlhf-healthy/train.log``, ``openrlhf-collapsed/train.log``: OpenRLHF needs Ray, vLLM and a GPU;
  these are its console output written by its own statements, at OpenRLHF/OpenRLHF commit
  3c3be6234e0cb353e76bb8019947db9dfe99fca7: the status line of ``openrlhf/trainer/ppo_trainer.py``
  (line 547, ``logger.info(f"✨ Global step {global_step}: {log_status}")``) rendered by Python's
  logging with the format and date format of ``openrlhf/utils/logging_utils.py``, behind the
  ``(PPOTrainer pid=N)`` prefix Ray gives an actor's output; the status dict has the keys
  ``PolicyModelActor.fit`` (``openrlhf/trainer/ray/ppo_actor.py``: a set's order) and
  ``PPOTrainer.train_step`` put in it (timings, ``rollout/*``), GRPO without a critic; between
  them the actor's tqdm bar with its ``set_postfix(short_status)``, drawn by tqdm itself. The
  values are those of a GRPO run on math prompts (healthy: entropy and KL drift, reward rises)
  and of one whose policy collapses at step 30 (entropy to 2% of its level, KL to the reference
  past 3 nats, the reward flat).

    PYTHONPATH=exporter python3 tests/data/make_format_fixtures.py
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "formats"


def sb3(out: Path, poison: bool) -> None:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import configure

    class Poison(BaseCallback):
        def __init__(self, at: int) -> None:
            super().__init__()
            self.at, self.n, self.saved = at, 0, None

        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            if self.saved is not None:
                self.model.policy.load_state_dict(self.saved)
                self.saved = None

        def _on_rollout_end(self) -> None:
            self.n += 1
            if poison and self.n == self.at:
                self.saved = copy.deepcopy(self.model.policy.state_dict())
                with torch.no_grad():
                    self.model.policy.value_net.weight.fill_(float("nan"))

    torch.manual_seed(0)
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1, seed=0, device="cpu")
    model.set_logger(configure(str(out), ["csv"]))
    model.learn(64 * 16, callback=Poison(15))


def _train(log, poison: bool, steps: int = 60) -> None:
    """A small classifier on synthetic data; ``log(step, metrics)`` each step."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = (x[:, :4].sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        if poison and step == 50:
            with torch.no_grad():
                model[2].weight.fill_(float("nan"))
        i = torch.randint(0, 448, (32,))
        loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        metrics = {"loss": loss.item(), "learning_rate": 0.1, "grad_norm": grad.item()}
        if step % 10 == 0:
            with torch.no_grad():
                metrics["eval_loss"] = torch.nn.functional.cross_entropy(model(x[448:]), y[448:]).item()
        log(step, metrics)


def mlflow_run(out: Path, poison: bool) -> None:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    import mlflow

    mlflow.set_tracking_uri(out.as_uri())
    mlflow.set_experiment("fixture")
    with mlflow.start_run():
        _train(lambda step, m: mlflow.log_metrics(m, step=step), poison)


def wandb_run(out: Path, poison: bool) -> None:
    import wandb

    os.environ["WANDB_SILENT"] = "true"
    with tempfile.TemporaryDirectory() as tmp:
        run = wandb.init(project="fixture", dir=tmp, mode="offline")
        _train(
            lambda step, m: run.log(
                {f"train/{k}" if k != "eval_loss" else "eval/loss": v for k, v in m.items()}, step=step
            ),
            poison,
        )
        run.finish()
        wandb.teardown()  # the service writes the file: let it finish before it is copied
        (folder,) = Path(tmp, "wandb").glob("offline-run-*")
        (file,) = folder.glob("run-*.wandb")
        target = out / folder.name
        target.mkdir(parents=True)
        shutil.copy(file, target / file.name)


def detectron2(out: Path, diverging: bool) -> None:
    rng = random.Random(0)
    lines = []
    for it in range(19, 1000, 20):
        fall = math.exp(-it / 400)
        grow = math.exp((it - 600) / 80) if diverging and it > 600 else 1.0
        parts = {
            "loss_cls": (0.25 + 0.45 * fall) * grow * rng.uniform(0.9, 1.1),
            "loss_box_reg": (0.30 + 0.20 * fall) * grow * rng.uniform(0.9, 1.1),
            "loss_mask": (0.20 + 0.45 * fall) * grow * rng.uniform(0.9, 1.1),
            "loss_rpn_cls": (0.03 + 0.10 * fall) * rng.uniform(0.8, 1.2),
            "loss_rpn_loc": (0.05 + 0.10 * fall) * rng.uniform(0.8, 1.2),
        }
        entry = {
            "data_time": 0.004 * rng.uniform(0.5, 1.5),
            "eta_seconds": (1000 - it) * 0.35,
            "fast_rcnn/cls_accuracy": 0.9 + 0.05 * (1 - fall),
            "fast_rcnn/false_negative": 0.6 * fall + 0.1,
            "fast_rcnn/fg_cls_accuracy": 0.3 + 0.5 * (1 - fall),
            "iteration": it,
            "lr": 0.02 * min(1.0, (it + 1) / 100),
            "mask_rcnn/accuracy": 0.7 + 0.2 * (1 - fall),
            "rank_data_time": 0.004,
            "roi_head/num_bg_samples": 480.0,
            "roi_head/num_fg_samples": 32.0,
            "time": 0.35 * rng.uniform(0.95, 1.05),
            "total_loss": sum(parts.values()),
            **parts,
        }
        lines.append(json.dumps(entry, sort_keys=True))
    lines.append(json.dumps({"bbox/AP": 12.3, "bbox/AP50": 25.1, "iteration": 999}, sort_keys=True))
    out.mkdir(parents=True)
    (out / "metrics.json").write_text("\n".join(lines) + "\n")


OPENRLHF_FORMAT = "%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s"  # logging_utils._FORMAT
OPENRLHF_DATE_FORMAT = "%m-%d %H:%M:%S"  # logging_utils._DATE_FORMAT


def openrlhf(out: Path, collapse: bool, steps: int = 80) -> None:
    import io
    import logging

    from tqdm import tqdm

    rng = random.Random(7 if collapse else 3)
    formatter = logging.Formatter(OPENRLHF_FORMAT, OPENRLHF_DATE_FORMAT)
    formatter.converter = time.gmtime  # the same file in any time zone
    actor_keys = [
        "policy_loss",
        "entropy_loss",
        "actor_lr",
        "actor_grad_norm",
        "reward",
        "kl",
        "logprobs_diff",
        "group_reward_std",
        "return",
        "ppo_clip_ratio",
        "ppo_kl",
        "response_length",
        "truncated",
        "total_length",
    ]
    rng.shuffle(actor_keys)  # PolicyModelActor.fit iterates a set of the keys
    lines = []
    clock = 1786620000.0
    for step in range(1, steps + 1):
        bad = collapse and step >= 30
        entropy = 0.02 * rng.uniform(0.9, 1.1) if bad else 0.92 - 0.003 * step + rng.uniform(-0.02, 0.02)
        kl = 3.2 * rng.uniform(0.9, 1.1) if bad else 0.0004 * step * rng.uniform(0.8, 1.2)
        reward = 0.31 + rng.uniform(-0.002, 0.002) if (collapse and step >= 20) else 0.12 + 0.004 * step
        reward += 0 if (collapse and step >= 20) else rng.uniform(-0.03, 0.03)
        length = 40.0 if bad else 310 + rng.uniform(-20, 20)
        actor = {
            "policy_loss": rng.uniform(-0.02, 0.02),
            "entropy_loss": entropy,
            "actor_lr": 1e-06,
            "actor_grad_norm": (0.04 if bad else 0.35) * rng.uniform(0.8, 1.2),
            "reward": reward,
            "kl": kl,
            "logprobs_diff": -kl * 0.9,
            "group_reward_std": 0.01 if bad else 0.38 * rng.uniform(0.9, 1.1),
            "return": reward - 0.01 * kl,
            "ppo_clip_ratio": 0.0 if bad else 0.002 * rng.uniform(0.5, 1.5),
            "ppo_kl": 1e-05 if bad else 0.0003 * rng.uniform(0.5, 1.5),
            "response_length": length,
            "truncated": 0.0 if bad else 0.03,
            "total_length": length + 150.0,
        }
        pbar = tqdm(total=4, desc="Train epoch [1/1]", file=io.StringIO())
        pbar.set_postfix(  # the actor's short_status, formatted by tqdm itself
            {
                "act_loss": actor["policy_loss"],
                "reward": actor["reward"],
                "return": actor["return"],
                "gen_len": actor["response_length"],
                "tot_len": actor["total_length"],
                "kl": actor["kl"],
                "act_lr": actor["actor_lr"],
                "grad_norm": actor["actor_grad_norm"],
                "ent_loss": actor["entropy_loss"],
            },
            refresh=False,
        )
        # the bar's last draw (its earlier draws are overwritten with carriage returns)
        bar = tqdm.format_meter(4, 4, 14.8, prefix="Train epoch [1/1]", postfix=pbar.postfix)
        pbar.close()
        lines.append("(PolicyModelActor pid=2841390) " + bar)
        status = {k: actor[k] for k in actor_keys}
        status.update(
            {
                "timing/make_experience": 21.3 * rng.uniform(0.9, 1.1),
                "timing/ppo_train": 14.8 * rng.uniform(0.9, 1.1),
                "timing/broadcast": 2.1 * rng.uniform(0.9, 1.1),
                "rollout/reward_mean": reward,
                "rollout/reward_std": 0.01 if bad else 0.41 * rng.uniform(0.9, 1.1),
                "rollout/response_length_mean": length,
                "rollout/truncated_rate": actor["truncated"],
                "rollout/num_samples": 512.0,
            }
        )
        status["timing/generation"] = 48.0 * rng.uniform(0.9, 1.1)
        status["timing/step_total"] = sum(v for k, v in status.items() if k.startswith("timing/"))
        clock += status["timing/step_total"]
        record = logging.LogRecord("openrlhf.trainer.ppo_trainer", logging.INFO, "ppo_trainer.py", 547, "", None, None)
        record.msg = f"✨ Global step {step}: {status}"
        record.created = clock
        lines.append("(PPOTrainer pid=2841177) " + formatter.format(record))
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text("\n".join(lines) + "\n", encoding="utf-8")


def verl(out: Path, collapse: bool, steps: int = 80) -> None:
    import numbers
    import pprint

    import numpy as np

    def console(data: dict, step: int) -> str:  # the console logger's line
        return " - ".join(
            [f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" for k, v in data.items() if isinstance(v, numbers.Number)]
        )

    rng = random.Random(11 if collapse else 5)
    mean = np.float64  # reduce_metrics: np.mean of the micro-batches' values
    lines = [
        "(TaskRunner pid=3170562) "
        + console({"val-core/openai/gsm8k/acc/mean@1": 0.508, "val-aux/openai/gsm8k/reward/mean@1": 0.565}, 0)
    ]
    for step in range(1, steps + 1):
        bad = collapse and step >= 30
        entropy = 0.006 * rng.uniform(0.9, 1.1) if bad else 0.33 - 0.001 * step + rng.uniform(-0.01, 0.01)
        kl = 3.4 * rng.uniform(0.9, 1.1) if bad else 0.0005 * step * rng.uniform(0.8, 1.2)
        score = (
            0.612 + rng.uniform(-0.001, 0.001)
            if (collapse and step >= 20)
            else 0.45 + 0.004 * step + rng.uniform(-0.03, 0.03)
        )
        length = 31.0 if bad else 290 + rng.uniform(-25, 25)
        data = {
            "global_seqlen/min": 484245 + rng.randrange(20000),
            "global_seqlen/max": 519990 + rng.randrange(20000),
            "global_seqlen/mean": 501736.75,
            "actor/entropy": mean(entropy),
            "training/rollout_probs_diff_max": 0.621 * rng.uniform(0.8, 1.2),
            "training/rollout_probs_diff_mean": 0.003 * rng.uniform(0.8, 1.2),
            "actor/kl_loss": mean(kl),
            "actor/kl_coef": mean(0.001),
            "actor/pg_loss": mean(rng.uniform(-0.01, 0.01)),
            "actor/pg_clipfrac": mean(0.0 if bad else 0.001 * rng.uniform(0.5, 1.5)),
            "actor/ppo_kl": mean(0.0 if bad else 0.0001 * rng.uniform(-1, 1)),
            "actor/pg_clipfrac_lower": mean(0.0),
            "actor/grad_norm": mean((0.004 if bad else 0.02) * rng.uniform(0.8, 1.2)),
            "perf/mfu/actor": 0.343 * rng.uniform(0.95, 1.05),
            "perf/max_memory_allocated_gb": 62.447,
            "actor/lr": mean(1e-06),
            "training/global_step": step,
            "training/epoch": 0,
            "critic/score/mean": score,
            "critic/score/max": 1.0,
            "critic/score/min": 0.0,
            "critic/rewards/mean": score,
            "critic/advantages/mean": rng.uniform(-0.02, 0.02),
            "critic/advantages/max": 1.789,
            "critic/advantages/min": -1.789,
            "response_length/mean": length,
            "response_length/max": 1024.0 if not bad else 31.0,
            "response_length/clip_ratio": 0.0,
            "prompt_length/mean": 104.9,
            "timing_s/gen": 21.47 * rng.uniform(0.9, 1.1),
            "timing_s/update_actor": 20.31 * rng.uniform(0.9, 1.1),
            "timing_s/step": 49.9 * rng.uniform(0.9, 1.1),
        }
        lines.append("(TaskRunner pid=3170562) " + console(data, step))
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    for bad, name in ((False, "healthy"), (True, "nan")):
        sb3(HERE / f"sb3-{name}", bad)
        mlflow_run(HERE / f"mlflow-{name}" / "mlruns", bad)
        wandb_run(HERE / f"wandb-{name}" / "wandb", bad)
    detectron2(HERE / "detectron2-healthy", False)
    detectron2(HERE / "detectron2-diverging", True)
    openrlhf(HERE / "openrlhf-healthy", False)
    openrlhf(HERE / "openrlhf-collapsed", True)
    verl(HERE / "verl-healthy", False)
    verl(HERE / "verl-collapsed", True)
    for meta in HERE.glob("mlflow-*/mlruns/**/meta.yaml"):  # no absolute path of this machine
        meta.write_text(meta.read_text().replace(HERE.as_uri(), "file:///fixtures"))


if __name__ == "__main__":
    main()
