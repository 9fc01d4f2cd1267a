"""A torchrun worker for test_distributed.py: tensor + sequence parallelism on gloo.

``--scenario tp-sp``: a Llama-style block stack parallelised with ``parallelize_module``
(``SequenceParallel`` norms, whose replicated weights get ``Partial(sum)``
gradients; ``ColwiseParallel``/``RowwiseParallel`` linears). Every rank observes;
``<dir>/result.<rank>.json`` holds what the monitor measured and the reference
from the full gradients (``torch.nn.utils.get_total_norm``).

``--scenario rank0-only``: the common logging idiom ``if rank == 0:
monitor.observe(...)`` on the same model: rank 0 must fail fast with a clear
message (the step still recorded) instead of waiting in a collective alone.

``--scenario fsdp-tp``: torchtitan's 2-D layout on 4 ranks: a ``(2, 2)`` mesh
``("dp", "tp")``, the same model parallelised on ``mesh["tp"]``, then
``fully_shard`` on ``mesh["dp"]`` per block and on the root (parameters on the
2-D mesh: FSDP's ``_StridedShard``/``Shard`` over dp times TP's placement). Each
dp rank has its own data, the ranks of a tp group the same. Three training
steps: observe measures the first, ``monitor.clip_grad_norm_`` the others (the
second also against ``torch.nn.utils.clip_grad_norm_`` of the same gradients);
references from the gathered gradients (``full_tensor``), without lossbeat.
"""

import argparse
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from worker_exit import observe_alone, run_rank

import lossbeat.measure.gradients
from lossbeat import Monitor, MonitorConfig

WIDTH, SEQ = 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def parallel_model(mesh) -> Model:
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        parallelize_module(
            block,
            mesh,
            {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    parallelize_module(model.norm, mesh, SequenceParallel())
    return model


def backward(model, rank, world, seed):
    torch.manual_seed(seed)
    x, target = torch.randn(2, SEQ, WIDTH), torch.randn(2, SEQ, WIDTH)
    mine = slice(rank * SEQ // world, (rank + 1) * SEQ // world)  # each rank holds its slice of the sequence
    out = model(x[:, mine])
    loss = ((out.to_local() if hasattr(out, "to_local") else out) - target[:, mine]).pow(2).mean()
    loss.backward()
    return loss


def reference(model) -> tuple[float, dict[str, float]]:
    """From the full gradients (collectives per parameter: slow, exact)."""
    full = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    layers: dict[str, float] = {}
    for name, g in full.items():
        layer = name.rsplit(".", 1)[0]
        layers[layer] = layers.get(layer, 0.0) + float(g.double().square().sum())
    total = float(torch.nn.utils.get_total_norm(list(full.values())))
    return total, {k: math.sqrt(v) for k, v in layers.items()}


def fsdp_tp(rank: int, world: int) -> dict:
    """The fsdp-tp scenario: what each rank measured and the references, step by step."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    model = parallel_model(tp)
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(MonitorConfig(port=0), serve=False)  # the default: rank 0 exports the layers
    local = Monitor(MonitorConfig(port=0, reduce_shards=False), serve=False)  # its own shards, no collective
    result: dict = {"rank": rank, "dp_tp": [dp.get_local_rank(), tp.get_local_rank()], "steps": []}
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss = backward(model, tp.get_local_rank(), tp.size(), seed=10 * step + dp.get_local_rank())
        ref_global, ref_layers = reference(model)
        record: dict = {"loss": float(loss.detach()), "reference": ref_global, "reference_layers": ref_layers}
        if step == 0:  # observe measures the gradients
            result["placements"] = {
                name: [str(p.placements), str(p.grad.placements)]
                for name, p in model.named_parameters()
                if name.startswith("blocks.0.")
            }
            monitor.observe(step, loss=loss, model=model)
            local.observe(step, loss=loss, model=model)
            local.flush()
            record["local_only"] = local.state.grad_norm
        else:  # the usual loop: clip (measuring), then observe reports that measurement
            max_norm = ref_global / 4  # the same on every rank: the reference is the whole model's
            if step == 1:  # torch's clip of the same gradients, then the gradients put back
                grads = [p.grad._local_tensor for p in model.parameters()]
                saved = [g.clone() for g in grads]
                record["torch_clip"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor())
                torch_clipped = [g.clone() for g in grads]
                for g, s in zip(grads, saved):
                    g.copy_(s)
            returned = monitor.clip_grad_norm_(model, max_norm)
            record.update(max_norm=max_norm, clip_returned=float(returned), after_clip=reference(model)[0])
            if step == 1:
                record["max_diff_from_torch"] = max(
                    float((p.grad._local_tensor - t).abs().max()) for p, t in zip(model.parameters(), torch_clipped)
                )
            monitor.observe(step, loss=loss, model=model, grad_norm=returned)
        monitor.flush()
        record.update(grad_norm=monitor.state.grad_norm, layers=monitor.state.layer_norms)
        result["steps"].append(record)
        optimizer.step()
    result["errors"] = dict(monitor.state.errors)
    result["local_errors"] = dict(local.state.errors)
    result["steps_total"] = monitor.state.steps_total
    local.close()
    monitor.close()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--scenario", choices=("tp-sp", "rank0-only", "fsdp-tp"), default="tp-sp")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """This rank's result (the process group already initialised)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if args.scenario == "fsdp-tp":
        return fsdp_tp(rank, world)
    mesh = init_device_mesh("cpu", (world,))
    model = parallel_model(mesh)
    result: dict = {"rank": rank}
    backward(model, rank, world, 0)
    weight = model.blocks[0].norm.weight  # a replicated weight with a partial gradient
    result["placements"] = [str(weight.placements), str(weight.grad.placements)]
    model.zero_grad(set_to_none=True)
    # tp-sp compares every rank's layers; rank0-only keeps the default (rank 0 exports the layers)
    monitor = Monitor(MonitorConfig(port=0, layer_ranks="all" if args.scenario == "tp-sp" else "first"), serve=False)

    if args.scenario == "tp-sp":
        loss = backward(model, rank, world, 1)
        result["reference"] = reference(model)
        monitor.observe(0, loss=loss, model=model)
        monitor.flush()
        result["measured"] = (monitor.state.grad_norm, monitor.state.layer_norms)
        # monitor.clip_grad_norm_ clips with the corrected norm, as torch's does
        clipped_reference = parallel_model(mesh)
        backward(clipped_reference, rank, world, 1)
        result["torch_clip"] = float(torch.nn.utils.clip_grad_norm_(clipped_reference.parameters(), 0.05).full_tensor())
        result["clip_returned"] = float(monitor.clip_grad_norm_(model, 0.05))
        result["after_clip"] = reference(model)[0]
        result["after_torch_clip"] = reference(clipped_reference)[0]
        result["errors"] = dict(monitor.state.errors)
    else:
        lossbeat.measure.gradients.SHARD_HANDSHAKE_TIMEOUT_S = 3.0
        loss = backward(model, rank, world, 1)
        if rank == 0:  # the idiom: only rank 0 logs
            result.update(observe_alone(monitor, loss, model))
    monitor.close()
    dist.barrier()
    return result


if __name__ == "__main__":
    run_rank(run, parse_args())
