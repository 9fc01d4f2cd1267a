"""Apply one step's plain floats (the transfer has arrived): the event counters, the exported
state, the bounded windows, and every ``diagnose_every`` steps the judgment. No torch from here on."""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from lossbeat.diagnosis import History
from lossbeat.diagnosis.vitals import Vitals
from lossbeat.exposition.state import MonitorState
from lossbeat.monitor.guard import PARKED, SKIPPED
from lossbeat.monitor.inputs import FIRST_LR
from lossbeat.monitor.judgment import Judgment
from lossbeat.monitor.ratelog import RateLimitedLog
from lossbeat.monitor.transfer import PendingStep

__all__ = ["StepApplier", "derive_gauges", "ALL_LAYERS", "FROM_ANOTHER_RANK"]


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

    def at_read(self) -> None:
        """What a scrape computes itself (the transfer's lock held): the derived gauges."""
        derive_gauges(self.state, self.history)

    def __call__(self, record: PendingStep) -> None:
        s, v = self.state, record.host
        skipped = False
        if "guard" in v:  # first: a bad step whose Monitor.step may still come waits, untouched, in the guard
            verdict = self.guard.record(
                v["guard"], v["guard_index"], record.step, v.get("loss"), v.get("grad_norm"), record
            )
            if verdict == PARKED:
                return
            skipped = verdict == SKIPPED
        loss = v.get("loss")  # None: a rank without a loss this step (a pipeline stage before the last)
        grad_norm = v.get("grad_norm")
        lr_max = v.get(FIRST_LR) if record.has_lrs == 1 else None  # one LR (the usual): no scan of the values
        if lr_max is not None:
            lrs = {"0": lr_max}
        else:
            lrs = {k[1]: x for k, x in v.items() if type(k) is tuple and k[0] == "lr"} if record.has_lrs else None
        components = (
            {k[1]: x for k, x in v.items() if type(k) is tuple and k[0] == "component"}
            if record.has_components
            else None
        )
        layers = v.get("layers")
        if lr_max is not None:
            pass
        elif not lrs:
            lr_max = None
        elif len(lrs) == 1:
            (lr_max,) = lrs.values()
        else:
            lr_max = max(lrs.values())
            if any(math.isnan(x) for x in lrs.values()):
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
        overflow = "grad_scale" in v and (layer_nonfinite or (grad_norm is not None and not math.isfinite(grad_norm)))
        if overflow:
            grad_norm = layer_norms = None
            layer_nonfinite = False
        if "grad_scale" in v:
            s.grad_scale = self.history.grad_scale = v["grad_scale"]

        if skipped:  # withheld by Monitor.step: counted as a skip, not as a fault the model took in
            events = self.history.add_step(record.step, None, None, lr_max, components)
            layer_nonfinite = False
        else:  # the usual record's windows are written in a batch (History.defer), its events now
            events = None if components else self.history.defer(record.step, loss, grad_norm, lr_max)
            if events is None:
                events = self.history.add_step(record.step, loss, grad_norm, lr_max, components)
        if self.cross_rank.align_every:  # else record() has nothing to do
            self.cross_rank.record(record.step, grad_norm)
        if "fields" in v and self.profile is not None:
            self.profile.seen(v["fields"])
        if record.has_signals:
            signals = {k[1]: x for k, x in v.items() if type(k) is tuple and k[0] == "signal"}
            for name, x in signals.items():
                self.history.add_signal(name, x, record.step)
            s.signals = {**s.signals, **{k: (x if math.isfinite(x) else math.nan) for k, x in signals.items()}}
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
        # training_loss_cv and training_loss_trend_ratio are read at scrape time (derive_gauges).
        baseline = self.history.grad.median
        s.grad_norm_baseline = baseline if math.isfinite(baseline) else None
        # The status page's windows: one tuple of floats already at hand, one dict reference.
        s.recent.append((record.step, loss, grad_norm, s.grad_norm_baseline, lr_max))
        if layer_norms is not None:
            s.layer_history.append((record.step, layer_norms))

        s.steps_total += 1
        if "tokens" in v and math.isfinite(v["tokens"]):
            s.tokens_total += max(v["tokens"], 0.0)
        if events.nonfinite_loss:
            s.nonfinite_loss_total += 1
            s.event_steps = {**s.event_steps, "nonfinite_loss": record.step}
            self.log("nonfinite_loss", logging.WARNING, "lossbeat: non-finite loss %s at step %d", loss, record.step)
        if events.nonfinite_grad or layer_nonfinite:
            if layer_nonfinite:
                origin = _nonfinite_origin(layer_norms, loss, s.run_info.get("world_size", "1") != "1")
            else:  # no per-layer norms this step: the layer of this event (consecutive bad steps), never an earlier one's
                origin = s.first_nonfinite_layer if self._nonfinite_run else None
            # Set before the counter moves: a scrape in between sees the new count with its layer.
            s.first_nonfinite_layer = origin
            s.nonfinite_grad_total += 1
            s.event_steps = {**s.event_steps, "nonfinite_grad": record.step}
            self._nonfinite_run = True
            if origin is not None:
                self.log(
                    "nonfinite_grad",
                    logging.WARNING,
                    "lossbeat: non-finite gradient at step %d; it starts at layer %s",
                    record.step,
                    origin,
                )
            else:
                self.log(
                    "nonfinite_grad", logging.WARNING, "lossbeat: non-finite gradient norm at step %d", record.step
                )
        else:
            self._nonfinite_run = False
        if overflow:
            s.grad_scaler_overflows_total += 1
            s.event_steps = {**s.event_steps, "grad_scaler_overflows": record.step}
        if events.spike:
            s.loss_spikes_total += 1
            s.event_steps = {**s.event_steps, "loss_spikes": record.step}
        if events.explosion:
            s.grad_explosions_total += 1
            s.event_steps = {**s.event_steps, "grad_explosions": record.step}
            if layer_norms:
                top = max((x for x in layer_norms.items() if math.isfinite(x[1])), key=lambda x: x[1], default=None)
                self.log(
                    "explosion",
                    logging.WARNING,
                    "lossbeat: gradient norm %.4g at step %d; largest layer: %s",
                    grad_norm,
                    record.step,
                    top[0] if top else "-",
                )
        if record.duration is not None and s.phase[0] == "train":
            self.vitals.add_step_time(record.duration, True)
        if self.due(record.step):  # every diagnose_every steps, as `lossbeat analyze` judges
            self.judgment.diagnose(record.step)


def derive_gauges(state: MonitorState, history: History) -> None:
    """The gauges derived from the loss window, computed when a scrape reads them (the caller
    holds the transfer's lock, so the window is not written meanwhile): O(window) per scrape
    instead of work on every step."""
    history.flush()  # the steps held back for a batch
    cv, trend = history.loss.cv(), history.loss.trend_ratio()
    state.loss_cv = None if math.isnan(cv) else cv
    state.loss_trend_ratio = None if math.isnan(trend) else trend


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
