"""The fixtures of the modules that watch an old event not page again (a scrape gap, a Prometheus
or watcher restart): their stack runs the rules with the event window and the lookback group
scaled down together (stack_config.MEMORY_THRESHOLDS, MEMORY_LOOKBACK_INTERVAL). A module takes
them by importing both names, which override conftest's defaults for its own stack."""

from __future__ import annotations

import pytest

from .stack_config import MEMORY_LOOKBACK_INTERVAL, MEMORY_THRESHOLDS

__all__ = ["e2e_overrides", "lookback_interval"]


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    return MEMORY_THRESHOLDS


@pytest.fixture(scope="module")
def lookback_interval() -> str:
    return MEMORY_LOOKBACK_INTERVAL
