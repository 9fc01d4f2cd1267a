"""The step observer: ``Monitor.observe()`` on the training thread, cheap and bounded.

One step's flow: validate the arguments (programming errors raise at once),
gather every device value of the step (loss, grad norm, per-layer norms from
one fused reduction, LR tensors, loss components) into one packed tensor, move
it to the host with one non-blocking copy that is read when ready (a step
later on CUDA; at once on CPU, where there is nothing to wait for), then feed
the plain floats to the event counters, the bounded windows and, every N
steps, the diagnosis. A scrape renders the resulting state on the server's
thread (:mod:`lossbeat.exposition.collector`).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import math
import numbers
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from prometheus_client.registry import CollectorRegistry

from lossbeat._version import __version__
from lossbeat.exposition.collector import MonitorCollector
from lossbeat.measure.memory import read_memory
from lossbeat.measure.cross_rank import CrossRankSignals
from lossbeat.diagnosis import Finding, Judge, Status, StatusChange
from lossbeat.measure.gradients import (
    GradientNorms, LayerGrouping, ShardedMeasurementError, clip_with_norms, compute_grad_norms, deepspeed_zero_stage,
)
from lossbeat.exposition.metrics import PHASES
from lossbeat.exposition.registration import Registration, register
from lossbeat.exposition.server import MetricsServer, RankContext
from lossbeat.diagnosis.thresholds import Thresholds, load_thresholds
from lossbeat.exposition.webconfig import ENV_VAR as WEB_CONFIG_ENV
from lossbeat.exposition.webconfig import WebConfig, load_web_config
from lossbeat.exposition.state import MonitorState
from lossbeat.diagnosis.vitals import Vitals, as_schedule

__all__ = ["MonitorConfig", "Monitor", "NullMonitor", "PhaseScope", "Report", "start_exporter", "DEFAULT_PORT"]

log = logging.getLogger("lossbeat")

DEFAULT_PORT = 8470
"""8470 + LOCAL_RANK: clear of DCGM's 9400 and torchrun's 29400/29500."""

_MAX_PARAM_GROUPS = 32
_MAX_COMPONENTS = 32
_MAX_PENDING = 4  # deferred host copies in flight before the oldest is waited for
# Every N observe() calls the trainable parameters are compared with the layer grouping's
# (a pass over the parameters: too slow for every step, cheap amortised): unfreezing layers
# mid-run, or adding adapters, regroups.
_REGROUP_CHECK_EVERY = 100
_LOG_EVERY = 100  # repeated events (a NaN every step) are logged once per this many
# A scrape applies deferred device values that arrived once the training thread has not
# observed for this long (an evaluation, a checkpoint): a NaN just before them shows at once.
_SCRAPE_DRAIN_AFTER_S = 1.0
ALL_LAYERS = "all layers"
"""The non-finite layer reported when a non-finite loss made every layer's gradient non-finite
(on a pipeline stage without a loss: when every layer of the stage is non-finite)."""
_MAX_LINGER_S = 600.0


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
    web_config: str | os.PathLike | None = None
    """A web configuration file in the Prometheus exporter-toolkit format (TLS, mutual TLS, basic
    auth; see :mod:`lossbeat.exposition.webconfig`); None reads the path from ``LOSSBEAT_WEB_CONFIG`` if set."""
    strict_port: bool = False
    """Raise when ``port + LOCAL_RANK`` is taken (e.g. two jobs sharing a node) instead of
    serving on a free port the OS picks and logging which."""
    file_sd_dir: str | None = None
    """Folder Prometheus watches with file_sd: each serving rank writes its own target entry
    there (real port, job, node, Slurm job id) and removes it when it ends. None: the
    ``LOSSBEAT_FILE_SD_DIR`` environment variable, else no self-registration."""
    grad_norm_align_every: int = 100
    """Export the global grad norm of every step that is a multiple of N with that step, for
    ``TrainingRankGradientMismatch`` (replicas must agree). No collective: Prometheus compares
    the ranks, so it cannot hang a job. Pick N so that N steps span several scrape intervals (the
    rule compares ranks at the same aligned step). 0 disables it: set 0 where ranks
    legitimately differ (pipeline stages without ``pipeline_group``, whose norms are their own
    layers'; with it every stage exports the model's norm)."""
    work_time: bool = False
    """Time this rank's own work per step (data wait + forward, through forward hooks on the
    ``observe(model=...)`` module) for ``TrainingStraggler``."""

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
        if self.layer_depth is not None and (
            isinstance(self.layer_depth, bool) or not isinstance(self.layer_depth, int) or self.layer_depth < 1
        ):
            raise ValueError(f"layer_depth: expected a positive int or None, got {self.layer_depth!r}")
        for name in ("max_layers", "layer_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if (
            isinstance(self.linger_seconds, bool) or not isinstance(self.linger_seconds, numbers.Real)
            or not 0 <= self.linger_seconds <= _MAX_LINGER_S
        ):
            raise ValueError(f"linger_seconds: expected a number of seconds in 0..{_MAX_LINGER_S:g}, "
                             f"got {self.linger_seconds!r}")
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
        if isinstance(self.grad_norm_align_every, bool) or not isinstance(self.grad_norm_align_every, int) \
                or self.grad_norm_align_every < 0:
            raise ValueError(f"grad_norm_align_every: expected an int >= 0, got {self.grad_norm_align_every!r}")
        self.pipeline_group = _process_group("pipeline_group", self.pipeline_group)
        if not isinstance(self.work_time, bool):
            raise TypeError(f"work_time: expected True or False, got {self.work_time!r}")
        if self.file_sd_dir is not None and (not isinstance(self.file_sd_dir, (str, os.PathLike))
                                             or not str(self.file_sd_dir)):
            raise TypeError(f"file_sd_dir: expected a folder path or None, got {self.file_sd_dir!r}")

    def exports_layers(self, rank: int) -> bool:
        """Whether global ``rank`` exports per-layer norms (``layer_ranks``)."""
        if self.layer_ranks == "all":
            return True
        if self.layer_ranks == "first":
            if self.pipeline_group is not None:  # one rank per stage: the stages of rank 0's replica
                return 0 in dist.get_process_group_ranks(self.pipeline_group)
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


@dataclass
class _Pending:
    """One step whose device values are on their way to the host."""

    step: int
    wall_time: float
    duration: float | None
    epoch: float | None
    host: dict[str, Any]
    """Values already on the host (Python floats)."""
    layout: list[tuple[str, int]]
    """(key, length) of each slice of the packed device tensor."""
    packed: torch.Tensor | None = None
    """The packed values: a pinned host buffer filling asynchronously, or a CPU tensor."""
    event: Any = None
    """CUDA event recorded after the copy; None when the values are already on the host."""
    layer_names: list[str] = field(default_factory=list)
    has_lrs: bool = False
    has_components: bool = False


@dataclass(frozen=True)
class Report:
    """The end-of-run report: the last findings and the event counts."""

    findings: tuple[Finding, ...]
    counters: Mapping[str, float]
    step: float | None
    pattern: str = ""
    """The loss curve's pattern (article section 1.3), in words, with the step it began at."""

    @property
    def worst(self) -> Status:
        return max((f.status for f in self.findings), default=Status.GOOD)

    def __str__(self) -> str:
        lines = [f"lossbeat report (last step {int(self.step) if self.step is not None else '-'})"]
        if self.pattern:
            lines.append(f"  this run {self.pattern}")
        marks = {Status.GOOD: "ok  ", Status.WARNING: "WARN", Status.DANGER: "DANG"}
        for f in self.findings:
            if not f.known:
                continue
            where = f"{f.check}[{f.component}]" if f.component else f.check
            lines.append(f"  {marks[f.status]} {where:<24} {f.message}")
            if f.fix and f.status is not Status.GOOD:
                lines.append(f"       fix: {f.fix}")
        lines.append("  events: " + ", ".join(f"{k} {v:g}" for k, v in self.counters.items()))
        return "\n".join(lines)


def _process_group(name: str, value: Any) -> Any:
    """``value`` as a process group: a ProcessGroup, a 1-D DeviceMesh's group, or None; else TypeError."""
    if value is None:
        return None
    if dist.is_available():
        if isinstance(value, dist.ProcessGroup):
            return value
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(value, DeviceMesh):
            if value.ndim != 1:
                raise TypeError(f"{name}: expected a 1-D DeviceMesh (the pipeline dimension, e.g. mesh['pp']), "
                                f"got a {value.ndim}-D one")
            return value.get_group()
    raise TypeError(f"{name}: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                    f"got {type(value).__name__}")


def _scalar(name: str, value: Any, *, optional: bool = False) -> float | torch.Tensor | None:
    """A float, or a detached 0-d tensor left on its device (reading it would sync)."""
    kind = type(value)
    if kind is float:  # the common case, without ABC checks
        return value
    if kind is int:
        return _int_to_float(value)
    if value is None:
        if optional:
            return None
        raise TypeError(f"{name}: required, got None")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:  # metadata only: no sync
            raise TypeError(f"{name}: expected a single value, got a tensor of shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name}: expected a real number, got a {value.dtype} tensor")
        if value.is_meta:
            raise TypeError(f"{name}: a meta tensor holds no value")
        if hasattr(value, "full_tensor"):
            # A DTensor (torch's clip_grad_norm_ returns one under FSDP2): its value on every
            # rank; a partial one is all-reduced, enqueued on the device like any kernel.
            value = value.full_tensor()
        return value.detach().reshape(())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float or a 0-d tensor, got {type(value).__name__}")
    return _real_to_float(value)


def _real_to_float(value: numbers.Real) -> float:
    if isinstance(value, numbers.Integral):
        return _int_to_float(int(value))
    try:
        return float(value)
    except OverflowError:  # a Fraction beyond float range: a huge value is data, not an error
        return math.inf if value > 0 else -math.inf


def _int_to_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond 1.8e308: data (counted as non-finite), never raised
        return math.inf if value > 0 else -math.inf


def _loss_scale(grad_scaler: Any) -> torch.Tensor | None:
    """The scale of an enabled GradScaler as a 0-d device tensor (no sync), else None."""
    if grad_scaler is None:
        return None
    is_enabled = getattr(grad_scaler, "is_enabled", None)
    if not callable(is_enabled) or not callable(getattr(grad_scaler, "get_scale", None)):
        raise TypeError(f"grad_scaler: expected a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if not is_enabled():
        return None
    # get_scale() would read it with .item(): the tensor behind it is read with the step's values.
    scale = getattr(grad_scaler, "_scale", None)
    return scale.detach().reshape(()) if isinstance(scale, torch.Tensor) and scale.numel() == 1 else None


def _start_host_copy(packed: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A pinned host buffer that a non-blocking copy of the CUDA tensor ``packed`` fills,
    and the CUDA event that completes after it.

    The copy runs on the current stream of ``packed``'s device, which need not be the
    current device (a model on ``cuda:1`` without ``set_device``; the last GPU of
    ``device_map="auto"``): the event is recorded on that same stream, else it could
    complete before the copy and the buffer be read early. Everything happens with
    ``packed``'s device current, so no CUDA context is created on GPU 0 for it.
    """
    device = packed.device
    with torch.cuda.device(device):
        buffer = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        buffer.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return buffer, event


def _refuse_graph_capture(where: str) -> None:
    """Raise if called while the current CUDA stream is capturing a graph: the event query
    and the pinned allocation would break the capture, and a captured observe() would
    replay stale values. Checked only once CUDA is initialised (no cost on CPU); the query
    creates no CUDA context on the current device when it has none."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{where}: called during CUDA graph capture; call it outside the captured region "
            "(after graph.replay(), with the step's output tensors)"
        )


def _as_float_list(t: torch.Tensor) -> list[float]:
    return t.tolist()


class Monitor:
    """Observes training steps and serves them as Prometheus metrics.

    Use :func:`start_exporter` to get one; ``Monitor(config, serve=False)``
    builds one without an HTTP server (e.g. for tests with their own registry).
    """

    def __init__(
        self,
        config: MonitorConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
        serve: bool = True,
        rank_context: RankContext | None = None,
    ) -> None:
        self.config = config = config or MonitorConfig()
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"config: expected a MonitorConfig, got {type(config).__name__}")
        self.thresholds = config.load_thresholds()
        self.rank_context = rank_context or RankContext.detect()
        self._exports_layers = config.exports_layers(self.rank_context.rank)
        self.state = MonitorState(
            str(self.rank_context.rank),
            {
                "run": config.run_name,
                "profile": self.thresholds.profile.name,
                "world_size": str(self.rank_context.world_size),
                "local_rank": str(self.rank_context.local_rank),
                "version": __version__,
                "torch_version": torch.__version__.split("+")[0],
            },
        )
        self._judge = Judge(self.thresholds)  # the same judgment `lossbeat analyze` replays
        self.history = self._judge.history
        self._vitals = Vitals(self.thresholds, config.lr_schedule)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = MonitorCollector(self.state, before_scrape=self._drain_at_scrape)
        self.registry.register(self._collector)
        self._cross_rank = CrossRankSignals(self.state.rank, config.grad_norm_align_every, config.work_time)
        self.registry.register(self._cross_rank)
        self._grouping: LayerGrouping | None = None
        self._warned_deepspeed = False
        self._nonfinite_run = False  # the last applied step had a non-finite gradient
        # Deferred device values are applied by the training thread and, once it has been idle
        # for _SCRAPE_DRAIN_AFTER_S, by a scrape: one at a time, in order.
        self._drain_lock = threading.Lock()
        self._last_submit = time.monotonic()
        # Norms measured ahead of the next observe(model=...) by clip_grad_norm_ or
        # measure_gradients: (model, norms, clip coefficient or None).
        self._measured: tuple[torch.nn.Module, GradientNorms, torch.Tensor | None] | None = None
        self._pending: collections.deque[_Pending] = collections.deque()
        self._last_perf: float | None = None
        self._observed = 0
        self._submitted = 0
        self._grouping_checked = 0
        self._findings: tuple[Finding, ...] = ()
        self._log_counts: dict[str, int] = {}
        self.host_transfers = 0
        """Reads of a step's packed tensor values on the host: at most one per observed step
        (plus one for CPU tensors when a step mixes CPU and device tensors)."""
        self.blocking_waits = 0
        """Times ``observe()`` waited for a deferred device copy (more than ``_MAX_PENDING``
        steps in flight); 0 while the device keeps up. Waits in ``flush()`` are not counted."""
        self.closed = False
        self._server: MetricsServer | None = None
        self._registration: Registration | None = None
        if serve:
            port = config.port
            if port and config.port_per_local_rank:
                port += self.rank_context.local_rank
            self._server = MetricsServer(self.registry, port, config.addr, web_config=config.load_web_config(),
                                         strict_port=config.strict_port)
            self._registration = register(
                config.file_sd_dir, addr=config.addr, port=self._server.port, rank=self.rank_context.rank,
                job=config.run_name, on_error=lambda: self.state.count_error("register"))
            # A script that ends without close() (or a framework callback that only flushes)
            # still says "completed" at exit, unless an uncaught exception ends it.
            _watch_uncaught_exceptions()
            atexit.register(self._close_at_exit)

    # --- public API -----------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The port /metrics is served on (the real one when 0 was asked), or None."""
        return self._server.port if self._server else None

    def observe(
        self,
        step: int,
        *,
        loss: Any = None,
        optimizer: Any = None,
        learning_rate: Any = None,
        grad_norm: Any = None,
        model: torch.nn.Module | None = None,
        tokens: Any = None,
        losses: Mapping[str, Any] | None = None,
        epoch: float | None = None,
        grad_scaler: Any = None,
    ) -> None:
        """Record one optimizer step. Call after ``backward()`` and before ``zero_grad()``.

        ``loss`` and ``grad_norm`` may be floats or 0-d tensors on any device;
        ``model`` adds per-layer gradient norms (and the global norm when
        ``grad_norm`` is not given); ``losses`` are the components of a
        multi-task loss. ``grad_scaler``: fp16 training's ``torch.amp.GradScaler``
        (call ``scaler.unscale_(optimizer)`` first, as before clipping): its
        scale is exported, and a step whose gradients overflow, which the
        scaler skips, counts as an overflow instead of a non-finite gradient.

        ``loss=None`` (the default): this rank computes no loss this step, as
        the pipeline stages before the last. The step, its time, learning
        rates, tokens and gradient norms are recorded (``model=`` still joins
        the shard and pipeline all-reduces); the loss is not: no
        ``training_loss`` until one is given, no loss sample for the checks,
        which judge only the losses given. Never pass a placeholder such as
        torchtitan's ``-1`` for a stage without a loss: it would be judged as
        the loss.

        Wrong types raise ``TypeError``; NaN, Inf and other anomalies in the
        values are counted and exported, never raised.
        """
        if self.closed:
            raise RuntimeError("observe: this monitor is closed")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        _refuse_graph_capture("observe")
        loss_value = _scalar("loss", loss, optional=True)  # None: no loss on this rank (a pipeline stage)
        grad_value = _scalar("grad_norm", grad_norm, optional=True)
        tokens_value = _scalar("tokens", tokens, optional=True)
        lr_values = self._learning_rates(optimizer, learning_rate)
        component_values = self._components(losses)
        scale_value = _loss_scale(grad_scaler)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, numbers.Real)):
            raise TypeError(f"epoch: expected a number, got {type(epoch).__name__}")
        if epoch is not None:
            epoch = _real_to_float(epoch)

        now_perf = time.perf_counter()
        duration = None if self._last_perf is None else now_perf - self._last_perf
        self._last_perf = now_perf
        try:
            self._drain(block=False)
            values: dict[str, Any] = {"loss": loss_value, "grad_norm": grad_value, "tokens": tokens_value,
                                      "grad_scale": scale_value}
            values.update(lr_values)
            values.update(component_values)
            try:
                layer_names = self._gradients(model, grad_value is None, values)
            except Exception:  # gradients we cannot measure: the step's loss and LR still count
                layer_names = []
                values.pop("layers", None)
                self.state.count_error("observe")
                self._log_limited("error", logging.ERROR, "lossbeat: cannot measure the gradients; training continues",
                                  exc_info=True)
            self._submitted += 1
            self._submit(int(step), time.time(), duration, epoch, values, layer_names)
            self._cross_rank.step_end(model)
        except Exception:  # the training loop must go on: count, log, continue
            self.state.count_error("observe")
            self._log_limited("error", logging.ERROR, "lossbeat: error in observe(); training continues", exc_info=True)

    def observe_eval(self, step: int, eval_loss: Any) -> None:
        """Record an evaluation loss (feeds ``training_eval_loss`` and the overfitting check).

        Also a sign of progress: it refreshes the heartbeat TrainingStalled watches."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        value = _scalar("eval_loss", eval_loss)
        self.state.last_activity_time = time.time()
        try:
            if isinstance(value, torch.Tensor):
                value = float(value.item())  # host sync: evaluation is not the per-step hot path
            self.state.eval_loss = value if math.isfinite(value) else math.nan
            self.state.evals_total += 1
            self._drain(block=True)  # the steps before this evaluation first (host sync: not the hot path)
            self.history.add_eval(value, step=int(step))
            self._diagnose(int(step))  # judged after each evaluation, as `lossbeat analyze` does
        except Exception:
            self.state.count_error("observe")
            self._log_limited("error", logging.ERROR, "lossbeat: error in observe_eval()", exc_info=True)

    def phase(self, name: str) -> "PhaseScope":
        """Say what the run is doing now: ``"train"``, ``"eval"`` or ``"checkpoint"``.

        Takes effect at once (for framework hooks: ``phase("eval")`` when validation starts,
        ``phase("train")`` when it ends); as a context manager it restores the previous
        phase on exit::

            with monitor.phase("checkpoint"):
                save(model)

        Exported as ``training_phase`` and ``training_phase_seconds_total``: TrainingStalled
        allows ``alerts.stalled_phase_after`` outside training instead of ``stalled_after``.
        """
        if name not in PHASES:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {name!r}")
        previous = self.state.phase[0]
        self._set_phase(name)
        return PhaseScope(self, previous)

    def heartbeat(self) -> None:
        """Mark progress without a step (an evaluation batch, a checkpoint shard): TrainingStalled
        measures from the latest step, evaluation, phase change or heartbeat. Cheap: no sync."""
        self.state.last_activity_time = time.time()

    def _set_phase(self, name: str) -> None:
        current, since, totals = self.state.phase
        now = time.monotonic()
        if name != current:
            totals = {**totals, current: totals.get(current, 0.0) + now - since}
            self.state.phase = (name, now, totals)  # one swap: a scrape sees all or nothing
            self._last_perf = None  # the step that spans a phase change is no step time
        self.state.last_activity_time = time.time()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients like ``torch.nn.utils.clip_grad_norm_`` and measure them in the same pass.

        Returns the total norm before clipping (a 0-d tensor, no host sync).
        The per-layer norms it computed are reused by the next ``observe(model=model)``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
            raise ValueError(f"max_norm: expected a positive number, got {max_norm!r}")
        _refuse_graph_capture("clip_grad_norm_")
        self._measured = None
        try:
            grouping = self._grouping_for(model)
            per_layer = self._layers_due() and self._exports_layers
            norms, coefficient = clip_with_norms(grouping, float(max_norm), per_layer)
        except ShardedMeasurementError as e:
            # torch's clip would wait in the same collective forever: say why instead
            self._gradient_error("clip_grad_norm_", e)
            raise RuntimeError(f"clip_grad_norm_: {e}") from None
        except Exception as e:  # clip as torch does; only the measurement is lost
            self._gradient_error("clip_grad_norm_", e)
            return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
        if norms is None:
            return torch.zeros(())
        self._measured = (model, norms, coefficient)
        return norms.global_norm

    def measure_gradients(self, model: torch.nn.Module, *, grad_scaler: Any = None) -> torch.Tensor | None:
        """Measure ``model``'s gradients now; the next ``observe(model=model)`` reports these norms.

        For a training loop or framework that changes the gradients between
        backward and the point where ``observe`` runs (a Trainer that clips
        before its callback, say): measured here, the per-layer and global norms
        are the unclipped ones, and ``observe`` does not read the gradients
        again. Measuring again before that ``observe`` replaces the norms.
        Returns the global norm (a 0-d tensor, no host sync), or None when no
        parameter has a gradient or the measurement failed (counted in
        ``training_exporter_errors_total{where="gradients"}``; training goes on). ``grad_scaler``: fp16's
        GradScaler when the gradients still carry its scale (not yet ``unscale_``-d): the
        norms are divided by the scale on the device.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        _refuse_graph_capture("measure_gradients")
        scale = _loss_scale(grad_scaler)
        try:
            per_layer = self._layers_due() and self._exports_layers
            norms = compute_grad_norms(self._grouping_for(model), per_layer)
            if norms is not None and scale is not None:
                layers = norms.layer_norms
                norms = dataclasses.replace(norms, global_norm=norms.global_norm / scale,
                                            layer_norms=None if layers is None else layers / scale)
        except Exception as e:  # may run inside an autograd callback: never break backward
            self._measured = None
            self._gradient_error("measure_gradients", e)
            return None
        self._measured = None if norms is None else (model, norms, None)
        return None if norms is None else norms.global_norm

    def flush(self) -> None:
        """Process every step still waiting for its device values (waits for them)."""
        self._drain(block=True)

    def report(self) -> Report:
        """Run the diagnosis now and return the end-of-run report."""
        self.flush()
        self._diagnose()
        s = self.state
        counters = {
            "steps": s.steps_total,
            "nonfinite_loss": s.nonfinite_loss_total,
            "nonfinite_grad": s.nonfinite_grad_total,
            "loss_spikes": s.loss_spikes_total,
            "grad_explosions": s.grad_explosions_total,
            "grad_scaler_overflows": s.grad_scaler_overflows_total,
            "exporter_errors": sum(s.errors.values()),
        }
        return Report(self._findings, counters, s.step, self._vitals.describe_pattern())

    @property
    def findings(self) -> tuple[Finding, ...]:
        """The findings of the last diagnosis."""
        return self._findings

    def close(self, *, completed: bool = True) -> None:
        """End the run: process pending values, publish the completion marker
        (``training_run_completed``), keep /metrics up one scrape interval so Prometheus
        reads it and the last values (bounded by ``linger_seconds``), stop serving. Idempotent.

        ``completed=False`` (what leaving a ``with`` block on an exception does): the run
        failed; no marker and no wait, so its exporter vanishing pages TrainingExporterDown.
        """
        global _running
        if self.closed:
            return
        if self._server is not None:
            atexit.unregister(self._close_at_exit)
        try:
            self.flush()
        except Exception:
            self.state.count_error("observe")
        self.closed = True
        if completed:
            self.state.completed = True
            if self._server is not None:
                self._linger()
        # After the linger, before the port closes: Prometheus drops the target having read the
        # marker; a crash leaves the entry for the prune, and the vanished series page.
        if self._registration is not None:  # before the port closes: Prometheus drops the target, no up=0
            self._registration.remove()
        if self._server is not None:
            self._server.close()
        self._cross_rank.close()
        for collector in (self._collector, self._cross_rank):
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass
        with _lock:
            if _running is self:
                _running = None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(completed=exc_type is None)

    def _close_at_exit(self) -> None:
        try:
            self.close(completed=not _uncaught_exception_seen)
        except Exception:  # the interpreter is going away: never fail its exit
            log.debug("lossbeat: close at exit failed", exc_info=True)

    def _linger(self) -> None:
        """Serve one more scrape interval, as measured from the scrapes seen; none when
        nothing scrapes periodically (a script run by hand, a test)."""
        interval = self._collector.scrape_interval()
        if interval is None or not self.config.linger_seconds:
            return
        wait = min(float(self.config.linger_seconds), 1.2 * interval + 0.5)
        log.info("lossbeat: run completed; serving /metrics %.1fs more for the last scrape", wait)
        time.sleep(wait)

    # --- argument handling (raises on programming errors) ------------------------------

    def _learning_rates(self, optimizer: Any, learning_rate: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if optimizer is not None:
            groups = getattr(optimizer, "param_groups", None)
            if not isinstance(groups, (list, tuple)):
                raise TypeError(f"optimizer: expected a torch optimizer with param_groups, got {type(optimizer).__name__}")
            for i, group in enumerate(groups[:_MAX_PARAM_GROUPS]):
                label = str(group.get("name", i)) if isinstance(group, Mapping) else str(i)
                lr = group.get("lr") if isinstance(group, Mapping) else None
                if lr is not None:
                    out[("lr", label)] = _scalar("optimizer.param_groups[%d]['lr']" % i, lr)
        if learning_rate is not None:
            out[("lr", "0" if not out else "explicit")] = _scalar("learning_rate", learning_rate)
        return out

    def _components(self, losses: Mapping[str, Any] | None) -> dict[str, Any]:
        if losses is None:
            return {}
        if not isinstance(losses, Mapping):
            raise TypeError(f"losses: expected a mapping of component name to loss, got {type(losses).__name__}")
        out = {}
        for name, value in list(losses.items())[:_MAX_COMPONENTS]:
            if not isinstance(name, str):
                raise TypeError(f"losses: component names must be strings, got {name!r}")
            out[("component", name)] = _scalar(f"losses[{name!r}]", value)
        return out

    # --- hot path -------------------------------------------------------------------------

    def _grouping_for(self, model: torch.nn.Module) -> LayerGrouping:
        grouping = self._grouping
        if grouping is not None and grouping.model_ref is model:
            if self._submitted - self._grouping_checked < _REGROUP_CHECK_EVERY:
                return grouping
            # Counted in submitted steps, the same on every rank: a sharded model regroups everywhere.
            self._grouping_checked = self._submitted
            if grouping.matches(model):
                return grouping
        self._grouping_checked = self._submitted
        grouping = self._grouping = LayerGrouping(
            model, self.config.layer_depth, self.config.max_layers, self.config.reduce_shards,
            self.config.pipeline_group,
        )
        stage = deepspeed_zero_stage(model)
        if stage is not None and not self._warned_deepspeed:
            self._warned_deepspeed = True
            log.warning("lossbeat: DeepSpeed ZeRO-%d keeps partitioned gradients outside p.grad: per-layer and "
                        "global gradient norms cannot be measured from the model; pass "
                        "grad_norm=engine.get_global_grad_norm() to observe() (see the README)", stage)
        return grouping

    def _layers_due(self) -> bool:
        """Whether this step is one for per-layer norms (every ``layer_every`` observe() calls).

        The same on every rank: counted at submission, not when the values arrive
        (on CUDA they arrive a step late, which would skip or repeat a due step)."""
        return self._submitted % self.config.layer_every == 0

    def _gradients(self, model: torch.nn.Module | None, need_global: bool, values: dict[str, Any]) -> list[str]:
        """Adds device tensors for the global and per-layer norms to ``values``.

        Isolated: a failure here (an unsupported gradient, a sharded model some rank
        does not measure) is counted under ``where="gradients"`` and the step is still
        recorded with its loss, learning rates and timestamp, without gradient values."""
        measured, self._measured = self._measured, None
        if model is None:
            return []
        try:
            due = self._layers_due()
            per_layer = due and self._exports_layers
            if measured is not None and measured[0] is model:
                norms, coefficient = measured[1], measured[2]
            else:
                coefficient = None
                grouping = self._grouping_for(model)
                # A sharded or pipelined model's ranks all-reduce together: every rank measures on
                # due steps, whether it exports the layers or not.
                if not (per_layer or need_global or (due and grouping.collective)):
                    return []
                norms = compute_grad_norms(grouping, per_layer)
        except Exception as e:
            self._gradient_error("observe", e)
            return []
        if coefficient is not None:
            values["clip"] = coefficient
        if norms is None:  # no parameter has a gradient this step
            return []
        if need_global:
            values["grad_norm"] = norms.global_norm
        if norms.layer_norms is None:
            return []
        values["layers"] = norms.layer_norms
        return self._grouping.layer_names if self._grouping else []

    def _gradient_error(self, where: str, error: Exception) -> None:
        self.state.count_error("gradients")
        if isinstance(error, ShardedMeasurementError):  # a usage error: say what to do, without a traceback
            self._log_limited("sharded", logging.ERROR, "lossbeat: %s(): %s", where, error)
        else:
            self._log_limited("gradients", logging.ERROR, "lossbeat: error measuring gradients in %s(); their "
                              "norms are skipped, the step and training go on", where, exc_info=True)

    def _submit(
        self, step: int, wall: float, duration: float | None, epoch: float | None, values: dict[str, Any],
        layer_names: list[str],
    ) -> None:
        host: dict[str, Any] = {}
        device_parts: list[torch.Tensor] = []
        cpu_parts: list[torch.Tensor] = []
        layout: list[tuple[str, int]] = []
        cpu_layout: list[tuple[str, int]] = []
        device = None
        has_lrs = has_components = False
        for key, value in values.items():
            if value is None:
                continue
            if type(key) is tuple:
                if key[0] == "lr":
                    has_lrs = True
                else:
                    has_components = True
            if not isinstance(value, torch.Tensor):
                host[key] = value
                continue
            flat = value.reshape(-1)
            if flat.dtype != torch.float64:
                # float64: token counts stay exact past 2**24 and bf16/fp16 values lose nothing.
                flat = flat.double()
            if flat.device.type == "cpu":
                cpu_parts.append(flat)
                cpu_layout.append((key, flat.numel()))
                continue
            if device is None:
                device = flat.device
                self.state.cuda_device = device.index if device.type == "cuda" else None
            elif flat.device != device:
                flat = flat.to(device, non_blocking=True)
            device_parts.append(flat)
            layout.append((key, flat.numel()))

        if cpu_parts:  # CPU tensors: reading them waits for nothing
            packed = torch.cat(cpu_parts) if len(cpu_parts) > 1 else cpu_parts[0]
            self.host_transfers += 1
            _unpack(_as_float_list(packed), cpu_layout, host)

        record = _Pending(step, wall, duration, epoch, host, layout, layer_names=layer_names,
                          has_lrs=has_lrs, has_components=has_components)
        if device_parts:
            packed = torch.cat(device_parts) if len(device_parts) > 1 else device_parts[0]
            if device.type == "cuda" and self.config.defer_device_reads:
                # The step's one device->host transfer, asynchronous: read at a later observe()
                # (or scrape) once its event is done.
                record.packed, record.event = _start_host_copy(packed)
            else:
                # The step's one device->host transfer, synchronous (waits for the step's kernels).
                record.packed = packed.cpu()
        with self._drain_lock:
            self._pending.append(record)
            self._last_submit = time.monotonic()
            self._drain_locked(block=False, may_wait=True)

    def _drain(self, block: bool, may_wait: bool = True) -> None:
        """Apply pending steps in order, as far as their values have arrived.

        ``block``: wait for all (flush); else wait only when more than ``_MAX_PENDING``
        are in flight, and never when ``may_wait`` is False (a scrape)."""
        if not self._pending:  # nothing in flight (always, on CPU): no lock to take
            return
        with self._drain_lock:  # the training thread and a scrape: one applies at a time, in order
            self._drain_locked(block, may_wait)

    def _drain_locked(self, block: bool, may_wait: bool) -> None:
        pending = self._pending
        while pending:
            record = pending[0]
            if record.event is not None and not record.event.query():
                if not block and (len(pending) <= _MAX_PENDING or not may_wait):
                    return
                if not block:
                    self.blocking_waits += 1
                record.event.synchronize()  # host sync: only when too many are in flight, or on flush()
            pending.popleft()
            if record.packed is not None:
                self.host_transfers += 1
                _unpack(_as_float_list(record.packed), record.layout, record.host)
            self._apply(record)

    def _drain_at_scrape(self) -> None:
        """On the scrape thread: apply the steps whose device values have arrived while the
        training thread is away (an evaluation, a checkpoint). Never waits for the device or
        for the training thread: an event query only, and only if the lock is free.

        Caveat: an event query from this thread during a CUDA-graph capture in global mode on
        another thread would invalidate that capture; captures happen while the loop steps,
        and this runs only once the loop has not observed for ``_SCRAPE_DRAIN_AFTER_S``."""
        if not self._pending or time.monotonic() - self._last_submit < _SCRAPE_DRAIN_AFTER_S:
            return
        if not self._drain_lock.acquire(blocking=False):
            return
        try:
            self._drain_locked(block=False, may_wait=False)
        finally:
            self._drain_lock.release()

    # --- plain floats from here on -----------------------------------------------------

    def _apply(self, record: _Pending) -> None:
        s, v = self.state, record.host
        loss = v.get("loss")  # None: a rank without a loss this step (a pipeline stage before the last)
        grad_norm = v.get("grad_norm")
        lrs = {k[1]: x for k, x in v.items() if type(k) is tuple and k[0] == "lr"} if record.has_lrs else None
        components = (
            {k[1]: x for k, x in v.items() if type(k) is tuple and k[0] == "component"} if record.has_components else None
        )
        layers = v.get("layers")
        lr_max = max(lrs.values()) if lrs else None
        if lr_max is not None and any(math.isnan(x) for x in lrs.values()):
            lr_max = math.nan

        layer_norms = without_grad = None
        if layers is not None:
            # -1: no parameter of the layer had a gradient this step (unused head, unrouted
            # expert): omitted, not a zero norm, and counted apart.
            if -1.0 in layers:  # a C-level scan; the filter only when some layer had no gradient
                layer_norms = {name: x for name, x in zip(record.layer_names, layers) if not x < 0}
            else:
                layer_norms = dict(zip(record.layer_names, layers))
            without_grad = len(layers) - len(layer_norms)
        layer_nonfinite = layer_norms is not None and not all(map(math.isfinite, layer_norms.values()))
        # Under fp16 loss scaling an overflowing step is skipped by the scaler: routine, not a
        # fault, and no gradient sample. A scale collapsing is the fault (the nonfinite check).
        overflow = "grad_scale" in v and (
            layer_nonfinite or (grad_norm is not None and not math.isfinite(grad_norm))
        )
        if overflow:
            grad_norm = layer_norms = None
            layer_nonfinite = False
        if "grad_scale" in v:
            s.grad_scale = self.history.grad_scale = v["grad_scale"]

        events = self.history.add_step(record.step, loss, grad_norm, lr_max, components)
        self._cross_rank.record(record.step, grad_norm)
        if loss is not None:
            s.loss = loss if math.isfinite(loss) else math.nan
        if grad_norm is not None:
            s.grad_norm = grad_norm if math.isfinite(grad_norm) else math.nan
        s.step = float(record.step)
        if record.epoch is not None:
            s.epoch = float(record.epoch)
        s.last_step_time = record.wall_time
        if record.duration is not None:
            s.step_duration = record.duration
        if lrs:
            s.learning_rates = lrs
        if components:
            s.components = {k: (x if math.isfinite(x) else math.nan) for k, x in components.items()}
        if layer_norms is not None:
            s.layer_norms = layer_norms
            s.layers_without_grad = without_grad
            self.history.layer_norms = layer_norms
        if "clip" in v:
            s.clip_coefficient = v["clip"]
        cv, trend = self.history.loss.cv(), self.history.loss.trend_ratio()
        s.loss_cv = None if math.isnan(cv) else cv
        s.loss_trend_ratio = None if math.isnan(trend) else trend
        baseline = self.history.grad.median
        s.grad_norm_baseline = baseline if math.isfinite(baseline) else None

        s.steps_total += 1
        if "tokens" in v and math.isfinite(v["tokens"]):
            s.tokens_total += max(v["tokens"], 0.0)
        if events.nonfinite_loss:
            s.nonfinite_loss_total += 1
            self._log_limited("nonfinite_loss", logging.WARNING, "lossbeat: non-finite loss %s at step %d", loss, record.step)
        if events.nonfinite_grad or layer_nonfinite:
            if layer_nonfinite:
                origin = _nonfinite_origin(layer_norms, loss)
            else:  # no per-layer norms this step: the layer of this event (consecutive bad steps), never an earlier one's
                origin = s.first_nonfinite_layer if self._nonfinite_run else None
            # Set before the counter moves: a scrape in between sees the new count with its layer.
            s.first_nonfinite_layer = origin
            s.nonfinite_grad_total += 1
            self._nonfinite_run = True
            if origin is not None:
                self._log_limited(
                    "nonfinite_grad", logging.WARNING,
                    "lossbeat: non-finite gradient at step %d; it starts at layer %s", record.step, origin,
                )
            else:
                self._log_limited("nonfinite_grad", logging.WARNING, "lossbeat: non-finite gradient norm at step %d", record.step)
        else:
            self._nonfinite_run = False
        if overflow:
            s.grad_scaler_overflows_total += 1
        if events.spike:
            s.loss_spikes_total += 1
        if events.explosion:
            s.grad_explosions_total += 1
            if layer_norms:
                top = max((x for x in layer_norms.items() if math.isfinite(x[1])), key=lambda x: x[1], default=None)
                self._log_limited(
                    "explosion", logging.WARNING, "lossbeat: gradient norm %.4g at step %d; largest layer: %s",
                    grad_norm, record.step, top[0] if top else "-",
                )
        self._vitals.add_step_time(record.duration, s.phase[0] == "train")
        self._observed += 1
        if self._judge.due(record.step):  # every diagnose_every steps, as `lossbeat analyze` judges
            self._diagnose(record.step)

    def _diagnose(self, step: int | None = None) -> None:
        s = self.state
        step = self.history.last_step if step is None else step
        try:
            findings, changes = self._judge.judge(step)
            # Memory, throughput and the LR schedule: checks with their own bounded memory
            # (blocks, thirds, departures in a row) next to the Judge's.
            lrs = s.learning_rates
            vitals = self._vitals.findings(step, max(lrs.values()) if lrs else None, read_memory(s.cuda_device))
            held = s.health
            changes = list(changes) + [
                StatusChange(Status(held[key]), f, step) for f in vitals
                if (key := (f.check, f.component)) in held and held[key] != int(f.status)
            ]
            findings = list(findings) + vitals
            pattern = self._vitals.pattern(findings, step)
            s.pattern = (pattern.name if pattern else None, self._vitals.pattern_since)
        except Exception:
            self.state.count_error("diagnose")
            self._log_limited("diagnose", logging.ERROR, "lossbeat: error in the diagnosis", exc_info=True)
            return
        health = dict(self.state.health)
        for f in findings:
            health[(f.check, f.component)] = int(f.status)
        self.state.health = health
        self._findings = tuple(findings)
        if self.config.log_status_changes:
            for change in changes:
                _log_change(change)

    def _log_limited(self, key: str, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        n = self._log_counts.get(key, 0)
        self._log_counts[key] = n + 1
        if n % _LOG_EVERY == 0:
            log.log(level, msg + (" (repeated %d times)" % n if n else ""), *args, exc_info=exc_info)


def _nonfinite_origin(layer_norms: Mapping[str, float], loss: float | None) -> str:
    """Where a non-finite gradient started: backprop carries a NaN or Inf born in one layer's
    backward to every layer before it, so the origin is the last non-finite layer in model
    order; a non-finite loss poisons every layer (``ALL_LAYERS``). ``loss`` None: a rank
    without a loss (a pipeline stage before the last), whose gradients come from the next
    stage: every layer non-finite may have been poisoned there, so ``ALL_LAYERS`` too."""
    bad = [name for name, x in layer_norms.items() if not math.isfinite(x)]
    if len(bad) == len(layer_norms) and (loss is None or not math.isfinite(loss)):
        return ALL_LAYERS
    return bad[-1]


def _log_change(change: StatusChange) -> None:
    """One line per status change, recoveries included (WARNING: visible by default, so a log
    never shows GOOD -> WARNING twice in a row). Written above an active tqdm bar, not onto it."""
    f = change.finding
    message = "lossbeat: %s %s -> %s at step %s: %s%s"
    args = (change.where, change.previous.name, f.status.name, change.step, f.message,
            f"; fix: {f.fix}" if f.fix and f.status else "")
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if bars:
        with tqdm.tqdm.external_write_mode(file=sys.stderr):
            log.warning(message, *args)
    else:
        log.warning(message, *args)


def _unpack(values: list[float], layout: list[tuple[str, int]], into: dict[str, Any]) -> None:
    offset = 0
    for key, length in layout:
        if key == "layers":
            into[key] = values[offset : offset + length]
        else:
            into[key] = values[offset]
        offset += length


class PhaseScope:
    """What :meth:`Monitor.phase` returns: the phase is already set; leaving the ``with``
    block restores the one before."""

    def __init__(self, monitor: Monitor | None, previous: str) -> None:
        self._monitor = monitor
        self.previous = previous

    def __enter__(self) -> "PhaseScope":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._monitor._set_phase(self.previous)


class NullMonitor:
    """A monitor that does nothing: same API, so training code needs no ``if enabled:``."""

    port = None
    closed = False
    findings: tuple[Finding, ...] = ()

    def observe(self, step: int, **kwargs: Any) -> None:
        pass

    def observe_eval(self, step: int, eval_loss: Any) -> None:
        pass

    def phase(self, name: str) -> "PhaseScope":
        if name not in PHASES:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {name!r}")
        return PhaseScope(None, name)

    def heartbeat(self) -> None:
        pass

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def measure_gradients(self, model: torch.nn.Module, *, grad_scaler: Any = None) -> torch.Tensor | None:
        return None

    def flush(self) -> None:
        pass

    def report(self) -> Report:
        return Report((), {}, None)

    def close(self, *, completed: bool = True) -> None:
        pass

    def __enter__(self) -> "NullMonitor":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


_lock = threading.Lock()
_running: Monitor | None = None
_uncaught_exception_seen = False


def _watch_uncaught_exceptions() -> None:
    """Chain sys.excepthook once: an uncaught exception ends the process as a failure, so
    the close at exit publishes no completion marker (TrainingExporterDown then pages)."""
    previous = sys.excepthook
    if getattr(previous, "_lossbeat", False):
        return

    def hook(exc_type, exc, tb):
        global _uncaught_exception_seen
        _uncaught_exception_seen = True
        previous(exc_type, exc, tb)

    hook._lossbeat = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def start_exporter(
    port: int = DEFAULT_PORT, *, addr: str = "0.0.0.0", enabled: bool = True,
    rank_context: RankContext | None = None, **settings: Any
) -> Monitor | NullMonitor:
    """Serve /metrics on ``port + LOCAL_RANK`` and return the process's :class:`Monitor`.

    Calling it again returns the monitor already running (whatever the port).
    ``settings`` are :class:`MonitorConfig` fields. ``enabled=False`` or the
    environment variable ``LOSSBEAT_DISABLED=1`` gives a :class:`NullMonitor`.
    ``rank_context``: the process's rank, local rank and world size; default
    :meth:`RankContext.detect` (the process group's, else the launcher's variables).
    """
    global _running
    if not enabled or os.environ.get("LOSSBEAT_DISABLED", "") not in ("", "0"):
        return NullMonitor()
    unknown = set(settings) - set(MonitorConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"start_exporter: unknown setting {sorted(unknown)[0]!r}")
    config = MonitorConfig(port=port, addr=addr, **settings)
    with _lock:
        if _running is not None and not _running.closed:
            if _running.config.port != port:
                log.warning("lossbeat: exporter already running on port %s; ignoring port %s", _running.port, port)
            return _running
        _running = Monitor(config, rank_context=rank_context)
        return _running


def _forget_running() -> None:
    global _running
    _running = None  # a forked child (a ddp_fork rank) starts its own; the copy serves nothing


os.register_at_fork(after_in_child=_forget_running)
