"""A torchrun worker for test_distributed.py: a Hugging Face Trainer on gloo DDP with LossbeatCallback.

Trains a tiny GPT-2 with ``max_grad_norm`` clipping on, then writes
``<dir>/result.<rank>.json``: what the monitor exported for the last step and
what the Trainer logged for it.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from worker_exit import run_rank

from lossbeat import Monitor, MonitorConfig
from lossbeat.integrations.hf import LossbeatCallback


class Tokens(torch.utils.data.Dataset):
    """Random token sequences as their own labels (test_integrations.py trains on them too)."""

    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    )


def cpu_args(output_dir: object, **settings: object) -> TrainingArguments:
    """A short CPU run's TrainingArguments, quiet (no report, checkpoint or progress bar) and seeded,
    with ``settings`` (the steps, the logging, the evaluation) over those."""
    quiet = {"report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True, "seed": 0}
    return TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, **{**quiet, **settings})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """This rank's result (the Trainer initialises the process group unless it is already)."""
    torch.set_num_threads(1)
    model = tiny_gpt2()
    monitor = Monitor(MonitorConfig(port=0, layer_ranks="all"), serve=False)  # layers compared across ranks
    training = cpu_args(
        args.dir,
        max_steps=4,
        gradient_accumulation_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=0.05,
        ddp_backend="gloo",
        # As runs whose every parameter is used set it: DDP then hands back the model's own loss tensor
        # (with unused parameters searched, a copy), which the Trainer scales in place.
        ddp_find_unused_parameters=False,
    )
    # The sampler gives each rank its own shard: different data, gradients all-reduced by DDP.
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(64, 1), callbacks=[LossbeatCallback(monitor)])
    trainer.train()
    monitor.flush()
    logged = [r for r in trainer.state.log_history if "grad_norm" in r]
    s = monitor.state
    result = {
        "rank": trainer.args.process_index,
        "steps": s.steps_total,
        "grad_norm": s.grad_norm,
        "layer_norms": s.layer_norms,
        "trainer_grad_norm": logged[-1]["grad_norm"],
        "trainer_step": logged[-1]["step"],
        "loss": s.loss,
        "trainer_loss": logged[-1]["loss"],
    }
    monitor.close()
    return result


if __name__ == "__main__":
    run_rank(run, parse_args(), join_group=False)  # the Trainer joins the group
