"""``LossbeatCallback`` for the OLMo-core ``Trainer`` (extra ``olmo``)."""

from __future__ import annotations

import copy
import re
from typing import Any, ClassVar

import torch
from olmo_core.distributed.utils import get_local_rank, get_rank, get_world_size
from olmo_core.train.callbacks import Callback, EvaluatorCallback
from olmo_core.train.common import OPTIM_GRAD_NORM_METRIC, TRAIN_CE_LOSS_METRIC

from lossbeat.exposition.server import RankContext
from lossbeat.integrations._common import RankMonitorCallback, flush_quietly, phase_quietly
from lossbeat.integrations._guard import refuse_guard
from lossbeat.monitor import Monitor, NullMonitor

__all__ = ["LossbeatCallback"]

# The trainer's own stop on a non-finite loss (Trainer._check_and_pass_on_metrics), raised
# before any callback's log_metrics sees that step: on_error is where the NaN is seen.
_NONFINITE_STOP = re.compile(r"^(nan|inf|-inf) loss encountered at step (\d+)$")
_LR_KEY = re.compile(r"^optim/LR \(group (\d+)\)$")
_TOKENS_KEY = "throughput/total tokens"


class LossbeatCallback(RankMonitorCallback, Callback):
    r"""Feed an OLMo-core ``Trainer`` run to a lossbeat :class:`~lossbeat.monitor.Monitor`.

    It exports the metrics the trainer already gathers, read where the trainer has already
    moved them to the host and reduced them across ranks (``log_metrics``), and the per-layer
    gradient norms, measured by lossbeat on the device before the optimizer step: no
    host-device sync is added to the step.

    Hooks and the fields they feed:

    - ``pre_train`` (each rank's process, after ``prepare_training_environment``): the
      monitor, unless one was given: the process's exporter
      (:func:`~lossbeat.monitor.start_exporter` with ``settings``) labelled with OLMo-core's
      global rank, local rank and world size, serving on ``port + local rank``.
    - ``pre_step``: ``phase("train")``: a heartbeat every step (no sync), so TrainingStalled
      sees a live run between metric collections.
    - ``pre_optim_step`` (after backward, before the train module clips and steps):
      ``monitor.measure_gradients(model, step=step)``: the global and per-layer norms of the
      unclipped gradients (per-layer every ``layer_every`` steps), lossbeat's one fused reduction
      left on the device (for a sharded model, its all-reduce over the shards, on every rank).
      That step's ``observe`` reports them: their host read is the packed transfer of the
      step's values, once the trainer's own transfer of its metrics has waited for the device.
    - ``post_step`` (priority 10: before the ``EvaluatorCallback``, priority 0, runs its
      evaluations in its own ``post_step``): ``phase("eval")`` when an evaluator is due.
    - ``log_metrics(step, metrics)``: ``observe(step, loss=metrics["train/CE loss"],
      grad_norm=metrics["optim/total grad norm"], learning_rate=metrics["optim/LR (group 0)"],
      tokens=...)``: the loss is the mean over the data-parallel ranks, the gradient norm the
      total one before clipping (recorded only with ``max_grad_norm``; else lossbeat's, measured
      in ``pre_optim_step``); the per-layer norms of that step; without a scheduler's
      ``LR`` metric the learning rates come from the optimizer's param groups (read then:
      with ``metrics_collect_interval`` > 1, those of the step being trained);
      ``tokens`` is the growth of ``throughput/total tokens`` (``SpeedMonitorCallback``).
      Evaluator metrics: ``observe_eval(step, metrics[eval_key])``, then back to ``"train"``.
    - ``on_error``: the trainer stops on a NaN or infinite CE loss before any callback's
      ``log_metrics`` sees that step; the callback observes that loss from the error, so the
      NaN is counted (``training_nonfinite_loss_total``) and the run judged before it ends.
    - ``post_train``: flushes. ``close`` (always, even on an error): closes the monitor it
      started, as completed unless the fit failed; a monitor given to it is only flushed.

    Note:
        The trainer passes on its metrics every ``metrics_collect_interval`` steps (5 by
        default), all the steps since at once: the steps arrive in bursts, so the monitor's
        step times are those of the bursts (``training_step_duration_seconds``); the steps/s
        rate over a minute and the throughput judgment over blocks of steps are unaffected.
        The gradients are those of this rank's model as the train module holds them at
        ``pre_optim_step`` (data-parallel: all-reduced; FSDP: sharded, the shards' norms summed
        over their ranks, ``reduce_shards``).
        With ``async_bookkeeping`` (the default on a CPU-capable backend) ``log_metrics`` runs
        in the trainer's bookkeeping thread: that one thread is the only one that observes.

    Args:
        monitor: the monitor to feed, built in the process that trains; default: each rank's
            exporter, started in ``pre_train`` (/metrics on port 8470 + local rank).
        eval_key: the metric that is the eval loss. Default: the first
            ``eval/<evaluator>/CE loss`` in sorted order.
        **settings: :func:`~lossbeat.monitor.start_exporter` arguments (``port``, ``addr``,
            ``run_name``, any :class:`~lossbeat.monitor.MonitorConfig` field); checked here.

    Example::

        >>> from lossbeat.integrations.olmo_core import LossbeatCallback
        >>> trainer_config = trainer_config.with_callback("lossbeat", LossbeatCallback(run_name="olmo-7b"))
    """

    priority: ClassVar[int] = 10

    def __init__(
        self, monitor: Monitor | NullMonitor | None = None, *, eval_key: str | None = None, **settings: Any
    ) -> None:
        self._keep_monitor(monitor, settings)
        refuse_guard(monitor, settings, "OLMo-core", "OLMo-core's own SkipStepAdamW/SkipStepLion skip spikes")
        self.eval_key = eval_key
        self._observed_at = 0  # the last step observed (the trainer passes on step 0's and repeats)
        self._tokens_seen: float | None = None
        self._failed = False

    def __deepcopy__(self, memo: dict[int, Any]) -> LossbeatCallback:
        # TrainerConfig.with_callback() deep-copies its callbacks: the copy feeds the same
        # monitor (a process's exporter, never copied) and has its own settings.
        copied = copy.copy(self)
        copied._settings = copy.deepcopy(self._settings, memo)
        return copied

    def pre_train(self) -> None:
        if self._monitor is None or self._given is not None:
            ranks = RankContext(get_rank(), get_local_rank(), get_world_size(), "trainer")
            self._start_monitor(ranks)
        phase_quietly(self._monitor, "train")

    def pre_step(self, batch: dict[str, Any]) -> None:
        phase_quietly(self._monitor, "train")

    def pre_optim_step(self) -> None:
        # The training thread, every rank at the same step (a sharded model's all-reduce): the
        # norms stay on the device until log_metrics observes this step (no host read here).
        monitor, model = self._monitor, getattr(self._trainer_module(), "model", None)
        if monitor is not None and isinstance(model, torch.nn.Module):
            monitor.measure_gradients(model, step=self.step)  # errors are counted, never raised

    def post_step(self) -> None:
        for callback in self.trainer.callbacks.values():
            if isinstance(callback, EvaluatorCallback) and _eval_due(callback, self.step):
                phase_quietly(self._monitor, "eval")
                return

    def post_checkpoint_saved(self, path: Any) -> None:
        phase_quietly(self._monitor, "train")  # a heartbeat after a (possibly long) save

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        # The values here are plain floats: the trainer moved them to the host and reduced them
        # across ranks before this hook (Trainer._log_metrics), so reading them costs no sync.
        monitor = self._monitor
        if monitor is None:
            return
        loss = metrics.get(TRAIN_CE_LOSS_METRIC)
        if loss is not None and step > self._observed_at:
            self._observe(monitor, step, float(loss), metrics)
        found = self._eval_loss(metrics)
        if found is not None:
            monitor.observe_eval(step, found)
            phase_quietly(monitor, "train")

    def on_error(self, exc: BaseException) -> None:
        self._failed = True
        match = _NONFINITE_STOP.match(str(exc)) if isinstance(exc, RuntimeError) else None
        monitor = self._monitor
        if match is not None and monitor is not None and int(match.group(2)) > self._observed_at:
            self._observe(monitor, int(match.group(2)), float(match.group(1)), {})

    def post_train(self) -> None:
        flush_quietly(self._monitor)

    def close(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        if self._given is not None:
            flush_quietly(monitor)
        else:
            monitor.close(completed=not self._failed)  # errors are counted, never raised

    def _observe(self, monitor: Monitor | NullMonitor, step: int, loss: float, metrics: dict[str, float]) -> None:
        lrs = sorted((int(m.group(1)), v) for k, v in metrics.items() if (m := _LR_KEY.match(k)))
        optimizer = None if lrs else getattr(self._trainer_module(), "optim", None)
        tokens = None
        total = metrics.get(_TOKENS_KEY)
        if total is not None:
            if self._tokens_seen is not None and total >= self._tokens_seen:
                tokens = total - self._tokens_seen
            self._tokens_seen = total
        grad_norm = metrics.get(OPTIM_GRAD_NORM_METRIC)
        monitor.observe(
            step,
            loss=loss,
            grad_norm=grad_norm,
            learning_rate=lrs[0][1] if lrs else None,
            optimizer=optimizer if getattr(optimizer, "param_groups", None) is not None else None,
            tokens=tokens,
            epoch=float(self.trainer.epoch) if self._trainer is not None else None,
        )
        self._observed_at = step

    def _trainer_module(self) -> Any:
        return getattr(self._trainer, "train_module", None)

    def _eval_loss(self, metrics: dict[str, float]) -> float | None:
        if self.eval_key is not None:
            value = metrics.get(self.eval_key)
        else:
            keys = sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/CE loss"))
            value = metrics[keys[0]] if keys else None
        return float(value) if value is not None and not isinstance(value, bool) else None


def _eval_due(callback: Any, step: int) -> bool:
    """Whether ``callback`` (an ``EvaluatorCallback``) evaluates in this step's ``post_step``:
    its own condition."""
    if step <= 1:
        return False
    interval, fixed = getattr(callback, "eval_interval", None), getattr(callback, "fixed_steps", None)
    return bool((interval and step % interval == 0) or (fixed and step in fixed))
