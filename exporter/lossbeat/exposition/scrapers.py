"""Who scrapes this exporter, each on its own: the scrapers are told apart by their address and
user agent (an HA pair of Prometheus servers: two replicas, each with its own interval and
phase), so the linger after the completion marker (:func:`lossbeat.monitor.lifecycle.linger`)
waits until *each* recent scraper has read it, not one interval of their merged scrapes.

Written by the server's request threads, read by the training thread at close(): one lock.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

__all__ = ["Scrapers", "scraper_key"]

_KEPT = 8  # recent scrape times per scraper: enough to tell its interval
_MAX_SCRAPERS = 64  # the most recent scrapers kept (a port scan must not grow this without bound)


def scraper_key(environ: dict[str, Any]) -> tuple[str, str]:
    """One scraper: its address and user agent (the source port changes per connection)."""
    return environ.get("REMOTE_ADDR", ""), environ.get("HTTP_USER_AGENT", "")


class _Scraper:
    def __init__(self) -> None:
        self.arrivals: collections.deque[float] = collections.deque(maxlen=_KEPT)
        self.last_render = -1.0
        """Monotonic start of the render the latest answer carried: what it has seen."""


class Scrapers:
    """Per-scraper scrape times and the freshest render each was sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scrapers: collections.OrderedDict[tuple[str, str], _Scraper] = collections.OrderedDict()

    def record(self, key: tuple[str, str], arrived: float, rendered: float) -> None:
        """A scrape from ``key`` that arrived at ``arrived`` and was answered with the render
        that started at ``rendered`` (both ``time.monotonic()``)."""
        with self._lock:
            scraper = self._scrapers.pop(key, None) or _Scraper()
            self._scrapers[key] = scraper  # most recent last
            while len(self._scrapers) > _MAX_SCRAPERS:
                self._scrapers.popitem(last=False)
            scraper.arrivals.append(arrived)
            scraper.last_render = max(scraper.last_render, rendered)

    def periodic(self, now: float | None = None) -> dict[tuple[str, str], float]:
        """{scraper: its interval} of the scrapers that scrape periodically and recently: two
        scrapes or more, the latest within two of its intervals (+1 s). A look by hand is none."""
        now = time.monotonic() if now is None else now
        out = {}
        with self._lock:
            for key, s in self._scrapers.items():
                times = list(s.arrivals)
                if len(times) < 2:
                    continue
                interval = max(b - a for a, b in zip(times, times[1:]))
                if now - times[-1] <= 2 * interval + 1:
                    out[key] = interval
        return out

    def unseen(self, since: float, scrapers: dict[tuple[str, str], float]) -> list[tuple[str, str]]:
        """Those of ``scrapers`` not yet sent a render that started at or after ``since``."""
        with self._lock:
            return [k for k in scrapers if k not in self._scrapers or self._scrapers[k].last_render < since]

    def interval(self) -> float | None:
        """The longest interval among the periodic scrapers, or None when none scrapes periodically."""
        intervals = self.periodic().values()
        return max(intervals) if intervals else None
