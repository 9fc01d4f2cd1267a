"""Serving /metrics: TLS, clear errors on a taken port, rank context from torchrun's variables."""

import shutil
import socket
import ssl
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from lossbeat import Monitor, MonitorConfig
from lossbeat.server import MetricsServer, RankContext

from conftest import require


def test_metrics_over_tls(tmp_path):
    require(shutil.which("openssl") is not None, "openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", certfile=str(cert), keyfile=str(key))) as m:
        m.observe(0, loss=1.5)
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False
        body = urllib.request.urlopen(f"https://127.0.0.1:{m.port}/metrics", context=context, timeout=10).read()
        assert b'training_loss{rank="0"} 1.5' in body
        with pytest.raises(Exception):  # plain HTTP is refused
            urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=5).read()


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}.*port=0 for a free one"):
            MetricsServer(CollectorRegistry(), port, "127.0.0.1")


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
