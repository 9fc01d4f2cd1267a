"""The monitor's settings: :class:`MonitorConfig`, one docstring per field, validated on construction."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any

from lossbeat.diagnosis.thresholds import Thresholds, load_thresholds
from lossbeat.diagnosis.vitals import as_schedule
from lossbeat.exposition.webconfig import ENV_VAR as WEB_CONFIG_ENV
from lossbeat.exposition.webconfig import WebConfig, load_web_config
from lossbeat.monitor import loaded

__all__ = ["MonitorConfig", "DEFAULT_PORT"]

DEFAULT_PORT = 8470
"""8470 + LOCAL_RANK: clear of DCGM's 9400 and torchrun's 29400/29500."""
MAX_LINGER_S = 600.0
FEEDS = ("process", "log")
"""The values of ``MonitorConfig.feed``."""


@dataclass
class MonitorConfig:
    """Settings of a :class:`Monitor`; validated on construction."""

    port: int = DEFAULT_PORT
    """Base port of /metrics; each local rank serves on ``port + LOCAL_RANK``. 0 picks a free port."""
    addr: str = "0.0.0.0"
    """Address to bind; use 127.0.0.1 to keep /metrics on the host."""
    thresholds: Any = None
    """A thresholds YAML path (overlaid on the packaged defaults), a loaded Thresholds, or None."""
    profile: str | None = None
    """Task profile: causal-lm, classification, regression, multi-task, preference (DPO) or rl (default: the file's)."""
    run_name: str = ""
    """Free-form run name exported in ``training_run_info``."""
    run_id: str = ""
    """The run identity, the ``run_id`` label of every series: shared by the ranks of this run,
    different from any concurrent run of the same job name. "" (default): ``LOSSBEAT_RUN_ID``,
    else the Slurm job id, torchrun's run id, ... (:mod:`lossbeat.monitor.identity`)."""
    feed: str = "process"
    """What feeds this monitor, the ``feed`` label of ``training_run_info``: ``"process"`` (the
    training process observes its own steps) or ``"log"`` (``lossbeat watch`` reading the run's
    log: no per-layer norms, memory gauges or step times)."""
    port_per_local_rank: bool = True
    """Add LOCAL_RANK to the port so every rank of a node can serve."""
    layer_depth: int | None = None
    """Keep the first N module-path components as the layer name (coarser grouping); None = full module path."""
    max_layers: int = 1000
    """Upper bound on per-layer series; grouping gets coarser until the model fits."""
    layer_every: int = 1
    """Compute per-layer norms every N observed steps (the global norm is computed every step)."""
    layer_ranks: Any = "first"
    """Ranks that export per-layer norms: ``"first"`` (global rank 0: data, fully sharded and tensor
    parallel ranks all see the same norms, so series grow with layers, not layers x ranks; with a
    ``pipeline_group``, the ranks of the pipeline group that holds global rank 0, one per stage, so
    every stage's layers are exported once), ``"all"``, or a collection of global ranks."""
    defer_device_reads: bool = True
    """Read CUDA values one step late with a non-blocking copy instead of waiting for them."""
    reduce_shards: bool = True
    """Sharded models (FSDP, tensor parallel): sum the shards' norms over their ranks with an
    all-reduce, so every rank exports the model's norms. A collective: every rank must call
    ``observe(model=...)`` at the same steps. False: each rank measures its own shards only."""
    pipeline_group: Any = None
    """Pipeline parallelism: the process group joining this rank with the ranks that hold the
    other stages at the same data-parallel (and tensor-parallel) position, one rank per stage
    (torchtitan's ``pp`` mesh dimension; a 1-D DeviceMesh is taken as its group). The stages'
    sums of squares are added up with one all-reduce of one float64 scalar per measured step,
    so the exported global norm, the judgments on it and ``clip_grad_norm_`` are the whole
    model's on every stage; per-layer norms stay each stage's own layers. A collective, like
    ``reduce_shards``: every rank must call ``observe(model=...)`` at the same steps; the stages
    before the last, which compute no loss, call it without one (``observe(step, model=model,
    optimizer=optimizer)``), never with a placeholder such as torchtitan's ``-1``, which would be
    judged as the loss. None: each stage's global norm covers its own layers only."""
    log_status_changes: bool = True
    """Log a line whenever a health check changes status."""
    linger_seconds: float = 90.0
    """The most ``close()`` keeps /metrics up after a normal end: one scrape interval (measured
    from the scrapes seen, x1.2), so every Prometheus scrapes the completion marker and the
    last values; no wait when nothing scraped periodically. 0 never waits (the end of a run
    then looks like a crash to TrainingExporterDown); at most 600."""
    lr_schedule: Any = None
    """The LR schedule the run intends, checked against the LR it gets (``lr_schedule``
    check): an :class:`~lossbeat.diagnosis.schedule.LRSchedule` or a mapping of its fields
    (warmup_steps, peak_lr, total_steps, decay, min_lr), or the run's own LR scheduler
    (catches one not stepped, stepped per micro-batch, or reset by a resume). None: no check."""
    certfile: str | None = None
    """TLS certificate for /metrics (with keyfile)."""
    keyfile: str | None = None
    """TLS key for /metrics."""
    web_config: str | os.PathLike[str] | None = None
    """A web configuration file in the Prometheus exporter-toolkit format (TLS, mutual TLS, basic
    auth; see :mod:`lossbeat.exposition.webconfig`); None reads the path from ``LOSSBEAT_WEB_CONFIG`` if set."""
    strict_port: bool = False
    """Raise when ``port + LOCAL_RANK`` is taken (e.g. two jobs sharing a node) instead of
    serving on a free port the OS picks and logging which."""
    file_sd_dir: str | None = None
    """Folder Prometheus watches with file_sd: each serving rank writes its own target entry
    there (real port, job, node, Slurm job id) and removes it when it ends. None: the
    ``LOSSBEAT_FILE_SD_DIR`` environment variable, else no self-registration."""
    grad_norm_align_every: int | None = None
    """Export the global grad norm of every step that is a multiple of N with that step, for
    ``TrainingRankGradientMismatch`` (replicas must agree). No collective: Prometheus compares
    the ranks, so it cannot hang a job. Pick N so that N steps span several scrape intervals (the
    rule compares ranks at the same aligned step). 0 disables it.

    None (the default): on, every 100 steps, only where the ranks are known to be replicas that
    must agree: the model given to ``observe(model=...)`` is a ``DistributedDataParallel`` over
    every rank (pure data parallelism) and ``reduce_shards`` is True; off otherwise (FSDP/DTensor,
    a DDP over a subgroup next to expert or plain-tensor tensor parallelism, pipeline stages,
    ``reduce_shards=False``,
    or a callback that observes the unwrapped model), where ranks legitimately hold different
    norms. Set N explicitly where you know the ranks agree (the replicate dimension of HSDP,
    a Trainer or Lightning run under plain DDP)."""
    guard: str = "off"
    """The optimizer guard, applied by ``Monitor.step(optimizer)``: ``"off"`` (``optimizer.step()``
    exactly), ``"skip"`` (a step whose loss or grad norm is non-finite, or whose grad norm departs
    from the run's baseline as an explosion does, is skipped on the device, every rank agreeing;
    more than ``guard.max_consecutive`` in a row stop the run) or ``"stop"`` (the first bad step
    is skipped and ``TrainingHalted`` is raised). See docs/guard.md."""
    guard_spikes: bool = False
    """Also skip a step whose loss spikes (``loss.spike_sigma`` over the recent level)."""
    guard_schedule: str = "advance"
    """What a skipped step does to the LR scheduler given to ``Monitor.step(scheduler=...)``:
    ``"advance"`` (it takes its slot of the schedule, as torchtitan and OLMo-core do; no host read)
    or ``"hold"`` (the schedule waits; on CUDA, one host read of the decision per step)."""
    work_time: bool = False
    """Time this rank's own work per step on the host (data wait + forward, through forward
    hooks on the ``observe(model=...)`` module) for ``TrainingStraggler``: under asynchronous
    CUDA the forward's launch, not its kernels (a slow GPU does not show)."""

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected an int in 0..65535, got {self.port!r}")
        if not isinstance(self.addr, str) or not self.addr:
            raise TypeError(f"addr: expected an address string, got {self.addr!r}")
        if not (self.thresholds is None or isinstance(self.thresholds, (str, os.PathLike, Thresholds))):
            raise TypeError(f"thresholds: expected a path or Thresholds, got {type(self.thresholds).__name__}")
        if self.profile is not None and not isinstance(self.profile, str):
            raise TypeError(f"profile: expected a profile name, got {type(self.profile).__name__}")
        if not isinstance(self.run_name, str):
            raise TypeError(f"run_name: expected a string, got {type(self.run_name).__name__}")
        if self.feed not in FEEDS:
            raise ValueError(f"feed: expected one of {', '.join(FEEDS)}, got {self.feed!r}")
        if not isinstance(self.run_id, str):
            raise TypeError(f"run_id: expected a string, got {type(self.run_id).__name__}")
        if self.layer_depth is not None and (
            isinstance(self.layer_depth, bool) or not isinstance(self.layer_depth, int) or self.layer_depth < 1
        ):
            raise ValueError(f"layer_depth: expected a positive int or None, got {self.layer_depth!r}")
        for name in ("max_layers", "layer_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if (
            isinstance(self.linger_seconds, bool)
            or not isinstance(self.linger_seconds, numbers.Real)
            or not 0 <= self.linger_seconds <= MAX_LINGER_S
        ):
            raise ValueError(
                f"linger_seconds: expected a number of seconds in 0..{MAX_LINGER_S:g}, got {self.linger_seconds!r}"
            )
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("certfile, keyfile: give both or neither")
        for name in ("defer_device_reads", "reduce_shards", "log_status_changes", "port_per_local_rank"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.web_config is not None and not isinstance(self.web_config, (str, os.PathLike)):
            raise TypeError(f"web_config: expected a path, got {type(self.web_config).__name__}")
        self.load_web_config()  # a bad file fails here, naming its key, not at the first scrape
        as_schedule(self.lr_schedule)  # raises TypeError/ValueError naming lr_schedule
        ranks = self.layer_ranks
        if isinstance(ranks, str):
            if ranks not in ("first", "all"):
                raise ValueError(f"layer_ranks: expected 'first', 'all' or a collection of ranks, got {ranks!r}")
        elif not isinstance(ranks, (list, tuple, set, frozenset, range)) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
        ):
            raise TypeError(f"layer_ranks: expected 'first', 'all' or a collection of ranks >= 0, got {ranks!r}")
        if not isinstance(self.strict_port, bool):
            raise TypeError(f"strict_port: expected True or False, got {self.strict_port!r}")
        if self.grad_norm_align_every is not None and (
            isinstance(self.grad_norm_align_every, bool)
            or not isinstance(self.grad_norm_align_every, int)
            or self.grad_norm_align_every < 0
        ):
            raise ValueError(f"grad_norm_align_every: expected an int >= 0 or None, got {self.grad_norm_align_every!r}")
        self.pipeline_group = _process_group("pipeline_group", self.pipeline_group)
        if self.guard not in ("off", "skip", "stop"):
            raise ValueError(f"guard: expected 'off', 'skip' or 'stop', got {self.guard!r}")
        if not isinstance(self.guard_spikes, bool):
            raise TypeError(f"guard_spikes: expected True or False, got {self.guard_spikes!r}")
        if self.guard_schedule not in ("advance", "hold"):
            raise ValueError(f"guard_schedule: expected 'advance' or 'hold', got {self.guard_schedule!r}")
        if not isinstance(self.work_time, bool):
            raise TypeError(f"work_time: expected True or False, got {self.work_time!r}")
        if self.file_sd_dir is not None and (
            not isinstance(self.file_sd_dir, (str, os.PathLike)) or not str(self.file_sd_dir)
        ):
            raise TypeError(f"file_sd_dir: expected a folder path or None, got {self.file_sd_dir!r}")

    def exports_layers(self, rank: int) -> bool:
        """Whether global ``rank`` exports per-layer norms (``layer_ranks``)."""
        if self.layer_ranks == "all":
            return True
        if self.layer_ranks == "first":
            if self.pipeline_group is not None:  # one rank per stage: the stages of rank 0's replica
                return 0 in loaded.distributed().get_process_group_ranks(self.pipeline_group)
            return rank == 0
        return rank in self.layer_ranks

    def load_web_config(self) -> WebConfig | None:
        """The /metrics security settings: ``web_config``, ``LOSSBEAT_WEB_CONFIG``, or certfile/keyfile."""
        path = self.web_config if self.web_config is not None else os.environ.get(WEB_CONFIG_ENV) or None
        if path is not None and self.certfile is not None:
            # Never drop one silently: the file's basic auth would be lost to a bare certfile.
            where = "web_config" if self.web_config is not None else WEB_CONFIG_ENV
            raise ValueError(f"{where}, certfile: give one of them (put the certificate in the web config)")
        if path is not None:
            return load_web_config(path)
        if self.certfile is not None and self.keyfile is not None:
            return WebConfig.from_tls_files(self.certfile, self.keyfile)
        return None

    def load_thresholds(self) -> Thresholds:
        if isinstance(self.thresholds, Thresholds):
            return self.thresholds.with_profile(self.profile) if self.profile else self.thresholds
        return load_thresholds(self.thresholds, profile=self.profile)


def _process_group(name: str, value: Any) -> Any:
    """``value`` as a process group: a ProcessGroup, a 1-D DeviceMesh's group, or None; else TypeError."""
    if value is None:
        return None
    dist = loaded.distributed()  # None without torch: then no process group was made
    if dist is not None:
        if isinstance(value, dist.ProcessGroup):
            return value
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(value, DeviceMesh):
            if value.ndim != 1:
                raise TypeError(
                    f"{name}: expected a 1-D DeviceMesh (the pipeline dimension, e.g. mesh['pp']), "
                    f"got a {value.ndim}-D one"
                )
            return value.get_group()
    raise TypeError(
        f"{name}: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got {type(value).__name__}"
    )
