"""The result type every diagnosis check returns."""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["Status", "Finding", "GOOD", "WARNING", "DANGER"]


class Status(enum.IntEnum):
    """Exported as ``training_health_status``: 0 good, 1 warning, 2 danger."""

    GOOD = 0
    WARNING = 1
    DANGER = 2


GOOD, WARNING, DANGER = Status.GOOD, Status.WARNING, Status.DANGER
"""The statuses as module names, for the checks: under Python 3.11 ``Status.GOOD`` goes through
``EnumType.__getattr__``'s hook, five times the cost of a global, dozens of times a diagnosis."""


class Finding(NamedTuple):
    """One check's verdict. Immutable; a tuple, because a diagnosis builds a dozen or more of
    them every ``windows.diagnose_every`` steps on the training thread (a frozen dataclass costs
    three times as much to build)."""

    check: str
    """One of :data:`lossbeat.exposition.metrics.HEALTH_CHECKS`."""
    status: Status
    message: str
    """What was seen, with the numbers."""
    fix: str = ""
    """What to try; empty when all is well."""
    component: str = ""
    """The loss component the finding is about ('' = the total loss)."""
    known: bool = True
    """False when there was not enough data to judge (status is then GOOD)."""

    @classmethod
    def unknown(cls, check: str, message: str = "not enough data yet", component: str = "") -> Finding:
        return cls(check, GOOD, message, "", component, False)
