"""A torchrun worker for test_distributed.py: FSDP2 (``fully_shard``) on gloo with the monitor.

``--replicas R``: a (R, world / R) mesh, HSDP when R > 1 (replicated over the
first dimension, sharded over the second). Each rank trains on its own data;
after a few steps it writes ``<dir>/result.<rank>.json`` with what the monitor
measured and a reference computed from the full (gathered) gradients.
"""

import argparse
import json
import math
import pathlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lossbeat import Monitor, MonitorConfig
from lossbeat.demo import ModelSize, SyntheticCorpus, TinyLM


def reference_norms(model: torch.nn.Module) -> tuple[float, dict[str, float]]:
    """Per-module norms from the gathered gradients (a collective per parameter: slow, exact)."""
    squares: dict[str, float] = {}
    for name, p in model.named_parameters():
        full = p.grad.full_tensor().double()
        layer = name.rsplit(".", 1)[0]
        squares[layer] = squares.get(layer, 0.0) + float(full.square().sum())
    return math.sqrt(sum(squares.values())), {k: math.sqrt(v) for k, v in squares.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyLM(ModelSize(vocab=32, context=16, width=32, layers=2, heads=2))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    corpus = SyntheticCorpus(32, 16, seed=100 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = Monitor(MonitorConfig(port=0), serve=False)

    result = {"rank": rank, "placements": str(next(model.parameters()).placements)}
    for step in range(3):
        loss = model(*corpus.batch(8))
        loss.backward()
        if step == 1:  # measured by observe(model=...)
            result["reference"] = reference_norms(model)
            monitor.observe(step, loss=loss, model=model)
            monitor.flush()
            result["measured"] = (monitor.state.grad_norm, monitor.state.layer_norms)
        elif step == 2:  # clipped and measured in one pass, against torch's own clip
            result["clip_reference"] = reference_norms(model)[0]
            returned = monitor.clip_grad_norm_(model, 0.05)
            result["clip_returned"] = float(returned)
            result["after_clip"] = reference_norms(model)[0]
            monitor.observe(step, loss=loss, model=model, grad_norm=returned)
            monitor.flush()
            result["clip_coefficient"] = monitor.state.clip_coefficient
        else:  # torch's clip returns a DTensor: observe takes it as the grad norm
            returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            monitor.observe(step, loss=loss, model=model, grad_norm=returned)
            monitor.flush()
            result["torch_clip"] = (float(returned.full_tensor()), monitor.state.grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result["errors"] = dict(monitor.state.errors)
    result["steps"] = monitor.state.steps_total
    monitor.close()
    (pathlib.Path(args.dir) / f"result.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
