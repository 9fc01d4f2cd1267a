"""A validated step's path on the training thread: its time, its gradients measured on the device,
the guard's verdict, then its one host transfer (:mod:`~lossbeat.monitor.transfer`), which applies
what has arrived. Host floats alone (the usual scalars-only call) take a shorter road to the same
record. Nothing here raises into the training loop: a failure is counted and logged."""

from __future__ import annotations

import logging
import time
from typing import Any

from lossbeat.exposition.state import MonitorState
from lossbeat.measure.meter import GradientMeter
from lossbeat.monitor import inputs
from lossbeat.monitor.ratelog import RateLimitedLog
from lossbeat.monitor.record import FIRST_LR, DeviceStep, StepValues
from lossbeat.monitor.transfer import DeviceTransfer

__all__ = ["StepPath"]


class StepPath:
    """From ``observe()``'s validated values to the submitted record; owns the step timer."""

    def __init__(
        self,
        state: MonitorState,
        log: RateLimitedLog,
        meter: GradientMeter,
        guard: Any,
        transfer: DeviceTransfer,
        cross_rank: Any,
    ) -> None:
        self.state, self.log = state, log
        self.meter, self.guard, self.transfer, self.cross_rank = meter, guard, transfer, cross_rank
        self.last_perf: float | None = None
        """``time.perf_counter()`` at the previous step; None: the next step has no duration
        (the first one, or one that spans a phase change)."""

    def _duration(self) -> tuple[float, float | None]:
        now = time.perf_counter()
        last, self.last_perf = self.last_perf, now
        return now, None if last is None else now - last

    def floats(self, step: int, loss: float, grad_norm: float | None, learning_rate: float | None) -> None:
        """A step of host floats only: the record the general path would build (the same fields, the
        same applier) without its scans of the arguments and values. No device work, so no graph
        capture check: nothing here could be captured."""
        now, duration = self._duration()
        try:
            transfer = self.transfer
            values: DeviceStep = StepValues(
                loss=loss,
                grad_norm=grad_norm,
                learning_rates=None if learning_rate is None else {FIRST_LR: learning_rate},
            )
            if transfer.pending or self.meter.holds_norms or self.guard.decides:
                # Steps in flight, norms measured ahead, or the guard's verdict: the general path.
                inputs.refuse_graph_capture("observe")
                self._submit(step, now, duration, None, values, None)
                return
            self.meter.submitted += 1
            transfer.submit_host(step, time.time(), duration, values, now)
            if self.cross_rank.work_time:  # else step_end has nothing to do (no model here)
                self.cross_rank.step_end(None)
        except Exception:
            self._failed()

    def submit(self, step: int, epoch: float | None, values: DeviceStep, model: Any) -> None:
        """Any step: measure, decide, submit (the step's one host transfer), then drain → apply →
        judge what has arrived."""
        now, duration = self._duration()
        try:
            self._submit(step, now, duration, epoch, values, model)
        except Exception:
            self._failed()

    def _submit(
        self, step: int, now: float, duration: float | None, epoch: float | None, values: DeviceStep, model: Any
    ) -> None:
        transfer, meter = self.transfer, self.meter
        if transfer.pending:  # drain: the steps whose values arrived since (never any on CPU)
            transfer.drain(block=False)
        layer_names = self._measure(model, values, step) if model is not None or meter.holds_norms else []
        meter.submitted += 1
        if self.guard.decides:  # guard="skip"/"stop": the step's verdict, on the device
            self.guard.decide(values)
        transfer.submit(step, time.time(), duration, epoch, values, layer_names, now)
        if transfer.cuda_device != self.state.cuda_device:  # set once, not a call a step
            self.state.set_cuda_device(transfer.cuda_device)
        if model is not None or self.cross_rank.work_time:  # else step_end has nothing to do
            self.cross_rank.step_end(model)

    def _measure(self, model: Any, values: DeviceStep, step: int) -> list[str]:
        """The step's gradient norms as device tensors in ``values`` (no host read); the layer names."""
        try:
            return self.meter.measure_step(model, values.grad_norm is None, values, step)
        except Exception:  # gradients we cannot measure: the step's loss and LR still count
            values.layers = None
            self.state.count_error("observe")
            self.log(
                "error", logging.ERROR, "lossbeat: cannot measure the gradients; training continues", exc_info=True
            )
            return []

    def _failed(self) -> None:  # the training loop must go on: count, log, continue
        self.guard.settle()  # no decision for this step: Monitor.step decides it from its gradients
        self.state.count_error("observe")
        self.log("error", logging.ERROR, "lossbeat: error in observe(); training continues", exc_info=True)
