"""The end-of-run report: the last findings, the event counts and the loss curve's pattern."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from lossbeat.diagnosis import Finding, Status

__all__ = ["Report"]


@dataclass(frozen=True)
class Report:
    """The end-of-run report: the last findings and the event counts."""

    findings: tuple[Finding, ...]
    counters: Mapping[str, float]
    step: float | None
    pattern: str = ""
    """The loss curve's pattern (article section 1.3), in words, with the step it began at."""

    @property
    def worst(self) -> Status:
        return max((f.status for f in self.findings), default=Status.GOOD)

    def __str__(self) -> str:
        lines = [f"lossbeat report (last step {int(self.step) if self.step is not None else '-'})"]
        if self.pattern:
            lines.append(f"  this run {self.pattern}")
        marks = {Status.GOOD: "ok  ", Status.WARNING: "WARN", Status.DANGER: "DANG"}
        for f in self.findings:
            if not f.known:
                continue
            where = f"{f.check}[{f.component}]" if f.component else f.check
            lines.append(f"  {marks[f.status]} {where:<24} {f.message}")
            if f.fix and f.status is not Status.GOOD:
                lines.append(f"       fix: {f.fix}")
        lines.append("  events: " + ", ".join(f"{k} {v:g}" for k, v in self.counters.items()))
        return "\n".join(lines)
