"""A torchrun worker for test_distributed.py: pipeline parallelism on gloo with the monitor.

Two stages (``torch.distributed.pipelining``: ``PipelineStage`` + ``ScheduleGPipe``,
two micro-batches) on a (world / 2, 2) mesh ``("dp", "pp")``: with 4 ranks each
stage is also sharded over 2 data-parallel ranks with FSDP2 (torchtitan's FSDP + PP),
so the pipeline groups are {0, 1} and {2, 3}. The monitor gets ``pipeline_group=mesh["pp"]``.

``--scenario train``: every rank observes, the first stage without a loss (it computes
none); ``<dir>/result.<rank>.json`` holds what its /metrics served (scraped over HTTP) and
references from the gathered gradients of every stage, computed without lossbeat: the
model's norm, the stage's own norm, torch's clip of the gathered gradients, and a step
with NaN injected in stage 1.

``--scenario one-stage``: only stage 0 observes (``if stage == 0: monitor.observe``):
it must fail fast with a clear message instead of waiting in the collective alone.
"""

import argparse
import math
import pathlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from worker_exit import observe_alone, run_rank

import lossbeat.measure.gradients
from lossbeat import Monitor, MonitorConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the one scrape helper
from helpers.scrape import scrape

WIDTH, BATCH, STAGES = 16, 8, 2


class Stage(nn.Module):
    """Two blocks of the model (layers 2s and 2s + 1), the last stage with the head."""

    def __init__(self, stage: int):
        super().__init__()
        torch.manual_seed(stage)
        self.layers = nn.ModuleDict(
            {str(2 * stage + i): nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for i in range(2)}
        )
        self.head = nn.Linear(WIDTH, WIDTH) if stage == STAGES - 1 else None

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def mse(output, target):
    return (output - target).pow(2).mean()


def full_grads(module) -> dict[str, torch.Tensor]:
    """This stage's whole gradients (FSDP2 shards gathered over the data-parallel group)."""
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for name, p in module.named_parameters()
    }


def one_value(metrics, name):
    return metrics[name][0][1] if name in metrics else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--scenario", choices=("train", "one-stage"), default="train")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """This rank's result (the process group already initialised)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // STAGES, STAGES), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh["pp"], mesh["dp"]
    stage_index = pp.get_local_rank()
    pp_ranks = dist.get_process_group_ranks(pp.get_group())
    module = Stage(stage_index)
    if dp.size() > 1:
        for layer in module.layers.values():
            fully_shard(layer, mesh=dp)
        fully_shard(module, mesh=dp)
    stage = PipelineStage(module, stage_index, STAGES, torch.device("cpu"), group=pp.get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=mse)

    def train_step(seed: int) -> torch.Tensor | None:
        """Forward and backward through both stages; the loss on the last stage, None before it."""
        module.zero_grad(set_to_none=True)
        torch.manual_seed(100 * seed + dp.get_local_rank())  # each replica its own data
        x, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=losses)
        # The first stage has no loss: it observes without one (no broadcast, no placeholder).
        return torch.stack(losses).mean().detach() if losses else None

    def gathered() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """(this stage's whole gradients, every stage's), without lossbeat."""
        mine = full_grads(module)
        stages: list = [None] * STAGES
        dist.all_gather_object(stages, mine, group=pp.get_group())
        return mine, stages

    def norm(grads) -> float:
        return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in grads])))

    result: dict = {"rank": rank, "stage": stage_index, "pp_ranks": pp_ranks}
    lossbeat.measure.gradients.SHARD_HANDSHAKE_TIMEOUT_S = 3.0 if args.scenario == "one-stage" else 60.0
    # With pipeline_group every stage exports the model's norm, so the replicas agree: aligned norms on.
    config = MonitorConfig(
        port=0, addr="127.0.0.1", run_name="pp", pipeline_group=pp, linger_seconds=0, grad_norm_align_every=100
    )
    monitor = Monitor(config, serve=True)  # pipeline_group: the 1-D "pp" mesh, taken as its group

    if args.scenario == "train":
        loss = train_step(1)
        mine, stages = gathered()
        result["reference"] = norm(g for s in stages for g in s.values())
        result["stage_only"] = norm(mine.values())
        squares: dict[str, float] = {}
        for name, g in mine.items():
            layer = name.rsplit(".", 1)[0]
            squares[layer] = squares.get(layer, 0.0) + float(g.double().square().sum())
        result["reference_layers"] = {layer: math.sqrt(v) for layer, v in squares.items()}
        monitor.observe(0, loss=loss, model=module)
        monitor.flush()
        metrics = scrape(monitor.port)
        result["grad_norm"] = one_value(metrics, "training_grad_norm")
        result["loss"] = None if loss is None else float(loss)
        result["exported_loss"] = one_value(metrics, "training_loss")
        result["aligned"] = one_value(metrics, "training_grad_norm_aligned")
        result["layers"] = {labels["layer"]: v for labels, v in metrics.get("training_layer_grad_norm", [])}
        result["measure_gradients"] = float(monitor.measure_gradients(module))

        # Clip: the model's norm gives one coefficient on every stage, as torch's clip of the whole.
        max_norm = result["reference"] / 4
        whole = [torch.zeros_like(g, requires_grad=True) for s in stages for g in s.values()]
        for p, g in zip(whole, (g for s in stages for g in s.values())):
            p.grad = g.clone()
        torch_total = float(torch.nn.utils.clip_grad_norm_(whole, max_norm))
        offset = sum(len(s) for s in stages[:stage_index])
        torch_mine = [p.grad for p in whole[offset : offset + len(mine)]]
        returned = float(monitor.clip_grad_norm_(module, max_norm))
        clipped, clipped_stages = gathered()
        result["clip"] = {
            "max_norm": max_norm,
            "returned": returned,
            "torch_total": torch_total,
            "stage_ratio": norm(clipped.values()) / result["stage_only"],
            "after": norm(g for s in clipped_stages for g in s.values()),
            "max_diff_from_torch": max(float((a - b).abs().max()) for a, b in zip(clipped.values(), torch_mine)),
        }
        monitor.observe(1, loss=loss, model=module)

        # NaN in one gradient of the last stage: every stage's model norm is non-finite.
        loss = train_step(2)
        if stage_index == STAGES - 1:
            grad = module.head.weight.grad
            getattr(grad, "_local_tensor", grad).view(-1)[0] = float("nan")
        monitor.observe(2, loss=loss, model=module)
        monitor.flush()
        result["nan_grad_norm"] = repr(one_value(scrape(monitor.port), "training_grad_norm"))
        result["errors"] = dict(monitor.state.errors)
        result["steps"] = monitor.state.steps_total
        result["nonfinite_loss"] = monitor.state.nonfinite_loss_total
        result["loss_findings"] = [
            (f.check, int(f.status), f.known) for f in monitor.report().findings if f.check.startswith("loss")
        ]
    else:
        loss = train_step(1)
        if stage_index == 0:  # the idiom: only one stage logs
            result.update(observe_alone(monitor, loss, module))
    monitor.close()
    dist.barrier()
    return result


if __name__ == "__main__":
    run_rank(run, parse_args())
