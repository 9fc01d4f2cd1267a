"""A Lightning fit on 2 CPU processes for test_launchers.py, with ``--strategy`` ddp_spawn or ddp_fork.

The ranks run in children of this process; the LossbeatCallback is built here, in the parent,
with exporter settings. Each rank, at the end of training, writes ``<dir>/ready.<global rank>``
(JSON: the port its monitor serves, its steps) and keeps serving until ``<dir>/done`` appears.
"""

import argparse
import json
import os
import pathlib
import time

import lightning as L
import torch

from lossbeat.integrations.lightning import LossbeatCallback


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class HoldUntilScraped(L.Callback):
    """Runs after LossbeatCallback's on_train_end (listed after it): the rank's values are in."""

    def __init__(self, folder: str, lossbeat: LossbeatCallback) -> None:
        self.folder = folder
        self.lossbeat = lossbeat

    def on_train_end(self, trainer, pl_module) -> None:
        folder = pathlib.Path(self.folder)
        monitor = self.lossbeat.monitor
        ready = {
            "port": monitor.port,
            "pid": os.getpid(),
            "global_step": trainer.global_step,
            "observed": self.lossbeat.observed_steps,
        }
        (folder / f"ready.{trainer.global_rank}").write_text(json.dumps(ready))
        deadline = time.monotonic() + 90
        while not (folder / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    lossbeat = LossbeatCallback(port=args.port, addr="127.0.0.1", run_name="lightning-launch")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lossbeat, HoldUntilScraped(args.dir, lossbeat)],
    )
    trainer.fit(Regressor(), data)
    assert lossbeat.monitor is None, "the launching process started no monitor"


if __name__ == "__main__":
    main()
