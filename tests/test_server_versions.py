"""The servers the suite runs are the line it claims to test.

`make test` runs the suite on the system's Prometheus (Debian stable's 2.x line); `make
test-prometheus3` runs the server tests again with the Prometheus 3 LTS line first on PATH and
LOSSBEAT_EXPECT_PROMETHEUS=3. A wrong PATH would otherwise test the old line twice and pass.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import require_binary

pytestmark = pytest.mark.servers

ALERTMANAGER_AT_LEAST = {"3": (0, 28)}
"""The oldest Alertmanager each Prometheus line is tested with."""


def version_of(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    match = re.search(r"version (\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    assert match, f"{binary} --version: {out.stdout + out.stderr!r}"
    return tuple(int(part) for part in match.groups())


def test_prometheus_and_promtool_are_one_line_and_the_expected_one():
    prometheus = version_of(require_binary("prometheus"))
    promtool = version_of(require_binary("promtool"))
    assert prometheus[0] == promtool[0]
    expected = os.environ.get("LOSSBEAT_EXPECT_PROMETHEUS")
    if expected:
        assert prometheus[0] == int(expected)


def test_alertmanager_and_amtool_are_recent_enough_for_the_line():
    alertmanager = version_of(require_binary("alertmanager", "prometheus-alertmanager"))
    amtool = version_of(require_binary("amtool"))
    assert alertmanager[:2] == amtool[:2]
    expected = os.environ.get("LOSSBEAT_EXPECT_PROMETHEUS")
    if expected:
        assert alertmanager[:2] >= ALERTMANAGER_AT_LEAST[expected]
