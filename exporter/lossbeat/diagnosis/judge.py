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

from lossbeat.diagnosis.findings import DANGER, GOOD, Finding, Status
from lossbeat.diagnosis.history import History
from lossbeat.diagnosis.run import diagnose
from lossbeat.diagnosis.thresholds import Thresholds

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
        self._held_now: dict[tuple[str, str], Status] = {}  # each held finding's status, for the value hysteresis
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
        # at its end, where no warning can be confirmed (real-logs-2's custom fp16 log: four restarts
        # of 3-8 records each, every one flat, read as good).
        if self._judged_at is None:
            self._judged_at = step
        return self._records % every == 0 or step - self._judged_at >= every or step < self._judged_at

    def judge(self, step: int | None = None) -> tuple[list[Finding], list[StatusChange]]:
        """Diagnose now; returns the held findings and the status changes this diagnosis made."""
        self.history.flush()  # the records held back for a batch, into the windows the checks read
        h = self.thresholds.hysteresis
        warning_enter, danger_enter, leave = h.warning_enter, h.danger_enter, h.leave
        self._records = 0
        self._judged_at = step
        findings, changes = [], []
        held_map, held_now = self._held, self._held_now
        for raw in diagnose(self.history, held_now):  # a list: held_now is read before it changes below
            key = (raw.check, raw.component)
            held = held_map.get(key)
            if held is None:
                # Good until confirmed; a first word of a worse status says it is only that.
                first = (
                    raw.message
                    if raw.status is GOOD or not raw.known
                    else (
                        f"{raw.message} (said once, not yet confirmed: a {raw.status.name.lower()} after "
                        f"{danger_enter if raw.status is DANGER else warning_enter} diagnoses in a row)"
                    )
                )
                held = held_map[key] = _Held(Finding(raw.check, GOOD, first, component=raw.component, known=raw.known))
                held_now[key] = GOOD
            finding = held.finding
            before = finding.status
            status = raw.status
            if status == before or not raw.known:
                held.finding = finding = raw
                held.up = held.down = 0
            elif status > before:
                held.down = 0
                held.up += 1
                if held.up >= (danger_enter if status is DANGER else warning_enter):
                    held.finding = finding = raw
                    held.up = 0
            else:
                held.up = 0
                held.down += 1
                if held.down >= leave:
                    held.finding = finding = raw
                    held.down = 0
            if finding.status != before:
                changes.append(StatusChange(before, finding, step))
                held_now[key] = finding.status
            findings.append(finding)
        self.findings = findings
        return findings, changes
