"""Which test process runs what under xdist, and in what order (docs/tests.md#scheduling).

The suite is handed out in units: a unit is a test module, or a group of modules in GROUPS.
A unit goes whole to one process (``UnitScheduling``), so its module fixtures (a Prometheus
stack, a wheel, a shared torchrun job) are set up once and a group's frameworks are imported
once. The units go longest first (longest-processing-time first: the long ones start while
every process is free, the short ones fill the end), by their tests' seconds in
``tests/durations.json``; a unit keeps its tests in their collected order, and a test the file
does not list counts ``UNLISTED_S``. The order depends only on the file and the collection, so
every xdist process computes the same one.

Refresh the file from a run's ``LOSSBEAT_TEST_CPU`` log (docs/tests.md)::

    LOSSBEAT_TEST_CPU=/tmp/cpu.jsonl make test
    python3 tests/helpers/module_order.py /tmp/cpu.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
LISTED_FROM_S = 1.0
"""Tests shorter than this are left out of the file (most of the suite: they count UNLISTED_S)."""
UNLISTED_S = 0.15
"""The seconds of a test the file does not list: about the mean of those left out."""

GROUPS = {
    # Their tests import Lightning or the HF Trainer in the test process: 6-7 CPU-s the first
    # time in a process, nothing after.
    "frameworks": (
        "tests/test_callback_phases.py",
        "tests/test_guard_integrations.py",
        "tests/test_integration_faults.py",
        "tests/test_integration_signals.py",
        "tests/test_integrations.py",
        "tests/test_launchers.py",
        "tests/test_pretrain_integrations.py",
    ),
}
_GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The unit a test belongs to: its group's name, or its module's path."""
    module = module_of(nodeid)
    return _GROUP_OF.get(module, module)


def load(path: Path = DURATIONS) -> dict[str, float]:
    """{test id: seconds}; an empty dict if the file is missing (every test then counts UNLISTED_S)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def order(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """The indices of ``nodeids``, unit by unit, the longest units first; a unit's tests keep
    their collected order, and units of equal seconds theirs."""
    first_seen: dict[str, int] = {}
    total: dict[str, float] = {}
    for index, nodeid in enumerate(nodeids):
        unit = unit_of(nodeid)
        first_seen.setdefault(unit, index)
        total[unit] = total.get(unit, 0.0) + seconds.get(nodeid, UNLISTED_S)
    units = [unit_of(nodeid) for nodeid in nodeids]
    return sorted(range(len(nodeids)), key=lambda i: (-total[units[i]], first_seen[units[i]], i))


def make_scheduler(config, log):
    """xdist's scope scheduler with our units as scopes and the collected order (ours) kept:
    each unit to the first free process, a unit at a time."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # xdist would sort the units by their number of tests
    return UnitScheduling(config, log)


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
        print("usage: python3 tests/helpers/module_order.py LOSSBEAT_TEST_CPU_FILE...", file=sys.stderr)
        return 2
    durations = refreshed([Path(p) for p in argv])
    DURATIONS.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{DURATIONS}: {len(durations)} tests of at least {LISTED_FROM_S:g} s, {sum(durations.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
