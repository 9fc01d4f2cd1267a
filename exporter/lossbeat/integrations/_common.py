"""Shared by the integrations: the rank process's monitor, the eval loss, measuring gradients before clipping."""

from __future__ import annotations

import logging
import numbers
import os
from typing import Any, Mapping

import torch

from lossbeat.diagnosis.profiles import is_signal
from lossbeat.exposition.server import RankContext
from lossbeat.monitor import Monitor, MonitorConfig, NullMonitor, TrainingHalted, start_exporter

__all__ = [
    "RankMonitorCallback",
    "CountsObservedSteps",
    "check_monitor",
    "rank_monitor",
    "flush_quietly",
    "phase_quietly",
    "eval_loss_from",
    "task_metrics",
    "AfterBackward",
    "uses_deepspeed",
    "deepspeed_grad_norm",
]

log = logging.getLogger("lossbeat")


def check_monitor(monitor: Monitor | NullMonitor | None, settings: Mapping[str, Any]) -> None:
    """Raises at once for a callback given a wrong ``monitor``, both a monitor and exporter
    settings, or settings :func:`start_exporter` does not take."""
    if monitor is not None:
        if not isinstance(monitor, (Monitor, NullMonitor)):
            raise TypeError(f"monitor: expected a lossbeat Monitor, got {type(monitor).__name__}")
        if settings:
            raise TypeError(f"{sorted(settings)[0]}: give a monitor or exporter settings, not both")
        return
    fields = {k: v for k, v in settings.items() if k != "enabled"}
    unknown = set(fields) - set(MonitorConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"LossbeatCallback: unknown exporter setting {sorted(unknown)[0]!r}")
    MonitorConfig(**fields)  # bad values raise here, not in the rank processes


def rank_monitor(
    given: Monitor | NullMonitor | None, given_in_pid: int, settings: Mapping[str, Any], ranks: RankContext
) -> Monitor | NullMonitor:
    """The monitor of this rank process: ``given`` when it was built in this process, else the
    process's exporter (:func:`start_exporter` with ``settings``) labelled with the trainer's ranks.

    A trainer that runs its ranks in forked or spawned children (Lightning's ``ddp_spawn``,
    ``ddp_fork``, ``ddp_notebook``; ``accelerate``'s notebook launcher) calls this in each
    child: a monitor built in the launching process would be a copy that nothing serves.
    """
    if isinstance(given, NullMonitor):
        return given
    if given is not None:
        if given_in_pid != os.getpid():
            raise RuntimeError(
                "LossbeatCallback(monitor=...): the monitor was built in the launching process "
                f"(pid {given_in_pid}), and this rank runs in process {os.getpid()} (ddp_spawn, ddp_fork, "
                "ddp_notebook), where nothing serves it; pass exporter settings instead "
                "(LossbeatCallback(port=..., run_name=...)) and each rank starts its own"
            )
        return given
    return start_exporter(rank_context=ranks, **settings)


class RankMonitorCallback:
    """What every framework's callback holds: the monitor it was given (or None), the process
    it was given in, and the exporter settings for the rank's own monitor, checked at once.

    ``monitor`` is the one given until the callback starts the rank's (:meth:`_start_monitor`,
    from the framework's first hook in the rank process).
    """

    _monitor: Monitor | NullMonitor | None

    def _keep_monitor(self, monitor: Monitor | NullMonitor | None, settings: dict[str, Any]) -> None:
        """Check ``monitor`` and ``settings`` (:func:`check_monitor`) and keep them for the rank."""
        check_monitor(monitor, settings)
        self._monitor = monitor
        self._given = monitor
        self._given_in_pid = os.getpid()
        self._settings = settings

    def _start_monitor(self, ranks: RankContext) -> Monitor | NullMonitor:
        """The rank process's monitor (:func:`rank_monitor`), kept as :attr:`monitor`."""
        self._monitor = rank_monitor(self._given, self._given_in_pid, self._settings, ranks)
        return self._monitor

    @property
    def monitor(self) -> Monitor | NullMonitor | None:
        """The monitor fed: the one given, else the rank's exporter once training has begun (None before)."""
        return self._monitor


class CountsObservedSteps:
    """A callback that counts the optimizer steps it observed with their gradients."""

    _observed_steps: int = 0

    @property
    def observed_steps(self) -> int:
        """Optimizer steps observed with their gradients; 0 when the callback reads only logged steps."""
        return self._observed_steps


def flush_quietly(monitor: Monitor | NullMonitor | None) -> None:
    """``monitor.flush()`` at the end of training: an error is counted and logged, never raised
    into the trainer (like :meth:`Monitor.close`)."""
    if monitor is None:
        return
    try:
        monitor.flush()
    except TrainingHalted:  # the guard stopped the run at one of its last steps: the stop asked for
        raise
    except Exception:  # e.g. a device error surfacing at the last deferred read
        state = getattr(monitor, "state", None)
        if state is not None:
            state.count_error("observe")
        log.error("lossbeat: error flushing the monitor at the end of training", exc_info=True)


def phase_quietly(monitor: Monitor | NullMonitor | None, name: str) -> None:
    """``monitor.phase(name)`` from a framework's hook: the phase TrainingStalled reads, and a
    heartbeat (a no-op but the heartbeat when already in it; no host sync). Errors are counted
    and logged, never raised into the trainer."""
    if monitor is None:
        return
    try:
        monitor.phase(name)
    except Exception:
        state = getattr(monitor, "state", None)
        if state is not None:
            state.count_error("observe")
        log.error("lossbeat: error setting the phase %r", name, exc_info=True)


def _real(value: Any) -> float | torch.Tensor | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def eval_loss_from(metrics: Mapping[str, Any] | None, key: str | None, prefix: str = "eval_") -> tuple[str, Any] | None:
    """(key, value) of the eval loss in ``metrics``: ``key`` if given, else ``{prefix}loss``,
    else the first ``{prefix}<set>_loss`` in sorted order (one eval set feeds the monitor)."""
    if not metrics:
        return None
    if key is not None:
        value = _real(metrics.get(key))
        return (key, value) if value is not None else None
    candidates = [f"{prefix}loss"] + sorted(
        k for k in metrics if isinstance(k, str) and k.startswith(prefix) and k.endswith("_loss")
    )
    for k in candidates:
        value = _real(metrics.get(k))
        if value is not None:
            return k, value
    return None


EVAL_PREFIXES = ("eval_", "val_", "test_", "predict_", "eval/", "val/", "test/")
"""Logged names of an evaluation: they reach ``observe_eval``, never a training step."""
_FED_APART = frozenset({"loss", "grad_norm", "learning_rate", "lr", "epoch", "step", "global_step"})
"""Logged values a callback passes to ``observe`` as its own arguments."""
_NAMES_KEPT = 256
"""Distinct names a callback passes on per run (the monitor remembers at most 64)."""


def task_metrics(
    logged: Mapping[str, Any] | None, passed: set[str], *, evaluation: bool = False, skip: str | None = None
) -> dict[str, Any] | None:
    """The task's named values in what a framework logged, for ``observe(metrics=...)`` (training)
    or ``observe_eval(metrics=...)`` (``evaluation``), or None when there is nothing to pass.

    The live profile detection and the RL, preference and classification judgments read them.
    Every known signal (``reward``, ``reward_std``, ``kl``, ``rewards/margins``, ``eval_accuracy``,
    ... :data:`lossbeat.diagnosis.profiles.SIGNALS`) comes with its value each time, first; any
    other name once per run with the value None: it still names the task, and its value is neither
    read nor exported. A value that is not one real number (a string, a list) is None. Training
    leaves out the evaluation's names (:data:`EVAL_PREFIXES`) and what ``observe`` takes as its own
    arguments (loss, grad_norm, learning_rate, epoch); an evaluation takes only its own names but
    ``skip`` (its loss). ``passed``: the names passed so far, updated. No host read: a tensor is
    passed as it is (the step's one transfer carries it)."""
    if not logged:
        return None
    signals: dict[str, Any] = {}
    names: dict[str, Any] = {}
    for name, value in logged.items():
        if not isinstance(name, str) or name == skip or name in _FED_APART:
            continue
        if name.startswith(EVAL_PREFIXES) != evaluation:
            continue
        if is_signal(name):
            signals[name] = _real(value)
        elif name not in passed and len(passed) < _NAMES_KEPT:
            names[name] = None
        else:
            continue
        passed.add(name)
    signals.update(names)
    return signals or None


def uses_deepspeed(model: Any, optimizer: Any) -> bool:
    """Whether the step runs under DeepSpeed: accelerate wraps its optimizer in a
    ``DeepSpeedOptimizerWrapper``, or ``model`` is the engine (or its ZeRO-3 parameters)."""
    if type(optimizer).__name__ == "DeepSpeedOptimizerWrapper" or type(model).__name__ == "DeepSpeedEngine":
        return True
    from lossbeat.measure.gradients import deepspeed_zero_stage

    return isinstance(model, torch.nn.Module) and deepspeed_zero_stage(model) is not None


def deepspeed_grad_norm(model: Any, optimizer: Any) -> Any:
    """The global gradient norm DeepSpeed computed for this step, where ZeRO-2/3 leave ``p.grad``
    None: the engine's ``get_global_grad_norm()``, else its optimizer's ``_global_grad_norm``
    (accelerate's wrapper → the ZeRO optimizer; set by ``engine.step()``, which accelerate runs
    inside ``backward``); a float or a device tensor as DeepSpeed keeps it (no host sync here).
    None when neither has one (DeepSpeed without ZeRO keeps ``p.grad``: measure the model)."""
    for engine in (model, getattr(model, "module", None)):
        get = getattr(engine, "get_global_grad_norm", None)
        if callable(get):
            value = get()
            if value is not None:
                return value
    opt = optimizer
    for _ in range(4):  # accelerate's wrapper, DeepSpeed's ZeRO or fp16 optimizer, the torch one
        if opt is None:
            break
        value = getattr(opt, "_global_grad_norm", None)
        if value is not None:
            return value
        opt = getattr(opt, "optimizer", None)
    return None


class AfterBackward:
    """Measures a model's gradients once a backward pass has finished, before anything clips them.

    A hook on the loss queues an autograd-engine callback for the end of the
    backward pass; that callback queues the measurement, so it runs after
    every callback queued during the pass, among them DistributedDataParallel's,
    which writes the all-reduced gradients back: the norms are the job's, not
    this rank's local ones. The measurement is ``monitor.measure_gradients``: one
    fused reduction left on the device (no host sync), reported by the next
    ``observe(model=model)``. ``grad_scaler``: fp16's GradScaler, whose scale the gradients
    still carry at that point: the norms are divided by it on the device.
    """

    def __init__(self, monitor: Monitor | NullMonitor, grad_scaler: Any = None) -> None:
        self.monitor = monitor
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        self._queue = getattr(engine, "queue_callback", None)

    def watch(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        """Measure ``model``'s gradients when the backward pass through ``loss`` ends."""
        queue = self._queue
        if queue is None or not loss.requires_grad:
            return

        def measure() -> None:
            self.monitor.measure_gradients(model, grad_scaler=self.grad_scaler)  # errors are counted

        def at_end_of_backward(grad: torch.Tensor) -> None:
            # Queued from the first callback: it runs after those queued during the pass.
            queue(lambda: queue(measure))

        loss.register_hook(at_end_of_backward)
