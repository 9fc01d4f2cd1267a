"""A local Alertmanager webhook receiver: records every notification that arrives.

``lossbeat stack up`` runs it on loopback for the page and ticket webhooks of the shipped
``alertmanager.yml`` (``http://127.0.0.1:5001/page``, ``/ticket``), so a user sees a page
arrive without PagerDuty or Slack. Each POST is appended as one JSON line to the log file;
``lossbeat stack status`` reads them back. It also serves the shipped runbooks as HTML at
``/runbooks`` (one anchor per alert), which the local stack's ``runbook_url`` links point to.

Run as ``python -m lossbeat.stack.webhook --port 5001 --log notifications.jsonl``.
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

__all__ = ["read_notifications", "runbooks_html", "serve", "main"]

MAX_BODY = 4 << 20  # Alertmanager batches stay far below this; anything larger is refused


def read_notifications(log: Path) -> list[dict]:
    """The notifications recorded in ``log``, oldest first (a torn last line is skipped)."""
    try:
        lines = Path(log).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


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
    return ("<!doctype html><meta charset=utf-8><title>lossbeat runbooks</title>"
            "<body style='font-family:sans-serif;white-space:pre-wrap;max-width:60em'>"
            + "\n".join(body) + "</body>\n")


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY:
            self._reply(413 if length > MAX_BODY else 400, b"bad length\n")
            return
        try:
            payload = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._reply(400, b"not JSON\n")
            return
        record = {
            "received_at": time.time(),
            "path": self.path,
            "receiver": payload.get("receiver"),
            "status": payload.get("status"),
            "alerts": [{"labels": a.get("labels", {}), "status": a.get("status"),
                        "startsAt": a.get("startsAt")} for a in payload.get("alerts", [])],
        }
        with self.server.lock, open(self.server.log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._reply(200, b"ok\n")

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/-/ready":
            self._reply(200, b"ready\n")
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

    def __init__(self, addr: tuple[str, int], log: Path, runbooks: str) -> None:
        super().__init__(addr, _Handler)
        self.log, self.runbooks, self.lock = Path(log), runbooks, threading.Lock()


def serve(port: int, log: Path, addr: str = "127.0.0.1", runbooks: str = "") -> _Server:
    """Bind the receiver (not yet serving); raises OSError when the port is taken."""
    return _Server((addr, port), log, runbooks_html(runbooks) if runbooks else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lossbeat.stack.webhook", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--addr", default="127.0.0.1")
    parser.add_argument("--log", type=Path, required=True, help="JSON-lines file the notifications go to")
    parser.add_argument("--runbooks", type=Path, help="runbooks.md to serve at /runbooks")
    args = parser.parse_args(argv)
    try:
        server = serve(args.port, args.log, args.addr,
                       args.runbooks.read_text(encoding="utf-8") if args.runbooks else "")
    except OSError as exc:
        print(f"lossbeat webhook receiver: cannot listen on {args.addr}:{args.port} ({exc.strerror or exc})",
              file=sys.stderr)
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
