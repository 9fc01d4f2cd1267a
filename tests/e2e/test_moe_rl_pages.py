"""MoE router collapse and RL policy collapse page through the real stack: monitors serving on
loopback (a tiny MoE trained on CPU, and a policy's logged entropy, KL and reward), scraped every
second by the module's Prometheus with rules generated from thresholds whose ``for`` is seconds,
routed by the shipped Alertmanager config. The collapsed runs page on the paging route; the
healthy ones, scraped beside them for as long, fire nothing. The same for a real TRL GRPOTrainer
on CPU (a tiny random GPT-2), whose logged entropy and KL the HF callback passes."""

from __future__ import annotations

import pytest

from lossbeat.monitor import Monitor, MonitorConfig
from lossbeat.stack.local import write_target_groups

from .e2e_harness import wait_for_page, wait_until
from .stack_config import E2E_THRESHOLDS

PAGES = ("TrainingMoERouterCollapse", "TrainingRLEntropyCollapse", "TrainingRLKLExploded")


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    return {
        **E2E_THRESHOLDS,
        "moe": {"for": "5s", "dead_window_steps": 20},
        # min_records 8: the TRL runs below are 14 steps long
        "rl_policy": {"entropy_for": "5s", "kl_for": "5s", "min_records": 8},
    }


def _serve(thresholds) -> Monitor:
    return Monitor(MonitorConfig(port=0, addr="127.0.0.1", thresholds=str(thresholds), log_status_changes=False))


def _policy(monitor: Monitor, collapse: bool) -> None:
    for step in range(40):
        late = collapse and step >= 8
        monitor.observe(
            step,
            loss=0.01 * (step % 3 - 1),
            grad_norm=0.5,
            metrics={
                "reward": 0.5 + 0.001 * (step % 2),
                "reward_std": 0.2,
                "entropy": 0.05 if late else 2.0 - 0.001 * step,
                "kl": 2.0 if late else 0.01,
            },
        )
    monitor.flush()


def test_collapsed_router_and_policy_page_and_healthy_ones_stay_silent(stack, receiver, prometheus, e2e_thresholds):
    from test_moe import _train

    runs = {
        "e2e-moe-collapsed": _train(collapse_layer=1, monitor=_serve(e2e_thresholds))[0],
        "e2e-moe-healthy": _train(monitor=_serve(e2e_thresholds))[0],
        "e2e-rl-collapsed": _serve(e2e_thresholds),
        "e2e-rl-healthy": _serve(e2e_thresholds),
    }
    _policy(runs["e2e-rl-collapsed"], collapse=True)
    _policy(runs["e2e-rl-healthy"], collapse=False)
    write_target_groups(
        stack.targets_file,
        [{"targets": [f"127.0.0.1:{m.port}"], "labels": {"job": job}} for job, m in runs.items()],
    )
    try:
        page = wait_for_page(receiver, "TrainingMoERouterCollapse", "e2e-moe-collapsed", timeout=90)
        assert page.labels["layer"] == "layers.1.router" and page.labels["severity"] == "critical"
        for alert in ("TrainingRLEntropyCollapse", "TrainingRLKLExploded"):
            assert wait_for_page(receiver, alert, "e2e-rl-collapsed", timeout=90).labels["severity"] == "critical"
        # The healthy runs were scraped as long, past every `for`: nothing of these fires for them.
        wait_until(lambda: prometheus.query('up{job="e2e-moe-healthy"} == 1'), 30, "the healthy targets scraped")
        for job in ("e2e-moe-healthy", "e2e-rl-healthy"):
            assert [a for a in prometheus.alerts(job=job) if a["labels"]["alertname"] in PAGES] == []
            assert [d for d in receiver.received(job=job) if d.labels["alertname"] in PAGES] == []
    finally:
        write_target_groups(stack.targets_file, [])
        for monitor in runs.values():
            monitor.close(completed=False)


def test_a_real_trl_grpo_policy_collapse_pages_and_a_healthy_one_stays_silent(
    stack, receiver, prometheus, e2e_thresholds, tmp_path
):
    from test_rl_policy import _grpo

    runs = {
        "e2e-trl-collapsed": _grpo(tmp_path / "collapsed", collapse=True, monitor=_serve(e2e_thresholds))[0],
        "e2e-trl-healthy": _grpo(tmp_path / "healthy", collapse=False, monitor=_serve(e2e_thresholds))[0],
    }
    write_target_groups(
        stack.targets_file,
        [{"targets": [f"127.0.0.1:{m.port}"], "labels": {"job": job}} for job, m in runs.items()],
    )
    try:
        for alert in ("TrainingRLEntropyCollapse", "TrainingRLKLExploded"):
            page = wait_for_page(receiver, alert, "e2e-trl-collapsed", timeout=90)
            assert page.labels["severity"] == "critical"
        wait_until(lambda: prometheus.query('up{job="e2e-trl-healthy"} == 1'), 30, "the healthy target scraped")
        assert [a for a in prometheus.alerts(job="e2e-trl-healthy") if a["labels"]["alertname"] in PAGES] == []
        assert [d for d in receiver.received(job="e2e-trl-healthy") if d.labels["alertname"] in PAGES] == []
    finally:
        write_target_groups(stack.targets_file, [])
        for monitor in runs.values():
            monitor.close(completed=False)
