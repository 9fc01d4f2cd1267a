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
    port: int = DEFAULT_PORT,
    *,
    addr: str = "0.0.0.0",
    enabled: bool = True,
    rank_context: RankContext | None = None,
    **settings: Any,
) -> Monitor | NullMonitor:
    """Serve /metrics on ``port + LOCAL_RANK`` and return the process's :class:`Monitor`.

    Calling it again returns the monitor already running, whatever its arguments: a warning
    names each setting given that differs from the running monitor's (they are ignored).
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
        running: Monitor | None = process.running
        if running is not None and not running.closed:
            ignored = [
                name for name in ("port", "addr", *settings) if getattr(running.config, name) != getattr(config, name)
            ]
            if ignored:
                log.warning(
                    "lossbeat: an exporter is already running (port %s); start_exporter() returns it "
                    "and ignores these settings of this call: %s",
                    running.port,
                    ", ".join(
                        f"{name}={getattr(config, name)!r} (running: {getattr(running.config, name)!r})"
                        for name in ignored
                    ),
                )
            return running
        monitor = process.running = Monitor(config, rank_context=rank_context)
        return monitor
