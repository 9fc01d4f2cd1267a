"""``start_exporter``: serve /metrics and return the process's one monitor (or a NullMonitor)."""

from __future__ import annotations

import logging
import os
from typing import Any

from lossbeat.exposition.server import RankContext
from lossbeat.monitor.config import DEFAULT_PORT, MonitorConfig
from lossbeat.monitor.core import Monitor
from lossbeat.monitor.lifecycle import process
from lossbeat.monitor.null import NullMonitor

__all__ = ["start_exporter"]

log = logging.getLogger("lossbeat")


def start_exporter(
    port: int = DEFAULT_PORT, *, addr: str = "0.0.0.0", enabled: bool = True,
    rank_context: RankContext | None = None, **settings: Any
) -> Monitor | NullMonitor:
    """Serve /metrics on ``port + LOCAL_RANK`` and return the process's :class:`Monitor`.

    Calling it again returns the monitor already running (whatever the port).
    ``settings`` are :class:`MonitorConfig` fields. ``enabled=False`` or the
    environment variable ``LOSSBEAT_DISABLED=1`` gives a :class:`NullMonitor`.
    ``rank_context``: the process's rank, local rank and world size; default
    :meth:`RankContext.detect` (the process group's, else the launcher's variables).
    """
    if not enabled or os.environ.get("LOSSBEAT_DISABLED", "") not in ("", "0"):
        return NullMonitor()
    unknown = set(settings) - set(MonitorConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"start_exporter: unknown setting {sorted(unknown)[0]!r}")
    config = MonitorConfig(port=port, addr=addr, **settings)
    with process.lock:
        running = process.running
        if running is not None and not running.closed:
            if running.config.port != port:
                log.warning("lossbeat: exporter already running on port %s; ignoring port %s", running.port, port)
            return running
        process.running = Monitor(config, rank_context=rank_context)
        return process.running
