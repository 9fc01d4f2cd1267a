"""The /metrics endpoint: routing, basic auth and the HTTP(S) server thread.

Follows the Prometheus exporter conventions: ``GET``/``HEAD /metrics`` (gzip
when the scraper accepts it), a landing page at ``/`` linking to it, a
health path ``/-/healthy``; any other path is 404 and any other method 405. With a
monitor's :class:`~lossbeat.exposition.status.StatusSource`, ``/`` is the live status page
and ``/status.json`` the data it polls (:mod:`lossbeat.exposition.status`).
With a :class:`~lossbeat.exposition.webconfig.WebConfig`, every path requires the
configured TLS client certificate and basic-auth user, as exporter-toolkit does.

Nothing here runs on the training thread. A client that stalls, mid-handshake
or mid-request, holds one short-lived connection thread, never the server: the
TLS handshake runs on the connection's thread with a timeout, not in accept().
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import logging
import os
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted
from prometheus_client.registry import CollectorRegistry

from lossbeat._version import __version__
from lossbeat.exposition.render import bake
from lossbeat.exposition.scrapers import Scrapers, scraper_key
from lossbeat.exposition.status import STATUS_PATH, StatusSource, page_html
from lossbeat.exposition.webconfig import TLSServerConfig, WebConfig, WebConfigError, require_bcrypt

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication  # wsgiref.types is Python 3.11+

__all__ = ["make_app", "start_server", "METRICS_PATH", "HEALTH_PATH"]

log = logging.getLogger("lossbeat")

METRICS_PATH = "/metrics"
HEALTH_PATH = "/-/healthy"
_ALLOWED = "GET, HEAD"
_HANDSHAKE_TIMEOUT_S = 10.0
_REQUEST_TIMEOUT_S = 30.0
_AUTH_CACHE = 64  # verified (user, password) digests kept: a scrape costs one bcrypt check, not one each
_LANDING = (
    '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>lossbeat exporter</title></head>\n'
    "<body><h1>lossbeat exporter</h1>\n<p>Training-health metrics of a PyTorch run, for Prometheus "
    f"(lossbeat {__version__}).</p>\n"
    '<ul><li><a href="metrics">Metrics</a></li><li><a href="-/healthy">Health</a></li></ul>\n'
    "</body></html>\n"
).encode()
_COMMON_HEADERS = [("X-Content-Type-Options", "nosniff")]

Response = tuple[str, list[tuple[str, str]], bytes]


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes (exporter-toolkit's ``basic_auth_users``)."""

    def __init__(self, users: dict[str, str]) -> None:
        self._bcrypt = require_bcrypt()
        self._users = {user: hashed.encode() for user, hashed in users.items()}
        # An unknown user is checked against a real hash too, so timing does not tell which names exist.
        self._decoy = next(iter(self._users.values()))
        self._verified: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # One bcrypt check at a time: a password guesser gets at most one core away from training.
        self._bcrypt_lock = threading.Lock()
        self._cache_lock = threading.Lock()  # apart, so a known scraper never queues behind guesses

    def allows(self, header: str | None) -> bool:
        if not header or not header[:6].lower() == "basic ":
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return False
        if not sep:
            return False
        hashed = self._users.get(user)
        digest = hashlib.sha256(b"\0".join((user.encode(), password.encode(), hashed or b""))).digest()
        with self._cache_lock:
            if hashed is not None and digest in self._verified:
                self._verified.move_to_end(digest)
                return True
        with self._bcrypt_lock:
            try:
                good = self._bcrypt.checkpw(password.encode(), hashed or self._decoy)
            except ValueError:  # bcrypt refuses passwords over 72 bytes: no such password can match
                good = False
        if not (good and hashed is not None):
            return False
        with self._cache_lock:
            self._verified[digest] = None
            if len(self._verified) > _AUTH_CACHE:
                self._verified.popitem(last=False)
        return True


class _SharedRenders:
    """Scrapes arriving together share one render of the registry (per format), never a stale one.

    A scrape is answered with a render that started after the scrape arrived: its values are
    as fresh as a render of its own. Fifty scrapers at once cost the training process about two
    renders, not fifty (every render holds the interpreter lock the training thread needs).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._locks: dict[tuple[str, bool], threading.Lock] = collections.defaultdict(threading.Lock)
        self._latest: dict[tuple[str, bool], tuple[float, Response]] = {}

    def get(self, accept: str | None, accept_encoding: str | None, arrived: float) -> tuple[float, Response]:
        """(the monotonic start of the render, the response) for a scrape that arrived at ``arrived``."""
        # By what is served, not by the raw headers: a handful of keys whatever clients send.
        # (prometheus_client reads a missing header, None, as "".)
        key = (choose_encoder(accept or "")[1], gzip_accepted(accept_encoding or ""))
        with self._locks[key]:  # one render per format at a time; the others wait for it
            latest = self._latest.get(key)
            if latest is not None and latest[0] >= arrived:
                return latest
            started = time.monotonic()
            response = bake(self._registry, accept, accept_encoding)
            self._latest[key] = (started, response)
            return started, response


def make_app(
    registry: CollectorRegistry,
    web_config: WebConfig | None = None,
    scrapers: Scrapers | None = None,
    status: StatusSource | None = None,
) -> WSGIApplication:
    """The WSGI application serving ``registry`` by the exporter conventions above (and
    ``status`` at ``/`` and ``/status.json``); basic auth guards every path alike. Each scrape
    of /metrics is recorded in ``scrapers`` (who scraped, when, which render it was sent)."""
    auth = BasicAuth(dict(web_config.basic_auth_users)) if web_config and web_config.basic_auth_users else None
    extra_headers = _COMMON_HEADERS + list(web_config.headers.items() if web_config else ())
    configured = {name.lower() for name, _ in extra_headers}  # the web config's headers win over ours
    failed_once = threading.Event()
    renders = _SharedRenders(registry)
    status_source = status

    def route(environ: dict[str, Any]) -> Response:
        method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
        if auth is not None and not auth.allows(environ.get("HTTP_AUTHORIZATION")):
            return (
                "401 Unauthorized",
                [
                    ("WWW-Authenticate", 'Basic realm="lossbeat", charset="UTF-8"'),
                    ("Content-Type", "text/plain; charset=utf-8"),
                ],
                b"Unauthorized\n",
            )
        if path not in (METRICS_PATH, "/", HEALTH_PATH) and not (status_source is not None and path == STATUS_PATH):
            return (
                "404 Not Found",
                [("Content-Type", "text/plain; charset=utf-8")],
                b"Not Found: metrics are at /metrics\n",
            )
        if method not in ("GET", "HEAD"):
            return (
                "405 Method Not Allowed",
                [("Allow", _ALLOWED), ("Content-Type", "text/plain; charset=utf-8")],
                f"Method Not Allowed: use {_ALLOWED}\n".encode(),
            )
        if path == "/":
            page = _LANDING if status_source is None else page_html()
            return "200 OK", [("Content-Type", "text/html; charset=utf-8"), ("Cache-Control", "no-cache")], page
        if path == STATUS_PATH and status_source is not None:
            return "200 OK", [("Content-Type", "application/json"), ("Cache-Control", "no-store")], status_source.json()
        if path == HEALTH_PATH:
            return "200 OK", [("Content-Type", "text/plain; charset=utf-8")], b"OK\n"
        accept, encoding = environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING")
        params = parse_qs(environ.get("QUERY_STRING", ""))
        arrived = time.monotonic()
        if params:  # name[] filters: rare, rendered on their own (and no full scrape)
            status, headers, body = bake(registry, accept, encoding, params)
        else:
            rendered, (status, headers, body) = renders.get(accept, encoding, arrived)
            if scrapers is not None:
                scrapers.record(scraper_key(environ), arrived, rendered)
        return status, list(headers) + [("Vary", "Accept, Accept-Encoding")], body

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            status, headers, body = route(environ)
        except Exception:  # a collector of the user's registry, say: a 500, never a dead server
            if not failed_once.is_set():
                failed_once.set()
                log.exception("lossbeat: error while serving %s (logged once)", environ.get("PATH_INFO"))
            status, headers, body = "500 Internal Server Error", [("Content-Type", "text/plain")], b"error\n"
        headers = (
            [h for h in headers if h[0].lower() not in configured]
            + extra_headers
            + [("Content-Length", str(len(body)))]
        )
        start_response(status, headers)
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    timeout = _REQUEST_TIMEOUT_S  # a client stalling mid-request frees its thread after this

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes are not log lines in the training log


class _TLSContexts:
    """The server's SSL context, rebuilt when the certificate files change (rotation, cert-manager)."""

    def __init__(self, tls: TLSServerConfig) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._stamp = self._mtimes()
        self._context = tls.ssl_context()

    def _mtimes(self) -> tuple[float, ...]:
        try:
            return tuple(os.stat(f).st_mtime_ns for f in self._tls.files())
        except OSError:
            return ()

    def current(self) -> ssl.SSLContext:
        stamp = self._mtimes()  # a few stat() calls per connection: scrapes are seconds apart
        with self._lock:
            if stamp and stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._context = self._tls.ssl_context()
                    log.info("lossbeat: reloaded the TLS certificate of /metrics")
                except WebConfigError as exc:  # mid-rotation: keep serving with the old one
                    log.warning("lossbeat: keeping the previous TLS certificate: %s", exc)
            return self._context


class _Server(ThreadingWSGIServer):
    tls: _TLSContexts | None = None
    # socketserver's default backlog is 5: a sixth scraper connecting at the same moment has its
    # SYN dropped and retries after 1, 3, 7... seconds (scrapes timing out under load).
    request_queue_size = 128

    def process_request_thread(  # type: ignore[override]  # TCP: a socket, never UDP's (data, socket) pair
        self, request: socket.socket, client_address: Any
    ) -> None:
        if self.tls is not None:
            try:
                request.settimeout(_HANDSHAKE_TIMEOUT_S)
                request = self.tls.current().wrap_socket(request, server_side=True)  # the handshake
            except (OSError, ValueError):  # no certificate, wrong CA, plain HTTP, a port scanner...
                request.close()
                return
        super().process_request_thread(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper hanging up mid-response: not worth a traceback in the training log.
        log.debug("lossbeat: connection from %s ended with an error", client_address, exc_info=True)


def _address_family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    infos = socket.getaddrinfo(addr or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, str(sockaddr[0])  # a str already for AF_INET and AF_INET6, the only families asked


def start_server(
    registry: CollectorRegistry,
    port: int,
    addr: str = "0.0.0.0",
    web_config: WebConfig | None = None,
    scrapers: Scrapers | None = None,
    status: StatusSource | None = None,
) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """Serve ``registry`` on ``addr:port`` from a daemon thread; OSError when the port cannot be bound."""
    app = make_app(registry, web_config, scrapers, status)  # before binding: a bad config never holds the port
    tls = _TLSContexts(web_config.tls) if web_config and web_config.tls else None
    family, host = _address_family(addr, port)

    class Server(_Server):
        address_family = family

    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    httpd.tls = tls
    if web_config and web_config.basic_auth_users and tls is None:
        log.warning("lossbeat: basic auth without TLS sends passwords in clear; add tls_server_config")
    thread = threading.Thread(target=httpd.serve_forever, name="lossbeat-metrics", daemon=True)
    thread.start()
    return httpd, thread
