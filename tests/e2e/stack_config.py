"""What the end-to-end stack runs with: thresholds that fire in seconds, and the shipped
Alertmanager config with test timing and the test's webhook receiver."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import yaml

__all__ = [
    "E2E_THRESHOLDS",
    "MEMORY_LOOKBACK_INTERVAL",
    "MEMORY_THRESHOLDS",
    "MEMORY_WATCH_SECONDS",
    "SHIPPED_ALERTMANAGER",
    "retimed_alertmanager_config",
]

REPO = Path(__file__).resolve().parents[2]
SHIPPED_ALERTMANAGER = REPO / "alerting" / "alertmanager.yml"

# Overrides of the thresholds file for alerts that fire within seconds, not minutes.
E2E_THRESHOLDS = {
    "alerts": {
        "event_window": "1m",
        "explosion_for": "5s",
        "stalled_after": "15s",
        "exporter_down_for": "5s",
    },
}

# For the modules that watch an old event not page again (a gap, a restart): the event window and
# the lookback group that remembers the counters (every minute when shipped) scaled down together,
# so that the memory is recorded well within one window, as the shipped 5m window and 1m group do.
MEMORY_LOOKBACK_INTERVAL = "5s"
MEMORY_THRESHOLDS = {"alerts": {**E2E_THRESHOLDS["alerts"], "event_window": "20s"}}
MEMORY_WATCH_SECONDS = 20 + 5 + 15
"""How long those modules watch for a second page: past a whole event window and a lookback
evaluation after the counter is back, with 15 s to spare (a page would come within seconds)."""

# Alertmanager timing for tests: send a new group after 1 s, not the shipped 30 s.
E2E_ALERTMANAGER_TIMING = {"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"}


def retimed_alertmanager_config(source: Path, receiver_url: str) -> dict:
    """The shipped Alertmanager config with test timing and the webhooks pointed at
    ``receiver_url`` (its path prefixed: /page stays the paging route). Routing,
    receivers and inhibitions are untouched."""
    doc = yaml.safe_load(source.read_text(encoding="utf-8"))

    def retime(route: dict) -> None:
        for key, value in E2E_ALERTMANAGER_TIMING.items():
            if key in route or route is doc["route"]:
                route[key] = value
        for child in route.get("routes", []) or []:
            retime(child)

    retime(doc["route"])
    base = urllib.parse.urlsplit(receiver_url)
    for receiver in doc.get("receivers", []):
        for webhook in receiver.get("webhook_configs", []) or []:
            url = urllib.parse.urlsplit(webhook["url"])
            path = base.path.rstrip("/") + url.path
            webhook["url"] = urllib.parse.urlunsplit((base.scheme, base.netloc, path, url.query, ""))
    return doc
