"""Run every check on a :class:`History` and return the findings."""

from __future__ import annotations


from .findings import Finding, Status
from .gradients import check_grad_norm, check_layer_grad_norms
from .history import History
from .learning_rate import check_learning_rate, check_warmup
from .loss import check_loss_range, check_loss_trend, check_loss_volatility, check_overfitting

__all__ = ["diagnose"]


def diagnose(history: History) -> list[Finding]:
    """One finding per check (plus range/trend/volatility per loss component)."""
    t = history.thresholds
    loss = history.loss
    # Volatility is judged around the trend: a steady descent is not jitter.
    cv = loss.detrended_cv()
    trend = loss.trend_ratio()
    findings = [
        check_loss_range(loss.ring.last(t.windows.range_steps), t.profile),
        check_loss_trend(trend, t.loss, noise_ratio=loss.trend_noise_ratio()),
        check_loss_volatility(cv, t.loss),
        check_grad_norm(list(history.grad_norms), t.gradients),
        check_layer_grad_norms(history.layer_norms, t.gradients),
        check_learning_rate(
            list(history.lrs), loss.ring.last(t.learning_rate.too_small_window), cv, t.learning_rate
        ),
        check_warmup(history.first_loss, history.loss_at_warmup_check, history.finite_losses_seen, t.learning_rate),
        check_overfitting(list(history.eval_losses), trend, t.overfitting, t.loss),
        _nonfinite(history),
    ]
    component_profile = t.profiles.get("multi-task", t.profile) if t.profile.name == "multi-task" else t.profile
    for name, window in history.components.items():
        findings.append(check_loss_range(window.ring.last(t.windows.range_steps), component_profile, name))
        findings.append(check_loss_trend(window.trend_ratio(), t.loss, name, window.trend_noise_ratio()))
        findings.append(check_loss_volatility(window.detrended_cv(), t.loss, name))
    return findings


def _nonfinite(history: History) -> Finding:
    """Danger while a non-finite loss or gradient is within the volatility window, or while
    the fp16 loss scale has collapsed (nearly every step overflows and is skipped)."""
    scale, scale_min = history.grad_scale, history.thresholds.gradients.loss_scale_min
    if scale is not None and not scale >= scale_min:
        return Finding(
            "nonfinite", Status.DANGER,
            f"fp16 loss scale collapsed to {scale:.3g} (below {scale_min:g}): nearly every step overflows and is "
            "skipped",
            "the gradients overflow even unscaled: lower the learning rate, check the inputs for NaN/Inf, "
            "train in bf16, and locate the first bad op with torch.autograd.set_detect_anomaly(True)",
        )
    last = history.last_nonfinite_at
    if last is not None and history.steps_seen - last < history.thresholds.windows.cv_steps:
        ago = history.steps_seen - last
        return Finding(
            "nonfinite", Status.DANGER,
            f"non-finite loss or gradient {ago} step(s) ago ({history.nonfinite_seen} steps so far)",
            "lower the learning rate 10x, check the inputs for NaN/Inf, prefer bf16 over fp16 or use loss scaling, "
            "and locate the first bad op with torch.autograd.set_detect_anomaly(True)",
        )
    return Finding("nonfinite", Status.GOOD, "all values finite")
