"""What the torchrun workers of test_distributed.py share: how a rank starts, runs and writes its
result, one rank observing a sharded or pipelined model alone, and how they end."""

import argparse
import json
import logging
import os
import pathlib
import sys
import time
from typing import Callable

import torch.distributed as dist


def write_result(folder: str, rank: int, result: dict) -> None:
    """``<folder>/result.<rank>.json``: what a rank measured, for the test to read."""
    (pathlib.Path(folder) / f"result.{rank}.json").write_text(json.dumps(result))


def finish() -> None:
    """Leave the process group with every rank, then exit without interpreter teardown.

    Teardown after gloo work sometimes aborts ("terminate called without an
    active exception": seen twice in one CI run, in no local run of 24) after
    the results were written. By then the measured part has succeeded or
    raised, and the test reads its results from the files.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(run: Callable[[argparse.Namespace], dict], args: argparse.Namespace, *, join_group: bool = True) -> None:
    """A worker's rank started by torchrun: join the gloo group (``join_group=False``: ``run`` joins
    it, as a Trainer does), ``run(args)``, write what it returns for the test (``args.dir``), and
    :func:`finish`."""
    if join_group:
        dist.init_process_group("gloo")
    result = run(args)
    write_result(args.dir, dist.get_rank(), result)
    finish()


def observe_alone(monitor, loss, model) -> dict:
    """The idiom ``if rank == 0: monitor.observe(...)`` on a model measured with collectives:
    two observes and a clip on this rank alone. What the monitor did, with its log lines and
    how long the two observes took (the handshake's timeout, once)."""
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("lossbeat").addHandler(handler)
    result = {}
    started = time.monotonic()
    monitor.observe(0, loss=loss, model=model)
    monitor.observe(1, loss=loss, model=model)  # decided once: no second wait
    result["seconds"] = time.monotonic() - started
    try:
        monitor.clip_grad_norm_(model, 1.0)
    except RuntimeError as e:
        result["clip_error"] = str(e)
    monitor.flush()
    result["steps"] = monitor.state.steps_total
    result["loss"] = monitor.state.loss
    result["grad_norm"] = monitor.state.grad_norm
    result["errors"] = dict(monitor.state.errors)
    result["log"] = [r.getMessage() for r in records]
    return result
