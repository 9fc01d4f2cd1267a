"""Apply one step's plain floats (the transfer has arrived): the event counters, the exported
state, the bounded windows, and every ``diagnose_every`` steps the judgment. No torch from here on."""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, cast

from lossbeat.diagnosis import History
from lossbeat.diagnosis.history import StepEvents
from lossbeat.diagnosis.vitals import Vitals
from lossbeat.exposition.state import MonitorState
from lossbeat.monitor.guard import PARKED, SKIPPED
from lossbeat.monitor.judgment import Judgment
from lossbeat.monitor.moe import apply_experts
from lossbeat.monitor.ratelog import RateLimitedLog
from lossbeat.monitor.record import HostStep
from lossbeat.monitor.transfer import PendingStep

__all__ = ["StepApplier", "derive_gauges", "ALL_LAYERS", "FROM_ANOTHER_RANK", "WARMUP_OVERFLOWS"]

WARMUP_OVERFLOWS = 16
"""The most non-finite gradient norms at a run's start read as a GradScaler's warm-up: its
default scale, 2**16, halved 16 times is 1; a real fp16 run needs a handful (4-5 measured with
an HF Trainer)."""


ALL_LAYERS = "all layers"
"""The non-finite layer reported when a non-finite loss made every layer's gradient non-finite
(on a pipeline stage without a loss: when every layer of the stage is non-finite)."""
FROM_ANOTHER_RANK = "poisoned by the gradient all-reduce from another rank"
"""The non-finite layer reported when every layer is non-finite but this rank's loss is finite,
in a job of several ranks: a NaN loss on another data-parallel rank, averaged into every
replica's gradients by the all-reduce (an origin inside this rank's model leaves the layers
after it finite). The page goes to that rank's TrainingLossNaN; this one is inhibited."""


class StepApplier:
    """Called with each step, in order, once its values are on the host (the transfer's lock held)."""

    def __init__(
        self,
        *,
        state: MonitorState,
        history: History,
        cross_rank: Any,
        vitals: Vitals,
        judgment: Judgment,
        log: RateLimitedLog,
        guard: Any,
        profile: Any = None,
    ) -> None:
        self.state, self.history, self.cross_rank, self.vitals = state, history, cross_rank, vitals
        self.profile = profile  # a ProfileChoice: the names observe(metrics=...) was given choose it
        self.guard = guard
        self.judgment, self.log = judgment, log
        self.due = judgment.judge.due  # whether a record is judged (one call a step, not two)
        self._nonfinite_run = False  # the last applied step had a non-finite gradient
        self._warmup = 0
        """Non-finite gradient norms taken for a GradScaler's warm-up; -1 once a norm was finite."""

    def _warmup_overflow(self, grad_norm: float | None, loss: float | None, known: bool) -> bool:
        """Whether a non-finite gradient norm is a GradScaler's warm-up where nothing else tells
        (a watched log, ``observe(grad_norm=...)`` without ``grad_scaler=`` or per-layer norms):
        the scaler starts at 2**16 and halves at each overflow until the gradients fit, so an
        fp16 run logs a few non-finite norms with a finite loss before its first finite one. At
        most :data:`WARMUP_OVERFLOWS` of them, at the run's start, are counted as the scaler's
        overflows (no fault); more, or any later, are non-finite gradients."""
        if grad_norm is None and not known:
            return False  # nothing to tell from
        if known or grad_norm is None or math.isfinite(grad_norm) or loss is None or not math.isfinite(loss):
            self._warmup = -1
            return False
        if self._warmup >= WARMUP_OVERFLOWS:
            self._warmup = -1
            return False
        self._warmup += 1
        return True

    def at_read(self) -> None:
        """What a scrape computes itself (the transfer's lock held): the derived gauges."""
        derive_gauges(self.state, self.history)

    def __call__(self, record: PendingStep) -> None:
        # cast: the transfer wrote every tensor's float (a vector's list) back in place before it
        # applies the record (transfer.unpack, _read_cpu); what is left were floats already.
        s, v = self.state, cast(HostStep, record.values)
        skipped = False
        if v.guard is not None:  # first: a bad step whose Monitor.step may still come waits, untouched, in the guard
            verdict = self.guard.record(v.guard, v.guard_index, record.step, v.loss, v.grad_norm, record)
            if verdict == PARKED:
                return
            skipped = verdict == SKIPPED
        loss = v.loss  # None: a rank without a loss this step (a pipeline stage before the last)
        grad_norm = v.grad_norm
        lr_max: float | None
        lrs = v.learning_rates
        if lrs is not None and len(lrs) == 1:  # one LR (the usual): no scan, no call
            (lr_max,) = lrs.values()
        else:
            lrs, lr_max = _learning_rates(lrs)
        components = v.components or None
        layers = v.layers
        layer_norms = without_grad = None
        if layers is not None:
            layer_norms, without_grad = _layer_norms(record.layer_names, layers)
        layer_nonfinite = layer_norms is not None and not all(map(math.isfinite, layer_norms.values()))
        # Under fp16 loss scaling an overflowing step is skipped by the scaler: routine, not a
        # fault, and no gradient sample. A scale collapsing is the fault (the nonfinite check).
        scaled = v.grad_scale is not None
        overflow = scaled and (layer_nonfinite or (grad_norm is not None and not math.isfinite(grad_norm)))
        if self._warmup >= 0:
            overflow = self._warmup_overflow(grad_norm, loss, layers is not None or scaled) or overflow
        if overflow:
            grad_norm = layer_norms = None
            layer_nonfinite = False
        if v.grad_scale is not None:
            self.history.set_grad_scale(v.grad_scale)

        events: StepEvents | None
        if skipped:  # withheld by Monitor.step: counted as a skip, not as a fault the model took in
            events = self.history.add_step(record.step, None, None, lr_max, components)
            layer_nonfinite = False
        else:  # the usual record's windows are written in a batch (History.defer), its events now
            events = None if components else self.history.defer(record.step, loss, grad_norm, lr_max)
            if events is None:
                events = self.history.add_step(record.step, loss, grad_norm, lr_max, components)
        if self.cross_rank.align_every:  # else record() has nothing to do
            self.cross_rank.record(record.step, grad_norm)
        if v.fields and self.profile is not None:
            self.profile.seen(v.fields)
        if v.experts is not None:  # observe(expert_load=...): the routers' per-layer statistics
            apply_experts(s, self.history, v, record.step)
        if v.signals:
            self._signals(record.step, v.signals)
        if layer_norms is not None:
            self.history.set_layer_norms(layer_norms)
        # training_loss_cv and training_loss_trend_ratio are read at scrape time (derive_gauges).
        baseline = self.history.grad.median
        s.record_step(  # by position, in the signature's order: keywords cost a step 0.2 µs
            record.step,
            record.wall_time,
            record.epoch,
            record.duration,
            loss,
            grad_norm,
            lr_max,
            lrs,
            components,
            layer_norms,
            without_grad,
            layer_norms is not None
            and (layer_nonfinite or events.explosion or events.nonfinite_grad or events.nonfinite_loss),
            v.clip,
            v.grad_scale,
            baseline if math.isfinite(baseline) else None,
            v.tokens,
        )
        if (
            events.nonfinite_loss
            or events.nonfinite_grad
            or layer_nonfinite
            or overflow
            or events.spike
            or events.explosion
        ):
            self._count_events(record.step, events, loss, grad_norm, layer_norms, layer_nonfinite, overflow)
        else:
            self._nonfinite_run = False
        if record.duration is not None and s.phase[0] == "train":
            self.vitals.add_step_time(record.duration, True)
        if self.due(record.step):  # every diagnose_every steps, as `lossbeat analyze` judges
            self.judgment.diagnose(record.step)

    def _signals(self, step: int, signals: dict[str, float]) -> None:
        """The task's named values (``observe(metrics=...)``): into their windows and the state."""
        for name, x in signals.items():
            self.history.add_signal(name, x, step)
        self.state.merge_signals({k: (x if math.isfinite(x) else math.nan) for k, x in signals.items()})

    def _count_events(
        self,
        step: int,
        events: Any,
        loss: float | None,
        grad_norm: float | None,
        layer_norms: dict[str, float] | None,
        layer_nonfinite: bool,
        overflow: bool,
    ) -> None:
        """A step with an event: its counters, the step it happened at, and a rate-limited log line."""
        s = self.state
        if events.nonfinite_loss:
            s.count_event("nonfinite_loss", step)
            self.log("nonfinite_loss", logging.WARNING, "lossbeat: non-finite loss %s at step %d", loss, step)
        if events.nonfinite_grad or layer_nonfinite:
            origin: str | None
            if layer_nonfinite and layer_norms is not None:
                origin = _nonfinite_origin(layer_norms, loss, s.run_info.get("world_size", "1") != "1")
            else:  # no per-layer norms this step: the layer of this event (consecutive bad steps), never an earlier one's
                origin = s.first_nonfinite_layer if self._nonfinite_run else None
            s.count_event("nonfinite_grad", step, origin=origin)
            self._nonfinite_run = True
            if origin is not None:
                self.log(
                    "nonfinite_grad",
                    logging.WARNING,
                    "lossbeat: non-finite gradient at step %d; it starts at layer %s",
                    step,
                    origin,
                )
            else:
                self.log("nonfinite_grad", logging.WARNING, "lossbeat: non-finite gradient norm at step %d", step)
        else:
            self._nonfinite_run = False
        if overflow:
            s.count_event("grad_scaler_overflows", step)
        if events.spike:
            s.count_event("loss_spikes", step)
        if events.explosion:
            s.count_event("grad_explosions", step)
            if layer_norms:
                top = max((x for x in layer_norms.items() if math.isfinite(x[1])), key=lambda x: x[1], default=None)
                self.log(
                    "explosion",
                    logging.WARNING,
                    "lossbeat: gradient norm %.4g at step %d; largest layer: %s",
                    grad_norm,
                    step,
                    top[0] if top else "-",
                )


def derive_gauges(state: MonitorState, history: History) -> None:
    """The gauges derived from the loss window, computed when a scrape reads them (the caller
    holds the transfer's lock, so the window is not written meanwhile): O(window) per scrape
    instead of work on every step."""
    history.flush()  # the steps held back for a batch
    cv, trend = history.loss.cv(), history.loss.trend_ratio()
    state.set_loss_gauges(None if math.isnan(cv) else cv, None if math.isnan(trend) else trend)


def _learning_rates(lrs: dict[str, float] | None) -> tuple[dict[str, float] | None, float | None]:
    """Every param group's learning rate (the record's own dict, handed on), and the largest
    (NaN when any is NaN)."""
    if not lrs:
        return None, None
    if len(lrs) == 1:
        (lr_max,) = lrs.values()  # one (the usual): no scan
        return lrs, lr_max
    lr_max = max(lrs.values())
    return lrs, math.nan if any(math.isnan(x) for x in lrs.values()) else lr_max


def _layer_norms(names: list[str], layers: list[float]) -> tuple[dict[str, float], int]:
    """Per-layer norms by name, and how many layers had no gradient: -1 (no parameter of the layer
    had a gradient this step: an unused head, an unrouted expert) is omitted, not a zero norm."""
    if -1.0 in layers:  # a C-level scan; the filter only when some layer had no gradient
        norms = {name: x for name, x in zip(names, layers) if not x < 0}
    else:
        norms = dict(zip(names, layers))
    return norms, len(layers) - len(norms)


def _nonfinite_origin(layer_norms: Mapping[str, float], loss: float | None, several_ranks: bool = False) -> str:
    """Where a non-finite gradient started: backprop carries a NaN or Inf born in one layer's
    backward to every layer before it, so the origin is the last non-finite layer in model
    order; a non-finite loss poisons every layer (``ALL_LAYERS``). ``loss`` None: a rank
    without a loss (a pipeline stage before the last), whose gradients come from the next
    stage: every layer non-finite may have been poisoned there, so ``ALL_LAYERS`` too. Every
    layer non-finite with a finite loss in a job of several ranks: another rank's NaN came
    in through the all-reduce (``FROM_ANOTHER_RANK``), not this model's last layer."""
    bad = [name for name, x in layer_norms.items() if not math.isfinite(x)]
    if len(bad) == len(layer_norms):
        if loss is None or not math.isfinite(loss):
            return ALL_LAYERS
        if several_ranks:
            return FROM_ANOTHER_RANK
    return bad[-1]
