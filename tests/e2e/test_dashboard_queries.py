"""Every query of every dashboard panel returns data from a Prometheus that scraped real
demo runs: a multi-task one with fp16 loss scaling where one layer explodes and another
vanishes (component, layer and loss-scale panels) and one whose loss turns NaN (non-finite
panels, firing alerts). A panel
that stays empty here would stay empty for users."""

from __future__ import annotations

from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin.dashboards import build_dashboards, expand_query, panel_queries

from .e2e_harness import exporter_samples, wait_until


def test_every_panel_query_returns_data_from_real_runs(demo, prometheus, e2e_thresholds):
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

    def runs_done():
        return all(exporter_samples(r.port).get('training_steps_total{rank="0"}') == 120 for r in (exploding, nan))

    wait_until(runs_done, 600, "both runs to finish training")
    wait_until(lambda: prometheus.firing("TrainingLossNaN", job=nan.job), 30, "an alert to fire (Firing alerts panel)")

    jobs = f"{exploding.job}|{nan.job}"
    dashboards = build_dashboards(load_thresholds(e2e_thresholds))
    empty, checked = [], 0
    for file_name, dashboard in dashboards.items():
        for title, expr in panel_queries(dashboard):
            query = expand_query(expr, job=jobs, rank=".*", rate_interval="1m", time_range="5m", interval="1s")
            checked += 1
            if not prometheus.query(query):
                empty.append(f"{file_name} / {title}: {query}")
    assert checked >= 25
    assert empty == [], "panels without data:\n" + "\n".join(empty)
