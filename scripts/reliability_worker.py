"""The two training runs of scripts/reliability_runs.py, each with the exporter on fixed ports.

``staggered`` (under torchrun, gloo DDP): every rank trains paced steps for ``--train-s``; then
ranks 1..N-1 close (the completion marker) and exit, while rank 0 goes on alone for
``--tail-s`` (a final evaluation or an upload: phase ``eval``, a heartbeat every few seconds,
no collective), then closes too.

``validation`` (one process, a real Lightning fit through lossbeat's callback): paced training
steps for ``--train-s``, one validation of ``--validation-s`` (its batches slowed with sleep;
the callback sets the phase and heartbeats every batch), more training, then close.

``crash`` (the control, one process): paced training steps for ``--train-s``, then SIGKILL (an
OOM kill): no completion marker, so on-call must get one page, ``TrainingExporterDown``.

Each writes ``<dir>/<mode>.<rank>.json``: when it trained, closed and exited (Unix time).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time

import torch

from lossbeat import start_exporter
from lossbeat.demo import ModelSize, SyntheticCorpus, TinyLM

SIZE = ModelSize(vocab=32, context=16, width=32, layers=2, heads=2)
STEP_PAUSE_S = 0.5  # paced steps: wall-clock time, almost no CPU


def _write(folder: pathlib.Path, name: str, record: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1))


def staggered(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(SIZE))
    corpus = SyntheticCorpus(SIZE.vocab, SIZE.context, seed=100 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = start_exporter(args.port, addr="127.0.0.1", run_name=args.job, strict_port=True)
    record = {"rank": rank, "world_size": world, "port": monitor.port, "started": time.time()}
    deadline = time.monotonic() + args.train_s
    step = 0
    while True:
        # Every rank leaves at the same step: rank 0's clock decides (a rank alone in the next
        # all-reduce would hang).
        stop = torch.tensor([float(rank == 0 and time.monotonic() > deadline)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        loss = model(*corpus.batch(8))
        loss.backward()
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        time.sleep(STEP_PAUSE_S)
    record.update(steps=step, trained_until=time.time())
    if rank == 0:
        # The work after training that only rank 0 does: no step, no collective.
        with monitor.phase("eval"):
            tail_end = time.monotonic() + args.tail_s
            while time.monotonic() < tail_end:
                time.sleep(min(5.0, max(0.0, tail_end - time.monotonic())))
                monitor.heartbeat()
        record["tail_until"] = time.time()
    record["close_started"] = time.time()
    monitor.close()  # the completion marker, lingering until each scraper has read it
    record["closed"] = time.time()
    _write(pathlib.Path(args.dir), f"staggered.{rank}", record)
    sys.stdout.flush()
    sys.stderr.flush()
    # No barrier, no interpreter teardown: the other ranks are gone or still working.
    os._exit(0)


def crash(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = TinyLM(SIZE)
    corpus = SyntheticCorpus(SIZE.vocab, SIZE.context, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = start_exporter(args.port, addr="127.0.0.1", run_name=args.job, strict_port=True)
    started = time.time()
    deadline, step = time.monotonic() + args.train_s, 0
    while time.monotonic() < deadline:
        loss = model(*corpus.batch(8))
        loss.backward()
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        time.sleep(STEP_PAUSE_S)
    _write(pathlib.Path(args.dir), "crash.0", {"started": started, "steps": step, "killed": time.time()})
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: nothing of ours runs


def validation(args: argparse.Namespace) -> None:
    import lightning as L

    from lossbeat.integrations.lightning import LossbeatCallback

    torch.manual_seed(0)
    torch.set_num_threads(1)
    corpus = SyntheticCorpus(SIZE.vocab, SIZE.context, seed=1)
    steps_before = max(1, int(args.train_s / STEP_PAUSE_S))
    val_batches = max(1, int(args.validation_s / args.val_batch_s))
    times: dict[str, float] = {}

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyLM(SIZE)

        def training_step(self, batch, batch_idx):
            time.sleep(STEP_PAUSE_S)
            return self.net(*batch)

        def on_validation_start(self) -> None:
            times.setdefault("validation_started", time.time())

        def validation_step(self, batch, batch_idx):
            time.sleep(args.val_batch_s)  # a slow evaluation batch (a large eval set, generation)
            self.log("val_loss", self.net(*batch))

        def on_validation_end(self) -> None:
            times["validation_ended"] = time.time()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    train = [corpus.batch(8) for _ in range(4 * steps_before)]  # one long epoch: no epoch-end validation
    val = [corpus.batch(8) for _ in range(val_batches)]
    monitor = start_exporter(args.port, addr="127.0.0.1", run_name=args.job, strict_port=True)
    times["started"] = time.time()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_steps=steps_before + steps_before // 2,
        val_check_interval=steps_before,
        limit_val_batches=val_batches,
        callbacks=[LossbeatCallback(monitor)],
    )
    trainer.fit(
        Model(), torch.utils.data.DataLoader(train, batch_size=None), torch.utils.data.DataLoader(val, batch_size=None)
    )
    times.update(steps=trainer.global_step, close_started=time.time())
    monitor.close()
    times["closed"] = time.time()
    _write(pathlib.Path(args.dir), "validation.0", times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("staggered", "validation", "crash"))
    parser.add_argument("--dir", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--port", type=int, required=True, help="the base port (+ LOCAL_RANK)")
    parser.add_argument("--train-s", type=float, default=150)
    parser.add_argument("--tail-s", type=float, default=300)
    parser.add_argument("--validation-s", type=float, default=900)
    parser.add_argument("--val-batch-s", type=float, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"staggered": staggered, "validation": validation, "crash": crash}[args.mode](args)


if __name__ == "__main__":
    main()
