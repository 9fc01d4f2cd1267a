"""torchtitan's metrics processor feeding lossbeat (extra ``torchtitan``; not yet released: see docs/torchtitan.md)."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor

from lossbeat.exposition.server import RankContext
from lossbeat.integrations._common import check_monitor, flush_quietly, phase_quietly, rank_monitor
from lossbeat.integrations._guard import refuse_guard
from lossbeat.monitor import Monitor, NullMonitor

__all__ = ["LossbeatLogger", "LossbeatMetricsProcessor"]

LOSS_KEY = "loss_metrics/global_avg_loss"
GRAD_NORM_KEY = "grad_norm"
TOKENS_KEY = "n_tokens_seen"
EVAL_LOSS_KEY = "validation_metrics/loss"
# The trainer's own stop on a non-finite loss (Trainer.train_step), raised before it logs the step.
_NONFINITE_STOP = re.compile(r"^Loss is not finite \(global_avg_loss=(\S+)\) at step (\d+)\.")


class LossbeatLogger(BaseLogger):
    r"""A torchtitan metric-logger backend (``BaseLogger``) that feeds a lossbeat monitor.

    torchtitan's ``MetricsProcessor.log`` hands every backend the dict it logs at each log
    step (``metrics.log_freq``): plain floats it has already moved to the host (the loss's
    ``.item()``, the all-reduced loss, ``grad_norm.item()``), so feeding lossbeat from them
    adds no host sync. ``log(metrics, step)`` observes ``step`` with
    ``loss_metrics/global_avg_loss`` (the mean over the data-parallel ranks; a negative
    value, torchtitan's ``-1`` placeholder of a pipeline stage without the loss, is no loss),
    ``grad_norm`` (the total norm before clipping, as ``clip_grad_norm_`` returns it), the
    ``lr/<optimizer>[/<group>]`` learning rates (the first is exported) and, as tokens, the
    growth of ``n_tokens_seen``; ``validation_metrics/loss`` is ``observe_eval``.

    ``close()`` (the trainer's ``close``, which torchtitan's ``train.py`` calls also when
    training raised): the trainer stops on a NaN or infinite loss before logging it; when that
    error is the one being handled, its step is observed with that loss first, so the NaN is
    counted (``training_nonfinite_loss_total``). Then the monitor: closed if this logger
    started it (completed unless an error is being handled), else flushed.

    Args:
        monitor: the monitor to feed; default: the process's exporter
            (:func:`~lossbeat.monitor.start_exporter` with ``settings``), started at once.
        **settings: :func:`~lossbeat.monitor.start_exporter` arguments.
    """

    def __init__(self, monitor: Monitor | NullMonitor | None = None, **settings: Any) -> None:
        check_monitor(monitor, settings)
        refuse_guard(monitor, settings, "torchtitan", "the monitor still pages on NaNs and explosions")
        self._owned = monitor is None
        self.monitor = rank_monitor(monitor, os.getpid(), settings, RankContext.detect())
        self._observed_at = 0
        self._tokens_seen: float | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        loss = metrics.get(LOSS_KEY)
        if loss is not None and step > self._observed_at:
            self._observe(step, float(loss), metrics)
        eval_loss = metrics.get(EVAL_LOSS_KEY)
        if eval_loss is not None:
            self.monitor.observe_eval(step, float(eval_loss))
            phase_quietly(self.monitor, "train")

    def close(self) -> None:
        exc = sys.exc_info()[1]
        match = _NONFINITE_STOP.match(str(exc)) if isinstance(exc, RuntimeError) else None
        if match is not None and int(match.group(2)) > self._observed_at:
            self._observe(int(match.group(2)), float(match.group(1)), {})
        if self._owned and isinstance(self.monitor, Monitor):
            self.monitor.close(completed=exc is None)
        else:
            flush_quietly(self.monitor)

    def _observe(self, step: int, loss: float, metrics: dict[str, Any]) -> None:
        lrs = [v for k, v in metrics.items() if isinstance(k, str) and k.startswith("lr/")]
        tokens = None
        total = metrics.get(TOKENS_KEY)
        if total is not None:
            total = float(total)
            if self._tokens_seen is not None and total >= self._tokens_seen:
                tokens = total - self._tokens_seen
            self._tokens_seen = total
        self.monitor.observe(
            step,
            loss=loss if loss >= 0 or loss != loss else None,
            grad_norm=metrics.get(GRAD_NORM_KEY),
            learning_rate=lrs[0] if lrs else None,
            tokens=tokens,
        )
        self._observed_at = step


class LossbeatMetricsProcessor(MetricsProcessor):
    r"""torchtitan's ``MetricsProcessor`` with a :class:`LossbeatLogger` among its backends.

    Select it in the job's config: ``metrics=LossbeatMetricsProcessor.Config(log_freq=10,
    lossbeat_port=8470)``. Built on every rank (the trainer builds its metrics processor
    after starting the process group), each serving /metrics on ``lossbeat_port + local rank``;
    torchtitan's TensorBoard and W&B backends keep their own rank selection.
    ``should_log(step)``, which the trainer asks at the start of every step, is also the
    heartbeat (``phase("train")``, no sync): TrainingStalled sees a live run between log steps.
    """

    logger: BaseLogger  # set by MetricsProcessor (torchtitan ships no types)

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        lossbeat_enabled: bool = True
        """Whether to start the lossbeat exporter."""

        lossbeat_port: int = 8470
        """Base port of lossbeat's /metrics (plus the local rank)."""

        lossbeat_run_name: str = ""
        """lossbeat's run label (empty: its default)."""

        lossbeat_settings: dict[str, Any] = field(default_factory=dict)
        """Further :class:`~lossbeat.monitor.MonitorConfig` fields."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        settings: dict[str, Any] = {
            "port": config.lossbeat_port,
            "enabled": config.lossbeat_enabled,
            **config.lossbeat_settings,
        }
        if config.lossbeat_run_name:
            settings["run_name"] = config.lossbeat_run_name
        self.lossbeat = LossbeatLogger(**settings)
        if not isinstance(self.logger, LoggerContainer):  # a bare BaseLogger: no backend on this rank
            self.logger = LoggerContainer()
        self.logger.add_logger(self.lossbeat)

    def should_log(self, step: int) -> bool:
        phase_quietly(self.lossbeat.monitor, "train")
        return super().should_log(step)
