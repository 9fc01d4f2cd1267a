"""scripts/test_report.py: docs/tests.md's measured block is written from JUnit files, not by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "test_report.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
errors="0" failures="1" skipped="1" tests="4" time="12.5"><testcase classname="tests.test_a" name="test_x" time="3.25"/>
<testcase classname="tests.e2e.test_b" name="test_y" time="7.5"/><testcase classname="tests.test_a" name="test_z"
time="0.5"><failure message="no"/></testcase><testcase classname="tests.test_a" name="test_s" time="0.0">
<skipped message="s"/></testcase></testsuite></testsuites>"""


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path)


def test_the_block_holds_the_counts_time_and_slowest_tests(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    page = tmp_path / "tests.md"
    page.write_text("# T\n\nbefore\n<!-- measured:begin -->\nold\n<!-- measured:end -->\nafter\n")
    result = run(tmp_path, "--write", str(page), "Prometheus 9.9=j.xml")
    assert result.returncode == 1  # a failed test: the page is written, the command fails
    text = page.read_text()
    assert "old" not in text and text.startswith("# T\n\nbefore\n") and text.endswith("after\n")
    assert "| Prometheus 9.9 | 4 | 2 | 1 | 0 | 1 | 12.5 s |" in text
    slowest = [line for line in text.splitlines() if line.startswith("| 7.50") or line.startswith("| 3.25")]
    assert slowest == ["| 7.50 | `tests/e2e/test_b.py::test_y` |", "| 3.25 | `tests/test_a.py::test_x` |"]


def test_a_page_without_the_block_is_refused(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    (tmp_path / "tests.md").write_text("# no block\n")
    result = run(tmp_path, "--write", "tests.md", "P=j.xml")
    assert result.returncode != 0 and "no <!-- measured:begin -->" in result.stderr


def test_the_committed_page_has_the_block():
    text = (REPO / "docs" / "tests.md").read_text(encoding="utf-8")
    assert text.count("<!-- measured:begin -->") == 1 and text.count("<!-- measured:end -->") == 1
