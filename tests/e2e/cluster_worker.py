"""A torchrun worker for test_cluster_ranks.py: real DDP training on gloo with the exporter,
registering itself for Prometheus (LOSSBEAT_FILE_SD_DIR), with per-rank faults:

  --slow-rank R --slow-s S   rank R sleeps S seconds in its data loading every step (a straggler)
  --corrupt-rank R           rank R scales its gradients by 1.1 after the all-reduce (a bad replica)
  --odd-data-rank R          rank R trains on random targets (a broken data shard)

Trains until ``<dir>/done`` appears (or --max-s pass), a step every --step-s at most: the ranks
wait out the rest of the step's slot before the backward, whose all-reduce is where fast ranks
wait for a slow one anyway and which the rank work time leaves out, so a healthy job's ranks do
no more steps than the rules need and the work times compared are those of the steps themselves.
"""

import argparse
import pathlib
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "workers"))  # for worker_exit

from worker_exit import finish

from lossbeat import start_exporter
from lossbeat.demo import ModelSize, SyntheticCorpus, TinyLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--thresholds", required=True)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--corrupt-rank", type=int, default=-1)
    parser.add_argument("--odd-data-rank", type=int, default=-1)
    parser.add_argument("--align-every", type=int, default=50)
    parser.add_argument("--max-s", type=float, default=240)
    parser.add_argument("--step-s", type=float, default=0.1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank
    torch.set_num_threads(1)
    model = DistributedDataParallel(TinyLM(ModelSize(vocab=32, context=16, width=32, layers=2, heads=2)))
    corpus = SyntheticCorpus(32, 16, seed=100 + rank)  # each rank its own shard
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = start_exporter(
        0,
        addr="127.0.0.1",
        run_name=args.job,
        thresholds=args.thresholds,
        work_time=True,
        grad_norm_align_every=args.align_every,
    )
    folder = pathlib.Path(args.dir)
    deadline = time.monotonic() + args.max_s
    slot_end = time.monotonic()
    step = 0
    while True:
        # Every rank leaves at the same step: a rank alone in the next all-reduce would hang.
        stop = torch.tensor([float((folder / "done").exists() or time.monotonic() > deadline)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        if rank == args.slow_rank:
            time.sleep(args.slow_s)  # a slow data loader on this rank only
        batch = corpus.batch(8)
        if rank == args.odd_data_rank:
            batch = (batch[0], torch.randint_like(batch[1], 32))  # labels from another distribution: noise
        loss = model(*batch)
        # The rest of the step's slot (none when the job runs slower, a straggler's), between the
        # forward and the backward's all-reduce: that all-reduce absorbs the ranks' different
        # slot phases, and the rank work time counts neither.
        slot_end = max(slot_end + args.step_s, time.monotonic())
        time.sleep(max(0.0, slot_end - time.monotonic()))
        loss.backward()  # DDP all-reduces (averages) the gradients here
        if rank == args.corrupt_rank:
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.mul_(1.1)  # after the all-reduce: this replica now differs
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        time.sleep(0.02)
    monitor.close()
    finish()


if __name__ == "__main__":
    main()
