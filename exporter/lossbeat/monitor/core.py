"""The step observer: ``Monitor.observe()`` on the training thread, cheap and bounded.

One step reads as: validate the arguments (:mod:`~lossbeat.monitor.inputs`: programming errors
raise at once) → measure the gradients on the device (:mod:`lossbeat.measure.meter`) → submit
every device value in one packed, non-blocking host copy (:mod:`~lossbeat.monitor.transfer`) →
drain the steps whose values have arrived → apply their plain floats to the counters, the state
and the windows (:mod:`~lossbeat.monitor.apply`) → judge every N steps
(:mod:`~lossbeat.monitor.judgment`). A scrape renders the resulting state on the server's
thread (:mod:`lossbeat.exposition.collector`). torch is read as the process has loaded it
(:mod:`~lossbeat.monitor.loaded`): a monitor fed floats never imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import numbers
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from prometheus_client.registry import CollectorRegistry

from lossbeat._version import __version__
from lossbeat.diagnosis import Finding, History, Judge
from lossbeat.diagnosis.vitals import Vitals
from lossbeat.exposition.collector import MonitorCollector
from lossbeat.exposition.cross_rank import CrossRankCollector
from lossbeat.exposition.metrics import PHASES
from lossbeat.exposition.registration import Registration, register
from lossbeat.exposition.server import MetricsServer, RankContext
from lossbeat.exposition.state import MonitorState
from lossbeat.exposition.status import StatusSource
from lossbeat.measure.cross_rank import CrossRankSignals
from lossbeat.measure.meter import GradientMeter, ShardedMeasurementError, ShardHandshakeError
from lossbeat.monitor import identity, inputs, lifecycle, loaded
from lossbeat.monitor.apply import StepApplier
from lossbeat.monitor.config import DEFAULT_PORT, MonitorConfig
from lossbeat.monitor.guard import make_guard
from lossbeat.monitor.judgment import Judgment
from lossbeat.monitor.moe import ExpertLoads
from lossbeat.monitor.null import NullMonitor, PhaseScope
from lossbeat.monitor.profile import ProfileChoice
from lossbeat.monitor.ratelog import RateLimitedLog
from lossbeat.monitor.report import Report
from lossbeat.monitor.steps import StepPath
from lossbeat.monitor.transfer import DeviceTransfer

if TYPE_CHECKING:
    import torch

__all__ = ["Monitor", "MonitorConfig", "NullMonitor", "PhaseScope", "Report", "DEFAULT_PORT"]


class Monitor:
    """Observes training steps and serves them as Prometheus metrics.

    Use :func:`~lossbeat.start_exporter` to get one; ``Monitor(config, serve=False)``
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
        self.rank_context = ctx = rank_context or RankContext.detect()
        self.state = MonitorState(
            str(ctx.rank),
            {
                "run": config.run_name,
                "profile": self.thresholds.profile.name,
                "world_size": str(ctx.world_size),
                "local_rank": str(ctx.local_rank),
                "feed": config.feed,
                "version": __version__,
                "torch_version": loaded.torch_version(),  # binds torch's names if torch is loaded
            },
            identity.run_identity(config.run_id, ctx.world_size),
        )
        self._log = RateLimitedLog()
        self._judge = Judge(self.thresholds)  # the same judgment `lossbeat analyze` replays
        self._history = history = self._judge.history
        self._profile = ProfileChoice(config.profile, self._judge, self.state)
        vitals = Vitals(self.thresholds, config.lr_schedule)
        self._judgment = Judgment(self.state, self._judge, vitals, config.log_status_changes, self._log)
        align = config.grad_norm_align_every  # None: decided from the first model (pure DDP only)
        self._cross_rank = CrossRankSignals(
            self.state.rank, 0 if align is None and not config.reduce_shards else align, config.work_time
        )
        self._meter = GradientMeter(
            layer_depth=config.layer_depth,
            max_layers=config.max_layers,
            layer_every=config.layer_every,
            reduce_shards=config.reduce_shards,
            pipeline_group=config.pipeline_group,
            exports_layers=config.exports_layers(ctx.rank),
            on_error=lambda where, error: _gradient_error(self.state, self._log, where, error),
        )
        self._guard = make_guard(
            mode=config.guard,
            spikes=config.guard_spikes,
            schedule=config.guard_schedule,
            thresholds=self.thresholds,
            history=history,
            state=self.state,
            defer=config.defer_device_reads,
        )
        applier = StepApplier(
            state=self.state,
            history=history,
            cross_rank=self._cross_rank,
            vitals=vitals,
            judgment=self._judgment,
            log=self._log,
            guard=self._guard,
            profile=self._profile,
        )
        self._transfer = DeviceTransfer(applier, config.defer_device_reads)
        self._guard.attach(self._transfer.lock, self._transfer.apply)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = MonitorCollector(self.state, before_scrape=self._transfer.drain_at_scrape)
        self.registry.register(self._collector)
        self._cross_rank_collector = CrossRankCollector(self._cross_rank, self.state.run_id)
        self.registry.register(self._cross_rank_collector)
        self._steps = StepPath(self.state, self._log, self._meter, self._guard, self._transfer, self._cross_rank)
        self._experts = ExpertLoads(self.thresholds.moe.dead_window_steps, lambda: self.state.count_error("observe"))
        self.closed = False
        self._server: MetricsServer | None = None
        self._registration: Registration | None = None
        if serve:
            port = config.port + (ctx.local_rank if config.port and config.port_per_local_rank else 0)
            self._server = MetricsServer(
                self.registry,
                port,
                config.addr,
                web_config=config.load_web_config(),
                strict_port=config.strict_port,
                status=StatusSource(self.state, self._transfer.drain_at_scrape),
            )
            self._registration = register(
                config.file_sd_dir,
                addr=config.addr,
                port=self._server.port,
                rank=ctx.rank,
                job=config.run_name,
                on_error=_error_counter(self.state, "register"),
            )
            # A script that ends without close() (or a framework callback that only flushes)
            # still says "completed" at exit, unless an uncaught exception ends it.
            lifecycle.watch_uncaught_exceptions()
            atexit.register(self._close_at_exit)

    @property
    def port(self) -> int | None:
        """The port /metrics is served on (the real one when 0 was asked), or None."""
        return self._server.port if self._server else None

    @property
    def host_transfers(self) -> int:
        """Reads of a step's packed values on the host: at most one per observed step."""
        return self._transfer.host_transfers

    @property
    def blocking_waits(self) -> int:
        """Times ``observe()`` waited for a deferred device copy (too many in flight)."""
        return self._transfer.blocking_waits

    @property
    def history(self) -> History:
        """The run's windows, with every step applied so far in them (the usual ones are batched)."""
        with self._transfer.lock:
            self._history.flush()
        return self._history

    @property
    def findings(self) -> tuple[Finding, ...]:
        """The findings of the last diagnosis."""
        return self._judgment.findings

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
        metrics: Mapping[str, Any] | None = None,
        expert_load: Mapping[str, Any] | None = None,
    ) -> None:
        """Record one optimizer step. Call after ``backward()`` and before ``zero_grad()``.

        ``loss`` and ``grad_norm`` may be floats or 0-d tensors on any device; ``model`` adds
        per-layer gradient norms (and the global norm when ``grad_norm`` is not given);
        ``losses`` are the components of a multi-task loss. ``grad_scaler``: fp16 training's
        ``torch.amp.GradScaler`` (call ``scaler.unscale_(optimizer)`` first, as before
        clipping): its scale is exported, and a step whose gradients overflow, which the
        scaler skips, counts as an overflow instead of a non-finite gradient.

        ``loss=None`` (the default): this rank computes no loss this step, as the pipeline
        stages before the last. The step, its time, learning rates, tokens and gradient norms
        are recorded (``model=`` still joins the shard and pipeline all-reduces); the loss is
        not. Never pass a placeholder such as torchtitan's ``-1``: it would be judged as the loss.

        ``metrics``: the task's named values (``{"reward_std": s}`` for GRPO, ``{"rewards/margins": m}``
        for DPO): their names choose the profile (``training_profile_info``; ``MonitorConfig.profile``
        wins); known ones are judged and exported as ``training_signal{signal=...}``.

        ``expert_load``: a mixture-of-experts model's routing, ``{layer name: tokens per expert}`` (a
        1-d tensor or a sequence per MoE layer; :mod:`lossbeat.integrations.moe` fills it from a
        model's ``router_logits`` or from hooks on its routers). Reduced on the device to each
        layer's load imbalance and dead experts, read in the step's one host transfer, exported per
        layer (``training_moe_*``) and judged (the ``moe_router`` check, TrainingMoERouterCollapse).

        Wrong types raise ``TypeError``; NaN, Inf and other anomalies in the values are
        counted and exported, never raised. A loss (or component) tensor of several values is
        reduced to its mean and counted (``training_exporter_errors_total{where="input"}``); a
        component that is None is absent this step.
        """
        # validate
        if self.closed:
            raise RuntimeError("observe: this monitor is closed")
        if type(step) is not int:
            step = inputs.check_step(step)
        if (
            type(loss) is float
            and (grad_norm is None or type(grad_norm) is float)
            and (learning_rate is None or type(learning_rate) is float)
            and optimizer is None
            and model is None
            and tokens is None
            and losses is None
            and epoch is None
            and grad_scaler is None
            and metrics is None
            and expert_load is None
        ):
            self._steps.floats(step, loss, grad_norm, learning_rate)
            return
        inputs.refuse_graph_capture("observe")
        values, anomalies = inputs.step_values(
            loss=loss,
            optimizer=optimizer,
            learning_rate=learning_rate,
            grad_norm=grad_norm,
            tokens=tokens,
            losses=losses,
            grad_scaler=grad_scaler,
            metrics=metrics,
            model=model,
            seen=self._profile.names_seen,
        )
        if expert_load is not None:
            self._experts.add(step, expert_load, values)  # device work; read with the step's values
        if epoch is not None:
            epoch = inputs.check_epoch(epoch)
        if anomalies:
            _count_anomalies(self.state, self._log, anomalies)

        self._steps.submit(step, epoch, values, model)

    def step(self, optimizer: Any, *, grad_scaler: Any = None, scheduler: Any = None, closure: Any = None) -> Any:
        """Apply the observed step: ``optimizer.step()``, unless the guard keeps it from the optimizer.

        Call it in place of ``optimizer.step()``, after ``observe``; ``optimizer`` may be a list of
        them (several optimizers sharing a GradScaler must be stepped together). Every optimizer stepped
        before the next ``observe`` shares that step's decision (several optimizers are skipped or
        applied together). A step no ``observe`` decided is decided from its gradients (non-finite
        values) and counted (``training_guard_undecided_steps_total``). With ``grad_scaler`` it
        runs ``grad_scaler.step(optimizer)`` and ``grad_scaler.update()`` (call neither yourself; a
        disabled scaler is none); ``scheduler`` is stepped after it (``guard_schedule`` says what a
        skip does to it). ``closure``: run first, as ``optimizer.step(closure)`` would (it may call
        ``observe``); its result is returned. Raises :class:`~lossbeat.monitor.guard.TrainingHalted`
        on every rank when the guard stops the run; ValueError at the first step of an optimizer
        the guard cannot withhold (LBFGS).
        """
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for one in optimizers:
            if getattr(one, "param_groups", None) is None or not callable(getattr(one, "step", None)):
                raise TypeError(f"optimizer: expected a torch optimizer (or a list of them), got {type(one).__name__}")
        if not optimizers or (closure is not None and len(optimizers) > 1):
            raise ValueError("optimizer: expected one optimizer with a closure, or one or more without")
        if closure is not None and not callable(closure):
            raise TypeError(f"closure: expected a callable, got {type(closure).__name__}")
        return self._guard.step(optimizers, grad_scaler, scheduler, closure)

    def observe_eval(self, step: int, eval_loss: Any, *, metrics: Mapping[str, Any] | None = None) -> None:
        """Record an evaluation loss (feeds ``training_eval_loss`` and the overfitting check).

        ``metrics``: its metrics (``{"eval_accuracy": 0.91}``): their names choose the profile too.
        Also a sign of progress: it refreshes the heartbeat TrainingStalled watches."""
        _take_logged(self, inputs.check_step(step), inputs.scalar("eval_loss", eval_loss), metrics)

    def observe_metrics(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Record named values logged for a step already observed, adding no step: a trainer's
        log written after its step (the last one of a run has no next ``observe`` to go with).

        As ``observe(metrics=...)``: their names choose the profile, the known signals are judged
        and exported as ``training_signal{signal=...}``. Not for the hot path: the steps still
        waiting for their device values are processed first."""
        _take_logged(self, inputs.check_step(step), None, metrics)

    def phase(self, name: str) -> PhaseScope:
        """Say what the run is doing now: ``"train"``, ``"eval"`` or ``"checkpoint"``.

        Takes effect at once; as a context manager it restores the previous phase on exit
        (``with monitor.phase("checkpoint"): save(model)``). Exported as ``training_phase``
        and ``training_phase_seconds_total``: TrainingStalled allows
        ``alerts.stalled_phase_after`` outside training instead of ``stalled_after``.
        """
        if name not in PHASES:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {name!r}")
        previous = self.state.phase[0]
        self._set_phase(name)
        return PhaseScope(self, previous)

    def heartbeat(self) -> None:
        """Mark progress without a step (an evaluation batch, a checkpoint shard): TrainingStalled
        measures from the latest step, evaluation, phase change or heartbeat. Cheap: no sync."""
        self.state.mark_activity()

    def time_next_step_from(self, started: float | None) -> None:
        """Measure the next ``observe()``'s step duration from ``started`` (a ``time.perf_counter()``
        value) instead of the last ``observe()``; None: the next step has no duration. For a caller
        that replays steps timed elsewhere, as ``lossbeat watch`` does with a log's records."""
        self._steps.last_perf = started

    def hold_scrapes(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()`` is true a scrape renders none of this run's series: Prometheus sees a
        gap, never counters at a value they are about to leave (``lossbeat watch`` replaying a log)."""
        self._collector.ready = ready

    def _set_phase(self, name: str) -> None:
        if self.state.enter_phase(name, time.monotonic()):
            self._steps.last_perf = None  # the step that spans a phase change is no step time
        self.state.mark_activity()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients like ``torch.nn.utils.clip_grad_norm_`` and measure them in the same pass.

        Returns the total norm before clipping (a 0-d tensor, no host sync).
        The per-layer norms it computed are reused by the next ``observe(model=model)``.
        """
        inputs.check_model(model)
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
            raise ValueError(f"max_norm: expected a positive number, got {max_norm!r}")
        inputs.refuse_graph_capture("clip_grad_norm_")
        return self._meter.clip(model, float(max_norm))

    def measure_gradients(
        self, model: torch.nn.Module, *, grad_scaler: Any = None, step: int | None = None
    ) -> torch.Tensor | None:
        """Measure ``model``'s gradients now; the next ``observe(model=model)`` reports these norms.

        For a loop or framework that changes the gradients between backward and ``observe``
        (a Trainer that clips before its callback): the norms are the unclipped ones, and ``observe``
        does not read the gradients again. Returns the global norm (a 0-d tensor, no host sync), or
        None when no parameter has a gradient or the measurement failed (``where="gradients"`` errors).
        ``grad_scaler``: fp16's GradScaler when the gradients still carry its scale: the norms are
        divided by it on the device. ``step``: ``observe(step)`` reports them, even after
        later steps' (metrics passed on in bursts), and never reads that model's gradients again.
        """
        inputs.check_model(model)
        inputs.refuse_graph_capture("measure_gradients")
        return self._meter.measure_ahead(
            model, inputs.loss_scale(grad_scaler), None if step is None else inputs.check_step(step)
        )

    def flush(self) -> None:
        """Process every step still waiting for its device values (waits for them). Raises
        :class:`~lossbeat.monitor.guard.TrainingHalted` when the guard stopped the run at a step
        among the last ones, whose halt was not raised yet."""
        self._transfer.drain(block=True)
        self._raise_pending_halt()

    def _raise_pending_halt(self) -> None:
        halt = self._guard.pending_halt()
        if halt is not None:
            self.state.halt()
            raise halt

    def report(self) -> Report:
        """Run the diagnosis now and return the end-of-run report."""
        self.flush()
        return self._judgment.report()

    def close(self, *, completed: bool = True) -> None:
        """End the run: process pending values, publish the completion marker
        (``training_run_completed``), keep /metrics up one scrape interval so Prometheus
        reads it and the last values (bounded by ``linger_seconds``), stop serving. Idempotent.

        ``completed=False`` (what leaving a ``with`` block on an exception does): the run
        failed; no marker and no wait, so its exporter vanishing pages TrainingExporterDown.
        """
        if self.closed:
            return
        if self._server is not None:
            atexit.unregister(self._close_at_exit)
        try:
            self._guard.settle()
            self._transfer.drain(block=True)
        except Exception:
            self.state.count_error("observe")
        halt = self._guard.pending_halt()  # a stop among the last steps: the run did not complete
        self.closed = True
        if halt is not None:
            self.state.halt()
        self.state.finish(completed=completed)
        if completed or self.state.halted:  # a halted run lingers too: Prometheus reads training_halted
            if self._server is not None:  # until each scraper has read it
                lifecycle.linger(self._server.scrapers, time.monotonic(), self.config.linger_seconds)
        _stop_serving(self)
        lifecycle.process.forget(self)
        if halt is not None and completed:  # the stop the user asked for, not raised by a step yet
            raise halt

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # SystemExit(0) leaving the block is a normal end; SystemExit(1) or an exception is not.
        self.close(
            completed=exc_type is None or (isinstance(exc, SystemExit) and not lifecycle.failure_status(exc.code))
        )

    def _close_at_exit(self) -> None:
        try:
            self.close(completed=not lifecycle.process.uncaught_exception_seen)
        except Exception:  # the interpreter is going away: never fail its exit
            logging.getLogger("lossbeat").debug("lossbeat: close at exit failed", exc_info=True)


def _take_logged(monitor: Monitor, step: int, value: Any, metrics: Mapping[str, Any] | None) -> None:
    """Values logged apart from a step: an evaluation's (``value``: its loss) or a log's written after its
    step (``value`` None). The steps still waiting for their device values go first; then the values
    are judged at ``step``. An error is counted and logged, never raised."""
    signals, new_fields = inputs.signals(metrics, monitor._profile.names_seen)
    monitor.state.mark_activity()
    try:
        if value is not None:
            if type(value) is not float:  # a tensor
                value = float(value.item())  # host sync: evaluation is not the per-step hot path
            monitor.state.record_eval(value)
        monitor._transfer.drain(block=True)  # the steps before these values first (host sync: not the hot path)
        with monitor._transfer.lock:
            monitor._profile.evaluation(step, signals, new_fields)
        if value is not None:
            monitor._history.add_eval(value, step=step)
        monitor._judgment.diagnose(step)  # judged after each evaluation, as `lossbeat analyze` does
    except Exception:
        monitor.state.count_error("observe")
        where = "observe_eval" if value is not None else "observe_metrics"
        monitor._log("error", logging.ERROR, "lossbeat: error in %s()", where, exc_info=True)


def _gradient_error(state: MonitorState, log: RateLimitedLog, where: str, error: Exception) -> None:
    state.count_error("gradients")
    if isinstance(error, (ShardedMeasurementError, ShardHandshakeError)):  # usage or store: say it, no traceback
        log(type(error).__name__, logging.ERROR, "lossbeat: %s(): %s", where, error)
    else:
        log(
            "gradients",
            logging.ERROR,
            "lossbeat: error measuring gradients in %s(); their norms are skipped, the step and training go on",
            where,
            exc_info=True,
        )


def _count_anomalies(state: MonitorState, log: RateLimitedLog, anomalies: list[str]) -> None:
    """Per-step data that was not one value (observed as its mean): counted and logged, never raised."""
    for name in anomalies:
        state.count_error("input")
        log(
            "input",
            logging.WARNING,
            "lossbeat: %s: expected one value, got a tensor of several "
            "(pass e.g. loss.mean()); observed as its mean (an empty one: skipped)",
            name,
        )


def _error_counter(state: MonitorState, where: str) -> Callable[[], None]:
    """A callback that counts one error at ``where`` (its count, which the callers have no use for, dropped)."""

    def count() -> None:
        state.count_error(where)

    return count


def _stop_serving(monitor: Monitor) -> None:
    """After the linger, before the port closes: the file_sd entry goes first, so Prometheus drops
    the target having read the completion marker (no up=0; a crash leaves the entry for the prune,
    and the vanished series page); then the server, the cross-rank hooks and the collectors."""
    if monitor._registration is not None:
        monitor._registration.remove()
    if monitor._server is not None:
        monitor._server.close()
    monitor._cross_rank.close()
    for collector in (monitor._collector, monitor._cross_rank_collector):
        with contextlib.suppress(KeyError):
            monitor.registry.unregister(collector)
