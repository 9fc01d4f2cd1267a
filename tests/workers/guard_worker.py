"""A torchrun worker for test_guard_distributed.py: a real DDP or FSDP2 job on gloo, with the
optimizer guard on and one fault injected on one rank only; each rank writes what it saw."""

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from worker_exit import run_rank

from lossbeat import Monitor, MonitorConfig, TrainingHalted

FAULTS = {30: "local_loss_nan", 40: "grad_nan_before_allreduce", 45: "local_loss_nan", 50: "spike_one_rank"}
"""Step -> the fault injected there, each on one rank only (the last, the first, the last, the last)."""
UNOBSERVED = 45
"""With ``--observe even``: odd steps are not observed, so this fault's step has no decision from
observe() and monitor.step decides it from the gradients (without it, the fault is not injected)."""
STOP_FAULTS = {30: "spike_one_rank"}
"""With ``--mode stop``: a loss gone bad on the last rank only, whose gradients, averaged into every
rank's, explode everywhere; each rank sees a different loss and must stop at the same step."""
SUSTAINED_FAULTS = {step: "spike_one_rank" for step in range(30, 60)}
"""With ``--sustained``: the same loss gone bad on the last rank for 30 steps in a row: skipped as
explosions until too many in a row stop every rank, never taken in as a new level by any."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--optimizers", choices=("one", "two"), default="one")
    parser.add_argument("--observe", choices=("every", "even"), default="every")
    parser.add_argument("--mode", choices=("skip", "stop"), default="skip")
    parser.add_argument("--sustained", action="store_true")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """This rank's result (the process group already initialised)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if args.wrap == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        wrapped = model
    if args.optimizers == "two":  # e.g. Muon for matrices and AdamW for the rest: one decision for both
        optimizers = [
            torch.optim.AdamW(model[0].parameters(), lr=1e-2),
            torch.optim.SGD(model[2].parameters(), lr=1e-2, momentum=0.9),
        ]
    else:
        optimizers = [torch.optim.AdamW(wrapped.parameters(), lr=1e-2)]
    faults = {s: f for s, f in FAULTS.items() if s != UNOBSERVED or args.observe == "even"}
    if args.mode == "stop":
        faults = STOP_FAULTS
    if args.sustained:
        faults = SUSTAINED_FAULTS
    # With stop, spikes are not guarded (the default): the explosion alone, judged with each rank's loss.
    config = MonitorConfig(port=0, guard=args.mode, guard_spikes=args.mode == "skip", grad_norm_align_every=0)
    monitor = Monitor(config, serve=False)
    state = {"step": 0}
    if rank == 0:
        # A NaN born in this rank's backward, before the gradients are averaged (DDP) or reduced (FSDP).
        def poison(module, inputs, output):
            if faults.get(state["step"]) == "grad_nan_before_allreduce":
                output.register_hook(lambda g: g * math.nan)

        model[2].register_forward_hook(poison)
    skipped_at, losses, unchanged, halted = [], [], [], None
    try:
        _train(args, wrapped, optimizers, monitor, model, faults, state, rank, world, skipped_at, losses, unchanged)
    except TrainingHalted as e:  # raised by monitor.step before anything of the bad step was applied
        halted = {"step": e.step, "reason": e.reason, "loop_step": state["step"]}
        unchanged.append(all(torch.equal(a, b) for a, b in zip(state["snapshot"], _snapshot(model, optimizers))))
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params]).double()
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    result = {
        "skipped_at": skipped_at,
        "unchanged_at_faults": unchanged,
        "undecided": monitor.state.guard_undecided_steps,
        "skipped": dict(monitor.state.skipped_steps),
        "halted": halted,
        "level_changes": monitor.state.guard_level_changes,
        "params_equal_across_ranks": all(torch.equal(gathered[0], g) for g in gathered),
        "params_finite": bool(torch.isfinite(flat).all()),
        "last_loss_finite": math.isfinite(losses[-1]),
        "world": world,
        "pid": os.getpid(),
    }
    monitor.close(completed=halted is None)
    result["completed"] = monitor.state.completed
    return result


def _train(args, wrapped, optimizers, monitor, model, faults, state, rank, world, skipped_at, losses, unchanged):
    """The training loop; what it saw goes into the last three lists (and the snapshot into ``state``)."""
    for step in range(max(faults) + 10):
        state["step"] = step
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.1
        loss = nn.functional.mse_loss(wrapped(x), y)
        if rank == world - 1 and faults.get(step) == "local_loss_nan":
            loss = loss * math.nan
        if rank == world - 1 and faults.get(step) == "spike_one_rank":
            loss = loss * 1e4
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
        before = sum(monitor.state.skipped_steps.values())
        if args.observe == "every" or step % 2 == 0:
            monitor.observe(step, loss=loss, grad_norm=grad_norm, optimizer=optimizers[0])
        snapshot = state["snapshot"] = _snapshot(model, optimizers) if step in faults else None
        losses.append(float(loss.detach()))
        for optimizer in optimizers:
            monitor.step(optimizer)
        if snapshot is not None:
            unchanged.append(all(torch.equal(a, b) for a, b in zip(snapshot, _snapshot(model, optimizers))))
        if sum(monitor.state.skipped_steps.values()) > before:
            skipped_at.append(step)


def _snapshot(model: nn.Module, optimizers: list) -> list[torch.Tensor]:
    """This rank's parameters and optimizer state tensors (local shards under FSDP2), cloned."""
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa: E731
    out = [local(p) for p in model.parameters()]
    for optimizer in optimizers:
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            out.extend(local(v) for _, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v))
    return out


if __name__ == "__main__":
    run_rank(run, parse_args())
