"""Checks on the learning rate: invalid, too small, too large, and warmup."""

from __future__ import annotations

import math
from typing import Sequence

from ..thresholds import LearningRateThresholds
from .findings import Finding, Status

__all__ = ["check_learning_rate", "check_warmup"]


def check_learning_rate(
    recent_lrs: Sequence[float], recent_losses: Sequence[float], cv: float, t: LearningRateThresholds
) -> Finding:
    """``recent_lrs``: the largest LR across param groups, one per step, newest last.

    ``recent_losses``: the finite losses over (up to) ``t.too_small_window`` steps.
    """
    check = "learning_rate"
    if not recent_lrs:
        return Finding.unknown(check)
    lr = recent_lrs[-1]
    if not math.isfinite(lr):
        return Finding(check, Status.DANGER, f"learning rate is {lr}", "check the scheduler and the optimizer state")
    if all(v == 0 for v in recent_lrs[-5:]) and len(recent_lrs) >= 5:
        return Finding(
            check, Status.WARNING, "learning rate is 0: the model is not updating",
            "check the scheduler (a warmup from 0 that never ends, or a decay that ended)",
        )
    if len(recent_losses) >= t.too_small_window and lr < t.too_small:
        # Means of the window's first and last tenth: single per-step losses are too noisy.
        edge = max(1, len(recent_losses) // 10)
        first = sum(recent_losses[:edge]) / edge
        last = sum(recent_losses[-edge:]) / edge
        decrease = (first - last) / first if first > 0 else 0.0
        if decrease < t.too_small_min_decrease:
            return Finding(
                check, Status.WARNING,
                f"learning rate {lr:.3g} with only {decrease * 100:.1f}% loss decrease over {len(recent_losses)} steps",
                "the learning rate looks too small: try 10x larger, or check the schedule's minimum",
            )
    if math.isfinite(cv) and max(recent_lrs) > t.too_large and cv > t.too_large_cv:
        return Finding(
            check, Status.WARNING,
            f"learning rate {max(recent_lrs):.3g} with a volatile loss (CV {cv:.3f})",
            "the learning rate looks too large: lower it (e.g. 3-10x) or lengthen the warmup",
        )
    return Finding(check, Status.GOOD, f"learning rate {lr:.3g}")


def check_warmup(first_loss: float, loss_at_check: float, steps_seen: int, t: LearningRateThresholds) -> Finding:
    """After ``warmup_check_step`` steps the loss should be well below the first one."""
    check = "warmup"
    if steps_seen < t.warmup_check_step or not (math.isfinite(first_loss) and math.isfinite(loss_at_check)):
        return Finding.unknown(check)
    if first_loss > 0 and loss_at_check > t.warmup_max_ratio * first_loss:
        return Finding(
            check, Status.WARNING,
            f"loss after {t.warmup_check_step} steps is {loss_at_check:.4g}, "
            f"{loss_at_check / first_loss * 100:.0f}% of the first ({first_loss:.4g})",
            "warmup may be too short or the peak LR wrong: try warmup over ~10% of the steps",
        )
    return Finding(check, Status.GOOD, f"loss fell from {first_loss:.4g} to {loss_at_check:.4g} in the first {t.warmup_check_step} steps")
