"""A real Hugging Face Trainer run for test_watch_pages.py: a job whose code lossbeat does not touch,
writing the three kinds of log ``lossbeat watch`` follows.

  stdout/stderr              its printed output (the test sends both into ``<dir>/train.log``, unbuffered)
  <dir>/trainer_log.jsonl    a LLaMA-Factory-style log: one JSON line per ``on_log``, appended and
                             closed each time, with ``current_steps`` / ``total_steps``
  <dir>/tb/                  TensorBoard events, written by the Trainer's own ``TensorBoardCallback``
                             (``torch.utils.tensorboard.SummaryWriter``)

``--nan-at K`` sets the final LayerNorm's weight to NaN before step K (the forward then returns a
NaN loss from step K on, as a run whose weights were poisoned). ``--step-s S`` sleeps S seconds
after each step: the pace is set by the clock, not by compute. The Trainer's NaN filter is off
(``logging_nan_inf_filter=False``): with it on, the Trainer logs the mean of the earlier losses in
place of a NaN (docs/watch.md says what the watcher then sees).
"""

import argparse
import json
import math
import os
import pathlib
import sys
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "workers"))  # for hf_ddp_worker
from hf_ddp_worker import Tokens, tiny_gpt2


class Paced(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


class PoisonAt(TrainerCallback):
    """Sets the final LayerNorm's weight to NaN just before step ``step`` runs."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                model.transformer.ln_f.weight.fill_(math.nan)


class TrainerLogJsonl(TrainerCallback):
    """One JSON line per log event, as LLaMA-Factory's ``LogCallback`` appends to ``trainer_log.jsonl``."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.started = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        last = state.log_history[-1] if state.log_history else {}
        entry = {
            "current_steps": state.global_step,
            "total_steps": state.max_steps,
            "loss": last.get("loss"),
            "eval_loss": last.get("eval_loss"),
            "lr": last.get("learning_rate"),
            "epoch": last.get("epoch"),
            "percentage": round(100 * state.global_step / state.max_steps, 2),
            "elapsed_time": time.strftime("%H:%M:%S", time.gmtime(time.time() - self.started)),
        }
        with open(
            self.path, "a", encoding="utf-8"
        ) as fh:  # json.dumps writes a NaN loss as NaN, as LLaMA-Factory's does
            fh.write(json.dumps({k: v for k, v in entry.items() if v is not None}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=0.25)
    parser.add_argument("--nan-at", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    out = pathlib.Path(args.dir)
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tb")  # where the Trainer's TensorBoardCallback writes
    training = TrainingArguments(
        output_dir=str(out / "checkpoints"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        logging_nan_inf_filter=False,
    )
    callbacks = [Paced(args.step_s), TrainerLogJsonl(out / "trainer_log.jsonl")]
    if args.nan_at:
        callbacks.append(PoisonAt(args.nan_at))
    Trainer(model=tiny_gpt2(), args=training, train_dataset=Tokens(64, 1), callbacks=callbacks).train()


if __name__ == "__main__":
    main()
