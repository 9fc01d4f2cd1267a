"""The /metrics endpoint: exporter conventions, the web config (TLS, mutual TLS, basic auth),
and clients that must get nothing. Real servers, real sockets, real handshakes."""

from __future__ import annotations

import base64
import gzip
import http.client
import re
import socket
import ssl
import sys
import threading

import pytest
import yaml
from conftest import require_module
from helpers.tls_certs import make_certs
from prometheus_client.parser import text_string_to_metric_families

from lossbeat import Monitor, MonitorConfig
from lossbeat.exposition.webconfig import WebConfigError, load_web_config


def request(port, method="GET", path="/metrics", headers=None, context=None, timeout=10):
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=timeout)
        if context
        else http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    )
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def basic(user, password):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def monitor():
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
        m.observe(3, loss=2.5)
        yield m


def test_metrics_landing_page_and_health(monitor):
    status, headers, body = request(monitor.port)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert samples["training_loss"] == 2.5 and samples["training_step"] == 3.0

    status, headers, body = request(monitor.port, "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 100

    status, headers, body = request(monitor.port, path="/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'href="metrics"' in body and b"training_loss" not in body

    assert request(monitor.port, path="/-/healthy")[::2] == (200, b"OK\n")


@pytest.mark.parametrize("path", ["/no-such-path", "/metrics/", "/metricsx", "/favicon.ico", "/-/ready", "/metrics;x"])
def test_other_paths_are_404_without_metrics(monitor, path):
    status, _, body = request(monitor.port, path=path)
    assert status == 404
    assert b"training_" not in body


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
def test_other_methods_are_405(monitor, method):
    status, headers, body = request(monitor.port, method)
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert b"training_" not in body


def test_gzip_when_accepted(monitor):
    status, headers, body = request(monitor.port, headers={"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert re.search(rb'training_loss{rank="0",run_id="[^"]*"} 2\.5', gzip.decompress(body))
    _, headers, body = request(monitor.port)
    assert "Content-Encoding" not in headers and b"training_loss" in body


def test_openmetrics_is_negotiated(monitor):
    _, headers, body = request(monitor.port, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


# --- the web config -------------------------------------------------------------------------


def write_config(tmp_path, doc, name="web.yml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return path


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def hashed():
    bcrypt = require_module("bcrypt")
    return bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"tls_server_config": {"cert_file": "x.crt"}}, "tls_server_config.key_file: required"),
        ({"tls_server_confg": {}}, "tls_server_confg: unknown key"),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "cipher_suites": ["x"]}},
            "tls_server_config.cipher_suites: not supported",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "RequireAnyClientCert"}},
            "client_auth_type: expected one of .*verifies every client certificate",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "client_ca_file: required with client_auth_type",
        ),
        (
            {"tls_server_config": {"cert_file": "missing.crt", "key_file": "missing.key"}},
            "tls_server_config.cert_file/key_file: cannot load",
        ),
        ({"basic_auth_users": {"prometheus": "plain-password"}}, "basic_auth_users.prometheus: expected a bcrypt hash"),
        ({"basic_auth_users": ["prometheus"]}, "basic_auth_users: expected a mapping"),
        ({"http_server_config": {"headers": {"X-A": "1\r\nSet-Cookie: x"}}}, "http_server_config.headers.X-A"),
        ({"http_server_config": {"http3": True}}, "http_server_config.http3: unknown key"),
        ("- a\n- list\n", r"\(top level\): expected a mapping"),
        ("tls_server_config: !!python/object/apply:os.system [echo pwned]\n", "not valid YAML"),
        ("tls_server_config: [\n", "not valid YAML"),
    ],
)
def test_a_bad_web_config_names_the_key(tmp_path, doc, message):
    path = write_config(tmp_path, doc)
    with pytest.raises(WebConfigError, match=message):
        load_web_config(path)
    with pytest.raises(ValueError, match=message):  # at configuration, not at the first scrape
        MonitorConfig(port=0, web_config=str(path))


def test_tls_versions_are_checked(tmp_path, certs):
    doc = {
        "tls_server_config": {
            "cert_file": str(certs.server_cert),
            "key_file": str(certs.server_key),
            "min_version": "TLS13",
            "max_version": "TLS12",
        }
    }
    with pytest.raises(WebConfigError, match="min_version: must not be above max_version"):
        load_web_config(write_config(tmp_path, doc))
    doc["tls_server_config"]["max_version"] = "SSL3"
    with pytest.raises(WebConfigError, match="max_version: expected one of TLS10"):
        load_web_config(write_config(tmp_path, doc))


def test_relative_paths_are_from_the_config_file(tmp_path, certs):
    (tmp_path / "tls").mkdir()
    for src in (certs.server_cert, certs.server_key):
        (tmp_path / "tls" / src.name).write_bytes(src.read_bytes())
    config = load_web_config(
        write_config(tmp_path, {"tls_server_config": {"cert_file": "tls/server.crt", "key_file": "tls/server.key"}})
    )
    assert config.tls.cert_file == str(tmp_path / "tls" / "server.crt")


def test_a_web_config_and_a_certfile_conflict(tmp_path, certs, monkeypatch):
    path = write_config(tmp_path, {})
    with pytest.raises(ValueError, match="web_config, certfile: give one"):
        MonitorConfig(web_config=str(path), certfile=str(certs.server_cert), keyfile=str(certs.server_key))
    monkeypatch.setenv("LOSSBEAT_WEB_CONFIG", str(path))
    with pytest.raises(ValueError, match="LOSSBEAT_WEB_CONFIG, certfile: give one"):
        MonitorConfig(certfile=str(certs.server_cert), keyfile=str(certs.server_key))
    with pytest.raises(TypeError, match="web_config: expected a path"):
        MonitorConfig(web_config={"tls_server_config": {}})


def test_basic_auth_without_bcrypt_is_a_clear_error(tmp_path, hashed, monkeypatch):
    monkeypatch.setitem(sys.modules, "bcrypt", None)  # what an environment without the extra sees
    with pytest.raises(ImportError, match=r"needs the bcrypt package: pip install 'lossbeat\[security\]'"):
        load_web_config(write_config(tmp_path, {"basic_auth_users": {"prometheus": hashed}}))


def test_basic_auth(tmp_path, hashed, monkeypatch):
    monkeypatch.setenv(
        "LOSSBEAT_WEB_CONFIG",
        str(
            write_config(
                tmp_path,
                {
                    "basic_auth_users": {"prometheus": hashed, "other": hashed.replace("$2b$04$", "$2b$04$")},
                    "http_server_config": {"headers": {"Cache-Control": "no-store"}},
                },
            )
        ),
    )
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1")) as m:
        m.observe(0, loss=1.0)
        for headers in (
            {},
            basic("prometheus", "wrong"),
            basic("nobody", "s3cret"),
            basic("prometheus", ""),
            {"Authorization": "Basic !!!not-base64"},
            {"Authorization": "Bearer s3cret"},
            basic("prometheus", "s3cret" + "x" * 100),
        ):
            for path in ("/metrics", "/", "/-/healthy", "/secret-path"):
                status, resp_headers, body = request(m.port, path=path, headers=headers)
                assert status == 401, (headers, path)
                assert resp_headers["WWW-Authenticate"].startswith('Basic realm="lossbeat"')
                assert b"training_" not in body
        status, headers, body = request(m.port, headers=basic("prometheus", "s3cret"))
        assert status == 200 and re.search(rb'training_loss{rank="0",run_id="[^"]*"} 1\.0', body)
        assert headers["Cache-Control"] == "no-store"
        assert request(m.port, path="/nope", headers=basic("prometheus", "s3cret"))[0] == 404


def tls_client(certs, cert=None, key=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert:
        context.load_cert_chain(str(cert), str(key))
    return context


def mtls_config(tmp_path, certs, hashed=None, auth="RequireAndVerifyClientCert"):
    doc = {
        "tls_server_config": {
            "cert_file": str(certs.server_cert),
            "key_file": str(certs.server_key),
            "client_ca_file": str(certs.ca),
            "client_auth_type": auth,
        }
    }
    if hashed:
        doc["basic_auth_users"] = {"prometheus": hashed}
    return str(write_config(tmp_path, doc))


def test_mutual_tls_refuses_clients_without_the_right_certificate(tmp_path, certs, hashed):
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", web_config=mtls_config(tmp_path, certs, hashed))) as m:
        m.observe(0, loss=1.25)
        good = tls_client(certs, certs.client_cert, certs.client_key)
        status, _, body = request(m.port, headers=basic("prometheus", "s3cret"), context=good)
        assert status == 200 and re.search(rb'training_loss{rank="0",run_id="[^"]*"} 1\.25', body)
        assert request(m.port, context=good)[0] == 401  # the certificate alone is not enough

        for context in (tls_client(certs), tls_client(certs, certs.rogue_cert, certs.rogue_key)):
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                request(m.port, headers=basic("prometheus", "s3cret"), context=context)
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            status, _, body = request(m.port, headers=basic("prometheus", "s3cret"))  # plain HTTP
            assert b"training_" not in body
            raise ConnectionError(f"plain HTTP answered {status}")
        # After all of that, the server still serves.
        assert request(m.port, headers=basic("prometheus", "s3cret"), context=good)[0] == 200


def test_verify_client_cert_if_given(tmp_path, certs):
    config = mtls_config(tmp_path, certs, auth="VerifyClientCertIfGiven")
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", web_config=config)) as m:
        assert request(m.port, context=tls_client(certs))[0] == 200
        assert request(m.port, context=tls_client(certs, certs.client_cert, certs.client_key))[0] == 200
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            request(m.port, context=tls_client(certs, certs.rogue_cert, certs.rogue_key))


def test_a_stalled_handshake_does_not_block_other_scrapes(tmp_path, certs, monkeypatch):
    import lossbeat.exposition.endpoint as endpoint

    # Stalled handshakes that never time out during the test: a scrape queued behind them would
    # never be answered, however fast or slow the machine is.
    monkeypatch.setattr(endpoint, "_HANDSHAKE_TIMEOUT_S", 600.0)
    config = mtls_config(tmp_path, certs)
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", web_config=config)) as m:
        stalled = [socket.create_connection(("127.0.0.1", m.port)) for _ in range(5)]  # connect, say nothing
        try:
            status, _, _ = request(m.port, context=tls_client(certs, certs.client_cert, certs.client_key), timeout=60)
            assert status == 200
            for sock in stalled:  # answered while every stalled handshake is still open on the server
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
        finally:
            for sock in stalled:
                sock.close()


def test_rotated_certificates_are_picked_up(tmp_path, certs):
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.crt", "server.key"):
        (live / name).write_bytes((certs.server_cert.parent / name).read_bytes())
    config = write_config(
        tmp_path, {"tls_server_config": {"cert_file": "live/server.crt", "key_file": "live/server.key"}}
    )
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", web_config=str(config))) as m:
        assert request(m.port, context=tls_client(certs))[0] == 200
        (tmp_path / "rotated").mkdir()
        rotated = make_certs(tmp_path / "rotated", server_name="rotated")
        for name in ("server.crt", "server.key"):
            (live / name).write_bytes((rotated.server_cert.parent / name).read_bytes())
        context = tls_client(rotated)
        context.check_hostname = True
        assert request(m.port, context=context)[0] == 200  # the new CA's certificate is served
        with pytest.raises(ssl.SSLError):
            request(m.port, context=tls_client(certs))  # the old one no longer


def test_the_legacy_certfile_keyfile_still_serve_tls(certs):
    config = MonitorConfig(port=0, addr="127.0.0.1", certfile=str(certs.server_cert), keyfile=str(certs.server_key))
    with Monitor(config) as m:
        m.observe(0, loss=0.5)
        status, _, body = request(m.port, context=tls_client(certs))
        assert status == 200 and re.search(rb'training_loss{rank="0",run_id="[^"]*"} 0\.5', body)
    with pytest.raises(ValueError, match="cert_file/key_file: cannot load"):
        MonitorConfig(certfile=str(certs.server_key), keyfile=str(certs.server_key))


def test_password_guessers_do_not_hold_up_a_known_scraper(tmp_path, monkeypatch):
    """A guess's bcrypt check is held open (the real check, then a wait on an event): the
    known scraper is answered while it holds the one-check-at-a-time lock and three more
    guesses queue on it. A scraper queued behind the check would wait for the event, and
    time out, whatever the machine's load."""
    bcrypt = require_module("bcrypt")
    known = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()  # the hold, not the cost, is the point
    real_checkpw, checking, release = bcrypt.checkpw, threading.Event(), threading.Event()

    def held_checkpw(password, hashed):
        try:
            return real_checkpw(password, hashed)
        finally:
            if password == b"guess":
                checking.set()
                release.wait(120)

    monkeypatch.setattr(bcrypt, "checkpw", held_checkpw)
    config = write_config(tmp_path, {"basic_auth_users": {"prometheus": known}})
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", web_config=str(config))) as m:
        assert request(m.port, headers=basic("prometheus", "s3cret"))[0] == 200  # verified once, then cached
        stop = threading.Event()

        def guess():
            while not stop.is_set():
                assert request(m.port, headers=basic("prometheus", "guess"), timeout=180)[0] == 401

        guessers = [threading.Thread(target=guess) for _ in range(4)]
        for t in guessers:
            t.start()
        try:
            assert checking.wait(60), "no guess reached the bcrypt check"
            for _ in range(5):
                assert request(m.port, headers=basic("prometheus", "s3cret"), timeout=60)[0] == 200
            assert not release.is_set()  # all five answered while a guess held the check
        finally:
            stop.set()
            release.set()
            for t in guessers:
                t.join(60)
