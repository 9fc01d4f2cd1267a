"""A torchrun worker that runs several of test_distributed.py's worker variants in one job.

Each rank imports torch (and transformers, for the Trainer's variants) once, and the
launcher starts once, for all the variants of one world size (``torchrun_jobs.py``
starts this job and reads what it writes). ``--spec FILE`` is JSON:
``{"dir": DIR, "variants": [[name, worker module, [args, ...]], ...]}``. For each
variant in order, each rank calls ``<worker>.run(<worker>.parse_args([*args, "--dir", DIR/name]))``,
as the worker's own ``main()`` does alone (``python -m torch.distributed.run ...
tests/workers/fsdp_worker.py --wrap fsdp1 --dir D`` still runs one variant), and writes:

- ``DIR/name/started.<rank>`` when it begins;
- ``DIR/name/result.<rank>.json``: the rank's result, and on rank 0 ``DIR/name/seconds``
  (from its start until every rank finished it);
- ``DIR/name/error.<rank>.txt``: the traceback when the variant raised on that rank.

A variant that raises ends the job (exit 1, torchrun stops the other ranks): its ranks may
have left the process group out of step (one waiting in a collective the other never
joins), so nothing after it could be trusted in this job; ``torchrun_jobs.py`` runs the
variants left in a new job. Between variants: a barrier, and accelerate's shared states
(Borg singletons the Trainer fills, and ``CpuFsdpTrainer`` edits) reset, the process
group kept. Variants in which some ranks observe alone (the shard handshake's sequence
then differs between ranks) go last in their job.
"""

import argparse
import importlib
import json
import os
import pathlib
import sys
import time
import traceback

import torch.distributed as dist
from worker_exit import finish, write_result

import lossbeat.measure.gradients


def reset_shared_state(handshake_timeout: float) -> None:
    """What one variant leaves in the process that the next would see: accelerate's states
    (the process group itself stays) and the shard handshake's timeout some workers set."""
    lossbeat.measure.gradients.SHARD_HANDSHAKE_TIMEOUT_S = handshake_timeout
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(pathlib.Path(parser.parse_args().spec).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    handshake_timeout = lossbeat.measure.gradients.SHARD_HANDSHAKE_TIMEOUT_S
    for name, worker, args in spec["variants"]:
        folder = pathlib.Path(spec["dir"]) / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"started.{rank}").write_text("")
        started = time.monotonic()
        try:
            module = importlib.import_module(worker)
            result = module.run(module.parse_args([*args, "--dir", str(folder)]))
        except BaseException:  # noqa: B036 - SystemExit from argparse too: recorded, then the job ends
            (folder / f"error.{rank}.txt").write_text(traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        write_result(str(folder), rank, result)
        dist.barrier()
        if rank == 0:
            (folder / "seconds").write_text(repr(time.monotonic() - started))
        reset_shared_state(handshake_timeout)
    finish()


if __name__ == "__main__":
    main()
