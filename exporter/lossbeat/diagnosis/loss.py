"""Checks on the loss: absolute range, trend, volatility, spikes, overfitting.

Pure functions over plain floats; thresholds come from :mod:`lossbeat.thresholds`.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..thresholds import LossThresholds, OverfittingThresholds, Profile
from ..window import fsum
from .findings import Finding, Status

__all__ = ["check_loss_range", "check_loss_trend", "check_loss_volatility", "is_spike", "check_overfitting"]


def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return fsum(finite) / len(finite) if finite else math.nan


def check_loss_range(recent: Sequence[float], profile: Profile, component: str = "") -> Finding:
    """Layer 1: is the mean of the recent losses where this task's losses live?"""
    check = "loss_range"
    if profile.loss_good is None and profile.loss_warn_low is None and profile.loss_warn_high is None:
        return Finding.unknown(check, f"profile {profile.name} has no absolute loss range", component)
    mean = _finite_mean(recent)
    if math.isnan(mean):
        return Finding.unknown(check, component=component)
    if profile.loss_warn_high is not None and mean > profile.loss_warn_high:
        return Finding(
            check, Status.WARNING,
            f"mean loss {mean:.4g} is above {profile.loss_warn_high:g} for a {profile.name} task",
            "check the learning rate, the labels and the loss reduction; a loss this high often means the model is not learning",
            component,
        )
    if profile.loss_warn_low is not None and mean < profile.loss_warn_low:
        return Finding(
            check, Status.WARNING,
            f"mean loss {mean:.4g} is below {profile.loss_warn_low:g}: suspiciously low for a {profile.name} task",
            "look for label leakage or memorisation: compare with the eval loss and check the data split",
            component,
        )
    if profile.loss_good is not None and profile.loss_good[0] <= mean <= profile.loss_good[1]:
        return Finding(check, Status.GOOD, f"mean loss {mean:.4g} is in the usual range", component=component)
    return Finding(check, Status.GOOD, f"mean loss {mean:.4g}", component=component)


def check_loss_trend(trend_ratio: float, t: LossThresholds, component: str = "", noise_ratio: float = 0.0) -> Finding:
    """Layer 2: is the loss still falling? ``trend_ratio`` > 0 means it falls.

    ``noise_ratio``: the standard error of the trend ratio from step-to-step
    noise; a rise smaller than ``t.trend_min_z`` of them is a plateau, not a rise.
    """
    check = "loss_trend"
    if not math.isfinite(trend_ratio):
        return Finding.unknown(check, component=component)
    pct = trend_ratio * 100
    if trend_ratio > t.trend_improving:
        return Finding(check, Status.GOOD, f"loss falling ({pct:.1f}% between windows)", component=component)
    if trend_ratio >= t.trend_rising or -trend_ratio <= t.trend_min_z * noise_ratio:
        return Finding(
            check, Status.WARNING,
            f"loss has plateaued ({pct:+.1f}% between windows)",
            "if it is not converged: raise the learning rate, try a cosine schedule with restarts, or check that the data is shuffled",
            component,
        )
    return Finding(
        check, Status.DANGER,
        f"loss is rising ({pct:+.1f}% between windows)",
        "lower the learning rate, enable gradient clipping, and check the data of the recent steps",
        component,
    )


def check_loss_volatility(cv: float, t: LossThresholds, component: str = "") -> Finding:
    """Layer 3: how much does the loss jump around its trend? ``cv``: std / mean of the
    window, detrended by the caller (:meth:`LossWindow.detrended_cv`)."""
    check = "loss_volatility"
    if not math.isfinite(cv):
        return Finding.unknown(check, component=component)
    if cv < t.cv_warning:
        return Finding(check, Status.GOOD, f"loss volatility normal (CV {cv:.3f})", component=component)
    if cv < t.cv_danger:
        return Finding(
            check, Status.WARNING,
            f"loss is volatile (CV {cv:.3f})",
            "use a larger batch (or gradient accumulation) or a lower learning rate",
            component,
        )
    return Finding(
        check, Status.DANGER,
        f"loss is very volatile (CV {cv:.3f})",
        "lower the learning rate, clip gradients, and look for bad batches",
        component,
    )


def is_spike(value: float, mean: float, std: float, sigma: float) -> bool:
    """A loss above mean + sigma * std of the window before it."""
    return math.isfinite(value) and std > 0 and value > mean + sigma * std


def check_overfitting(
    eval_losses: Sequence[float], train_trend_ratio: float, t: OverfittingThresholds, loss_t: LossThresholds
) -> Finding:
    """Eval loss rising from its best while the training loss still falls."""
    check = "overfitting"
    finite = [v for v in eval_losses if math.isfinite(v)]
    if len(finite) < 2:
        return Finding.unknown(check)
    best = min(finite)
    latest = finite[-1]
    rise = (latest - best) / best if best > 0 else math.inf if latest > best else 0.0
    train_falling = math.isfinite(train_trend_ratio) and train_trend_ratio > 0
    if rise > t.eval_rise and latest > finite[-2] * (1 - 1e-9) and (train_falling or math.isnan(train_trend_ratio)):
        return Finding(
            check, Status.WARNING,
            f"eval loss {latest:.4g} is {rise * 100:.0f}% above its best {best:.4g} while the training loss falls",
            "add weight decay or dropout, get more data, or stop early at the best checkpoint",
        )
    return Finding(check, Status.GOOD, f"eval loss {latest:.4g} (best {best:.4g})")
