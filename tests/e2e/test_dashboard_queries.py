"""Every query of every dashboard panel returns data from a Prometheus that scraped real
demo runs: a multi-task one with fp16 loss scaling where one layer explodes and another
vanishes (component, layer and loss-scale panels) and one whose loss turns NaN (non-finite
panels, firing alerts), beside a monitor fed a mixture-of-experts router's load and an RL
policy's signals (the router and policy panels). A panel that stays empty here would stay
empty for users."""

from __future__ import annotations

from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin.dashboards import build_dashboards, expand_query, panel_queries
from lossbeat.monitor import Monitor, MonitorConfig
from lossbeat.stack.local import write_target_groups

from .e2e_harness import exporter_samples, wait_until


def _moe_and_policy_run(thresholds) -> Monitor:
    """A run with two MoE layers (one unbalanced), a router auxiliary loss and an RL policy's
    entropy, KL and rewards, observed as a training loop would."""
    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1", thresholds=str(thresholds), log_status_changes=False))
    for step in range(30):
        monitor.observe(
            step,
            loss=0.5 - 0.001 * step,
            grad_norm=0.5,
            losses={"lm": 0.49 - 0.001 * step, "router_aux_loss": 0.01},
            metrics={"reward": 0.4 + 0.01 * step, "reward_std": 0.2, "entropy": 1.5, "kl": 0.01},
            expert_load={"layers.0.router": [16, 15, 17, 16], "layers.1.router": [60, 4, 0, 0]},
        )
    monitor.flush()
    return monitor


def test_every_panel_query_returns_data_from_real_runs(demo, stack, prometheus, e2e_thresholds):
    common = (
        "--steps",
        "120",
        "--step-delay",
        "0.05",
        "--batch-size",
        "8",
        "--eval-every",
        "10",
        "--fault-step",
        "40",
        "--linger",
        "120",
    )
    exploding = demo(*common, "--fault", "explode,vanish", "--multi-task", "--grad-scaler")
    nan = demo(*common, "--fault", "nan")
    for run in (exploding, nan):
        run.wait_serving()
    routed = _moe_and_policy_run(e2e_thresholds)
    routed_job = f"{nan.job}-moe-rl"
    write_target_groups(
        stack.targets_file,
        [{"targets": [r.target], "labels": {"job": r.job}} for r in (exploding, nan)]
        + [{"targets": [f"127.0.0.1:{routed.port}"], "labels": {"job": routed_job}}],
    )

    def runs_done():
        return all(exporter_samples(r.port).get('training_steps_total{rank="0"}') == 120 for r in (exploding, nan))

    wait_until(runs_done, 600, "both runs to finish training")
    wait_until(lambda: prometheus.firing("TrainingLossNaN", job=nan.job), 30, "an alert to fire (Firing alerts panel)")

    wait_until(lambda: prometheus.query(f'training_moe_experts{{job="{routed_job}"}}'), 60, "the MoE run scraped")

    jobs = f"{exploding.job}|{nan.job}|{routed_job}"
    dashboards = build_dashboards(load_thresholds(e2e_thresholds))
    empty, checked = [], 0
    try:
        for file_name, dashboard in dashboards.items():
            for title, expr in panel_queries(dashboard):
                query = expand_query(expr, job=jobs, rank=".*", rate_interval="1m", time_range="5m", interval="1s")
                checked += 1
                if not prometheus.query(query):
                    empty.append(f"{file_name} / {title}: {query}")
    finally:
        routed.close(completed=False)
    assert checked >= 25
    assert empty == [], "panels without data:\n" + "\n".join(empty)
