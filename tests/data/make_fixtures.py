"""Regenerate the real-output fixtures in this folder (run by hand, not by the tests).

Each is the genuine output of a tiny CPU run of the library named (no download: a
randomly initialised 2-layer GPT-2 on a synthetic corpus):

* hf-trainer-real-stdout.log: ``Trainer`` stdout+stderr (``logging_steps=5``, eval every 10 steps,
  progress bars on), as ``python train.py > out.log 2>&1`` writes it;
* hf-trainer-real-tfevents/: the ``TensorBoardCallback``'s event file of the same run;
* lightning-real-lr-monitor-metrics.csv: ``CSVLogger`` with ``LearningRateMonitor`` (two param groups).

    PYTHONPATH=exporter python3 tests/data/make_fixtures.py
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

HF_SCRIPT = r"""
import torch, transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.manual_seed(0)
V = 64
class Data(torch.utils.data.Dataset):
    def __init__(self, n): self.x = torch.randint(0, V, (n, 16))
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        x = self.x[i].clone(); x[1::2] = (x[0::2] + 1) % V  # learnable: every other token follows
        return {"input_ids": x, "labels": x}
model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
import os; os.environ["TENSORBOARD_LOGGING_DIR"] = OUT + "/tb"
args = TrainingArguments(output_dir=OUT, max_steps=40, per_device_train_batch_size=8, logging_steps=5,
                         eval_strategy="steps", eval_steps=10, learning_rate=3e-3, warmup_steps=5,
                         lr_scheduler_type="cosine", report_to=["tensorboard"],
                         save_strategy="no", use_cpu=True, disable_tqdm=False, seed=0)
Trainer(model=model, args=args, train_dataset=Data(320), eval_dataset=Data(64)).train()
"""

LIGHTNING_SCRIPT = r"""
import torch, lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
torch.manual_seed(0)
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.a = torch.nn.Linear(8, 16); self.b = torch.nn.Linear(16, 1)
    def forward(self, x): return self.b(torch.relu(self.a(x)))
    def training_step(self, batch, i):
        x, y = batch; loss = torch.nn.functional.mse_loss(self(x), y); self.log("train_loss", loss); return loss
    def validation_step(self, batch, i):
        x, y = batch; self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))
    def configure_optimizers(self):
        opt = torch.optim.AdamW([{"params": self.a.parameters()}, {"params": self.b.parameters(), "lr": 1e-3}], lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 30, 0.5), "interval": "step"}}
x = torch.randn(640, 8); y = x.sum(1, keepdim=True)
dl = lambda: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
trainer = L.Trainer(max_epochs=5, logger=CSVLogger(OUT), callbacks=[LearningRateMonitor("step")],
                    log_every_n_steps=10, enable_checkpointing=False, enable_progress_bar=False,
                    accelerator="cpu", enable_model_summary=False)
trainer.fit(M(), dl(), dl())
"""


def _run(script: str, out: str, log: Path | None = None) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") if log else contextlib.nullcontext() as fh:
        subprocess.run(
            [sys.executable, "-c", f"OUT = {out!r}\n" + script],
            check=True,
            env=env,
            stdout=fh or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if fh else None,
        )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _run(HF_SCRIPT, tmp, HERE / "hf-trainer-real-stdout.log")
        (event,) = Path(tmp, "tb").glob("events.out.tfevents.*")
        target = HERE / "hf-trainer-real-tfevents"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        shutil.copy(event, target / "events.out.tfevents.fixture")
    with tempfile.TemporaryDirectory() as tmp:
        _run(LIGHTNING_SCRIPT, tmp)
        (metrics,) = Path(tmp).glob("lightning_logs/version_*/metrics.csv")
        shutil.copy(metrics, HERE / "lightning-real-lr-monitor-metrics.csv")


if __name__ == "__main__":
    main()
