"""The order the test processes take the modules in: the longest first (docs/tests.md#scheduling).

Under xdist, ``--dist loadscope`` (pyproject.toml) hands out whole modules, each to the first
process that is free, so a module's fixtures (a Prometheus stack, a wheel, a shared torchrun
job) are set up once. ``order`` sorts the modules by their tests' seconds in
``tests/durations.json`` (longest-processing-time first: the long modules start while every
process is free, the short ones fill the end), keeping each module's tests in their collected
order. A test the file does not list counts ``UNLISTED_S``. The order depends only on the
file and the collection, so every xdist process computes the same one.

Refresh the file from a run's ``LOSSBEAT_TEST_CPU`` log (docs/tests.md)::

    LOSSBEAT_TEST_CPU=/tmp/cpu.jsonl make test
    python3 tests/module_order.py /tmp/cpu.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
LISTED_FROM_S = 1.0
"""Tests shorter than this are left out of the file (most of the suite: they count UNLISTED_S)."""
UNLISTED_S = 0.15
"""The seconds of a test the file does not list: the mean of those left out in the last refresh."""


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load(path: Path = DURATIONS) -> dict[str, float]:
    """{test id: seconds}; an empty dict if the file is missing (collection order is kept)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def order(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """The indices of ``nodeids`` with the modules longest first; a module's tests keep their
    order, and modules of equal seconds keep theirs."""
    first_seen: dict[str, int] = {}
    total: dict[str, float] = {}
    for index, nodeid in enumerate(nodeids):
        module = module_of(nodeid)
        first_seen.setdefault(module, index)
        total[module] = total.get(module, 0.0) + seconds.get(nodeid, UNLISTED_S)
    return sorted(range(len(nodeids)),
                  key=lambda i: (-total[module_of(nodeids[i])], first_seen[module_of(nodeids[i])], i))


def refreshed(cpu_logs: list[Path]) -> dict[str, float]:
    """{test id: wall seconds} of the tests at least LISTED_FROM_S long, from ``LOSSBEAT_TEST_CPU``
    logs (JSON lines; a test's last line wins)."""
    wall: dict[str, float] = {}
    for log in cpu_logs:
        for line in log.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                wall[row["test"]] = float(row["wall_s"])
    return {test: round(s, 1) for test, s in sorted(wall.items()) if s >= LISTED_FROM_S}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    durations = refreshed([Path(p) for p in argv])
    DURATIONS.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{DURATIONS}: {len(durations)} tests of at least {LISTED_FROM_S:g} s, {sum(durations.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
