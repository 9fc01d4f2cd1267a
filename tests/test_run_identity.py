"""The run identity (the ``run_id`` label of every series): where it comes from, and that every
series of a monitor carries it."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lossbeat.monitor import Monitor, MonitorConfig, identity
from lossbeat.monitor.identity import run_identity

_ENV = ("LOSSBEAT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_first_source_found_wins(clean_env):
    env = clean_env
    env.setenv("MASTER_ADDR", "node-a")
    env.setenv("MASTER_PORT", "29500")
    assert run_identity("", 4) == "node-a:29500"
    env.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default rdzv id: no identity
    assert run_identity("", 4) == "node-a:29500"
    env.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    assert run_identity("", 4) == "3f2a"
    env.setenv("SLURM_JOB_ID", "101")
    assert run_identity("", 4) == "101"
    env.setenv("LOSSBEAT_RUN_ID", "sweep-7")
    assert run_identity("", 4) == "sweep-7"
    assert run_identity("given", 4) == "given"


def test_a_single_process_gets_an_id_of_its_own_and_ranks_without_one_say_so(clean_env):
    # No process group's store either (another test of this worker may have left one), and the
    # warning read from a handler of lossbeat's own logger: an in-process trainer's logging set-up
    # may have stopped it propagating to caplog's.
    clean_env.setattr(identity, "_from_store", lambda: "")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("lossbeat")
    clean_env.setattr(logger, "disabled", False)
    level = logger.level  # another test of this worker may have left it at ERROR
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        a, b = run_identity("", 1), run_identity("", 1)
        assert a and b and a != b
        assert run_identity("", 8) == ""
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any("no run identity" in m for m in seen)


def test_every_series_carries_the_run_id(clean_env):
    clean_env.setenv("SLURM_JOB_ID", "4242")
    monitor = Monitor(MonitorConfig(port=0, work_time=True), serve=False)
    monitor.observe(1, loss=1.0)
    monitor.observe(2, loss=0.5)
    monitor.flush()
    samples = [s for f in text_string_to_metric_families(generate_latest(monitor.registry).decode()) for s in f.samples]
    assert len(samples) > 20
    assert {s.labels.get("run_id") for s in samples} == {"4242"}


def test_run_id_is_validated():
    with pytest.raises(TypeError, match="run_id"):
        MonitorConfig(run_id=5)
