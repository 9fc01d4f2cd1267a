"""Checks on gradient norms: global explosion / vanishing and per-layer outliers."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from ..thresholds import GradientThresholds
from ..window import fsum
from .findings import Finding, Status

__all__ = ["check_grad_norm", "check_layer_grad_norms"]


def check_grad_norm(recent: Sequence[float], t: GradientThresholds) -> Finding:
    """Layer 4 (gradients): the mean global grad norm over the recent steps."""
    check = "grad_norm"
    finite = [v for v in recent if math.isfinite(v)]
    if not finite:
        return Finding.unknown(check)
    mean = fsum(finite) / len(finite)
    if mean > t.explosion:
        return Finding(
            check, Status.DANGER,
            f"gradient norm {mean:.3g} is above {t.explosion:g}: exploding gradients",
            "clip gradients (clip_grad_norm_ to 1.0), lower the learning rate, check that inputs are normalised",
        )
    if mean < t.vanishing:
        return Finding(
            check, Status.WARNING,
            f"gradient norm {mean:.3g} is below {t.vanishing:g}: vanishing gradients",
            "look for saturated activations, add residual connections or normalisation, raise the learning rate",
        )
    if t.healthy_low <= mean <= t.healthy_high:
        return Finding(check, Status.GOOD, f"gradient norm {mean:.3g} in the healthy band")
    return Finding(check, Status.GOOD, f"gradient norm {mean:.3g}")


def check_layer_grad_norms(layer_norms: Mapping[str, float], t: GradientThresholds, shown: int = 3) -> Finding:
    """Layers whose own grad norm is out of bounds (non-finite layers are the nonfinite check's)."""
    check = "layer_grad_norm"
    if not layer_norms:
        return Finding.unknown(check)
    exploding = sorted(
        ((n, v) for n, v in layer_norms.items() if math.isfinite(v) and v > t.layer_explosion),
        key=lambda item: -item[1],
    )
    vanishing = [(n, v) for n, v in layer_norms.items() if math.isfinite(v) and v < t.layer_vanishing]
    messages, fixes = [], []
    if exploding:
        names = ", ".join(f"{n} ({v:.3g})" for n, v in exploding[:shown])
        messages.append(f"{len(exploding)} layer(s) above {t.layer_explosion:g}: {names}")
        fixes.append("clip gradients; lower the learning rate for these layers; check their initialisation")
    if vanishing:
        names = ", ".join(n for n, _ in vanishing[:shown])
        messages.append(f"{len(vanishing)} layer(s) below {t.layer_vanishing:g}: {names}")
        fixes.append("check that the vanishing layers are meant to train; add residual connections or normalisation")
    if messages:
        return Finding(check, Status.WARNING, "; ".join(messages), "; ".join(fixes))
    return Finding(check, Status.GOOD, f"all {len(layer_norms)} layers within bounds")
