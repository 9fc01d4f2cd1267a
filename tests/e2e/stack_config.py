"""What the end-to-end stack runs with: thresholds that fire in seconds, and the shipped
Alertmanager config with test timing and the test's webhook receiver."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import yaml

__all__ = ["E2E_THRESHOLDS", "SHIPPED_ALERTMANAGER", "retimed_alertmanager_config"]

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
