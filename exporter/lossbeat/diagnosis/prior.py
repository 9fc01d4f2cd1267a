"""A binary classifier that predicts its class prior: it learned the class balance, not the task.

A constant predictor that outputs the majority share ``a`` of a binary eval set has accuracy
``a``, log loss ``H(a) = -(a ln a + (1 - a) ln(1 - a))`` (the entropy of the class prior, the
chance level of an unbalanced task, not ln 2) and, for the positive class, F1 ``2a / (1 + a)``
when the majority is positive (0 when it is negative). :func:`check_class_prior` says so when:

* the task is known to be binary: ``eval_f1`` is logged (a binary F1: an averaged one has a
  suffix), or the train or first eval loss started at ln 2;
* the eval set size ``n`` is recovered as the smallest common denominator of the logged
  accuracies (an accuracy is correct / n exactly); not recoverable: not judged;
* the model was at the prior at an evaluation: its F1 and accuracy say it predicted one class
  only (no correct negative, or no correct positive), or, without an F1, the train and eval
  losses both sit at ``H(a)``;
* since then, the accuracy never rose beyond ``z`` standard errors ``sqrt(a(1 - a) / n)`` of
  ``a``, and the latest eval loss is within ``z`` standard errors of ``H(a)`` (a per-example
  spread of ``|ln(a / (1 - a))| sqrt(a(1 - a))``, exact for the constant predictor, floored at
  ``loss_spread_floor``).

Pure functions over a :class:`~lossbeat.diagnosis.history.History`.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import TYPE_CHECKING, Iterable, Sequence

from lossbeat.diagnosis.findings import WARNING, Finding
from lossbeat.diagnosis.profiles import ClassPriorThresholds, SignalTrack

if TYPE_CHECKING:
    from lossbeat.diagnosis.history import History

__all__ = ["check_class_prior", "eval_set_size", "prior_entropy"]

CHECK = "learning"
_COUNT_TOL = 1e-6  # an accuracy x n this close to an integer is a count (float64 k / n is off by ~1e-13)
_FIX = (
    "check that labels match inputs, weight the classes or sample them "
    "balanced (or tune the decision threshold), raise the learning rate or train longer; judge it by balanced "
    "accuracy, MCC or macro-F1, which a prior predictor cannot fake"
)


def prior_entropy(a: float) -> float:
    """H(a) in nats: the log loss of a constant predictor at share ``a``."""
    if not 0.0 < a < 1.0:
        return 0.0
    return -(a * math.log(a) + (1.0 - a) * math.log(1.0 - a))


def eval_set_size(accuracies: Iterable[float], largest: int) -> int | None:
    """The smallest n (at most ``largest``) for which every accuracy is a count / n, else None."""
    return _set_size(tuple(sorted(set(accuracies))), largest)


@functools.lru_cache(maxsize=64)  # judged at every diagnosis; the accuracies change once an evaluation
def _set_size(accuracies: tuple[float, ...], largest: int) -> int | None:
    n = 1
    for a in accuracies:
        if not 0.0 <= a <= 1.0:
            return None
        d = Fraction(a).limit_denominator(largest).denominator
        if abs(a * d - round(a * d)) > _COUNT_TOL:
            return None  # not a fraction with a denominator this small: averaged, rounded or float32
        n = n * d // math.gcd(n, d)
        if n > largest:
            return None  # no common eval set size: the accuracies are not one set's counts
    return n


def _aligned(acc: SignalTrack, f1: SignalTrack | None) -> tuple[list[float], Sequence[float | None]]:
    accs = acc.recent.last(len(acc.recent))
    if f1 is None or f1.count != acc.count:
        return accs, [None] * len(accs)
    f1s = f1.recent.last(len(f1.recent))
    m = min(len(accs), len(f1s))
    return accs[-m:], f1s[-m:]


def _one_class(a: float, f: float, n: int) -> bool:
    """Whether accuracy ``a`` and positive-class F1 ``f`` on ``n`` examples leave one class never
    predicted right: TP = f E / (2 (1 - f)) with E = n (1 - a) errors, TN = n a - TP."""
    if a < 0.5 or not 0.0 <= f < 1.0:
        return False
    if f == 0.0:
        return True  # no correct positive: the negatives' share, predicted for all
    tp = f * n * (1.0 - a) / (2.0 * (1.0 - f))
    return n * a - tp < 0.5  # no correct negative: F1 = 2a / (1 + a), the positives' share predicted for all


def _train_mean(history: History) -> tuple[float, float]:
    values = history.loss.ring.last(len(history.loss.ring))
    tail = values[-max(1, len(values) // 4) :]
    noise = history.loss.noise
    se = noise / math.sqrt(len(tail)) if math.isfinite(noise) else math.inf
    return (sum(tail) / len(tail) if tail else math.nan), se


def check_class_prior(history: History, c: ClassPriorThresholds, ln2_start: bool) -> Finding | None:
    """A WARNING when the binary classifier predicts its class prior (see the module), else None.
    ``ln2_start``: the train or the first eval loss started at ln 2 (a binary task)."""
    acc, f1 = history.signals.get("eval_accuracy"), history.signals.get("eval_f1")
    if acc is None or acc.count < 2 or not (f1 is not None or ln2_start):
        return None
    accs, f1s = _aligned(acc, f1)
    n = eval_set_size(accs, c.max_eval_examples)
    if n is None or n < c.min_eval_examples:
        return None  # the accuracies' denominator cannot be recovered: no sampling noise to judge by
    track = history.evals.get("") or (next(iter(history.evals.values())) if len(history.evals) == 1 else None)
    eval_loss = track.latest if track is not None and track.count else math.nan
    # The latest evaluation at the prior: one class never predicted right (an F1), else (no F1)
    # the first one, confirmed below by both losses at H(a).
    at = next(
        (i for i in range(len(accs) - 1, -1, -1) if (f := f1s[i]) is not None and _one_class(accs[i], f, n)), None
    )
    if at is None and f1s[0] is None and accs[0] >= 0.5:
        at = 0
    if at is None:
        return None
    a = accs[at]
    if not 0.5 <= a < 1.0:
        return None
    band = c.z * math.sqrt(a * (1.0 - a) / n)
    if max(accs[at:]) - a > band:
        return None  # the accuracy rose beyond its noise: the model learned something
    h = prior_entropy(a)
    spread = max(abs(math.log(a / (1.0 - a))) * math.sqrt(a * (1.0 - a)), c.loss_spread_floor)
    loss_band = c.z * spread / math.sqrt(n)
    if math.isfinite(eval_loss) and abs(eval_loss - h) > loss_band:
        return None  # the eval loss left the prior's entropy: below it learned, above it is another finding
    f = f1s[at]
    how = (
        ""
        if f is None
        else (
            f"eval F1 0 at evaluation {at + 1}: no positive predicted right"
            if f == 0.0
            else f"eval F1 {f:.3g} = 2a/(1+a) at evaluation {at + 1}: every example predicted positive"
        )
    )
    if not how:
        train, se = _train_mean(history)
        if not math.isfinite(eval_loss) or not abs(train - h) <= loss_band + c.z * se:
            return None  # no F1: only both losses at H(a) say the model outputs the prior
        how = f"train loss {train:.4g} at H(a) too"
    loss = (
        f", eval loss {eval_loss:.4g} against the prior's entropy H({a:.3f}) = {h:.4g}"
        if math.isfinite(eval_loss)
        else ""
    )
    return Finding(
        CHECK,
        WARNING,
        f"at the class prior: eval accuracy {accs[-1]:.3f} over {acc.count} evaluations stays at the "
        f"majority share {a:.3f} (within {band:.3f}, {c.z:g} standard errors of {n} examples){loss} "
        f"({how}): the model predicts the class prior: it learned the class balance, not the task",
        _FIX,
    )
