"""The thresholds of the event checks (``events`` in ``thresholds.yaml``).

Apart from :mod:`lossbeat.diagnosis.events` (which re-exports it) so that the thresholds parser does
not import the checks, which read a run's history and its thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EventThresholds"]


@dataclass(frozen=True)
class EventThresholds:
    repeated: int
    """Events within the last ``windows.cv_steps`` records that make them repeated."""
    worse_after: float
    """The loss level after an event this fraction above the level before it: the event did damage."""
