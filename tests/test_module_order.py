"""The order xdist's processes take the suite in (tests/helpers/module_order.py): units longest first."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import module_order
from helpers.module_order import GROUPS, UNLISTED_S, order, refreshed, unit_of

REPO = Path(__file__).resolve().parents[1]


def test_units_go_longest_first_and_keep_their_tests_in_order():
    nodeids = [
        "tests/test_a.py::one",
        "tests/test_a.py::two",
        "tests/test_b.py::one",
        "tests/test_c.py::one",
        "tests/test_c.py::two[x]",
        "tests/test_d.py::one",
    ]
    seconds = {
        "tests/test_a.py::two": 3.0,
        "tests/test_c.py::one": 2.0,
        "tests/test_c.py::two[x]": 2.0,
        "tests/test_d.py::one": 3.0 + UNLISTED_S,
    }
    ordered = [nodeids[i] for i in order(nodeids, seconds)]
    # c: 4.0; a: 3.0 + the unlisted one; d: the same, collected after a; b: unlisted only.
    assert ordered == [
        "tests/test_c.py::one",
        "tests/test_c.py::two[x]",
        "tests/test_a.py::one",
        "tests/test_a.py::two",
        "tests/test_d.py::one",
        "tests/test_b.py::one",
    ]
    assert order(nodeids, {}) == [0, 1, 3, 4, 2, 5]  # no file: every test UNLISTED_S, a and c first


def test_a_group_is_one_unit_however_its_modules_were_collected():
    first, second = GROUPS["frameworks"][:2]
    nodeids = [f"{first}::t", "tests/test_other.py::t", f"{second}::t"]
    assert unit_of(nodeids[0]) == unit_of(nodeids[2]) == "frameworks"
    assert unit_of("tests/test_other.py::t[a::b]") == "tests/test_other.py"
    ordered = [nodeids[i] for i in order(nodeids, {"tests/test_other.py::t": 1.0, f"{second}::t": 5.0})]
    assert ordered == [f"{first}::t", f"{second}::t", "tests/test_other.py::t"]


def test_every_grouped_module_exists():
    # A renamed module would leave its group silently (and import its frameworks in another process).
    assert [m for modules in GROUPS.values() for m in modules if not (REPO / m).is_file()] == []


def test_the_refresh_keeps_each_tests_last_wall_time_from_one_second(tmp_path):
    log = tmp_path / "cpu.jsonl"
    rows = [("tests/test_a.py::one", 5.04), ("tests/test_a.py::two", 0.4), ("tests/test_a.py::one", 2.26)]
    log.write_text("".join(json.dumps({"test": t, "cpu_s": 1.0, "wall_s": w}) + "\n" for t, w in rows) + "\n")
    assert refreshed([log]) == {"tests/test_a.py::one": 2.3}


def test_the_checked_in_durations_are_a_refresh():
    durations = module_order.load()
    assert len(durations) > 50 and min(durations.values()) >= module_order.LISTED_FROM_S
    assert all(test.startswith("tests/") and "::" in test for test in durations)
