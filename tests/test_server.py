"""Serving /metrics: TLS, clear errors on a taken port, rank context from torchrun's variables."""

import http.client
import re
import shutil
import socket
import ssl
import subprocess
import urllib.request

import pytest
from conftest import require
from prometheus_client import CollectorRegistry

from lossbeat import Monitor, MonitorConfig
from lossbeat.exposition.server import MetricsServer, RankContext


def test_metrics_over_tls(tmp_path):
    require(shutil.which("openssl") is not None, "openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", certfile=str(cert), keyfile=str(key))) as m:
        m.observe(0, loss=1.5)
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False
        body = urllib.request.urlopen(f"https://127.0.0.1:{m.port}/metrics", context=context, timeout=10).read()
        assert re.search(rb'training_loss{rank="0",run_id="[^"]*"} 1\.5', body)
        with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP is refused
            urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=5).read()


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_taken_port_falls_back_to_a_free_one_and_says_which_in_one_line(caplog):
    with _busy_port() as busy:
        taken = busy.getsockname()[1]
        with caplog.at_level("WARNING", logger="lossbeat"):
            server = MetricsServer(CollectorRegistry(), taken, "127.0.0.1")
        try:
            assert server.fallback and server.requested_port == taken
            assert server.port not in (0, taken)
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
                assert resp.status == 200
        finally:
            server.close()
    records = [r for r in caplog.records if r.name == "lossbeat"]
    assert len(records) == 1 and records[0].exc_info is None
    line = records[0].getMessage()
    assert "\n" not in line
    assert f"127.0.0.1:{taken} is unavailable" in line and f"on port {server.port} instead" in line


def test_two_jobs_sharing_a_node_both_serve(monkeypatch):
    """Two 4-rank jobs on one node: the second job's LOCAL_RANK 0 finds 8470+0 taken and still serves."""
    with _busy_port() as busy:
        base = busy.getsockname()[1]
        monkeypatch.setenv("LOCAL_RANK", "0")
        with Monitor(MonitorConfig(port=base, addr="127.0.0.1")) as m:
            m.observe(3, loss=0.5)
            assert m.port != base
            body = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read()
            assert re.search(rb'training_loss{rank="0",run_id="[^"]*"} 0\.5', body)


def test_strict_port_raises_naming_the_port_and_the_fix():
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(
            OSError,
            match=f"cannot serve metrics on 127.0.0.1:{port}.*strict_port=True.*"
            f"free port {port}.*port=0 for a free one",
        ):
            MetricsServer(CollectorRegistry(), port, "127.0.0.1", strict_port=True)
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*strict_port"):
            Monitor(MonitorConfig(port=port, addr="127.0.0.1", strict_port=True, port_per_local_rank=False))


def test_an_address_not_of_this_host_is_an_error_not_a_fallback():
    # TEST-NET-1 (RFC 5737) is never a local address: no port would work.
    with pytest.raises(OSError, match="cannot serve metrics on 192.0.2.1:0.*check addr"):
        MetricsServer(CollectorRegistry(), 0, "192.0.2.1")


def test_strict_port_is_validated():
    with pytest.raises(TypeError, match="strict_port: expected True or False"):
        MonitorConfig(strict_port="yes")


def test_rank_context_reads_torchrun_variables(monkeypatch):
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert RankContext.from_env() == RankContext(rank=11, local_rank=3, world_size=16)
    monkeypatch.setenv("LOCAL_RANK", "three")
    with pytest.raises(ValueError, match="LOCAL_RANK: expected an integer"):
        RankContext.from_env()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert RankContext.from_env() == RankContext(0, 0, 1)


def test_tls_needs_both_files():
    with pytest.raises(ValueError, match="certfile, keyfile"):
        MonitorConfig(certfile="cert.pem")
