"""Fixtures for the end-to-end tests: one real Prometheus + Alertmanager per module, a
webhook receiver, and real demo training processes scraped every second.

Each test's runs get their own ``job`` label (set in the file_sd targets file), so
alerts, routing and the ``equal: [job, run_id, instance, rank]`` inhibition never mix between tests
sharing a stack.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import require_binary

from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin.alert_rules import LOOKBACK_GROUP
from lossbeat.mixin.rules import render_rules, render_stage_rules
from lossbeat.mixin.stages import STAGES
from lossbeat.stack.local import Stack, write_target_groups

from .e2e_harness import DemoRun, Prometheus, WebhookReceiver, free_port
from .stack_config import E2E_THRESHOLDS, SHIPPED_ALERTMANAGER, retimed_alertmanager_config


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.servers)


@pytest.fixture(scope="session")
def servers() -> None:
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    """Thresholds overrides for this module's stack and demos; a module may override this fixture."""
    return E2E_THRESHOLDS


@pytest.fixture(scope="module")
def e2e_thresholds(e2e_overrides, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("thresholds") / "e2e-thresholds.yaml"
    path.write_text(yaml.safe_dump(e2e_overrides), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def lookback_interval() -> str | None:
    """The lookback group's evaluation interval in this module's rules, or None for the shipped
    one (every minute). A module that waits on the event counters' memory scales it down with
    its event window, as the other thresholds are scaled down for seconds-long tests."""
    return None


def _retime_lookback_group(text: str, interval: str) -> str:
    doc = yaml.safe_load(text)
    groups = [g for g in doc["groups"] if g["name"] == LOOKBACK_GROUP]
    assert len(groups) == 1, [g["name"] for g in doc["groups"]]
    groups[0]["interval"] = interval
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def e2e_rules(e2e_thresholds, lookback_interval, tmp_path_factory) -> Path:
    """rules.yml from the test thresholds, and its two stages beside it (rules-shard.yml,
    rules-global.yml): what `lossbeat rules --output-dir` writes there (tests/test_generate.py runs
    the command), rendered in this process without the promtool tests, whose healthy shapes'
    replay would cost each module's stack 3 CPU-s."""
    out = tmp_path_factory.mktemp("rules")
    thresholds = load_thresholds(e2e_thresholds)
    rendered = {"rules.yml": render_rules(thresholds)}
    for stage in STAGES:
        rendered[f"rules-{stage}.yml"] = render_stage_rules(thresholds, stage)
    for name, text in rendered.items():
        if lookback_interval is not None and LOOKBACK_GROUP in text:
            text = _retime_lookback_group(text, lookback_interval)
        (out / name).write_text(text, encoding="utf-8")
    return out / "rules.yml"


@pytest.fixture(scope="module")
def extra_alertmanagers() -> list[str]:
    """host:port of further Alertmanagers the module's Prometheus sends to; none by default."""
    return []


@pytest.fixture(scope="module")
def receiver():
    server = WebhookReceiver()
    yield server
    server.close()


@pytest.fixture(scope="module")
def stack(servers, e2e_rules, receiver, extra_alertmanagers, tmp_path_factory):
    """Prometheus (scrape and evaluation every 1 s) and Alertmanager on free loopback ports."""
    workdir = tmp_path_factory.mktemp("stack")
    am_config = workdir / "alertmanager.yml"
    am_config.write_text(yaml.safe_dump(retimed_alertmanager_config(SHIPPED_ALERTMANAGER, receiver.url)))
    server = Stack(
        workdir=workdir,
        prometheus_port=free_port(),
        alertmanager_port=free_port(),
        targets=(),
        scrape_interval="1s",
        rule_files=[e2e_rules],
        alertmanager_config=am_config,
        extra_alertmanagers=extra_alertmanagers,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prometheus(stack) -> Prometheus:
    return Prometheus(stack.prometheus_url)


def _job_name(node_name: str, index: int) -> str:
    return f"e2e-{re.sub(r'[^a-zA-Z0-9]+', '-', node_name).strip('-')}-{index}"


@pytest.fixture
def demo(stack, e2e_thresholds, tmp_path, request):
    """Factory: ``demo("--steps", "200", "--fault", "nan")`` starts a real training run
    (with the module's thresholds, like its rules), adds it to Prometheus's targets under
    its own job label and returns the DemoRun.

    Teardown removes the targets first (so no down-exporter alert outlives the test),
    then stops every process by PID.
    """
    runs: list[DemoRun] = []

    def start(*args: str) -> DemoRun:
        run = DemoRun(
            job=_job_name(request.node.name, len(runs)),
            log_path=tmp_path / f"demo-{len(runs)}.log",
            args=["--thresholds", str(e2e_thresholds), *args],
        )
        runs.append(run)
        run.start()
        write_target_groups(stack.targets_file, [{"targets": [r.target], "labels": {"job": r.job}} for r in runs])
        return run

    yield start
    try:
        write_target_groups(stack.targets_file, [])
    finally:
        for run in runs:
            run.stop()
    call = getattr(request.node, "rep_call", None)
    if call is not None and call.failed:
        for run in runs:
            print(f"--- demo {run.job} log tail:\n{run.log_tail()}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Expose each phase's report on the item so fixtures can print logs on failure."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
