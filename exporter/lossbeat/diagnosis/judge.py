"""Judgments with hysteresis: the one path from a :class:`History` to stable statuses.

The live :class:`lossbeat.monitor.Monitor` and ``lossbeat analyze`` both use a
:class:`Judge`, so the same series gives the same findings in both. A check
enters a worse status only after ``hysteresis.warning_enter`` (or
``danger_enter``) diagnoses in a row say so, and leaves it only after
``hysteresis.leave`` diagnoses in a row say better; a check that cannot judge
(non-finite loss, not enough data) says so at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.diagnosis.findings import DANGER, GOOD, Finding, Status
from lossbeat.diagnosis.history import History
from lossbeat.diagnosis.run import diagnose

__all__ = ["Judge", "StatusChange"]


@dataclass(frozen=True)
class StatusChange:
    previous: Status
    finding: Finding
    """The finding now held (its status is the new one)."""
    step: int | None

    @property
    def where(self) -> str:
        f = self.finding
        return f"{f.check}[{f.component}]" if f.component else f.check


class _Held:
    __slots__ = ("finding", "up", "down")

    def __init__(self, finding: Finding) -> None:
        self.finding = finding
        self.up = 0
        self.down = 0


class Judge:
    """A :class:`History` and the stable findings judged from it."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self.history = History(thresholds)
        self._held: dict[tuple[str, str], _Held] = {}
        self.findings: list[Finding] = []
        self._records = 0
        self._judged_at: int | None = None

    def retarget(self, thresholds: Thresholds) -> None:
        """Judge with ``thresholds`` from now on (another profile of the same file, detected
        live from the names ``observe`` was given); the windows and held statuses stay."""
        self.thresholds = thresholds
        self.history.retarget(thresholds)

    def due(self, step: int) -> bool:
        """Whether the judgment is due after a record at ``step``: every ``diagnose_every`` records, or
        ``diagnose_every`` steps, whichever comes first (a sparse log is judged at every record, so a dwell
        lasts about as many steps whatever the log interval)."""
        every = self.thresholds.windows.diagnose_every
        self._records += 1
        # Steps count from the first record before any judgment: a sparse log (every 10 steps) of a
        # short run was otherwise first judged at its 10th record, and a run of 3-8 records only once,
        # at its end, where no warning can be confirmed (issue 18: four restarts of 3-8 records each,
        # every one flat, read as good).
        if self._judged_at is None:
            self._judged_at = step
        return self._records % every == 0 or step - self._judged_at >= every or step < self._judged_at

    def judge(self, step: int | None = None) -> tuple[list[Finding], list[StatusChange]]:
        """Diagnose now; returns the held findings and the status changes this diagnosis made."""
        self.history.flush()  # the records held back for a batch, into the windows the checks read
        h = self.thresholds.hysteresis
        self._records = 0
        self._judged_at = step
        findings, changes = [], []
        held_now = {key: held.finding.status for key, held in self._held.items()}
        for raw in diagnose(self.history, held_now):
            key = (raw.check, raw.component)
            held = self._held.get(key)
            if held is None:
                # Good until confirmed; a first word of a worse status says it is only that.
                first = raw.message if raw.status is GOOD or not raw.known else (
                    f"{raw.message} (said once, not yet confirmed: a {raw.status.name.lower()} after "
                    f"{h.danger_enter if raw.status is DANGER else h.warning_enter} diagnoses in a row)")
                held = self._held[key] = _Held(Finding(raw.check, GOOD, first, component=raw.component,
                                                       known=raw.known))
            before = held.finding.status
            if not raw.known or raw.status == before:
                held.finding, held.up, held.down = raw, 0, 0
            elif raw.status > before:
                held.up, held.down = held.up + 1, 0
                if held.up >= (h.danger_enter if raw.status is DANGER else h.warning_enter):
                    held.finding, held.up = raw, 0
            else:
                held.down, held.up = held.down + 1, 0
                if held.down >= h.leave:
                    held.finding, held.down = raw, 0
            if held.finding.status != before:
                changes.append(StatusChange(before, held.finding, step))
            findings.append(held.finding)
        self.findings = findings
        return findings, changes
