"""``LossbeatCallback`` for ``lightning.Trainer`` (extra ``lightning``)."""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lossbeat.exposition.server import RankContext
from lossbeat.integrations._common import (
    CountsObservedSteps,
    RankMonitorCallback,
    eval_loss_from,
    flush_quietly,
    phase_quietly,
    task_metrics,
)
from lossbeat.integrations._guard import Patch, guard_mode, settings_guard
from lossbeat.monitor import Monitor, NullMonitor

__all__ = ["LossbeatCallback"]


class LossbeatCallback(RankMonitorCallback, CountsObservedSteps, Callback):
    r"""Feed a Lightning run to a lossbeat :class:`~lossbeat.monitor.Monitor`, one observation per optimizer step.

    Hooks and the fields they feed:

    - ``setup`` (stage ``fit``, in each rank's process, after the process group
      starts): the monitor. Without ``monitor``, the process's exporter
      (:func:`~lossbeat.monitor.start_exporter` with ``settings``), labelled
      with ``trainer.global_rank``, ``local_rank`` and ``world_size`` and
      serving on ``port + local_rank``: under ``ddp_spawn``, ``ddp_fork`` and
      ``ddp_notebook`` the ranks run in children of the launching process, and
      each starts its own.
    - ``on_before_backward``: keeps the loss of each micro-batch (Lightning has
      already divided it by ``accumulate_grad_batches``, so the kept values add
      up to the step's mean loss); a running sum on the device, reset every
      optimizer step.
    - ``on_before_optimizer_step``: ``Monitor.observe(step, loss, model, optimizer, epoch)``.
      Gradients are accumulated, unscaled (AMP) and not yet clipped here, so the
      global and per-layer norms come from the monitor's fused reduction over
      the real gradients. ``step`` is ``trainer.global_step + 1`` (steps
      completed once this one is), ``loss`` the summed micro-batch losses,
      the learning rates from ``optimizer.param_groups``, ``epoch`` is
      ``trainer.current_epoch``; ``metrics``: the task's values the step logged
      (``self.log("reward", ...)``, ``self.log("train_acc", ...)``: ``trainer.callback_metrics``, its
      known signals' values each step and every other name once, for the live profile detection
      and the RL, preference and classification judgments; no host read).
    - ``on_train_batch_end``: fallback for an optimizer step that came without a
      loss in ``on_before_backward``: ``outputs["loss"]`` (or ``outputs`` when it
      is a tensor), observed without gradients.
    - ``on_validation_epoch_end``: ``Monitor.observe_eval(trainer.global_step,
      trainer.callback_metrics[eval_key], metrics=...)`` with the other ``val_``/``test_`` values
      (``val_acc``, ``val_f1``, ``val_wer``: their names choose the profile); skipped during the
      sanity check.
    - The phases TrainingStalled reads: ``on_validation_start`` sets ``phase("eval")``, each
      validation batch heartbeats in it, ``on_validation_end`` goes back to ``"train"``;
      ``trainer.test()`` and ``trainer.predict()`` do the same with their own hooks;
      ``on_save_checkpoint`` sets ``phase("checkpoint")`` until the next training batch
      starts; ``on_train_end`` sets ``"checkpoint"`` for the work after ``fit`` (the final save,
      an upload), and an evaluation outside ``fit`` returns to it. A long validation, save or
      wrap-up pages only past ``alerts.stalled_phase_after``.
    - ``guard="skip"``/``"stop"`` (docs/guard.md): from ``on_train_start`` each optimizer has
      its own ``step`` on the instance. Lightning calls ``optimizer.step(closure)``; the guarded
      step runs the closure (training step, backward, ``on_before_optimizer_step``, where the
      step is observed and decided, clipping), then applies the step through ``Monitor.step``:
      a bad step leaves parameters and optimizer state as they were. With ``"16-mixed"``
      precision (a GradScaler) the scaler's ``step``/``update`` are guarded instead, so the skip
      joins the scaler's own and its scale is put back. ``TrainingHalted`` leaves
      ``trainer.fit()``. Lightning steps the LR schedulers itself: a skipped step takes its slot
      (``guard_schedule="advance"``; ``"hold"`` is refused). Taken off at train end or on an exception.
    - ``on_train_end``: flushes the monitor (an error there is counted, never raised) and sets
      ``phase("checkpoint")``.

    Args:
        monitor: the monitor to feed, built in the process that trains (not with
            ``ddp_spawn``/``ddp_fork``/``ddp_notebook``: pass settings instead); default:
            each rank's exporter, started in ``setup`` (/metrics on port 8470 + local rank).
        eval_key: the logged metric that is the validation loss. Default
            ``val_loss``, else the first ``val_<name>_loss`` in sorted order.
        **settings: :func:`~lossbeat.monitor.start_exporter` arguments (``port``,
            ``addr``, ``run_name``, any :class:`~lossbeat.monitor.MonitorConfig`
            field) for the exporter each rank starts; checked here. ``guard="skip"`` or
            ``"stop"`` guards the optimizer step (with ``monitor=``, its config's guard).

    Raises:
        TypeError: if ``monitor`` is not a lossbeat monitor, is given with settings,
            or a setting is unknown; ValueError for a bad setting value, or
            ``guard_schedule="hold"`` with a guard; in ``on_train_start``, a guard on LBFGS
            (its step re-evaluates the closure).
        RuntimeError: in ``setup``, if ``monitor`` was built in another process
            than the rank's (a spawned or forked rank).

    Note:
        With several optimizers (manual optimization) each ``optimizer.step()``
        is an observation; the monitor's step counter is Lightning's ``global_step``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lossbeat.integrations.lightning import LossbeatCallback
        >>> trainer = Trainer(callbacks=[LossbeatCallback()])
    """

    def __init__(
        self, monitor: Monitor | NullMonitor | None = None, *, eval_key: str | None = None, **settings: Any
    ) -> None:
        self._keep_monitor(monitor, settings)
        _check_schedule(*settings_guard(monitor, settings))
        self.eval_key = eval_key
        self._loss_sum: torch.Tensor | None = None
        self._observed_at: int | None = None  # trainer.global_step at the last observation
        self._patches: list[Patch] = []  # the guarded steps (guard="skip"/"stop"), for the fit
        self._decided: Any = None  # the optimizer whose step on_before_optimizer_step observed
        self._updated = False  # the guard ran the scaler's update: Lightning's own call is skipped
        self._fitting = False  # between on_train_start and on_train_end: evaluations return to "train"
        self._names_passed: set[str] = set()  # logged names given to the monitor (each once; signals always)
        self._resumed: Any = None  # the run memory of the checkpoint a fit resumed from, until applied

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the trainer to its ranks: they start their own exporters in setup().
        state = self.__dict__.copy()
        if isinstance(self._given, Monitor):
            raise TypeError(
                "LossbeatCallback(monitor=...) cannot go to spawned ranks (ddp_spawn, ddp_notebook): "
                "pass exporter settings instead (LossbeatCallback(port=..., run_name=...)), each rank starts its own"
            )
        state["_monitor"] = self._given
        state["_patches"], state["_decided"] = [], None
        return state

    def state_dict(self) -> dict[str, Any]:
        """Saved in each checkpoint: the run memory (first loss, best levels with their steps, the open
        event; a few numbers), so that a fit resumed from it is judged against the run's best."""
        memory = getattr(getattr(self._monitor, "history", None), "memory", None)
        return {"run_memory": memory.state()} if memory is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed fit's checkpoint: its run memory, applied now or once the rank's monitor exists."""
        self._resumed = state_dict.get("run_memory") if isinstance(state_dict, dict) else None
        self._apply_resumed()

    def _apply_resumed(self) -> None:
        memory = getattr(getattr(self._monitor, "history", None), "memory", None)
        if memory is not None and isinstance(self._resumed, dict):
            memory.load(self._resumed)
            self._resumed = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        ranks = RankContext(trainer.global_rank, trainer.local_rank, trainer.world_size, "trainer")
        self._start_monitor(ranks)
        self._names_passed = set()

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # A copy (one small kernel, no host sync): a view would follow any later in-place change
            # of the loss tensor (the HF Trainer scales its loss in place after backward).
            value = loss.detach().to(torch.float32, copy=True).reshape(())
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._loss_sum is None:
            return
        step = trainer.global_step + 1
        # "16-mixed" precision's GradScaler (None otherwise): an overflow it skips is no fault.
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        monitor = self._monitor
        assert monitor is not None  # set up by setup("fit"), before any batch
        monitor.observe(
            step,
            loss=self._loss_sum,
            model=pl_module,
            optimizer=optimizer,
            epoch=float(trainer.current_epoch),
            grad_scaler=scaler,
            metrics=task_metrics(trainer.callback_metrics, self._names_passed),
        )
        self._decided = optimizer if self._patches else None
        self._loss_sum = None
        self._observed_at = step
        self._observed_steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step  # already counts the step this batch completed, if any
        if step == 0 or step == self._observed_at:
            return  # accumulating, or observed with gradients
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            monitor = self._monitor
            assert monitor is not None  # set up by setup("fit"), before any batch
            monitor.observe(
                step,
                loss=loss,
                optimizer=trainer.optimizers[0] if trainer.optimizers else None,
                epoch=float(trainer.current_epoch),
                metrics=task_metrics(trainer.callback_metrics, self._names_passed),
            )
            self._observed_at = step
        self._loss_sum = None

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        monitor = self._monitor
        if trainer.sanity_checking or monitor is None:  # None: trainer.validate() outside a fit
            return
        logged = trainer.callback_metrics
        found = eval_loss_from(logged, self.eval_key, prefix="val_")
        if found is not None:
            monitor.observe_eval(
                trainer.global_step,
                found[1],
                metrics=task_metrics(logged, self._names_passed, evaluation=True, skip=found[0]),
            )

    def on_validation_start(self, trainer, pl_module) -> None:
        phase_quietly(self._monitor, "eval")  # None: trainer.validate() outside a fit

    def on_validation_batch_end(
        self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        phase_quietly(self._monitor, "eval")  # a heartbeat each batch

    def on_validation_end(self, trainer, pl_module) -> None:
        phase_quietly(self._monitor, self._after_evaluation())

    def on_test_start(self, trainer, pl_module) -> None:
        phase_quietly(self._monitor, "eval")

    def on_test_batch_end(
        self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        phase_quietly(self._monitor, "eval")  # a heartbeat each batch

    def on_test_end(self, trainer, pl_module) -> None:
        phase_quietly(self._monitor, self._after_evaluation())

    def on_predict_start(self, trainer, pl_module) -> None:
        phase_quietly(self._monitor, "eval")

    def on_predict_batch_end(
        self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        phase_quietly(self._monitor, "eval")  # a heartbeat each batch

    def on_predict_end(self, trainer, pl_module) -> None:
        phase_quietly(self._monitor, self._after_evaluation())

    def _after_evaluation(self) -> str:
        """The phase an evaluation returns to: training, or the wrap-up after ``fit``."""
        return "train" if self._fitting else "checkpoint"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        phase_quietly(self._monitor, "checkpoint")  # the checkpoint is written after this hook

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        monitor = self._monitor
        state = getattr(monitor, "state", None)  # None for a NullMonitor, or before setup
        if state is not None and state.phase[0] != "train":
            phase_quietly(monitor, "train")  # after a checkpoint (no hook follows the write)

    def on_train_start(self, trainer, pl_module) -> None:
        self._fitting = True
        self._apply_resumed()
        _restore_resumed(self._monitor, trainer)
        phase_quietly(self._monitor, "train")  # after the sanity check's validation
        self._unguard()
        monitor = self._monitor
        if guard_mode(monitor) == "off":
            return
        assert monitor is not None and not isinstance(monitor, NullMonitor)  # guard_mode() found its config
        _check_schedule("on", monitor.config.guard_schedule)
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None:  # "16-mixed": Lightning runs scaler.step(optimizer) and scaler.update()
            self._patches = [
                Patch(scaler, "step", self._guarded_scaler_step),
                Patch(scaler, "update", self._guarded_scaler_update),
            ]
            return
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError(
                    "guard: LBFGS re-evaluates the loss inside its step and cannot be guarded; use guard='off'"
                )
        self._patches = [Patch(optimizer, "step", self._guarded_step(optimizer)) for optimizer in trainer.optimizers]

    def on_train_end(self, trainer, pl_module) -> None:
        self._unguard()
        self._loss_sum = None
        self._fitting = False
        # What follows fit (the final checkpoint, an upload) takes no steps: not a stall for 10m.
        phase_quietly(self._monitor, "checkpoint")
        flush_quietly(self._monitor)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._unguard()  # TrainingHalted, or any error: the optimizers are the user's again

    # --- the guard ---------------------------------------------------------------

    def _guarded_step(self, optimizer: torch.optim.Optimizer) -> Any:
        def step(closure: Any = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:  # what a torch optimizer does first: the closure runs backward,
                with torch.enable_grad():  # then on_before_optimizer_step decides, then Lightning clips
                    loss = closure()
            patch = next(p for p in self._patches if p.obj is optimizer)
            if kwargs:  # arguments the guard does not know: the optimizer's own step
                patch.original(**kwargs)
                return loss
            self._decided = None  # a step nothing decided on is decided from its gradients by Monitor.step
            monitor = self._monitor
            assert monitor is not None  # the guard is patched in by on_train_start, after setup
            with patch.unpatched():
                monitor.step(optimizer)
            return loss

        return step

    def _guarded_scaler_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        step, update = self._patches
        if args or kwargs:  # arguments the guard does not know: the scaler's own step
            return step.original(optimizer, *args, **kwargs)
        self._decided = None
        monitor = self._monitor
        assert monitor is not None  # the guard is patched in by on_train_start, after setup
        with step.unpatched(), update.unpatched():
            monitor.step(optimizer, grad_scaler=step.obj)  # runs scaler.step and scaler.update
        self._updated = True
        return None

    def _guarded_scaler_update(self, new_scale: Any = None) -> None:
        if self._updated and new_scale is None:
            self._updated = False  # the guard updated the scaler already
            return
        self._patches[1].original(new_scale)

    def _unguard(self) -> None:
        for patch in reversed(self._patches):
            patch.restore()
        self._patches, self._decided, self._updated = [], None, False


_EVAL_LOSS = re.compile(r"^(?:val|valid|validation|eval)[_/]?loss(?:_epoch)?$")
_STEP_IN_PATH = re.compile(r"step=(\d+)")


def _restore_resumed(monitor: Monitor | NullMonitor | None, trainer: Any) -> None:
    """A fit resumed from a checkpoint (``global_step`` > 0) whose earlier fit ran without this callback
    (no run memory in the checkpoint): a ModelCheckpoint that monitors the eval loss restores its best
    score, the run memory's best eval (with its step where the file name has one). The earlier train
    losses are not there: Lightning's CSVLogger deletes the metrics.csv it writes to again, and other
    loggers keep their history outside the process. Never raises."""
    try:
        memory = getattr(getattr(monitor, "history", None), "memory", None)  # None: a rank that judges nothing
        step = int(getattr(trainer, "global_step", 0) or 0)
        if memory is None or step <= 0 or isinstance(monitor, NullMonitor) or monitor is None:
            return
        evals: list[tuple[int, float]] = []
        for callback in getattr(trainer, "checkpoint_callbacks", None) or ():
            score, name = getattr(callback, "best_model_score", None), getattr(callback, "monitor", None) or ""
            found = _STEP_IN_PATH.search(os.path.basename(getattr(callback, "best_model_path", "") or ""))
            if score is not None and _EVAL_LOSS.match(name) and found and not math.isfinite(memory.best_eval):
                evals.append((int(found.group(1)), float(score)))
        if evals:
            memory.restore(monitor.thresholds, (), sorted(evals))
    except Exception:  # the run goes on without the earlier steps; the exporter never stops it
        state = getattr(monitor, "state", None)
        if state is not None:
            state.count_error("restore")


def _check_schedule(guard: str, schedule: str) -> None:
    if guard != "off" and schedule == "hold":
        raise ValueError(
            "guard_schedule: 'hold' is not available with the Lightning callback: Lightning steps "
            "its LR schedulers itself, so a skipped step takes its slot; use 'advance'"
        )
