"""The step observer: the config, a thin Monitor (validate → measure → submit → drain → apply → judge),
the deferred device→host transfer, the lifecycle, and NullMonitor."""

from lossbeat.monitor.core import DEFAULT_PORT, Monitor, MonitorConfig, NullMonitor, Report, start_exporter

__all__ = ["DEFAULT_PORT", "Monitor", "MonitorConfig", "NullMonitor", "Report", "start_exporter"]
