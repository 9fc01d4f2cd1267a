"""lossbeat: a training-health monitor for PyTorch, exported to Prometheus.

    from lossbeat import start_exporter
    monitor = start_exporter(8470)
    monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
"""

from ._version import __version__  # noqa: E402,F401  (re-exported)

from .monitor import DEFAULT_PORT, Monitor, MonitorConfig, NullMonitor, Report, start_exporter  # noqa: E402
from .thresholds import Thresholds, ThresholdsError, load_thresholds  # noqa: E402

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
]
