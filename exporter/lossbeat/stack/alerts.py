"""What ``lossbeat stack status`` says of each alert: its state, the receiver Alertmanager routed
it to, whether the notification arrived, and the status page of the rank it fired on.

The page is ``<scheme>://<instance>/``: the alert's ``instance`` label is the rank's exporter
address, and Prometheus's active targets say whether it is scraped over TLS (``https``). A
job-level alert (no ``instance``) links to the pages of the job's ranks that Prometheus scrapes.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any, Sequence

from lossbeat.stack.webhook import Target, status_links

__all__ = ["alert_lines", "scraped_targets"]

# What a delivered notification means to a user, by receiver name (the shipped alertmanager.yml's).
_DELIVERED = {"page": "paged", "ticket": "ticketed"}
_LabelKey = tuple[tuple[str, Any], ...]  # an alert's labels, sorted: its identity


def scraped_targets(active_targets: list[dict[str, Any]]) -> list[Target]:
    """Prometheus's ``activeTargets`` (``/api/v1/targets``) as ``[{"instance", "job", "scheme"}]``:
    the scheme of each one's scrape URL (``https`` when scraped over TLS)."""
    out: list[Target] = []
    for target in active_targets:
        labels = target.get("labels") or {}
        if labels.get("instance"):
            out.append(
                {
                    "instance": labels["instance"],
                    "job": labels.get("job", ""),
                    "scheme": urllib.parse.urlsplit(target.get("scrapeUrl", "")).scheme or "http",
                }
            )
    return out


def _text(value: object) -> str:
    """A label value fit for a terminal: control characters (an escape sequence) shown escaped."""
    text = str(value)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def alert_lines(
    prometheus_alerts: list[dict[str, Any]],
    alertmanager_alerts: list[dict[str, Any]],
    notifications: list[dict[str, Any]] | None,
    targets: Sequence[Target] = (),
) -> list[str]:
    """One line per alert Prometheus holds: its state, the receiver Alertmanager routed it to,
    and whether that receiver got the notification (``paged: TrainingLossNaN``); with
    ``notifications`` None (no local receiver) delivery is unknown. Each line ends with the
    status page(s) of the alert's rank (``page http://127.0.0.1:8470/``; ``targets`` as
    :func:`scraped_targets` gives them), or none when no rank is known."""
    routed = {_key(a["labels"]): a for a in alertmanager_alerts}
    delivered: dict[tuple[_LabelKey, str | None], tuple[str | None, float]] = {}
    for note in notifications or ():
        for alert in note.get("alerts", []):
            if alert.get("status") == "firing":
                delivered[(_key(alert["labels"]), note.get("receiver"))] = (note.get("receiver"), note["received_at"])
    lines = []
    for alert in sorted(prometheus_alerts, key=lambda a: (a["state"] != "firing", a["labels"]["alertname"])):
        labels = alert["labels"]
        pages = " ".join(status_links(labels, list(targets)))
        name, where = (
            _text(labels["alertname"]),
            " ".join(f"{k}={_text(labels[k])}" for k in ("job", "rank", "instance") if k in labels),
        )
        if pages:
            where += f"  page {pages}"
        head = f"  alert  {name:30} {alert['state']:8}"
        if alert["state"] != "firing":
            lines.append(f"{head} (fires once its condition holds for the rule's `for`) {where}")
            continue
        am = routed.get(_key(labels))
        if am is None:
            lines.append(f"{head} not yet in Alertmanager {where}")
            continue
        receivers = [r["name"] for r in am.get("receivers", [])]
        state = am.get("status", {}).get("state", "active")
        if state != "active":
            lines.append(
                f"{head} receiver {','.join(receivers):8} {state}: inhibited or silenced, no notification  {where}"
            )
            continue
        for receiver in receivers:
            got = delivered.get((_key(labels), receiver))
            if notifications is None:
                lines.append(f"{head} receiver {receiver:8} (no local receiver: delivery not recorded)  {where}")
            elif got:
                verb = _DELIVERED.get(receiver, f"notified ({receiver})")
                at = time.strftime("%H:%M:%S", time.localtime(got[1]))
                lines.append(f"{head} receiver {receiver:8} {verb}: {name} at {at}  {where}")
            else:
                lines.append(
                    f"{head} receiver {receiver:8} not delivered yet (Alertmanager waits its "
                    f"group_wait; see alertmanager.log)  {where}"
                )
    return lines


def _key(labels: dict[str, Any]) -> _LabelKey:
    return tuple(sorted(labels.items()))
