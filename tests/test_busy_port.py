"""A busy exporter port in `lossbeat demo`: one clear line naming the port, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_demo_on_a_busy_port_says_so_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "lossbeat", "demo", "--port", str(port), "--steps", "3", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert "Traceback" not in result.stderr, result.stderr
    if result.returncode != 0:  # strict: it stops, saying why
        (line,) = result.stderr.strip().splitlines()
        assert str(port) in line and "port" in line.lower()
    else:  # or the exporter serves elsewhere (server.py's fallback) and the run goes on
        assert str(port) in result.stdout + result.stderr
