"""Checks on gradient norms: departures from the run's own level, vanishing, per-layer outliers."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.thresholds import GradientThresholds
from lossbeat.diagnosis.window import median as _median

if TYPE_CHECKING:
    from lossbeat.diagnosis.series import GradBaseline

__all__ = ["check_grad_norm", "check_layer_grad_norms", "LayerLevels"]

_MAX_LAYERS = 4096  # layers remembered (the monitor groups parameters into far fewer)

_CLIMB_RECORDS = 20
_FIX = "clip gradients (clip_grad_norm_ to 1.0), lower the learning rate, check the recent batches and that inputs are normalised"


def check_grad_norm(baseline: GradBaseline, t: GradientThresholds) -> Finding:
    """Layer 4 (gradients): the recent grad norm against the run's baseline (:class:`GradBaseline`).

    Danger: the recent median jumped to ``jump_ratio`` x the rolling median, or
    climbed to ``climb_ratio`` x the run's slow level. A stable level above the
    absolute ceiling, or the first steps of a run, are the run's own level.
    """
    check = "grad_norm"
    recent = baseline.recent
    if not math.isfinite(recent):
        return Finding.unknown(check)
    if recent < t.vanishing:
        return Finding(
            check,
            WARNING,
            f"gradient norm {recent:.3g} is below {t.vanishing:g}: vanishing gradients",
            "look for saturated activations, add residual connections or normalisation, raise the learning rate",
        )
    if not baseline.established:
        return Finding(check, GOOD, f"gradient norm {recent:.3g} (baseline not established yet: first steps)")
    median, level = baseline.median, baseline.level
    if median > 0 and recent > t.jump_ratio * median:
        return Finding(
            check,
            DANGER,
            f"gradient norm {recent:.3g} jumped to {recent / median:.1f}x the run's baseline {median:.3g}: exploding gradients",
            _FIX,
        )
    if not median > 0 and recent > t.explosion:  # a baseline of zero gradients: no ratio, the ceiling
        return Finding(
            check,
            DANGER,
            f"gradient norm {recent:.3g} jumped from a baseline of {median:.3g}, above {t.explosion:g}: exploding gradients",
            _FIX,
        )
    # A climb is the run's median level climbing: the median of the last records (as many as the
    # baseline needs), not a few spikes that clipping absorbs.
    climbing = math.isfinite(level) and level > 0 and recent > t.climb_ratio * level
    wide = _median(baseline.ring.last(_CLIMB_RECORDS)) if climbing else math.nan  # read only when it decides
    if climbing and wide > t.climb_ratio * level:
        return Finding(
            check,
            DANGER,
            f"gradient norm {recent:.3g} keeps climbing: the median of the last {_CLIMB_RECORDS} records {wide:.3g} "
            f"is {wide / level:.1f}x the run's level {level:.3g}",
            _FIX,
        )
    above = f", above the absolute ceiling {t.explosion:g} but at the run's own level" if recent > t.explosion else ""
    return Finding(check, GOOD, f"gradient norm {recent:.3g} (baseline {median:.3g}{above})")


class LayerLevels:
    """Each layer's own highest grad norm at a diagnosis, and the diagnoses in a row its norm has sat
    below ``layer_vanishing`` and ``layer_vanished_drop`` x that level. Bounded: one float and one int
    per layer, at most ``_MAX_LAYERS`` layers."""

    __slots__ = ("level", "vanished")

    def __init__(self) -> None:
        self.level: dict[str, float] = {}
        self.vanished: dict[str, int] = {}

    def update(self, layer_norms: Mapping[str, float], t: GradientThresholds) -> None:
        """Read the layers' latest norms at a diagnosis (one pass over the layers)."""
        level, vanished = self.level, self.vanished
        for name, value in layer_norms.items():
            if not math.isfinite(value):
                continue  # the nonfinite check's
            top = level.get(name)
            if top is None:
                if len(level) >= _MAX_LAYERS:
                    continue
                top = level[name] = 0.0
            if value > top:
                level[name] = top = value
            gone = value < t.layer_vanishing and value < t.layer_vanished_drop * top
            vanished[name] = vanished.get(name, 0) + 1 if gone else 0

    def stopped(self, t: GradientThresholds) -> list[tuple[str, float]]:
        """The layers whose gradients vanished against their own level and stayed so: (name, level)."""
        return [(n, self.level[n]) for n, k in self.vanished.items() if k >= t.layer_vanished_diagnoses]


def check_layer_grad_norms(
    layer_norms: Mapping[str, float], t: GradientThresholds, shown: int = 3, levels: LayerLevels | None = None
) -> Finding:
    """Layers whose own grad norm is out of bounds (non-finite layers are the nonfinite check's).

    A layer whose gradients fell by orders of magnitude below its own earlier level mid-run, and stayed
    there (``levels``), has stopped learning: a danger (the article's cheat sheet), whatever the rest does.
    """
    check = "layer_grad_norm"
    if not layer_norms:
        return Finding.unknown(check)
    stopped = levels.stopped(t) if levels is not None else []
    if stopped:
        names = ", ".join(
            f"{n} ({layer_norms.get(n, math.nan):.3g}, was up to {top:.3g})" for n, top in stopped[:shown]
        )
        return Finding(
            check,
            DANGER,
            f"{len(stopped)} layer(s) whose gradients vanished more than {1 / t.layer_vanished_drop:.0f}x below "
            f"their own level mid-run and stayed there for {t.layer_vanished_diagnoses}+ diagnoses: {names}; "
            "they have stopped learning",
            "find what cut these layers off: a hook or a mask that scales their gradients, a detach() or "
            "no_grad() around them, a frozen parameter group, a saturated activation or gate; the rest of the "
            "model trains without them",
        )
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
        return Finding(check, WARNING, "; ".join(messages), "; ".join(fixes))
    return Finding(check, GOOD, f"all {len(layer_norms)} layers within bounds")
