"""The five loss-curve patterns of the article's section 1.3, named from the findings.

A person reads the pattern first ("pattern 3, overfitting, since step 4,200"), then the
checks behind it. Numbering follows the article: 1 ideal convergence, 2 oscillation
(learning rate too large), 3 overfitting, 4 divergence (explosion, NaN), 5 no progress
(underfitting). The article's sixth curve, convergence with noise, is pattern 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding, Status

__all__ = ["Pattern", "PATTERNS", "classify", "PatternTracker"]


@dataclass(frozen=True)
class Pattern:
    number: int
    name: str
    """Also the value of the ``pattern`` label of ``training_loss_pattern``."""
    meaning: str


PATTERNS = (
    Pattern(1, "converging", "the loss falls and settles: healthy"),
    Pattern(2, "oscillating", "the loss jumps around without settling: the learning rate is too large"),
    Pattern(3, "overfitting", "the eval loss rises while the training loss falls"),
    Pattern(4, "diverging", "the loss or the gradients blow up (NaN, explosion, a rising loss)"),
    Pattern(5, "no_progress", "the loss barely falls: underfitting, a learning rate too small, or a data problem"),
)
_BY_NAME = {p.name: p for p in PATTERNS}


def classify(findings: Iterable[Finding]) -> Pattern | None:
    """The pattern the findings show, worst first; None before the checks can judge."""
    by_check, overfitting, _ = _read(findings)
    return _classify(by_check, overfitting)


def _read(findings: Iterable[Finding]) -> tuple[dict[str, Finding], bool, bool]:
    """One pass over the findings: the total loss's by check (components are judged on their own),
    whether any evaluation set overfits, and whether the total loss is seen falling."""
    by_check: dict[str, Finding] = {}
    overfitting = False
    for f in findings:
        check = f.check
        if not f.component:
            by_check[check] = f
        # ... except overfitting, judged per evaluation set: any set that overfits counts.
        if check == "overfitting" and f.known and f.status >= WARNING:
            overfitting = True
    trend = by_check.get("loss_trend")
    falling = trend is not None and trend.known and trend.status is GOOD and trend.message.startswith("loss falling")
    return by_check, overfitting, falling


def _classify(by_check: dict[str, Finding], overfitting: bool) -> Pattern | None:
    def status(check: str) -> Status | None:
        f = by_check.get(check)
        return f.status if f is not None and f.known else None

    trend = status("loss_trend")
    if status("nonfinite") == DANGER or status("grad_norm") == DANGER or trend == DANGER:
        return _BY_NAME["diverging"]
    if overfitting:
        return _BY_NAME["overfitting"]
    lr = by_check.get("learning_rate")
    lr_too_large = lr is not None and lr.status >= WARNING and "too large" in lr.fix
    if (status("loss_volatility") or 0) >= WARNING or lr_too_large:
        return _BY_NAME["oscillating"]
    lr_too_small = lr is not None and lr.status >= WARNING and "too small" in lr.fix
    if trend == WARNING or lr_too_small:
        return _BY_NAME["no_progress"]
    if trend is None:
        return None
    return _BY_NAME["converging"]


class PatternTracker:
    """The current pattern and the step it began at.

    A run whose loss was never seen falling is not converging, even when its flat end is
    what a decayed schedule expects: it made no progress (pattern 5) from the start."""

    def __init__(self) -> None:
        self.pattern: Pattern | None = None
        self.since_step: int | None = None
        self._fell = False

    def update(self, findings: Iterable[Finding], step: int | None) -> Pattern | None:
        by_check, overfitting, falling = _read(findings)
        self._fell = self._fell or falling
        pattern = _classify(by_check, overfitting)
        if pattern is not None and pattern.name == "converging" and not self._fell:
            pattern = _BY_NAME["no_progress"]
        if pattern is not self.pattern:  # one of PATTERNS each: identity, not the dataclass's field-wise ==
            self.pattern, self.since_step = pattern, step
        return pattern

    def describe(self) -> str:
        if self.pattern is None:
            return "not enough data to name the loss curve's pattern yet"
        since = f", since step {self.since_step:,}" if self.since_step is not None else ""
        return f"looks like pattern {self.pattern.number}, {self.pattern.name.replace('_', ' ')}{since}: {self.pattern.meaning}"
