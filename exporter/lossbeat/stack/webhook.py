"""A local Alertmanager webhook receiver: records every notification that arrives.

``lossbeat stack up`` runs it on loopback for the page and ticket webhooks of the shipped
``alertmanager.yml`` (``http://127.0.0.1:5001/page``, ``/ticket``), so a user sees a page
arrive without PagerDuty or Slack. Each POST is appended as one JSON line to the log file;
``lossbeat stack status`` reads them back. At ``/`` it shows them as a page, newest first, each
alert linked to the live status page of the rank it fired on (``http://<instance>/``, or the
job's ranks for a job-level alert: :func:`status_links`); at ``/notifications`` as JSON. It
also serves the shipped runbooks as HTML at ``/runbooks`` (one anchor per alert), which the
local stack's ``runbook_url`` links point to. Stdlib only: the stack runs it as a file.

Run as ``python -m lossbeat.stack.webhook --port 5001 --log notifications.jsonl
[--targets targets.json]`` (the stack's file_sd targets: the job's ranks and their scheme).
"""

from __future__ import annotations

import argparse
import html
import json
import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence, TypedDict

__all__ = ["read_notifications", "read_targets", "status_links", "notifications_html", "runbooks_html", "serve", "main"]

MAX_BODY = 4 << 20  # Alertmanager batches stay far below this; anything larger is refused
PAGE_NOTIFICATIONS = 200  # the page shows the newest ones; the log keeps them all
# An exporter address as Prometheus's ``instance`` label holds it: host (name, IPv4 or [IPv6]) and
# port. Anything else (a relabelled instance, a hostile label) gets no link: text only.
_ADDRESS = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,252})|\[[0-9A-Fa-f:.%a-zA-Z]{2,60}\]):[0-9]{1,5}$")


class Target(TypedDict):
    """One scraped rank, as :func:`read_targets` and ``stack.alerts.scraped_targets`` give it."""

    instance: str
    job: str
    scheme: str


def read_notifications(log: Path) -> list[dict[str, Any]]:
    """The notifications recorded in ``log``, oldest first (a torn last line is skipped)."""
    try:
        lines = Path(log).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_targets(path: Path | None) -> list[Target]:
    """The file_sd target groups in ``path`` (``[{"targets": [...], "labels": {...}}]``) as
    ``[{"instance", "job", "scheme"}]``; a group's ``__scheme__`` label (``https``: scraped over
    TLS) sets its scheme. Nothing when the file is absent or unreadable."""
    if path is None:
        return []
    try:
        groups = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    out: list[Target] = []
    for group in groups if isinstance(groups, list) else []:
        if not isinstance(group, dict):
            continue
        labels = group.get("labels") or {}
        for target in group.get("targets") or []:
            out.append(
                {
                    "instance": str(target),
                    "job": str(labels.get("job", "")),
                    "scheme": str(labels.get("__scheme__", "http")),
                }
            )
    return out


def status_links(labels: dict[str, Any], targets: Sequence[Target] = ()) -> list[str]:
    """The status pages an alert points at: ``<scheme>://<instance>/`` of the rank it fired on
    (``https`` where ``targets`` say that instance is scraped over TLS), or, for an alert
    without an ``instance`` (a job-level one), the pages of the job's ranks in ``targets``
    (``[{"instance", "job", "scheme"}]``); none when neither is known or the instance is not a
    host:port address."""
    schemes = {t["instance"]: t.get("scheme") for t in targets}
    instance = labels.get("instance")
    if instance:
        instances = [str(instance)]
    else:
        job = labels.get("job")
        instances = sorted({t["instance"] for t in targets if job is not None and t.get("job") == job})
    links = []
    for address in instances:
        if _ADDRESS.match(address):
            scheme = "https" if schemes.get(address) == "https" else "http"
            links.append(f"{scheme}://{address}/")
    return links


def notifications_html(notifications: list[dict[str, Any]], targets: Sequence[Target] = ()) -> str:
    """The page of notifications, newest first: one row per alert, its labels, summary, runbook
    and a link to the status page of its rank (:func:`status_links`). Every string that came
    with an alert (label, annotation) is escaped; links are only ``http(s)://`` ones."""
    esc = html.escape
    rows = []
    for note in reversed(notifications[-PAGE_NOTIFICATIONS:]):
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(note.get("received_at") or 0)))
        for alert in note.get("alerts") or []:
            labels = {str(k): str(v) for k, v in (alert.get("labels") or {}).items()}
            notes = {str(k): str(v) for k, v in (alert.get("annotations") or {}).items()}
            pages = (
                " ".join(f'<a class=page href="{esc(url)}">{esc(url)}</a>' for url in status_links(labels, targets))
                or "<span class=none>no page known</span>"
            )
            runbook = notes.get("runbook_url", "")
            runbook = f'<a href="{esc(runbook)}">runbook</a>' if re.match(r"^https?://", runbook) else esc(runbook)
            others = " ".join(f"<code>{esc(k)}={esc(v)}</code>" for k, v in sorted(labels.items()) if k != "alertname")
            rows.append(
                f"<tr class={'firing' if alert.get('status') == 'firing' else 'resolved'}>"
                f"<td>{esc(at)}</td><td>{esc(str(note.get('receiver') or note.get('path') or ''))}</td>"
                f"<td>{esc(str(alert.get('status') or ''))}</td><td><b>{esc(labels.get('alertname', ''))}</b>"
                f"<br>{others}</td><td>{esc(notes.get('summary', ''))}</td><td>{pages}</td><td>{runbook}</td></tr>"
            )
    body = "\n".join(rows) or "<tr><td colspan=7>no notification yet</td></tr>"
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8><meta http-equiv=refresh content=5>"
        "<title>lossbeat notifications</title><style>body{font-family:sans-serif;margin:1em}"
        "table{border-collapse:collapse}td,th{border-bottom:1px solid #ccc;padding:.3em .6em;"
        "text-align:left;vertical-align:top}tr.firing td:nth-child(3){color:#b00;font-weight:bold}"
        "code{font-size:.85em;margin-right:.4em}.none{color:#888}</style></head><body>"
        "<h1>Notifications</h1><p>What Alertmanager sent to this receiver, newest first "
        f"(the last {PAGE_NOTIFICATIONS}); each alert links to the status page of its rank. "
        "<a href=/notifications>JSON</a> · <a href=/runbooks>runbooks</a></p>"
        "<table><tr><th>received</th><th>receiver</th><th>status</th><th>alert</th><th>summary</th>"
        f"<th>status page</th><th>runbook</th></tr>\n{body}</table></body></html>\n"
    )


def runbooks_html(markdown: str) -> str:
    """``runbooks.md`` as a plain HTML page whose headings carry GitHub's anchors (``#alertname``)."""
    body = []
    for line in markdown.splitlines():
        heading = re.match(r"^(#{1,6})\s+(.+?)\s*$", line)
        if heading:
            level, text = len(heading.group(1)), heading.group(2)
            anchor = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            body.append(f'<h{level} id="{html.escape(anchor)}">{html.escape(text)}</h{level}>')
        else:
            body.append(html.escape(line))
    return (
        "<!doctype html><meta charset=utf-8><title>lossbeat runbooks</title>"
        "<body style='font-family:sans-serif;white-space:pre-wrap;max-width:60em'>" + "\n".join(body) + "</body>\n"
    )


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        # Alertmanager posts application/json. A web page can post to 127.0.0.1 too, but without
        # a CORS preflight (which this server never answers) only as text/plain or a form.
        if self.headers.get_content_type() != "application/json":
            self._reply(415, b"expected Content-Type: application/json\n")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length <= 0 or length > MAX_BODY:
            self._reply(413 if length > MAX_BODY else 400, b"bad length\n")
            return
        try:
            payload = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._reply(400, b"not JSON\n")
            return
        alerts = payload.get("alerts", []) if isinstance(payload, dict) else None
        if not isinstance(alerts, list) or not all(isinstance(a, dict) for a in alerts):
            self._reply(400, b"not an Alertmanager notification: an object whose alerts are objects\n")
            return
        record = {
            "received_at": time.time(),
            "path": self.path,
            "receiver": payload.get("receiver"),
            "status": payload.get("status"),
            "alerts": [
                {
                    "labels": a.get("labels", {}),
                    "annotations": a.get("annotations", {}),
                    "status": a.get("status"),
                    "startsAt": a.get("startsAt"),
                }
                for a in alerts
            ],
        }
        with self.server.lock, open(self.server.log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._reply(200, b"ok\n")

    def do_GET(self) -> None:
        if self.path == "/-/ready":
            self._reply(200, b"ready\n")
        elif self.path in ("/", "/index.html"):
            page = notifications_html(read_notifications(self.server.log), read_targets(self.server.targets))
            self._reply(200, page.encode(), "text/html; charset=utf-8")
        elif self.path == "/notifications":
            self._reply(200, json.dumps(read_notifications(self.server.log)).encode(), "application/json")
        elif self.path.split("#")[0] in ("/runbooks", "/runbooks.md") and self.server.runbooks:
            self._reply(200, self.server.runbooks.encode(), "text/html; charset=utf-8")
        else:
            self._reply(404, b"not found\n")

    def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass  # the log file is the record


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], log: Path, runbooks: str, targets: Path | None = None) -> None:
        super().__init__(addr, _Handler)
        self.log, self.runbooks, self.lock = Path(log), runbooks, threading.Lock()
        self.targets = targets


def serve(port: int, log: Path, addr: str = "127.0.0.1", runbooks: str = "", targets: Path | None = None) -> _Server:
    """Bind the receiver (not yet serving); raises OSError when the port is taken. ``targets``:
    the stack's file_sd targets file, read at each request of the page (the job's ranks)."""
    return _Server((addr, port), log, runbooks_html(runbooks) if runbooks else "", targets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lossbeat.stack.webhook", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--addr", default="127.0.0.1")
    parser.add_argument("--log", type=Path, required=True, help="JSON-lines file the notifications go to")
    parser.add_argument("--runbooks", type=Path, help="runbooks.md to serve at /runbooks")
    parser.add_argument("--targets", type=Path, help="the stack's file_sd targets file (the job's ranks)")
    args = parser.parse_args(argv)
    try:
        server = serve(
            args.port,
            args.log,
            args.addr,
            args.runbooks.read_text(encoding="utf-8") if args.runbooks else "",
            args.targets,
        )
    except OSError as exc:
        print(
            f"lossbeat webhook receiver: cannot listen on {args.addr}:{args.port} ({exc.strerror or exc})",
            file=sys.stderr,
        )
        return 1
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
