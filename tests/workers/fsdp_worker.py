"""A torchrun worker for test_distributed.py: sharded data parallel on gloo with the monitor.

``--wrap fsdp2`` (``fully_shard``; ``--replicas R``: a (R, world / R) mesh, HSDP
when R > 1, replicated over the first dimension and sharded over the second),
``fsdp1`` (``FullyShardedDataParallel`` per block, ``use_orig_params=True``) or
``fsdp1-flat`` (the same with flat parameters). Each rank trains on its own
data; after a few steps it writes ``<dir>/result.<rank>.json`` with what the
monitor measured and a reference computed from the full (gathered) gradients.
"""

import argparse
import contextlib
import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from worker_exit import run_rank

from lossbeat import Monitor, MonitorConfig
from lossbeat.demo import Block, ModelSize, SyntheticCorpus, TinyLM


def reference_norms(model: torch.nn.Module) -> tuple[float, dict[str, float]]:
    """Per-module norms from the gathered gradients (collectives per parameter: slow, exact)."""
    if isinstance(model, FullyShardedDataParallel):
        if not model._use_orig_params:  # per-parameter gradients are not recoverable: the total only
            return float(model.clip_grad_norm_(math.inf)), {}
        gathered = FullyShardedDataParallel.summon_full_params(model, with_grads=True)
    else:
        gathered = contextlib.nullcontext()
    squares: dict[str, float] = {}
    with gathered:
        for name, p in model.named_parameters():
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            layer = name.replace("_fsdp_wrapped_module.", "").rsplit(".", 1)[0]
            squares[layer] = squares.get(layer, 0.0) + float(full.double().square().sum())
    return math.sqrt(sum(squares.values())), {k: math.sqrt(v) for k, v in squares.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--wrap", choices=("fsdp2", "fsdp1", "fsdp1-flat"), default="fsdp2")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """This rank's result (the process group already initialised)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1's deprecation notice
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(ModelSize(vocab=32, context=16, width=32, layers=2, heads=2))
    if args.wrap == "fsdp2":
        mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        layout = str(next(model.parameters()).placements)
    else:
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=args.wrap == "fsdp1",
            device_id=torch.device("cpu"),
        )
        layout = str(model.sharding_strategy)
    corpus = SyntheticCorpus(32, 16, seed=100 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = Monitor(MonitorConfig(port=0, layer_ranks="all"), serve=False)  # every rank: compared below
    first_only = Monitor(MonitorConfig(port=0), serve=False)  # the default: only rank 0 exports layers

    result = {"rank": rank, "layout": layout}
    for step in range(3):
        loss = model(*corpus.batch(8))
        loss.backward()
        if step == 1:  # measured by observe(model=...)
            result["reference"] = reference_norms(model)
            monitor.observe(step, loss=loss, model=model)
            monitor.flush()
            result["measured"] = (monitor.state.grad_norm, monitor.state.layer_norms)
            # With the grad norm given, only rank 0 needs the per-layer norms: the others still
            # join the all-reduce (else rank 0 would wait forever) and export no layer.
            first_only.observe(step, loss=loss, model=model, grad_norm=torch.tensor(result["measured"][0]))
            first_only.flush()
            result["first_only_layers"] = sorted(first_only.state.layer_norms)
            # reduce_shards=False: no collective, so rank 0 alone may observe (it used to wait
            # forever for the others); it sees its own shards only.
            if rank == 0:
                local = Monitor(MonitorConfig(port=0, reduce_shards=False), serve=False)
                local.observe(step, loss=loss, model=model)
                local.flush()
                result["local_only"] = local.state.grad_norm
                local.close()
        elif step == 2:  # clipped and measured in one pass, against torch's own clip
            result["clip_reference"] = reference_norms(model)[0]
            returned = monitor.clip_grad_norm_(model, 0.05)
            result["clip_returned"] = float(returned)
            result["after_clip"] = reference_norms(model)[0]
            monitor.observe(step, loss=loss, model=model, grad_norm=returned)
            monitor.flush()
            result["clip_coefficient"] = monitor.state.clip_coefficient
        else:  # the framework's own clip; under FSDP2 torch's returns a DTensor, taken whole
            if isinstance(model, FullyShardedDataParallel):
                returned = model.clip_grad_norm_(1.0)
            else:
                returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            monitor.observe(step, loss=loss, model=model, grad_norm=returned)
            monitor.flush()
            full = returned.full_tensor() if hasattr(returned, "full_tensor") else returned
            result["torch_clip"] = (float(full), monitor.state.grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    first_only.close()
    result["errors"] = dict(monitor.state.errors)
    result["steps"] = monitor.state.steps_total
    monitor.close()
    return result


if __name__ == "__main__":
    run_rank(run, parse_args())
