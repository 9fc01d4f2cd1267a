"""How the torchrun workers of test_distributed.py end, once their results are written."""

import os
import sys

import torch.distributed as dist


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
