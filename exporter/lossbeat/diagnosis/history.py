"""Bounded training history: what the checks read, fed one step at a time.

Torch-free, so the live monitor and offline analysis of log files share it.
Memory is fixed by the thresholds' window sizes, whatever the run length.
"""

from __future__ import annotations

import math
from typing import Mapping

from ..thresholds import Thresholds
from ..window import LossWindow, Ring

__all__ = ["History", "StepEvents"]

_MAX_COMPONENTS = 32  # bounded label cardinality for multi-task losses


class StepEvents:
    """What one step counted (each flag is a counter increment)."""

    __slots__ = ("nonfinite_loss", "nonfinite_grad", "spike", "explosion")

    def __init__(self) -> None:
        self.nonfinite_loss = False
        self.nonfinite_grad = False
        self.spike = False
        self.explosion = False


class History:
    def __init__(self, thresholds: Thresholds) -> None:
        t = thresholds
        self.thresholds = t
        w = t.windows
        self.loss = LossWindow(w.cv_steps, w.trend_steps, history=t.learning_rate.too_small_window)
        self.components: dict[str, LossWindow] = {}
        self.grad_norms = Ring(w.grad_steps)
        self.lrs = Ring(max(5, w.grad_steps))
        self.eval_losses = Ring(64)
        self.first_loss = math.nan
        self.loss_at_warmup_check = math.nan
        self.finite_losses_seen = 0
        self.last_step: int | None = None
        self.steps_seen = 0
        self.nonfinite_seen = 0
        self.last_nonfinite_at: int | None = None  # steps_seen at the last non-finite value
        self.layer_norms: Mapping[str, float] = {}
        self.grad_scale: float | None = None  # fp16 GradScaler's loss scale, when one is observed

    def reset_windows(self) -> None:
        """The step went backwards (resumed from a checkpoint): old windows no longer apply."""
        self.loss.clear()
        for window in self.components.values():
            window.clear()
        self.grad_norms.clear()
        self.lrs.clear()

    def add_step(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        learning_rate: float | None = None,
        components: Mapping[str, float] | None = None,
    ) -> StepEvents:
        """Record one step; returns the events it counts. Never raises on data."""
        t = self.thresholds
        events = StepEvents()
        self.steps_seen += 1
        if self.last_step is not None and step < self.last_step:
            self.reset_windows()
        self.last_step = step

        if math.isfinite(loss):
            window = self.loss
            if window.ring and len(window) >= t.loss.spike_min_steps:
                events.spike = _spike(loss, window.mean(), window.std(), t.loss.spike_sigma)
            window.push(loss)
            if self.finite_losses_seen == 0:
                self.first_loss = loss
            self.finite_losses_seen += 1
            if self.finite_losses_seen == t.learning_rate.warmup_check_step:
                self.loss_at_warmup_check = loss
        else:
            events.nonfinite_loss = True

        if grad_norm is not None:
            if math.isfinite(grad_norm):
                self.grad_norms.push(grad_norm)
                events.explosion = grad_norm > t.gradients.explosion
            else:
                events.nonfinite_grad = True

        if learning_rate is not None:
            self.lrs.push(learning_rate)

        if events.nonfinite_loss or events.nonfinite_grad:
            self.nonfinite_seen += 1
            self.last_nonfinite_at = self.steps_seen

        if components:
            for name, value in components.items():
                window = self.components.get(name)
                if window is None:
                    if len(self.components) >= _MAX_COMPONENTS:
                        continue
                    window = self.components[name] = LossWindow(t.windows.cv_steps, t.windows.trend_steps)
                if math.isfinite(value):
                    window.push(value)
        return events

    def add_eval(self, eval_loss: float) -> None:
        self.eval_losses.push(eval_loss)


def _spike(value: float, mean: float, std: float, sigma: float) -> bool:
    return std > 0 and value > mean + sigma * std
