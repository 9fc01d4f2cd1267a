"""The monitor's lifecycle in the process: the one running monitor (start_exporter returns it), the
linger after a normal end, the close at exit, uncaught exceptions (a failure: no completion marker)
and fork (a child starts its own)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any, NoReturn

__all__ = ["process", "watch_uncaught_exceptions", "linger"]

log = logging.getLogger("lossbeat")


class _Process:
    """The process-wide monitor slot, guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: Any = None
        """The running Monitor, else None (``Any`` here: core imports this module, not the reverse)."""
        self.uncaught_exception_seen = False

    def forget(self, monitor: Any = None) -> None:
        """Clear the slot (if it holds ``monitor``, when given)."""
        with self.lock:
            if monitor is None or self.running is monitor:
                self.running = None


process = _Process()


def watch_uncaught_exceptions() -> None:
    """Chain sys.excepthook and wrap sys.exit, once each: an uncaught exception, or
    ``sys.exit()`` with a failure status (``sys.exit(1)`` from Hydra's ``run_and_report``, click
    and typer apps and ``sys.exit(main())`` wrappers; ``sys.exit(143)`` from a SIGTERM handler),
    ends the process as a failure, so the close at exit publishes no completion marker
    (TrainingExporterDown then pages). Only a normal end (status 0) or an explicit close()
    completes a run. Python gives atexit no exit status, hence the wrapper: a bare
    ``raise SystemExit(1)`` or ``exit`` imported before lossbeat is not seen."""
    previous = sys.excepthook
    if not getattr(previous, "_lossbeat", False):

        def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            process.uncaught_exception_seen = True
            previous(exc_type, exc, tb)

        hook._lossbeat = True  # type: ignore[attr-defined]
        sys.excepthook = hook
    exit_ = sys.exit
    if not getattr(exit_, "_lossbeat", False):

        def exit_with_status(status: str | int | None = None) -> NoReturn:
            if failure_status(status):
                process.uncaught_exception_seen = True
            exit_(status)

        exit_with_status._lossbeat = True  # type: ignore[attr-defined]
        sys.exit = exit_with_status


def failure_status(status: Any) -> bool:
    """Whether ``sys.exit(status)`` / ``SystemExit(status)`` ends the process with a failure:
    None and 0 are success; any other int, and a message (printed, status 1), are failures."""
    return status is not None and status != 0


def linger(scrapers: Any, since: float, limit_s: float, poll_s: float = 0.05) -> float:
    """Serve until each scraper that scrapes periodically has been sent a render that started
    at or after ``since`` (the completion marker's time), bounded by ``limit_s``; none when
    nothing scrapes periodically (a script run by hand, a test). Each scraper on its own (an
    HA pair of Prometheus servers: each replica must read the marker, or it pages
    TrainingExporterDown). Returns the seconds waited."""
    waiting = scrapers.periodic() if scrapers is not None and limit_s else {}
    if not waiting:
        return 0.0
    started = time.monotonic()
    deadline = started + min(float(limit_s), 2 * max(waiting.values()) + 1)  # each has scraped again by then
    log.info(
        "lossbeat: run completed; serving /metrics until %d scraper(s) read the completion marker (at most %.1fs)",
        len(waiting),
        deadline - started,
    )
    while True:
        unseen = scrapers.unseen(since, waiting)
        if not unseen or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if unseen:
        log.warning(
            "lossbeat: %d scraper(s) did not read the completion marker within %.1fs: %s",
            len(unseen),
            deadline - started,
            ", ".join(f"{a} ({ua})" for a, ua in unseen),
        )
    else:
        time.sleep(poll_s)  # the last answer is on its way out of the socket
    return time.monotonic() - started


def _forget_in_child() -> None:
    process.running = None  # a forked child (a ddp_fork rank) starts its own; the copy serves nothing


os.register_at_fork(after_in_child=_forget_in_child)
