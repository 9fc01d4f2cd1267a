"""``lossbeat dashboards``: the Grafana dashboards, generated from the thresholds file.

Two dashboards (``lossbeat / Overview`` and ``lossbeat / Layers``) are built as plain
Grafana JSON models: every threshold line, band and colour step comes from
:mod:`lossbeat.diagnosis.thresholds`, every metric name from :mod:`lossbeat.exposition.metrics`.  The command
writes them, plus a Kubernetes ConfigMap for Grafana's dashboard sidecar, into
``--output-dir`` (``grafana/``, ``kubernetes/``) or, with ``--checkout`` (``make generate``),
the repository's ``grafana/`` and ``deploy/kubernetes/``; ``--check`` fails on drift instead.

Tests and the end-to-end harness read the queries back with :func:`panel_queries` and
substitute Grafana's template variables with :func:`expand_query`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Iterable

from lossbeat.analyze.checklist import ITEMS as CHECKLIST_ITEMS
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.exposition.metrics import METRICS
from lossbeat.mixin.generated import add_generator_arguments, output_root, sync_files, thresholds_for
from lossbeat.mixin.heatmaps import heatmap_options as heatmap_options_for
from lossbeat.mixin.moe_rl_dashboard import OPTIONAL_METRICS as MOE_RL_METRICS
from lossbeat.mixin.moe_rl_dashboard import moe_rl_panels

__all__ = [
    "build_dashboards",
    "panel_queries",
    "expand_query",
    "render_files",
    "output_files",
    "may_be_empty",
    "add_arguments",
    "run",
]

SCHEMA_VERSION = 39  # Grafana 10.4 / 11.0 dashboards; newer Grafana migrates forward
OVERVIEW_FILE = "lossbeat-overview.json"
LAYERS_FILE = "lossbeat-layers.json"
CLUSTER_FILE = "lossbeat-cluster.json"
CONFIGMAP_PATH = "deploy/kubernetes/grafana-dashboards-configmap.yaml"
_REPO_ROOT = Path(__file__).resolve().parents[3]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILTER = 'job=~"$job", rank=~"$rank"'
# Alerts aggregated over ranks (stalled job, exporter down) carry no rank label: keep them
# visible when one rank is picked.
ALERTS_FILTER = 'job=~"$job", rank=~"$rank|"'
RATE_INTERVAL = "$__rate_interval"

HEALTH_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "0": {"color": "green", "index": 0, "text": "good"},
            "1": {"color": "yellow", "index": 1, "text": "warning"},
            "2": {"color": "red", "index": 2, "text": "danger"},
        },
    }
]

# Panels that show events which a healthy run never has: their queries return no series.
_QUIET_PANELS = frozenset(
    {
        "Firing alerts",
        "Exploding layers",
        "Vanishing layers",
        "Layers outside the healthy range",
        "First layer with a non-finite gradient",
    }
)
# Series only some runs export: loss components (multi-task runs), the rank work time
# (work_time=True).
_OPTIONAL_METRICS = ("training_loss_component{", "training_rank_work_seconds{") + MOE_RL_METRICS


def may_be_empty(title: str, expr: str) -> bool:
    """True if the query of panel ``title`` may return no series while a run is healthy."""
    return title in _QUIET_PANELS or any(metric in expr for metric in _OPTIONAL_METRICS)


# --- PromQL -------------------------------------------------------------------------


def _selector(metric: str, filters: str = FILTER, matchers: str = "") -> str:
    """``metric{matchers, job=~"$job", rank=~"$rank"}``; the name must be in the contract."""
    # Info metrics are exposed with an ``_info`` suffix that the contract's names leave off.
    base = metric.removesuffix("_info")
    spec = METRICS.get(base)
    if spec is None or metric.endswith("_info") != (spec.kind == "info"):
        raise ValueError(f"metric: {metric!r} is not exposed by lossbeat (see lossbeat.exposition.metrics.METRICS)")
    return f"{metric}{{{matchers + ', ' if matchers else ''}{filters}}}"


def _counter(function: str, metric: str) -> str:
    """Counters are only ever read as a rate or an increase over Grafana's rate interval."""
    if METRICS[metric].kind != "counter":
        raise ValueError(f"metric: {metric!r} is a {METRICS[metric].kind}, not a counter")
    return f"{function}({_selector(metric)}[{RATE_INTERVAL}])"


def _num(value: float) -> str:
    """A float as PromQL reads it back exactly (``repr`` round-trips)."""
    return repr(float(value))


def _seconds(duration: str) -> float:
    """A Prometheus duration (``1h30m``) in seconds."""
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"duration: expected a Prometheus duration like 5m, got {duration!r}")
    return float(sum(int(n) * scale[u] for n, u in parts))


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand_query(
    expr: str,
    *,
    job: str = ".*",
    rank: str = ".*",
    rate_interval: str = "1m",
    time_range: str = "1h",
    interval: str = "15s",
) -> str:
    """Substitute Grafana's template variables so Prometheus can run ``expr`` as is.

    ``job`` and ``rank`` are regexes (what Grafana puts in for All or a multi-value
    pick); the other arguments are Prometheus durations.  An unknown ``$variable``
    raises ValueError naming it.
    """
    if not isinstance(expr, str):
        raise TypeError(f"expr: expected a PromQL string, got {type(expr).__name__}")
    values = {
        "job": job,
        "rank": rank,
        "__rate_interval": rate_interval,
        "__range": time_range,
        "__interval": interval,
        "__range_s": str(int(_seconds(time_range))),
        "__interval_ms": str(int(_seconds(interval) * 1000)),
    }

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"expr: unknown template variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(substitute, expr)


# --- panels ---------------------------------------------------------------------------


def _target(expr: str, legend: str = "__auto", ref: str = "A", *, table: bool = False) -> dict:
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "format": "table" if table else "time_series",
        "instant": table,
        "legendFormat": legend,
        "range": not table,
        "refId": ref,
    }


def _targets(*queries: tuple[str, str]) -> list[dict]:
    return [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def _thresholds(base: str, *steps: tuple[float, str]) -> dict:
    """Grafana threshold steps: ``base`` below the first value, each colour from its value up."""
    return {
        "mode": "absolute",
        "steps": [{"color": base, "value": None}] + [{"color": c, "value": float(v)} for v, c in steps],
    }


def _panel(
    kind: str,
    title: str,
    description: str,
    unit: str,
    targets: list[dict],
    *,
    size: tuple[int, int],
    thresholds: dict | None = None,
    options: dict | None = None,
    custom: dict | None = None,
    defaults: dict | None = None,
    overrides: list | None = None,
    transformations: list | None = None,
) -> dict:
    field_defaults = {
        "color": {"mode": "thresholds" if kind in ("stat", "state-timeline") else "palette-classic"},
        "custom": custom or {},
        "mappings": [],
        "thresholds": thresholds or _thresholds("green"),
        "unit": unit,
        **(defaults or {}),
    }
    panel = {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {"defaults": field_defaults, "overrides": overrides or []},
        "options": options or {},
        "targets": targets,
        "title": title,
        "type": kind,
        "_size": size,  # consumed by _layout
    }
    if transformations:
        panel["transformations"] = transformations
    return panel


def _timeseries(
    title: str,
    description: str,
    unit: str,
    targets: list[dict],
    *,
    size: tuple[int, int] = (12, 8),
    thresholds: dict | None = None,
    threshold_style: str = "off",
    log_scale: bool = False,
    bars: bool = False,
    defaults: dict | None = None,
) -> dict:
    custom = {
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 60 if bars else 10,
        "lineWidth": 1,
        "pointSize": 4,
        "showPoints": "never",
        "spanNulls": False,
        "thresholdsStyle": {"mode": threshold_style},
        "scaleDistribution": {"type": "log", "log": 10} if log_scale else {"type": "linear"},
    }
    options = {
        "legend": {"calcs": ["lastNotNull", "max"], "displayMode": "table", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return _panel(
        "timeseries",
        title,
        description,
        unit,
        targets,
        size=size,
        thresholds=thresholds,
        options=options,
        custom=custom,
        defaults=defaults,
    )


def _stat(
    title: str,
    description: str,
    unit: str,
    targets: list[dict],
    *,
    size: tuple[int, int],
    thresholds: dict | None = None,
    mappings: list | None = None,
    defaults: dict | None = None,
) -> dict:
    options = {
        "colorMode": "background",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "value_and_name",
    }
    return _panel(
        "stat",
        title,
        description,
        unit,
        targets,
        size=size,
        thresholds=thresholds,
        options=options,
        defaults={"mappings": mappings or [], **(defaults or {})},
    )


def _heatmap(
    title: str, description: str, unit: str, targets: list[dict], *, size: tuple[int, int], options: dict
) -> dict:
    """A heatmap of one row per series; ``options`` (:func:`~lossbeat.mixin.heatmaps.heatmap_options`) name its colours."""
    custom = {"hideFrom": {"legend": False, "tooltip": False, "viz": False}, "scaleDistribution": {"type": "linear"}}
    return _panel("heatmap", title, description, unit, targets, size=size, options=options, custom=custom)


def _state_timeline(title: str, description: str, targets: list[dict], *, size: tuple[int, int]) -> dict:
    options = {
        "alignValue": "center",
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "mergeValues": True,
        "rowHeight": 0.8,
        "showValue": "never",
        "tooltip": {"mode": "single", "sort": "none"},
    }
    return _panel(
        "state-timeline",
        title,
        description,
        "none",
        targets,
        size=size,
        thresholds=_thresholds("green", (1, "yellow"), (2, "red")),
        options=options,
        custom={"fillOpacity": 80, "lineWidth": 0},
        defaults={"mappings": HEALTH_MAPPINGS},
    )


def _table(
    title: str,
    description: str,
    unit: str,
    expr: str,
    *,
    size: tuple[int, int],
    hide: Iterable[str] = ("Time", "Value", "__name__"),
    thresholds: dict | None = None,
    overrides: list | None = None,
) -> dict:
    options = {"cellHeight": "sm", "footer": {"show": False}, "showHeader": True}
    organize = {
        "id": "organize",
        "options": {
            "excludeByName": {name: True for name in sorted(hide)},
            "indexByName": {},
            "renameByName": {},
        },
    }
    return _panel(
        "table",
        title,
        description,
        unit,
        [_target(expr, table=True)],
        size=size,
        thresholds=thresholds,
        options=options,
        custom={"align": "auto"},
        overrides=overrides,
        transformations=[organize],
    )


def _layout(panels: list[dict]) -> list[dict]:
    """Stable ids in order; panels fill 24-column rows left to right."""
    x = y = row_height = 0
    for panel_id, panel in enumerate(panels, start=1):
        w, h = panel.pop("_size")
        if x + w > 24:
            x, y, row_height = 0, y + row_height, 0
        panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        panel["id"] = panel_id
        x += w
        row_height = max(row_height, h)
    return panels


# --- the two dashboards -----------------------------------------------------------------

CHECKLIST_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "0": {"color": "green", "index": 0, "text": "\u2713"},
            "1": {"color": "yellow", "index": 1, "text": "\u2717 warning"},
            "2": {"color": "red", "index": 2, "text": "\u2717 danger"},
        },
    }
]


def _checklist_panels() -> list[dict]:
    """The article's daily checklist (section 6.1): the dashboard's first row, eight ticks, the
    worst status of each item's checks over the selected ranks (``lossbeat checklist`` prints
    the same)."""
    panels = []
    for number, (name, checks, alerts) in enumerate(CHECKLIST_ITEMS, 1):
        selector = _selector("training_health_status", matchers=f'check=~"{"|".join(checks)}", component=""')
        panels.append(
            _stat(
                f"Daily checklist {number}: {name}",
                f"Worst status of the {', '.join(checks)} check(s) over the selected ranks; "
                f"its alerts: {', '.join(alerts)}.",
                "none",
                _targets((f"max({selector})", name)),
                size=(3, 3),
                thresholds=_thresholds("green", (1, "yellow"), (2, "red")),
                mappings=CHECKLIST_MAPPINGS,
            )
        )
    for panel in panels:
        panel["options"]["graphMode"] = "none"
        panel["options"]["textMode"] = "value"
    return panels


def _overview_panels(t: Thresholds) -> list[dict]:
    """The overview dashboard, row by row: the daily checklist, the headline numbers, the curves of
    one step, the events and errors, the speed, the alerts and runs."""
    return (
        _checklist_panels()
        + _overview_stats(t)
        + _overview_curves(t)
        + _overview_events()
        + _overview_speed()
        + _overview_tables()
    )


def _overview_stats(t: Thresholds) -> list[dict]:
    """The headline numbers: health, the loss's CV and trend, the time since the last step, the step."""
    loss = t.loss
    stalled = _seconds(t.alerts.stalled_after)
    return [
        _stat(
            "Health",
            "Worst diagnosis over every check and the selected ranks: good, warning or danger.",
            "none",
            _targets((f"max({_selector('training_health_status')})", "worst")),
            size=(6, 5),
            thresholds=_thresholds("green", (1, "yellow"), (2, "red")),
            mappings=HEALTH_MAPPINGS,
        ),
        _stat(
            "Loss CV",
            f"Coefficient of variation (std / mean) of the loss over the last {t.windows.cv_steps} "
            f"steps. Warning from {loss.cv_warning}, danger from {loss.cv_danger} (loss.cv_warning, loss.cv_danger).",
            "none",
            _targets((_selector("training_loss_cv"), "rank {{rank}}")),
            size=(5, 5),
            thresholds=_thresholds("green", (loss.cv_warning, "yellow"), (loss.cv_danger, "red")),
            defaults={"decimals": 3},
        ),
        _stat(
            "Loss trend",
            f"(previous mean - recent mean) / previous mean over two windows of "
            f"{t.windows.trend_steps} steps; positive means the loss falls. Red below {loss.trend_rising} "
            f"(rising), yellow up to {loss.trend_improving} (plateau), green above (learning).",
            "percentunit",
            _targets((_selector("training_loss_trend_ratio"), "rank {{rank}}")),
            size=(5, 5),
            thresholds=_thresholds("red", (loss.trend_rising, "yellow"), (loss.trend_improving, "green")),
        ),
        _stat(
            "Since last step",
            f"Seconds since each rank last completed a step; red from "
            f"{t.alerts.stalled_after} (alerts.stalled_after), when the stalled alert fires.",
            "s",
            _targets((f"time() - {_selector('training_last_step_timestamp_seconds')}", "rank {{rank}}")),
            size=(4, 5),
            thresholds=_thresholds("green", (stalled / 2, "yellow"), (stalled, "red")),
        ),
        _stat(
            "Step",
            "The last observed optimizer step per rank.",
            METRICS["training_step"].unit,
            _targets((_selector("training_step"), "rank {{rank}}")),
            size=(4, 5),
            thresholds=_thresholds("blue"),
            defaults={"decimals": 0},
        ),
    ]


def _overview_curves(t: Thresholds) -> list[dict]:
    """What each step measures: loss, gradient norm, health per check, LR, clipping, the fp16 loss scale."""
    g, lr, profile = t.gradients, t.learning_rate, t.profile
    loss_steps = []
    if profile.loss_warn_low is not None:
        loss_steps.append((profile.loss_warn_low, "green"))
    if profile.loss_warn_high is not None:
        loss_steps.append((profile.loss_warn_high, "red"))
    loss_base = "orange" if profile.loss_warn_low is not None else "green"
    return [
        _timeseries(
            "Loss",
            "Training loss per step (gaps where it was not finite), evaluation loss and "
            f"multi-task components. Dashed lines: the {profile.name} profile's warning bounds "
            "(profiles.*.loss_warn_low / loss_warn_high).",
            METRICS["training_loss"].unit,
            _targets(
                (_selector("training_loss"), "train rank {{rank}}"),
                (_selector("training_eval_loss"), "eval rank {{rank}}"),
                (_selector("training_loss_component"), "{{component}} rank {{rank}}"),
            ),
            thresholds=_thresholds(loss_base, *loss_steps),
            threshold_style="dashed" if loss_steps else "off",
        ),
        _timeseries(
            "Gradient norm",
            f"Global L2 gradient norm before clipping. Green band: healthy "
            f"{g.healthy_low}..{g.healthy_high} (gradients.healthy_low/high); red from {g.explosion}, "
            f"an explosion (gradients.explosion). Log scale.",
            METRICS["training_grad_norm"].unit,
            _targets((_selector("training_grad_norm"), "rank {{rank}}")),
            thresholds=_thresholds("blue", (g.healthy_low, "green"), (g.healthy_high, "yellow"), (g.explosion, "red")),
            threshold_style="line+area",
            log_scale=True,
        ),
        _state_timeline(
            "Health per check",
            "Diagnosis of each check over time, worst over the selected ranks: good, warning or danger.",
            _targets((f"max by (check, component) ({_selector('training_health_status')})", "{{check}} {{component}}")),
            size=(24, 8),
        ),
        _timeseries(
            "Learning rate",
            f"Learning rate of each optimizer param group. Dashed: too small below "
            f"{lr.too_small}, too large above {lr.too_large} (learning_rate.too_small/too_large). Log scale.",
            METRICS["training_learning_rate"].unit,
            _targets((_selector("training_learning_rate"), "group {{param_group}} rank {{rank}}")),
            thresholds=_thresholds("orange", (lr.too_small, "green"), (lr.too_large, "orange")),
            threshold_style="dashed",
            log_scale=True,
        ),
        _timeseries(
            "Gradient clip coefficient",
            "Factor the last clip_grad_norm_ scaled the gradients by; 1 means not clipped, lower means clipped harder.",
            METRICS["training_grad_clip_coefficient"].unit,
            _targets((_selector("training_grad_clip_coefficient"), "rank {{rank}}")),
            defaults={"min": 0, "max": 1},
        ),
        _timeseries(
            "Loss scale (fp16)",
            "Loss scale of the fp16 GradScaler passed to observe(grad_scaler=...); "
            "it halves at each overflowing step (skipped) and grows back. Red below "
            f"{g.loss_scale_min} (gradients.loss_scale_min): nearly every step overflows. Log scale.",
            METRICS["training_grad_scale"].unit,
            _targets((_selector("training_grad_scale"), "rank {{rank}}")),
            thresholds=_thresholds("red", (g.loss_scale_min, "green")),
            threshold_style="dashed",
            log_scale=True,
        ),
    ]


_OVERVIEW_EVENTS = (
    ("training_nonfinite_loss_total", "non-finite loss"),
    ("training_nonfinite_grad_total", "non-finite grad"),
    ("training_loss_spikes_total", "loss spike"),
    ("training_grad_explosions_total", "grad explosion"),
    ("training_grad_scaler_overflows_total", "fp16 overflow (skipped)"),
)
"""The event counters the overview's Events panel shows, with their legends."""


def _overview_events() -> list[dict]:
    """The events counted per rate interval, and lossbeat's own errors."""
    return [
        _timeseries(
            "Events",
            "Steps with a non-finite loss or gradient, loss spikes, gradient explosions and "
            "fp16 overflows, counted per rate interval (increase of the counters, so none is missed "
            "between scrapes).",
            "short",
            _targets(
                *[
                    (f"sum by (rank) ({_counter('increase', metric)})", f"{label} rank {{{{rank}}}}")
                    for metric, label in _OVERVIEW_EVENTS
                ]
            ),
            bars=True,
        ),
        _timeseries(
            "Exporter errors",
            "Errors inside lossbeat itself, by where they happened, per rate "
            "interval; training is never interrupted by them.",
            "short",
            _targets((f"sum by (where) ({_counter('increase', 'training_exporter_errors_total')})", "{{where}}")),
            bars=True,
        ),
    ]


def _overview_speed() -> list[dict]:
    """How fast the run goes and what it holds: steps and tokens per second, step duration, memory."""
    return [
        _timeseries(
            "Steps per second",
            "Optimizer steps per second per rank.",
            "count:steps/s",
            _targets(
                (f"sum by (job, run_id, rank) ({_counter('rate', 'training_steps_total')})", "{{job}} rank {{rank}}")
            ),
            size=(8, 8),
        ),
        _timeseries(
            "Tokens per second",
            "Tokens per second per rank, and in total per job.",
            "count:tok/s",
            _targets(
                (f"sum by (job, run_id, rank) ({_counter('rate', 'training_tokens_total')})", "{{job}} rank {{rank}}"),
                (f"sum by (job, run_id) ({_counter('rate', 'training_tokens_total')})", "{{job}} total"),
            ),
            size=(8, 8),
        ),
        _timeseries(
            "Step duration",
            "Wall time between the last two observed steps.",
            METRICS["training_step_duration_seconds"].unit,
            _targets((_selector("training_step_duration_seconds"), "rank {{rank}}")),
            size=(8, 8),
        ),
        _timeseries(
            "Memory",
            "Device memory allocated by tensors and its peak (CUDA), or the process's resident anonymous memory on CPU (mapped files left out).",
            METRICS["training_memory_allocated_bytes"].unit,
            _targets(
                (_selector("training_memory_allocated_bytes"), "allocated {{device}} rank {{rank}}"),
                (_selector("training_memory_peak_bytes"), "peak {{device}} rank {{rank}}"),
            ),
        ),
    ]


def _overview_tables() -> list[dict]:
    """The alerts firing now and the runs' metadata."""
    return [
        _table(
            "Firing alerts",
            "lossbeat alerts firing now (ALERTS from Prometheus' rule evaluation). "
            "Job-wide alerts without a rank label show whatever rank is picked.",
            "none",
            f'ALERTS{{alertstate="firing", alertname=~"Training.*", {ALERTS_FILTER}}}',
            size=(12, 8),
            hide=("Time", "Value", "__name__", "alertstate"),
        ),
        _table(
            "Runs",
            "Metadata of the runs exporting to the selected job and ranks.",
            "none",
            _selector("training_run_info"),
            size=(24, 5),
        ),
    ]


def _layers_panels(t: Thresholds) -> list[dict]:
    g = t.gradients
    norm = _selector("training_layer_grad_norm")
    exploding, vanishing = f"{norm} > {_num(g.layer_explosion)}", f"{norm} < {_num(g.layer_vanishing)}"
    layer_steps = _thresholds("blue", (g.layer_vanishing, "green"), (g.layer_explosion, "red"))
    # The colour scale spans exactly the healthy per-layer range: clipped at both ends.
    heatmap_options = heatmap_options_for(
        "Spectral", min=math.log10(g.layer_vanishing), max=math.log10(g.layer_explosion)
    )
    return [
        _stat(
            "Exploding layers",
            f"Layers whose gradient norm is above {g.layer_explosion} "
            "(gradients.layer_explosion), over the selected ranks.",
            "none",
            _targets((f"count({exploding})", "layers")),
            size=(8, 4),
            thresholds=_thresholds("green", (1, "red")),
            defaults={"noValue": "0"},
        ),
        _stat(
            "Vanishing layers",
            f"Layers whose gradient norm is below {g.layer_vanishing} "
            "(gradients.layer_vanishing), over the selected ranks.",
            "none",
            _targets((f"count({vanishing})", "layers")),
            size=(8, 4),
            thresholds=_thresholds("green", (1, "orange")),
            defaults={"noValue": "0"},
        ),
        _stat(
            "Layers monitored",
            "Layers reporting a gradient norm per rank.",
            "none",
            _targets((f"count by (rank) ({norm})", "rank {{rank}}")),
            size=(8, 4),
            thresholds=_thresholds("blue"),
        ),
        _heatmap(
            "Gradient norm per layer (log10)",
            "log10 of each layer's gradient norm over time, the largest over the selected ranks; one "
            f"row per layer. The colour scale runs from {g.layer_vanishing} (vanishing, "
            f"log10 = {math.log10(g.layer_vanishing):g}) to {g.layer_explosion} (exploding, "
            f"log10 = {math.log10(g.layer_explosion):g}): gradients.layer_vanishing / layer_explosion.",
            "none",
            _targets((f"log10(max by (layer) ({norm}))", "{{layer}}")),
            size=(24, 12),
            options=heatmap_options,
        ),
        _timeseries(
            "Top 10 layers by gradient norm",
            "The ten largest per-layer gradient norms at each "
            f"instant. Blue below {g.layer_vanishing} (vanishing), red above {g.layer_explosion} "
            "(exploding). Log scale.",
            METRICS["training_layer_grad_norm"].unit,
            _targets((f"topk(10, {norm})", "{{layer}} rank {{rank}}")),
            size=(16, 9),
            thresholds=layer_steps,
            threshold_style="dashed",
            log_scale=True,
        ),
        _table(
            "Layers outside the healthy range",
            f"Layers whose gradient norm is now above "
            f"{g.layer_explosion} or below {g.layer_vanishing} (gradients.layer_explosion / layer_vanishing).",
            "sci",
            f"{exploding} or {vanishing}",
            size=(8, 9),
            hide=("Time", "__name__"),
            thresholds=layer_steps,
            overrides=[
                {
                    "matcher": {"id": "byName", "options": "Value"},
                    "properties": [
                        {"id": "displayName", "value": "grad norm"},
                        {"id": "custom.cellOptions", "value": {"type": "color-background"}},
                    ],
                }
            ],
        ),
        _state_timeline(
            "Layer health",
            "The per-layer gradient check of the diagnosis, per rank.",
            _targets((_selector("training_health_status", matchers='check="layer_grad_norm"'), "rank {{rank}}")),
            size=(8, 7),
        ),
        _timeseries(
            "Non-finite gradient steps",
            "Steps whose gradient norm was NaN or infinite, per rate interval.",
            "short",
            _targets((f"sum by (rank) ({_counter('increase', 'training_nonfinite_grad_total')})", "rank {{rank}}")),
            size=(8, 7),
            bars=True,
        ),
        _table(
            "First layer with a non-finite gradient",
            "The first layer, in the model's order, whose gradient was last seen NaN or infinite: where to look first.",
            "none",
            _selector("training_nonfinite_grad_first_layer_info"),
            size=(8, 7),
        ),
    ]


def _cluster_panels(t: Thresholds) -> list[dict]:
    """The ranks of a job compared with each other (the cross-rank alerts' view)."""
    c = t.cross_rank
    run_info = _selector("training_run_info")
    work = _selector("training_rank_work_seconds")
    aligned = _selector("training_grad_norm_aligned")
    heatmap_options = heatmap_options_for("Oranges", rows_reversed=False)
    return [
        _timeseries(
            "Ranks reporting",
            "Distinct ranks exporting metrics, against the world size they "
            "report (legend): fewer for the alerts' `for` fires TrainingRankDown.",
            "short",
            _targets(
                (
                    f"count by (job, run_id, world_size) (count by (job, run_id, rank, world_size) ({run_info}))",
                    "{{job}}: reporting of world size {{world_size}}",
                )
            ),
            size=(8, 8),
        ),
        _table(
            "Slowest ranks",
            f"The ten ranks with the longest own work per step (data wait + forward, "
            f"host time, 5m mean; `work_time=True`). Above {_num(c.straggler_ratio)}x the job's median: "
            "TrainingStraggler.",
            "s",
            f"topk(10, avg_over_time({work}[5m]))",
            size=(8, 8),
            hide=("Time", "__name__"),
        ),
        _timeseries(
            "Gradient-norm agreement",
            "Each rank's global gradient norm at the last step that is a "
            "multiple of grad_norm_align_every, relative to the job's median at that step: data-parallel "
            f"replicas agree to float tolerance; above {_num(c.grad_norm_rtol)}: "
            "TrainingRankGradientMismatch.",
            "percentunit",
            _targets(
                (
                    f"abs({aligned} - on(job, run_id) group_left quantile by (job, run_id) (0.5, {aligned}))\n"
                    f"  / on(job, run_id) group_left quantile by (job, run_id) (0.5, {aligned})",
                    "rank {{rank}}",
                )
            ),
            size=(8, 8),
            thresholds=_thresholds("green", (c.grad_norm_rtol, "red")),
            threshold_style="dashed",
        ),
        _heatmap(
            "Work time per rank",
            "Each rank's own work per step (training_rank_work_seconds: "
            "data wait + forward on the host, no collectives), one row per rank: a straggler is a darker row.",
            "s",
            _targets((f"avg by (rank) ({work})", "{{rank}}")),
            size=(24, 10),
            options=heatmap_options,
        ),
        _timeseries(
            "Loss by rank",
            "The 5m mean loss of every rank: data-parallel ranks see different shards "
            "of the same data, so their lines stay together.",
            "none",
            _targets((f"job_run_id_instance_rank:training_loss:avg_over_time5m{{{FILTER}}}", "rank {{rank}}")),
            size=(12, 8),
        ),
        _timeseries(
            "Loss robust z-score by rank",
            "0.6745 x (a rank's 5m mean loss - the job's median) / MAD "
            f"across the ranks; beyond +-{_num(c.loss_spread_z)} (and {_num(100 * c.loss_spread_min_relative)}% "
            "from the median): TrainingLossRankSpread.",
            "none",
            _targets((f"job_run_id_instance_rank:training_loss:robust_z5m{{{FILTER}}}", "rank {{rank}}")),
            size=(12, 8),
            thresholds=_thresholds("red", (-c.loss_spread_z, "green"), (c.loss_spread_z, "red")),
            threshold_style="dashed",
        ),
    ]


def _variables() -> list[dict]:
    common = {"hide": 0, "skipUrlSync": False}
    return [
        {
            **common,
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "multi": False,
            "includeAll": False,
        },
        {
            **common,
            "name": "job",
            "label": "Job",
            "type": "query",
            "datasource": DATASOURCE,
            "query": "label_values(training_steps_total, job)",
            "definition": "label_values(training_steps_total, job)",
            "refresh": 2,
            "regex": "",
            "sort": 1,
            "multi": False,
            "includeAll": False,
        },
        {
            **common,
            "name": "rank",
            "label": "Rank",
            "type": "query",
            "datasource": DATASOURCE,
            "query": 'label_values(training_steps_total{job=~"$job"}, rank)',
            "definition": 'label_values(training_steps_total{job=~"$job"}, rank)',
            "refresh": 2,
            "regex": "",
            "sort": 3,
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        },
    ]


def _dashboard(uid: str, title: str, description: str, panels: list[dict]) -> dict:
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [
            {
                "asDropdown": False,
                "icon": "external link",
                "includeVars": True,
                "keepTime": True,
                "tags": ["lossbeat"],
                "targetBlank": False,
                "title": "lossbeat",
                "tooltip": "",
                "type": "dashboards",
            }
        ],
        "liveNow": False,
        "panels": _layout(panels),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["lossbeat", "training"],
        "templating": {"list": _variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def build_dashboards(thresholds: Thresholds) -> dict[str, dict]:
    """The dashboards as Grafana JSON models, keyed by their file name under ``grafana/``."""
    if not isinstance(thresholds, Thresholds):
        raise TypeError(
            f"thresholds: expected lossbeat.diagnosis.thresholds.Thresholds, got {type(thresholds).__name__}"
        )
    generated = f"Generated by `lossbeat dashboards` from the thresholds file ({thresholds.profile.name} profile)."
    return {
        OVERVIEW_FILE: _dashboard(
            "lossbeat-overview",
            "lossbeat / Overview",
            f"Training health of PyTorch jobs: loss, gradients, learning rate, "
            f"diagnosis, events, throughput. {generated}",
            _overview_panels(thresholds)
            + moe_rl_panels(thresholds, _heatmap, _timeseries, _targets, _selector, _thresholds),  # MoE, RL policy
        ),
        CLUSTER_FILE: _dashboard(
            "lossbeat-cluster",
            "lossbeat / Cluster",
            f"The ranks of a job compared: ranks reporting against the world size, "
            f"per-rank work time, the slowest ranks, loss by rank, gradient-norm agreement "
            f"between replicas. {generated}",
            _cluster_panels(thresholds),
        ),
        LAYERS_FILE: _dashboard(
            "lossbeat-layers",
            "lossbeat / Layers",
            f"Per-layer gradient norms: where gradients explode, vanish or turn non-finite. {generated}",
            _layers_panels(thresholds),
        ),
    }


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(panel title, PromQL expression)`` for every query of every panel, in panel order.

    The expressions keep Grafana's variables; run them through :func:`expand_query`.
    """
    if not isinstance(dashboard, dict) or not isinstance(dashboard.get("panels"), list):
        raise TypeError("dashboard: expected a Grafana dashboard dict with a 'panels' list")
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


# --- files ----------------------------------------------------------------------------------


def _json_text(dashboard: dict) -> str:
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _configmap_text(dashboards: dict[str, dict]) -> str:
    lines = [
        "# Generated by `lossbeat dashboards` from exporter/lossbeat/thresholds.yaml; do not edit.",
        '# Grafana\'s dashboard sidecar loads every ConfigMap labelled grafana_dashboard: "1".',
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        "  name: lossbeat-grafana-dashboards",
        "  labels:",
        "    app.kubernetes.io/name: lossbeat",
        "    app.kubernetes.io/component: dashboards",
        '    grafana_dashboard: "1"',
        "data:",
    ]
    for name in sorted(dashboards):
        lines.append(f"  {name}: |")
        lines.extend(f"    {line}" for line in _json_text(dashboards[name]).splitlines())
    return "\n".join(lines) + "\n"


def render_files(thresholds: Thresholds) -> dict[str, str]:
    """Every generated file's text, keyed by its path relative to the repository root."""
    dashboards = build_dashboards(thresholds)
    files = {f"grafana/{name}": _json_text(dashboard) for name, dashboard in sorted(dashboards.items())}
    files[CONFIGMAP_PATH] = _configmap_text(dashboards)
    return files


# --- the command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_generator_arguments(parser)
    parser.add_argument(
        "--root", type=Path, default=None, help="write grafana/ and deploy/ files in the repository's layout under ROOT"
    )


def output_files(thresholds: Thresholds) -> dict[str, str]:
    """The files for an output folder: ``grafana/*.json`` and ``kubernetes/<the ConfigMap>``."""
    return {
        path if path.startswith("grafana/") else f"kubernetes/{Path(path).name}": text
        for path, text in render_files(thresholds).items()
    }


def run(args: argparse.Namespace) -> int:
    thresholds = thresholds_for(args, "lossbeat dashboards")
    if thresholds is None:
        return 2
    if args.root is not None:
        root, files = args.root, render_files(thresholds)
    else:
        root = output_root(args, "lossbeat dashboards", _REPO_ROOT)
        if root is None:
            return 2
        files = render_files(thresholds) if args.output_dir is None else output_files(thresholds)
    return sync_files(
        {root / rel: text for rel, text in files.items()}, check=args.check, command="lossbeat dashboards"
    )
