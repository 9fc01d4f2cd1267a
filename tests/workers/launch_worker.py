"""A training process for test_launchers.py, started the way each launcher starts one.

Modes:

* ``env``: a plain process; the test sets a launcher's variables (Slurm's, Open MPI's...).
* ``group``: the same, after ``init_process_group("gloo", rank=--rank, world_size=--world)``
  through a file store: a script that reads its rank itself and starts the group.
* ``spawn``: ``torch.multiprocessing.spawn`` of --world processes, each starting the group
  with its index as rank; no launcher variable anywhere.

Each process starts the exporter on --port (plus its local rank), trains a tiny model for
--steps steps, writes ``<dir>/ready.<rank>`` (JSON: port, rank context) and keeps serving
until ``<dir>/done`` appears (or 90 s pass).
"""

import argparse
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from worker_exit import finish

from lossbeat import start_exporter


def train(folder: pathlib.Path, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    monitor = start_exporter(port, addr="127.0.0.1", run_name="launch-test")
    ctx = monitor.rank_context
    torch.manual_seed(ctx.rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(16, 4)
    for step in range(1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        monitor.observe(step, loss=loss, model=model)
        # Plain SGD by hand: a torch.optim optimizer's first param group imports torch._dynamo
        # (1.8 CPU-s a process, as much as torch itself); what these ranks test is their labels.
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    monitor.flush()
    ready = {
        "port": monitor.port,
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "source": ctx.source,
        "pid": os.getpid(),
    }
    (folder / f"ready.{ctx.rank}").write_text(json.dumps(ready))
    deadline = time.monotonic() + 90
    while not (folder / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    monitor.close()


def spawned(index: int, folder: str, port: int, steps: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=index, world_size=world)
    train(pathlib.Path(folder), port, steps)
    finish()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("env", "group", "spawn"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    folder = pathlib.Path(args.dir)
    if args.mode == "spawn":
        mp.spawn(spawned, args=(str(folder), args.port, args.steps, args.world), nprocs=args.world, join=True)
        return
    if args.mode == "group":
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=args.rank, world_size=args.world)
    train(folder, args.port, args.steps)
    finish()


if __name__ == "__main__":
    main()
