"""lossbeat: a training-health monitor for PyTorch, exported to Prometheus.

    from lossbeat import start_exporter
    monitor = start_exporter(8470)
    monitor.observe(step, loss=loss, optimizer=optimizer, model=model)

The public names load on first use (PEP 562), so the torch-free rooms (``lossbeat.diagnosis``,
``lossbeat.mixin``, ``lossbeat.logs``) import without torch or prometheus_client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lossbeat._version import __version__ as __version__  # re-exported

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from lossbeat.diagnosis.thresholds import Thresholds, ThresholdsError, load_thresholds
    from lossbeat.monitor import (
        DEFAULT_PORT,
        Monitor,
        MonitorConfig,
        NullMonitor,
        Report,
        TrainingHalted,
        start_exporter,
    )

__all__ = [
    "start_exporter",
    "Monitor",
    "MonitorConfig",
    "NullMonitor",
    "Report",
    "DEFAULT_PORT",
    "load_thresholds",
    "Thresholds",
    "ThresholdsError",
    "TrainingHalted",
]

_HOME = {  # keep in step with the TYPE_CHECKING imports above
    "start_exporter": "lossbeat.monitor",
    "Monitor": "lossbeat.monitor",
    "MonitorConfig": "lossbeat.monitor",
    "NullMonitor": "lossbeat.monitor",
    "Report": "lossbeat.monitor",
    "DEFAULT_PORT": "lossbeat.monitor",
    "TrainingHalted": "lossbeat.monitor",
    "load_thresholds": "lossbeat.diagnosis.thresholds",
    "Thresholds": "lossbeat.diagnosis.thresholds",
    "ThresholdsError": "lossbeat.diagnosis.thresholds",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'lossbeat' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
