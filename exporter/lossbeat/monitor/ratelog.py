"""A log that repeats itself rarely: an event on every step (a NaN each step) is logged once per N."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["RateLimitedLog", "log"]

log = logging.getLogger("lossbeat")

LOG_EVERY = 100


class RateLimitedLog:
    """``log(key, level, msg, ...)`` writes the 1st, the 101st, ... message of each key."""

    def __init__(self, every: int = LOG_EVERY) -> None:
        self.every = every
        self._counts: dict[str, int] = {}

    def __call__(self, key: str, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        if n % self.every == 0:
            log.log(level, msg + (f" (repeated {n} times)" if n else ""), *args, exc_info=exc_info)
