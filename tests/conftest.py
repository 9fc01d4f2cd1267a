"""Shared fixtures: real training loops, real monitors, real scrapes."""

from __future__ import annotations

import importlib
import os
import random
import shutil
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# tests/workers/ holds scripts that import their siblings by plain name (worker_exit), as Python
# finds them when it runs one; a test that imports a worker (workers.hf_ddp_worker) needs the same.
sys.path.append(str(Path(__file__).resolve().parent / "workers"))


def require(condition: bool, reason: str) -> None:
    """Skip outside CI; under CI=true a missing real component is a failure, never a skip."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a real component is missing: {reason}")
    pytest.skip(reason)


def require_binary(*names: str, install: str = "apt-get install prometheus prometheus-alertmanager") -> str:
    """Path of the first of ``names`` on PATH; missing fails under CI=true and skips elsewhere."""
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    require(False, f"{' or '.join(names)} not installed ({install})")
    raise AssertionError("unreachable")


def require_module(name: str) -> ModuleType:
    """The imported module ``name`` (an optional extra); missing fails under CI=true and skips elsewhere."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        require(False, f"{name} not importable ({e}); pip install -e .[test]")
        raise AssertionError("unreachable") from e


_PORT_PICKER = random.SystemRandom()


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive free loopback ports, below the kernel's ephemeral range.

    ``bind(0)`` hands out ports from that range (ip_local_port_range), where every other bind(0)
    and every outgoing connection draws too: between this probe and the bind of a process the test
    then starts (a minute later on a loaded machine) one of them may take the port, and the
    process serves elsewhere. Below the range only another probe like this one can pick it.

    The pick comes from a private generator seeded by the OS: a trainer run in-process (an HF
    ``Trainer``, Lightning's ``seed_everything``) reseeds the global ``random`` with the same seed
    in every test process, and the processes would then probe the same ports in the same order."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            ephemeral = int(fh.read().split()[0])
    except (OSError, ValueError):
        ephemeral = 32768
    for _ in range(200):
        base = _PORT_PICKER.randrange(10000, ephemeral - count)
        probes: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                probes.append(socket.socket())
                probes[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports below {ephemeral}")


def registry_samples(monitor) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items without rank and run_id: value}}, from the monitor's
    /metrics text (its registry, no HTTP)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(monitor.registry).decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("rank", "run_id")))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def sample_value(samples: dict, name: str, **labels: str) -> float:
    """The one value of ``name`` in :func:`registry_samples`' output, or the one with ``labels``."""
    if labels:
        return samples[name][tuple(sorted(labels.items()))]
    (value,) = samples[name].values()
    return value


CORPORA = Path(__file__).resolve().parent / "data" / "real-logs"
"""The corpora of real training logs the tests own: one folder a set, each with a SOURCES.md
(repository, path, commit and blob of every file) and, where one exists, its ground truth."""
REAL_LOGS = CORPORA / "real-logs"
"""The first set (its SOURCES.md says what each file shows)."""


# --- Under xdist (tests/helpers/module_order.py): each module, or group of modules, to one test process,
# the longest first. Every process sorts its collection the same way; the controller hands out the units.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from helpers import module_order

        indices = module_order.order([item.nodeid for item in items], module_order.load())
        items[:] = [items[i] for i in indices]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":  # xdist's default with -n; another --dist is xdist's own
        return None
    from helpers import module_order

    return module_order.make_scheduler(config, log)


@pytest.fixture(autouse=True)
def _one_thread():
    # Small models on a 2-core machine: intra-op threads only add noise. torch is imported here,
    # not at the top: the xdist controller, which runs no test, loads this file too (3 CPU-s).
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --- CPU time per test (LOSSBEAT_TEST_CPU=FILE): what the suite's wall time on 2 cores is made of.
# Each test's user + system time, its own process and the children it waited for (servers, trainers,
# promtool), appended as one JSON line to FILE (one writer per line: xdist workers share it).
_CPU_LOG = os.environ.get("LOSSBEAT_TEST_CPU")


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _CPU_LOG:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json
        import time

        cpu, wall = _cpu_seconds(), time.monotonic()
        yield
        line = json.dumps(
            {"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 3), "wall_s": round(time.monotonic() - wall, 3)}
        )
        with open(_CPU_LOG, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
