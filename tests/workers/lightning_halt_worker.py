"""A Lightning fit on 2 CPU processes started by Lightning's own ``ddp`` launcher (this script is run
again for rank 1), with ``LossbeatCallback(guard="stop")`` and a NaN loss on rank 1 at optimizer step
``NAN_AT``, for test_launchers.py. Each rank runs docs/guard.md's Lightning example of catching
``TrainingHalted`` as written (its ``halted.ckpt`` lands in the working directory) and writes
``<dir>/halted.<global rank>.json``: the halt it caught, and on rank 0 whether the checkpoint holds
the weights and AdamW state from just before the bad step.
"""

import argparse
import json
import math
import pathlib
import sys

import lightning as L
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the documented example

from test_guard import documented_save

from lossbeat import TrainingHalted
from lossbeat.integrations.lightning import LossbeatCallback

NAN_AT = 3


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.before_bad_step: dict = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 1 and self.trainer.global_step + 1 == NAN_AT:
            loss = loss * math.nan  # this rank only: its NaN gradients are averaged into rank 0's
        return loss

    def on_before_optimizer_step(self, optimizer):
        if self.trainer.global_step + 1 == NAN_AT:
            self.before_bad_step = {
                "params": {k: v.detach().clone() for k, v in self.state_dict().items()},
                "adam": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())},
            }

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(160, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",  # Lightning starts rank 1 itself, running this script again
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LossbeatCallback(port=0, addr="127.0.0.1", guard="stop")],
    )
    result: dict = {}
    try:
        exec(documented_save("trainer.fit("), {"trainer": trainer, "module": module, "datamodule": data})
    except TrainingHalted as halt:
        result = {"step": halt.step, "reason": halt.reason, "global_step": trainer.global_step}
        if trainer.global_rank == 0:
            saved = torch.load("halted.ckpt", weights_only=False)
            before = module.before_bad_step
            result["saved_global_step"] = saved["global_step"]
            result["saved_weights_equal"] = all(
                torch.equal(before["params"][k], v) for k, v in saved["state_dict"].items()
            ) and len(saved["state_dict"]) == len(before["params"])
            adam = saved["optimizer_states"][0]["state"]
            result["saved_adam_equal"] = all(
                torch.equal(s[k], adam[i][k]) for i, s in before["adam"].items() for k in s
            ) and len(adam) == len(before["adam"])
    (pathlib.Path(args.dir) / f"halted.{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
