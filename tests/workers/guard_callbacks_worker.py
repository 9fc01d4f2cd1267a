"""A torchrun worker for test_guard_distributed.py: the HF Trainer's and Lightning's LossbeatCallback
with the optimizer guard on a real 2-rank gloo DDP job (the Trainer accumulating 2 micro-batches a
step), a fault injected on the last rank only.

The faults: the last rank's loss is NaN at optimizer step ``NAN_AT`` (its NaN gradients are
averaged into every rank's), and x1e4 at ``SPIKE_AT``, once the gradient-norm baseline is
established: every rank's averaged gradients explode, only one rank's loss is bad. With
``--mode skip`` both steps are withheld on every rank and training goes on. With ``--mode stop``
(the x1e4 loss only) ``TrainingHalted`` leaves ``train()``/``fit()`` on every rank at that step,
and the worker saves the last good state as docs/guard.md shows. Each rank writes what it saw.
"""

import argparse
import math
import os
import pathlib

import torch
import torch.distributed as dist
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from worker_exit import finish, write_result

from lossbeat import Monitor, MonitorConfig, TrainingHalted

NAN_AT = 3
SPIKE_AT = 28
"""Optimizer steps (1-based, as the monitor and both trainers count them) of the two faults; an
explosion is judged once the baseline holds ``windows.baseline_min_records`` (20) norms besides
the recent few (step 25 here, 26 with the NaN step skipped)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--framework", choices=("hf", "lightning"), required=True)
    parser.add_argument("--mode", choices=("skip", "stop"), required=True)
    return parser.parse_args(argv)


def _snapshot(optimizer: torch.optim.Optimizer, params: list) -> list[torch.Tensor]:
    """The parameters and every optimizer state tensor (AdamW's moments and step), cloned."""
    out = [p.detach().clone() for p in params]
    for p in params:
        out.extend(v.clone() for _, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v))
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


def _exported_skips(monitor: Monitor) -> dict[str, float]:
    """training_skipped_steps_total by reason, as a scrape of this rank reads it."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(monitor.registry).decode()):
        for s in family.samples:
            if s.name == "training_skipped_steps_total":
                out[s.labels["reason"]] = s.value
    return out


class Fault:
    """The faults of this run, on the last rank only: ``apply(loss, step)`` at optimizer step ``step``."""

    def __init__(self, mode: str, rank: int, world: int) -> None:
        self.factors = {SPIKE_AT: 1e4} if mode == "stop" else {NAN_AT: math.nan, SPIKE_AT: 1e4}
        self.here = rank == world - 1

    def apply(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return loss * self.factors[step] if self.here and step in self.factors else loss


def run_hf(args: argparse.Namespace, monitor: Monitor, fault: Fault, record: dict) -> tuple[list, int]:
    """The Trainer on DDP (the process group is already up); returns (parameters, global step)."""
    from hf_ddp_worker import Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from lossbeat.integrations.hf import LossbeatCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    current = {"step": 0}
    # The loss the model returns (and the Trainer backpropagates) at the fault's step.
    model.register_forward_hook(
        lambda m, i, out: out.__setitem__("loss", fault.apply(out["loss"], current["step"])) if m.training else None
    )

    class Recorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current["step"] = state.global_step + 1

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            record["before"][state.global_step + 1] = _snapshot(optimizer.optimizer, list(model.parameters()))

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            record["after"][state.global_step + 1] = _snapshot(optimizer.optimizer, list(model.parameters()))

    training = TrainingArguments(
        output_dir=args.dir,
        max_steps=SPIKE_AT + 4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # the step's loss summed over its micro-batches, DDP syncing the last
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(512, 1),
        callbacks=[LossbeatCallback(monitor), Recorder()],
    )
    try:
        trainer.train()
    except TrainingHalted as halt:  # docs/guard.md, "Saving the last good state": the HF Trainer
        record["halted"] = {"step": halt.step, "reason": halt.reason}
        record["params_at_halt"] = _snapshot(trainer.optimizer.optimizer, list(model.parameters()))
        trainer.save_model(f"{training.output_dir}/halted")  # the weights before the bad step
        trainer.save_state()
        if trainer.args.process_index == 0:
            from transformers import GPT2LMHeadModel as Loaded

            saved = Loaded.from_pretrained(f"{training.output_dir}/halted").state_dict()
            record["saved_equal"] = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
            record["saved_state"] = pathlib.Path(training.output_dir, "trainer_state.json").exists()
    return [p.detach() for p in model.parameters()], trainer.state.global_step


def run_lightning(args: argparse.Namespace, monitor: Monitor, fault: Fault, record: dict) -> tuple[list, int]:
    """Lightning's DDP strategy under torchrun (its ranks are the launcher's); returns (parameters, global step)."""
    import lightning as L

    from lossbeat.integrations.lightning import LossbeatCallback

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return fault.apply(torch.nn.functional.mse_loss(self.net(x), y), self.trainer.global_step + 1)

        def on_before_optimizer_step(self, optimizer):  # after the callback's: the guard has decided
            record["before"][self.trainer.global_step + 1] = _snapshot(optimizer, list(self.parameters()))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            optimizer = self.optimizers().optimizer
            record["after"][self.trainer.global_step] = _snapshot(optimizer, list(self.parameters()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    x = torch.randn(8 * 2 * (SPIKE_AT + 4), 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy="ddp",
        max_steps=SPIKE_AT + 4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[LossbeatCallback(monitor)],
    )
    try:
        trainer.fit(module, data)
    except TrainingHalted as halt:  # docs/guard.md, "Saving the last good state": Lightning
        record["halted"] = {"step": halt.step, "reason": halt.reason}
        record["params_at_halt"] = _snapshot(trainer.optimizers[0], list(module.parameters()))
        path = os.path.join(args.dir, "halted.ckpt")
        trainer.save_checkpoint(path)  # the weights and optimizer state before the bad step
        if trainer.global_rank == 0:
            saved = torch.load(path, weights_only=False)
            record["saved_equal"] = all(torch.equal(saved["state_dict"][k], v) for k, v in module.state_dict().items())
            record["saved_state"] = len(saved["optimizer_states"]) == 1
    return [p.detach() for p in module.parameters()], trainer.global_step


def run(args: argparse.Namespace) -> dict:
    """This rank's result (the process group already initialised, by the variants' runner or main())."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    fault = Fault(args.mode, rank, world)
    monitor = Monitor(MonitorConfig(port=0, guard=args.mode, grad_norm_align_every=0), serve=False)
    record: dict = {"before": {}, "after": {}}
    params, global_step = (run_hf if args.framework == "hf" else run_lightning)(args, monitor, fault, record)
    monitor.flush()
    withheld = sorted(
        s for s, snap in record["before"].items() if s in record["after"] and _same(snap, record["after"][s])
    )
    flat = torch.cat([p.reshape(-1) for p in params]).double()
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    halted = record.get("halted")
    result = {
        "world": world,
        "rank": rank,
        "global_step": global_step,
        "steps_observed": monitor.state.steps_total,
        "withheld_at": withheld,  # optimizer steps after which parameters and state were bitwise as before
        "halted": halted,
        # stop: what the user's except block saves is the state before the bad step, untouched
        "unchanged_at_halt": halted is not None and _same(record["before"][SPIKE_AT], record["params_at_halt"]),
        "saved_equal": record.get("saved_equal"),
        "saved_state": record.get("saved_state"),
        "exported_skips": _exported_skips(monitor),
        "undecided": monitor.state.guard_undecided_steps,
        "params_equal_across_ranks": all(torch.equal(gathered[0], g) for g in gathered),
        "params_finite": bool(torch.isfinite(flat).all()),
        "pid": os.getpid(),
    }
    monitor.close(completed=halted is None)
    result["completed"] = monitor.state.completed
    return result


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    write_result(args.dir, dist.get_rank(), run(args))
    finish()


if __name__ == "__main__":
    main()
