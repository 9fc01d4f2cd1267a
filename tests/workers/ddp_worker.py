"""A torchrun worker for test_distributed.py: DDP training on gloo with the exporter live.

Trains ``--steps`` steps, writes ``<dir>/ready.<rank>``, then keeps serving
until ``<dir>/done`` appears (or 60 s pass).
"""

import argparse
import pathlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from worker_exit import finish

from lossbeat import start_exporter
from lossbeat.demo import ModelSize, SyntheticCorpus, TinyLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank
    torch.set_num_threads(1)
    model = DistributedDataParallel(TinyLM(ModelSize(vocab=32, context=16, width=32, layers=2, heads=2)))
    corpus = SyntheticCorpus(32, 16, seed=100 + rank)  # different data per rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = start_exporter(args.port, addr="127.0.0.1", run_name="ddp-test")
    for step in range(args.steps):
        loss = model(*corpus.batch(8))
        loss.backward()  # DDP all-reduces (averages) the gradients here
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model.module, tokens=8 * 16)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.flush()
    folder = pathlib.Path(args.dir)
    (folder / f"ready.{rank}").write_text(str(monitor.port))
    deadline = time.monotonic() + 60
    while not (folder / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    monitor.close()
    finish()


if __name__ == "__main__":
    main()
