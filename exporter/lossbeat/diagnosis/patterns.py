"""The five loss-curve patterns of the article's section 1.3, named from the findings.

A person reads the pattern first ("pattern 3, overfitting, since step 4,200"), then the
checks behind it. Numbering follows the article: 1 ideal convergence, 2 oscillation
(learning rate too large), 3 overfitting, 4 divergence (explosion, NaN), 5 no progress
(underfitting). The article's sixth curve, convergence with noise, is pattern 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding

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
    by_check: dict[str, Finding] = {}
    overfitting = False
    for f in findings:
        if not f.component:  # the total loss; components are judged on their own
            by_check[f.check] = f
        # ... except overfitting, judged per evaluation set: any set that overfits counts.
        overfitting = overfitting or (f.check == "overfitting" and f.known and f.status >= WARNING)
    status = lambda check: by_check[check].status if check in by_check and by_check[check].known else None  # noqa: E731
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
        findings = list(findings)
        self._fell = self._fell or any(
            f.check == "loss_trend" and not f.component and f.known and f.status is GOOD
            and f.message.startswith("loss falling") for f in findings
        )
        pattern = classify(findings)
        if pattern is not None and pattern.name == "converging" and not self._fell:
            pattern = _BY_NAME["no_progress"]
        if pattern != self.pattern:
            self.pattern, self.since_step = pattern, step
        return pattern

    def describe(self) -> str:
        if self.pattern is None:
            return "not enough data to name the loss curve's pattern yet"
        since = f", since step {self.since_step:,}" if self.since_step is not None else ""
        return f"looks like pattern {self.pattern.number}, {self.pattern.name.replace('_', ' ')}{since}: {self.pattern.meaning}"
