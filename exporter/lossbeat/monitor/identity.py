"""The run identity: one value shared by the ranks of one run and different between concurrent
runs of one job name (a sweep submitted from one sbatch script), exported as the ``run_id``
label of every series. The cross-rank rules and the Alertmanager inhibitions compare ranks
only within one ``(job, run_id)``.

Where it comes from, first found wins:

1. ``MonitorConfig(run_id=...)`` or ``LOSSBEAT_RUN_ID`` (Kubernetes: the Job's
   ``batch.kubernetes.io/controller-uid`` label through the downward API; deploy/README.md);
2. ``SLURM_JOB_ID`` (every array task has its own);
3. ``TORCHELASTIC_RUN_ID``, torchrun's ``--rdzv-id`` (a fresh UUID under ``--standalone``;
   ignored when it is torchrun's default ``none``);
4. ``MASTER_ADDR:MASTER_PORT``: two live runs cannot rendezvous on the same address;
5. a UUID the first rank writes into the initialised process group's store, which every rank
   reads back (``compare_set``: no collective, a rank alone cannot hang the job);
6. one process alone (world size 1): a UUID of its own.

Else (several ranks, none of the above) the label is ``""``: every rank of the job name is
then one population, as before run identities.
"""

from __future__ import annotations

import logging
import os
import uuid

from lossbeat.monitor import loaded

__all__ = ["ENV_RUN_ID", "run_identity", "environment_identity"]

log = logging.getLogger("lossbeat")
ENV_RUN_ID = "LOSSBEAT_RUN_ID"
_STORE_KEY = "lossbeat/run_id"


def environment_identity() -> str:
    """The run identity the environment gives (``LOSSBEAT_RUN_ID``, the Slurm job, torchrun's
    run, the rendezvous address), or ``""``."""
    for value in (os.environ.get(ENV_RUN_ID), os.environ.get("SLURM_JOB_ID")):
        if value:
            return value
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic.lower() != "none":
        return elastic
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return f"{addr}:{port}"
    return ""


def run_identity(configured: str = "", world_size: int = 1) -> str:
    """The run identity of this process (see the module's docstring for the order)."""
    found = configured or environment_identity()
    if found:
        return found
    shared = _from_store()
    if shared:
        return shared
    if world_size == 1:
        return uuid.uuid4().hex[:12]
    log.warning(
        "lossbeat: no run identity (set LOSSBEAT_RUN_ID, or run under Slurm or torchrun): "
        "concurrent runs of one job name will be compared with each other"
    )
    return ""


def _from_store() -> str:
    """The id the first rank to get here wrote into the default process group's store."""
    try:
        dist = loaded.distributed()  # None without torch: no process group, no store
        if dist is None or not dist.is_initialized():
            return ""
        store = dist.distributed_c10d._get_default_store()
        stored: bytes = store.compare_set(_STORE_KEY, "", uuid.uuid4().hex[:12])
        return stored.decode()
    except Exception as exc:
        log.debug("lossbeat: no run identity from the process group's store (%s)", exc)
        return ""
