"""A torchrun worker for test_one_fault.py: 2-rank DDP on gloo, one step whose input holds a NaN
on rank 1 only. Writes each rank's view to ``<dir>/rank<R>.json``: its loss, its counters and
the non-finite layer it names."""

import datetime
import json
import math
import pathlib
import sys

import torch
import torch.distributed as dist

from lossbeat.monitor import Monitor, MonitorConfig


def main() -> None:
    folder = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    monitor = Monitor(MonitorConfig(port=0, layer_ranks="all"), serve=False)
    x = torch.randn(4, 8)
    if rank == 1:
        x[0, 0] = float("nan")  # one corrupt sample on rank 1
    loss = ddp(x).pow(2).mean()
    loss.backward()  # the all-reduce averages rank 1's NaN gradients into rank 0's
    monitor.observe(1, loss=loss, model=ddp)
    monitor.flush()
    s = monitor.state
    (folder / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "loss_finite": s.loss is not None and math.isfinite(s.loss),
                "nonfinite_loss_total": s.nonfinite_loss_total,
                "nonfinite_grad_total": s.nonfinite_grad_total,
                "first_nonfinite_layer": s.first_nonfinite_layer,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
