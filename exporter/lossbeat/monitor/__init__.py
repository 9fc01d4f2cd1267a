"""The step observer: the config, a thin Monitor (validate → measure → submit → drain → apply → judge),
the deferred device→host transfer, the lifecycle, and NullMonitor."""

from lossbeat.monitor.config import DEFAULT_PORT, MonitorConfig
from lossbeat.monitor.core import Monitor
from lossbeat.monitor.guard import TrainingHalted
from lossbeat.monitor.null import NullMonitor, PhaseScope
from lossbeat.monitor.report import Report
from lossbeat.monitor.start import start_exporter

__all__ = [
    "DEFAULT_PORT",
    "Monitor",
    "MonitorConfig",
    "NullMonitor",
    "PhaseScope",
    "Report",
    "start_exporter",
    "TrainingHalted",
]
