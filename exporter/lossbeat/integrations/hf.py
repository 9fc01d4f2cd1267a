"""``LossbeatCallback`` for the Hugging Face ``transformers.Trainer`` (extra ``hf``)."""

from __future__ import annotations

import os
import sys
import threading
import types
from typing import Any

import torch
from transformers import TrainerCallback

try:  # the Trainer marks, in accelerate's shared state, the micro-batch that completes a step
    from accelerate.state import GradientState
except ImportError:  # pragma: no cover - the Trainer itself needs accelerate
    GradientState = None

from lossbeat.exposition.server import RankContext
from lossbeat.integrations._common import (
    AfterBackward,
    CountsObservedSteps,
    RankMonitorCallback,
    deepspeed_grad_norm,
    eval_loss_from,
    flush_quietly,
    log,
    phase_quietly,
    task_metrics,
    uses_deepspeed,
)
from lossbeat.integrations._guard import Patch, ScheduleGate, guard_mode, settings_guard
from lossbeat.monitor import Monitor, NullMonitor

__all__ = ["LossbeatCallback"]


class LossbeatCallback(RankMonitorCallback, CountsObservedSteps, TrainerCallback):
    r"""Feed a ``transformers.Trainer`` run to a lossbeat :class:`~lossbeat.monitor.Monitor`.

    Per-step mode (the default, used when the model's output carries a
    ``loss``, as every ``*ForCausalLM``/``*ForSequenceClassification`` model
    does when given labels): every optimizer step is observed in
    ``on_pre_optimizer_step``, after backward and before ``zero_grad``, with
    the model, so the per-layer gradient norms come from the monitor's fused
    reduction. Otherwise (a custom ``compute_loss`` whose loss is not the
    model's output), every logged step is observed in ``on_log`` from the
    Trainer's logged values, without per-layer norms.

    Hooks and the fields they feed:

    - ``on_train_begin`` (in each rank's process, once the Trainer has started
      the process group): the monitor, unless one was given: the process's
      exporter (:func:`~lossbeat.monitor.start_exporter` with ``settings``)
      labelled with ``args.process_index``, ``local_process_index`` and
      ``world_size``, serving on ``port + local_process_index``. Then it registers a forward hook on the model that keeps the
      training loss of each micro-batch (a running sum on the device, reset
      every optimizer step: bounded memory).
    - end of each backward pass (an autograd-engine callback queued by a hook
      on the loss; only when ``max_grad_norm`` clips):
      ``Monitor.measure_gradients(model)``, the global and per-layer gradient
      norms before the Trainer clips them, which it does before
      ``on_pre_optimizer_step``. With ``fp16=True`` the gradients still carry
      the GradScaler's loss scale there: the norms are divided by it on the
      device (no host sync). Under DDP they are measured after the
      all-reduce. Under FSDP (accelerate's FSDP1 or FSDP2) they are measured
      after the reduce-scatter: FSDP's own end-of-backward callback, queued
      during the pass and so run before this one, waits for it (on GPUs, the
      compute stream waits for the reduce-scatter's); each rank then holds its
      shard of the reduced gradients, and the measurement sums the shards'
      squares over the shard group with one small all-reduce, so every rank
      exports the norms of the full gradients. That all-reduce is a collective:
      every rank measures at the same steps, as every rank runs the same
      number of micro-batches per step. Only the step's last micro-batch is measured
      (accelerate's ``GradientState.sync_gradients``): its backward completes
      the gradients.
    - ``on_pre_optimizer_step``: ``Monitor.observe(step, loss, model, optimizer, epoch)``:
      ``step`` is ``state.global_step + 1`` (the number the Trainer logs for
      this step), ``loss`` the step's loss over its micro-batches (the sum of
      their shares when the model is given ``num_items_in_batch``, else their
      mean), the rank's own (the Trainer logs the mean over the ranks); the
      learning rates from the optimizer's param groups, ``epoch`` the fractional epoch the Trainer gives this step
      (``state.epoch`` is still the previous step's here: the step's micro-batches
      are added, as the Trainer adds them after the step); the gradient
      norms are those measured at the end of backward (read here when nothing
      clips; under FSDP the same collective, after the Trainer's own norm, which
      leaves the gradients unchanged).
    - ``on_log``: in fallback mode, ``loss``, ``grad_norm``, ``learning_rate`` and
      ``epoch`` of the log record, and the task's other logged values as ``metrics=``
      (TRL's ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``kl``, ``rewards/margins``,
      ``rewards/accuracies``, ...: the live profile detection and the RL and preference
      judgments read them; :func:`~lossbeat.integrations._common.task_metrics`). In per-step
      mode those values reach the monitor with the next step's ``observe`` (a log follows its
      step's ``on_pre_optimizer_step``); those of the run's last log, after its last step, with
      ``Monitor.observe_metrics`` in ``on_train_end``. Eval keys are left to ``on_evaluate`` so
      nothing is counted twice.
    - ``on_evaluate``: ``Monitor.observe_eval(state.global_step, metrics[eval_key],
      metrics=...)``, with the evaluation's other values (``eval_accuracy``, ``eval_wer``,
      ``eval_rouge1``, ...: their names choose the classification or seq2seq profile).
    - The phases TrainingStalled reads: ``on_step_end`` and ``on_epoch_end`` set
      ``phase("eval")`` when the Trainer will evaluate next (``control.should_evaluate``),
      ``phase("checkpoint")`` when it will save (``save_strategy="epoch"`` saves after the epoch); ``on_prediction_step`` sets ``phase("eval")`` and heartbeats every
      evaluation and prediction batch; ``on_evaluate`` moves on to ``"checkpoint"`` (a save
      follows) or ``"train"``; ``on_save`` back to ``"train"``; ``on_train_end`` sets
      ``"checkpoint"`` for the work after ``train()`` (``save_model``, ``push_to_hub``), and an
      ``evaluate()`` or ``predict()`` outside training returns to it. A long evaluation, save or
      wrap-up pages only past ``alerts.stalled_phase_after``.
    - ``guard="skip"``/``"stop"`` (docs/guard.md): from ``on_train_begin`` the Trainer's
      optimizer has its own ``step`` on the instance, which applies the step decided in
      ``on_pre_optimizer_step`` through ``Monitor.step`` (the torch optimizer inside accelerate's,
      with its GradScaler under fp16): a bad step leaves parameters and optimizer state as they
      were, and ``TrainingHalted`` leaves ``trainer.train()``. The LR scheduler the Trainer steps
      next follows ``guard_schedule``: ``"advance"`` steps it, ``"hold"`` marks the step skipped
      for accelerate (``accelerator.optimizer_step_was_skipped``), which holds it as for an fp16
      overflow. Under fp16 a guard skip is the scaler's skip, so the schedule holds either way.
      Taken off at train end, or when the step raises.
    - ``on_train_end``: passes the values of a log no step took (the run's last), removes the
      hook, flushes the monitor (an error there is counted, never raised) and sets ``phase("checkpoint")``; close the monitor
      (``monitor.close()``) when the script's work is done.

    Under ``nn.DataParallel`` (one process, several GPUs: the Trainer wraps the model
    itself) the forward hook runs in every replica's thread, each with the loss on its own
    device: it adds them under a lock, moving each onto the first's device (a device-to-device
    copy, no host sync), counts one micro-batch per forward (not per replica), observes the
    mean, and measures the gradients of the model, never of a replica (which has none).

    Under DeepSpeed ZeRO-2/3 the gradients are not in ``p.grad``: the step is observed with
    the engine's own ``get_global_grad_norm()`` (or its ZeRO optimizer's), without per-layer norms.

    Args:
        monitor: the monitor to feed, built in the process that trains; default: each
            rank's exporter, started in ``on_train_begin`` (/metrics on port 8470 + local rank).
        eval_key: the metric that is the eval loss. Default ``eval_loss``, or
            with several eval datasets the first ``eval_<name>_loss`` in sorted order.
        per_step: ``False`` observes logged steps only (``on_log``); the guard needs ``True``.
        **settings: :func:`~lossbeat.monitor.start_exporter` arguments (``port``,
            ``addr``, ``run_name``, any :class:`~lossbeat.monitor.MonitorConfig`
            field) for the exporter each rank starts; checked here. ``guard="skip"`` or
            ``"stop"`` guards the Trainer's optimizer step (with ``monitor=``, its config's guard).

    Raises:
        TypeError: if ``monitor`` is not a lossbeat monitor, is given with settings,
            or a setting is unknown; ValueError for a bad setting value, or a guard with
            ``per_step=False``.
        RuntimeError: in ``on_train_begin``, if ``monitor`` was built in another
            process than the one that trains (a forked or spawned rank).
        ValueError: in ``on_train_begin``, a guard under DeepSpeed (its engine steps inside
            ``backward``, before any callback).

    Note:
        With ``fp16=True`` (a GradScaler) and no clipping, the norms are read in
        ``on_pre_optimizer_step``, after the callback unscales the gradients as
        ``optimizer.step()`` would. The scaler goes to ``observe(grad_scaler=...)``:
        the loss scale is exported, and a step it skips for overflowing gradients
        counts as an overflow, not as a non-finite gradient.

    Example::

        >>> from transformers import Trainer
        >>> from lossbeat.integrations.hf import LossbeatCallback
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[LossbeatCallback()])
    """

    def __init__(
        self,
        monitor: Monitor | NullMonitor | None = None,
        *,
        eval_key: str | None = None,
        per_step: bool = True,
        **settings: Any,
    ) -> None:
        self._keep_monitor(monitor, settings)
        if settings_guard(monitor, settings)[0] != "off" and not per_step:
            raise ValueError("guard: the guard decides each step in on_pre_optimizer_step; it needs per_step=True")
        self._started_in = os.getpid()
        self.eval_key = eval_key
        self.per_step = bool(per_step)
        self._loss_sum: torch.Tensor | None = None
        self._micro_batches = 0  # losses added this step: one per micro-batch, per replica under DataParallel
        self._devices: set[torch.device] = set()  # the devices they came from (DataParallel: several)
        self._watched = False  # the gradients are measured once per step
        self._lock = threading.Lock()  # DataParallel runs the replicas' forwards (and this hook) in threads
        self._model: torch.nn.Module | None = None
        self._shares = False
        self._share_scale = 1.0
        self._hook: Any = None
        self._after_backward: AfterBackward | None = None
        self._measure_pre_clip = False
        self._steps_in_epoch: float | None = None  # micro-batches per epoch, as the Trainer counts them
        self._epoch_at_step_begin = 0.0
        self._step_patch: Patch | None = None  # the optimizer's guarded step (guard="skip"/"stop")
        self._loss_patches: list[Patch] = []  # the Trainer's training_step and compute_loss, for the loss
        self._step_loss_sum: torch.Tensor | None = None  # training_step's losses this step
        self._decided = False  # on_pre_optimizer_step observed the step the optimizer applies next
        self._training = False  # between on_train_begin and on_train_end: evaluations return to "train"
        self._names_passed: set[str] = set()  # logged names given to the monitor (each once; signals always)
        self._logged: dict[str, Any] | None = None  # per-step mode: a log's task values, for the next observe

    # --- hooks -------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        self._remove_hook()
        phase_quietly(self._start(args), "train")  # after an evaluate() or a train() before this one
        _restore_resumed(self._start(args), state)
        self._training = True
        self._names_passed, self._logged = set(), None
        # fp16: accelerate's optimizer carries the GradScaler; the norms measured at the end of
        # backward are divided by its scale, read there as a device tensor.
        self._after_backward = AfterBackward(self._monitor, getattr(optimizer, "scaler", None))
        # Under DeepSpeed the engine clips inside backward and keeps the gradients: its own norm is read.
        self._measure_pre_clip = bool(args.max_grad_norm) and not uses_deepspeed(model, optimizer)
        self._steps_in_epoch = _batches_per_epoch(train_dataloader, state, args)
        self._model = model if isinstance(model, torch.nn.Module) else None
        if self.per_step and self._model is not None:
            self._hook = model.register_forward_hook(self._capture_loss, with_kwargs=True)
        trainer = _find_trainer() if self.per_step else None
        if trainer is not None:
            # A model that returns no loss (TRL's trainers, any custom compute_loss): the loss the
            # Trainer backpropagates, training_step's return, and compute_loss's for the pre-clip norms.
            self._loss_patches = [
                Patch(trainer, "training_step", self._captured_training_step),
                Patch(trainer, "compute_loss", self._captured_compute_loss),
            ]
        # Across devices, num_items_in_batch counts every rank's tokens: the Trainer then
        # multiplies each rank's loss by the process count, and so does this callback.
        self._share_scale = float(args.world_size) if getattr(args, "average_tokens_across_devices", False) else 1.0
        self._unguard()
        if guard_mode(self._monitor) != "off" and optimizer is not None:
            if uses_deepspeed(model, optimizer):
                raise ValueError(
                    "guard: not available under DeepSpeed, whose engine steps inside backward; use guard='off'"
                )
            self._step_patch = Patch(optimizer, "step", self._guarded_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self._reset()
        self._epoch_at_step_begin = float(state.epoch or 0.0)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._loss_sum is None and self._step_loss_sum is None:
            return
        # A model given num_items_in_batch returns its micro-batch's share of the step's
        # loss (the shares add up); otherwise each micro-batch loss is a mean. Under
        # DataParallel each micro-batch gives one loss per device, which the Trainer averages.
        replicas = max(1, len(self._devices))
        if self._loss_sum is None:  # the model returned no loss: training_step's, summed as the Trainer logs it
            loss = self._step_loss_sum
        elif self._shares:
            loss = self._loss_sum * (self._share_scale / replicas)
        else:
            loss = self._loss_sum / self._micro_batches
        # fp16 on an accelerator: accelerate's optimizer carries the GradScaler. The Trainer
        # unscales the gradients when it clips; when it does not, unscale them here, as
        # optimizer.step() would, so the norms are the real ones.
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and scaler.is_enabled() and not args.max_grad_norm:
            scaler.unscale_(getattr(optimizer, "optimizer", optimizer))
        # The Trainer sets state.epoch after the step: epoch + micro-batches seen / micro-batches per epoch.
        epoch = self._epoch_at_step_begin
        if self._steps_in_epoch:
            epoch += self._micro_batches / replicas / self._steps_in_epoch
        measured: dict[str, Any] = {"model": model}
        if uses_deepspeed(model, optimizer):
            # ZeRO-2/3 keep the gradients out of p.grad: the engine's norm of this step instead.
            norm = deepspeed_grad_norm(model, optimizer)
            if norm is not None:
                measured = {"grad_norm": norm}
        logged, self._logged = self._logged, None
        self.monitor.observe(
            state.global_step + 1,
            loss=loss,
            optimizer=optimizer,
            epoch=epoch,
            grad_scaler=scaler,
            metrics=logged,
            **measured,
        )
        self._decided = self._step_patch is not None
        self._observed_steps += 1
        self._reset()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        metrics = task_metrics(logs, self._names_passed)
        loss = logs.get("loss")
        if self._observed_steps or not isinstance(loss, (int, float)) or isinstance(loss, bool):
            # Per-step mode (or a log without a loss): the values go with the next observed step.
            if metrics:
                self._logged = metrics if self._logged is None else {**self._logged, **metrics}
            return
        grad_norm = logs.get("grad_norm")
        lr = logs.get("learning_rate")
        epoch = logs.get("epoch")
        logged, self._logged = self._logged, None
        self._start(args).observe(
            state.global_step,
            loss=float(loss),
            grad_norm=float(grad_norm) if isinstance(grad_norm, (int, float)) else None,
            learning_rate=float(lr) if isinstance(lr, (int, float)) else None,
            epoch=float(epoch) if isinstance(epoch, (int, float)) else None,
            metrics=metrics if logged is None else {**logged, **(metrics or {})},
        )

    def on_step_end(self, args, state, control, **kwargs):
        self._before_evaluate_or_save(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._before_evaluate_or_save(control)  # "epoch" strategies evaluate and save here

    def _before_evaluate_or_save(self, control) -> None:
        # DefaultFlowCallback (first in the list) has decided what follows.
        if control.should_evaluate:
            phase_quietly(self._monitor, "eval")
        elif control.should_save:
            phase_quietly(self._monitor, "checkpoint")

    def on_prediction_step(self, args, state, control, **kwargs):
        phase_quietly(self._monitor, "eval")  # every evaluation batch: a heartbeat in "eval"

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        found = eval_loss_from(metrics, self.eval_key)
        if found is not None:
            self._start(args).observe_eval(
                state.global_step,
                found[1],
                metrics=task_metrics(metrics, self._names_passed, evaluation=True, skip=found[0]),
            )
        phase_quietly(self._monitor, "checkpoint" if control.should_save else self._after_evaluation())

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        phase_quietly(self._monitor, self._after_evaluation())

    def on_save(self, args, state, control, **kwargs):
        phase_quietly(self._monitor, self._after_evaluation())  # the checkpoint is written

    def on_train_end(self, args, state, control, **kwargs):
        self._unguard()
        self._remove_hook()
        self._reset()
        self._training = False
        self._pass_last_log(state.global_step)
        # What follows train() (save_model, push_to_hub) takes no steps: not a stall for 10m.
        phase_quietly(self._monitor, "checkpoint")
        flush_quietly(self._monitor)

    # --- internals ---------------------------------------------------------------

    def _pass_last_log(self, step: int) -> None:
        """The values of a log no observed step took (the run's last log follows its last step),
        for that step; an error is counted and logged, never raised into the Trainer."""
        logged, self._logged = self._logged, None
        if not logged or self._monitor is None:
            return
        try:
            self._monitor.observe_metrics(step, logged)
        except Exception:
            state = getattr(self._monitor, "state", None)
            if state is not None:
                state.count_error("observe")
            log.error("lossbeat: error passing the last logged values at the end of training", exc_info=True)

    def _guarded_step(self, closure: Any = None) -> Any:
        """The Trainer's ``optimizer.step()`` under a guard: the step observed in
        ``on_pre_optimizer_step`` goes through ``Monitor.step``; any other is accelerate's own."""
        patch = self._step_patch
        assert patch is not None
        self._decided = False  # a step nothing decided on is decided from its gradients by Monitor.step
        accelerated = patch.obj
        inner = getattr(accelerated, "optimizer", accelerated)  # the torch optimizer: the guard's strategies know it
        scaler = getattr(accelerated, "scaler", None)
        scaler = scaler if scaler is not None and scaler.is_enabled() else None
        gate, ran = ScheduleGate(), []
        # Under fp16 the scaler skips an overflow (or a guard skip) by not calling the torch step.
        hook = (
            inner.register_step_post_hook(lambda *_: ran.append(True))
            if scaler is not None and hasattr(inner, "register_step_post_hook")
            else None
        )
        monitor = self._monitor
        assert monitor is not None  # the guard is patched in once training has begun
        try:
            out = monitor.step(inner, grad_scaler=scaler, scheduler=gate, closure=closure)
        except BaseException:  # TrainingHalted (or a failing step) leaves train(): no on_train_end follows
            self._unguard()
            raise
        finally:
            if hook is not None:
                hook.remove()
        took = gate.stepped and (scaler is None or hook is None or bool(ran))
        if hasattr(accelerated, "_is_overflow"):
            # accelerate's own record of a skipped step (private; its step would have set it):
            # the Trainer and accelerate's scheduler wrapper hold the LR schedule for it.
            accelerated._is_overflow = not took
        return out

    def _unguard(self) -> None:
        if self._step_patch is not None:
            self._step_patch.restore()
            self._step_patch = None
        self._decided = False

    def _start(self, args: Any) -> Monitor | NullMonitor:
        """The monitor, started in this (rank) process on first use."""
        if self._monitor is None or self._monitor is self._given or self._started_in != os.getpid():
            ranks = RankContext(args.process_index, args.local_process_index, args.world_size, "trainer")
            monitor = self._start_monitor(ranks)
            self._started_in = os.getpid()  # a forked child that trains again starts its own
            return monitor
        return self._monitor

    def _captured_training_step(self, *args: Any, **kwargs: Any) -> Any:
        loss = self._loss_patches[0].original(*args, **kwargs)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            value = loss.detach().to(torch.float32, copy=True).reshape(())  # no host sync
            with self._lock:
                total = self._step_loss_sum
                self._step_loss_sum = value if total is None else total + value.to(total.device)
        return loss

    def _captured_compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        """The loss before backward: where the gradients' pre-clip norms are measured from."""
        out = self._loss_patches[1].original(*args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        if isinstance(loss, torch.Tensor) and self._model is not None and torch.is_grad_enabled():
            with self._lock:
                if self._measure_pre_clip and self._after_backward is not None and not self._watched:
                    if _completes_step():
                        self._watched = True
                        self._after_backward.watch(loss, self._model)
        return out

    def _capture_loss(self, module: torch.nn.Module, inputs: Any, kwargs: dict, output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        # A DataParallel replica shares this hook (its __dict__ is a copy) but holds no
        # parameters: the gradients are the model's, where the replicas' backward sends them.
        owner = self._model if getattr(module, "_is_replica", False) and self._model is not None else module
        # A copy (one small kernel, no host sync): with num_items_in_batch across several
        # processes the Trainer scales the model's loss in place (`loss *= world size`) after
        # this hook, and a view would count the first micro-batch at that scale.
        value = loss.detach().to(torch.float32, copy=True).reshape(())
        with self._lock:  # replicas' threads: no lost update, one measurement per step
            if self._measure_pre_clip and self._after_backward is not None and not self._watched and _completes_step():
                self._watched = True
                self._after_backward.watch(loss, owner)
            if self._loss_sum is None:
                self._loss_sum = value
            else:  # another replica's device: a device-to-device copy onto the first's (no host sync)
                self._loss_sum = self._loss_sum + value.to(self._loss_sum.device)
            self._micro_batches += 1
            self._devices.add(value.device)
            self._shares = kwargs.get("num_items_in_batch") is not None

    def _after_evaluation(self) -> str:
        """The phase an evaluation returns to: training, or the wrap-up after ``train()``."""
        return "train" if self._training else "checkpoint"

    def _reset(self) -> None:
        with self._lock:
            self._loss_sum = self._step_loss_sum = None
            self._micro_batches = 0
            self._devices = set()
            self._watched = False

    def _remove_hook(self) -> None:
        for patch in reversed(self._loss_patches):
            patch.restore()
        self._loss_patches = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _batches_per_epoch(train_dataloader: Any, state: Any, args: Any) -> float | None:
    """Micro-batches per epoch as the Trainer counts them for ``state.epoch``: the training
    dataloader's length, else (no length) ``max_steps`` times the accumulation steps."""
    try:
        length = len(train_dataloader) if train_dataloader is not None else None
    except (TypeError, NotImplementedError):
        length = None
    if length:
        return float(length)
    if getattr(state, "max_steps", 0) and getattr(args, "gradient_accumulation_steps", 0):
        return float(state.max_steps * args.gradient_accumulation_steps)
    return None


def _completes_step() -> bool:
    """Whether the current micro-batch is the last of its optimizer step.

    The Trainer sets accelerate's ``GradientState.sync_gradients`` before each
    micro-batch: measuring only then reads the gradients once per step, not
    once per micro-batch (gradient accumulation 8 would read them 8 times).
    """
    if GradientState is None:
        return True
    return bool(getattr(GradientState(), "sync_gradients", True))


def _restore_resumed(monitor, state) -> None:
    """A run resumed from a checkpoint: its earlier losses (``state.log_history``, restored by the
    Trainer with the checkpoint) give the run memory its best levels, so a resume that lost its
    scheduler state and settles above them is judged against the run's best, not its own start."""
    history = getattr(state, "log_history", None)
    if not getattr(state, "global_step", 0) or not history:
        return
    entries = [e for e in history if isinstance(e, dict) and isinstance(e.get("step"), int)]
    train = [(e["step"], e["loss"]) for e in entries if isinstance(e.get("loss"), (int, float))]
    evals = [(e["step"], e["eval_loss"]) for e in entries if isinstance(e.get("eval_loss"), (int, float))]
    memory = getattr(getattr(monitor, "history", None), "memory", None)  # None: a rank that judges nothing
    if memory is not None:
        memory.restore(monitor.thresholds, train, evals)


def _find_trainer() -> Any:
    """The Trainer whose ``train()`` calls this ``on_train_begin``: a few frames up the stack
    (the Trainer passes callbacks no reference to itself). None when not found."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - the callback needs transformers
        return None
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None
