"""The Grafana dashboards: generated from the thresholds, schema-valid, and every query real PromQL."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import free_ports, require

from lossbeat.cli import main
from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.exposition.metrics import METRICS
from lossbeat.mixin.dashboards import (
    build_dashboards,
    expand_query,
    may_be_empty,
    panel_queries,
    render_files,
)
from lossbeat.stack.local import MissingBinaryError, find_binary, stop_pid

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "grafana/schema/lossbeat-dashboard.schema.json").read_text(encoding="utf-8"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
OVERVIEW, LAYERS, CLUSTER = "lossbeat-overview.json", "lossbeat-layers.json", "lossbeat-cluster.json"
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
COUNTERS = sorted(name for name, spec in METRICS.items() if spec.kind == "counter")


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return build_dashboards(load_thresholds())


def _panel(dashboard: dict, title: str) -> dict:
    matches = [p for p in dashboard["panels"] if p["title"] == title]
    assert len(matches) == 1, f"expected one panel titled {title!r}"
    return matches[0]


def _steps(panel: dict) -> list:
    return [step["value"] for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def _all_queries(dashboards: dict[str, dict]) -> list[tuple[str, str, str]]:
    return [(name, title, expr) for name, d in sorted(dashboards.items()) for title, expr in panel_queries(d)]


def _thresholds_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "thresholds.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# --- generated files ------------------------------------------------------------------------


def test_checked_in_files_match_the_generator():
    files = render_files(load_thresholds())
    assert sorted(files) == [
        "deploy/kubernetes/grafana-dashboards-configmap.yaml",
        "grafana/lossbeat-cluster.json",
        "grafana/lossbeat-layers.json",
        "grafana/lossbeat-overview.json",
    ]
    for rel, text in files.items():
        path = ROOT / rel
        assert path.is_file(), f"{rel} missing; run `python -m lossbeat dashboards`"
        assert path.read_text(encoding="utf-8") == text, f"{rel} drifted; run `python -m lossbeat dashboards`"


def test_generation_is_deterministic():
    assert render_files(load_thresholds()) == render_files(load_thresholds())


def test_cli_writes_then_check_passes_and_reports_drift(tmp_path, capsys):
    assert main(["dashboards", "--root", str(tmp_path)]) == 0
    overview = tmp_path / "grafana" / OVERVIEW
    assert json.loads(overview.read_text())["uid"] == "lossbeat-overview"
    assert main(["dashboards", "--root", str(tmp_path), "--check"]) == 0
    capsys.readouterr()

    overview.write_text(overview.read_text().replace('"lossbeat / Overview"', '"edited by hand"'))
    assert main(["dashboards", "--root", str(tmp_path), "--check"]) == 1
    diff = capsys.readouterr().out
    assert f"grafana/{OVERVIEW} (checked in)" in diff
    assert '-  "title": "edited by hand",' in diff and '+  "title": "lossbeat / Overview",' in diff


def test_cli_check_fails_when_the_thresholds_change(tmp_path, capsys):
    changed = _thresholds_file(tmp_path, "gradients:\n  explosion: 25\n")
    assert main(["dashboards", "--root", str(ROOT), "--check"]) == 0
    assert main(["dashboards", "--root", str(ROOT), "--check", "--thresholds", str(changed)]) == 1
    assert '"value": 25.0' in capsys.readouterr().out


def test_cli_names_a_bad_thresholds_key(tmp_path, capsys):
    bad = _thresholds_file(tmp_path, "gradients:\n  explosoin: 25\n")
    assert main(["dashboards", "--root", str(tmp_path), "--thresholds", str(bad)]) == 2
    assert "gradients.explosoin: unknown key" in capsys.readouterr().err
    assert not (tmp_path / "grafana").exists()


def test_configmap_carries_both_dashboards_for_the_sidecar(dashboards):
    doc = yaml.safe_load((ROOT / "deploy/kubernetes/grafana-dashboards-configmap.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "ConfigMap")
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(doc["data"]) == [CLUSTER, LAYERS, OVERVIEW]
    for name, text in doc["data"].items():
        assert json.loads(text) == dashboards[name]


# --- thresholds drive the dashboards --------------------------------------------------------------


def test_grad_norm_panel_shows_the_healthy_band_and_explosion_line(dashboards):
    panel = _panel(dashboards[OVERVIEW], "Gradient norm")
    assert _steps(panel) == [None, 0.1, 5.0, 10.0]
    assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line+area"


def test_changing_the_explosion_threshold_moves_the_dashboard_step(tmp_path):
    changed = build_dashboards(load_thresholds(_thresholds_file(tmp_path, "gradients:\n  explosion: 25\n")))
    assert _steps(_panel(changed[OVERVIEW], "Gradient norm")) == [None, 0.1, 5.0, 25.0]


def test_loss_stats_are_coloured_at_the_loss_thresholds(tmp_path, dashboards):
    assert _steps(_panel(dashboards[OVERVIEW], "Loss CV")) == [None, 0.15, 0.30]
    assert _steps(_panel(dashboards[OVERVIEW], "Loss trend")) == [None, -0.02, 0.05]
    trend = _panel(dashboards[OVERVIEW], "Loss trend")
    colours = [s["color"] for s in trend["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert colours == ["red", "yellow", "green"]  # rising, plateau, learning
    changed = build_dashboards(
        load_thresholds(
            _thresholds_file(tmp_path, "loss:\n  cv_warning: 0.2\n  cv_danger: 0.4\n  trend_rising: -0.1\n")
        )
    )
    assert _steps(_panel(changed[OVERVIEW], "Loss CV")) == [None, 0.2, 0.4]
    assert _steps(_panel(changed[OVERVIEW], "Loss trend")) == [None, -0.1, 0.05]


def test_layer_thresholds_reach_queries_and_heatmap_colours(tmp_path, dashboards):
    layers = dashboards[LAYERS]
    assert panel_queries({"panels": [_panel(layers, "Exploding layers")]})[0][1].endswith("> 10.0)")
    assert panel_queries({"panels": [_panel(layers, "Vanishing layers")]})[0][1].endswith("< 1e-05)")
    colour = _panel(layers, "Gradient norm per layer (log10)")["options"]["color"]
    assert (colour["min"], colour["max"]) == (-5.0, 1.0)

    changed = build_dashboards(
        load_thresholds(_thresholds_file(tmp_path, "gradients:\n  layer_explosion: 20\n  layer_vanishing: 1.0e-7\n"))
    )[LAYERS]
    assert panel_queries({"panels": [_panel(changed, "Exploding layers")]})[0][1].endswith("> 20.0)")
    colour = _panel(changed, "Gradient norm per layer (log10)")["options"]["color"]
    assert colour["min"] == pytest.approx(-7.0) and colour["max"] == pytest.approx(math.log10(20))
    assert _steps(_panel(changed, "Top 10 layers by gradient norm")) == [None, 1e-7, 20.0]


def test_loss_panel_draws_the_profile_bounds(dashboards):
    assert _steps(_panel(dashboards[OVERVIEW], "Loss")) == [None, 0.1, 5.0]  # causal-lm
    regression = build_dashboards(load_thresholds(profile="regression"))
    loss = _panel(regression[OVERVIEW], "Loss")
    assert _steps(loss) == [None]  # no absolute scale: no lines
    assert loss["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "off"


def test_since_last_step_turns_red_when_the_stalled_alert_fires(tmp_path):
    changed = build_dashboards(load_thresholds(_thresholds_file(tmp_path, "alerts:\n  stalled_after: 1h30m\n")))
    assert _steps(_panel(changed[OVERVIEW], "Since last step")) == [None, 2700.0, 5400.0]


# --- structure and schema ---------------------------------------------------------------------


def test_uids_titles_and_panel_types(dashboards):
    assert {n: (d["uid"], d["title"]) for n, d in dashboards.items()} == {
        OVERVIEW: ("lossbeat-overview", "lossbeat / Overview"),
        LAYERS: ("lossbeat-layers", "lossbeat / Layers"),
        CLUSTER: ("lossbeat-cluster", "lossbeat / Cluster"),
    }
    assert all(d["schemaVersion"] >= 39 for d in dashboards.values())
    types = {p["type"] for d in dashboards.values() for p in d["panels"]}
    assert types == {"timeseries", "stat", "heatmap", "table", "state-timeline"}
    assert _panel(dashboards[LAYERS], "Gradient norm per layer (log10)")["type"] == "heatmap"
    assert _panel(dashboards[OVERVIEW], "Firing alerts")["type"] == "table"


@pytest.mark.parametrize("name", [OVERVIEW, LAYERS, CLUSTER])
def test_dashboard_validates_against_the_schema(dashboards, name):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    checked_in = json.loads((ROOT / "grafana" / name).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(SCHEMA).validate(checked_in)


def _without(path: tuple, dashboard: dict) -> dict:
    broken = copy.deepcopy(dashboard)
    node = broken
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return broken


@pytest.mark.parametrize(
    "path",
    [
        ("panels", 0, "gridPos"),
        ("panels", 3, "datasource"),
        ("panels", 1, "description"),
        ("panels", 2, "fieldConfig", "defaults", "unit"),
        ("panels", 4, "targets", 0, "expr"),
        ("panels", 0, "gridPos", "w"),
        ("templating",),
        ("uid",),
    ],
    ids=lambda p: ".".join(map(str, p)),
)
def test_schema_rejects_a_broken_dashboard(dashboards, path):
    broken = _without(path, dashboards[OVERVIEW])
    errors = list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(broken))
    assert any(f"'{path[-1]}' is a required property" in e.message for e in errors), [e.message for e in errors]


@pytest.mark.parametrize("mutation", ["typo", "wide", "bad_type", "bad_threshold"])
def test_schema_rejects_invalid_values(dashboards, mutation):
    broken = copy.deepcopy(dashboards[LAYERS])
    panel = broken["panels"][0]
    if mutation == "typo":
        panel["gridpos"] = panel.pop("gridPos")
    elif mutation == "wide":
        panel["gridPos"]["w"] = 25
    elif mutation == "bad_type":
        panel["type"] = "graph"  # the removed Angular panel
    else:
        panel["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] = "10"
    assert not jsonschema.Draft202012Validator(SCHEMA).is_valid(broken)


def test_panels_have_unique_ids_and_do_not_overlap(dashboards):
    for dashboard in dashboards.values():
        ids = [p["id"] for p in dashboard["panels"]]
        assert ids == list(range(1, len(ids) + 1))
        cells = set()
        for p in dashboard["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, p["title"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{p['title']} overlaps another panel"
            cells |= mine


def test_every_panel_has_unit_description_and_the_datasource_variable(dashboards):
    for dashboard in dashboards.values():
        for panel in dashboard["panels"]:
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
            assert len(panel["description"]) > 20, panel["title"]
            assert panel["datasource"] == DATASOURCE, panel["title"]
            assert panel["targets"] and all(t["datasource"] == DATASOURCE for t in panel["targets"])


def test_units_follow_the_metric_contract(dashboards):
    overview = dashboards[OVERVIEW]
    assert _panel(overview, "Memory")["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert _panel(overview, "Step duration")["fieldConfig"]["defaults"]["unit"] == "s"
    assert _panel(overview, "Loss trend")["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert METRICS["training_memory_allocated_bytes"].unit == "bytes"


def test_health_panels_map_0_1_2_to_good_warning_danger(dashboards):
    for title in ("Health", "Health per check"):
        mapping = _panel(dashboards[OVERVIEW], title)["fieldConfig"]["defaults"]["mappings"][0]
        assert {k: (v["text"], v["color"]) for k, v in mapping["options"].items()} == {
            "0": ("good", "green"),
            "1": ("warning", "yellow"),
            "2": ("danger", "red"),
        }
    assert _panel(dashboards[OVERVIEW], "Health per check")["type"] == "state-timeline"


def test_template_variables(dashboards):
    for dashboard in dashboards.values():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert list(variables) == ["datasource", "job", "rank"]
        assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
        assert variables["job"]["query"] == "label_values(training_steps_total, job)"
        rank = variables["rank"]
        assert rank["query"] == 'label_values(training_steps_total{job=~"$job"}, rank)'
        assert (rank["multi"], rank["includeAll"], rank["allValue"]) == (True, True, ".*")


def test_provisioning_files():
    dashboards_provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/lossbeat.yml").read_text())
    assert dashboards_provider["apiVersion"] == 1
    [provider] = dashboards_provider["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    assert provider["folder"] == "lossbeat"
    datasources = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    [prometheus] = datasources["datasources"]
    assert (prometheus["type"], prometheus["uid"]) == ("prometheus", "prometheus")
    assert prometheus["url"] == "http://prometheus:9090"
    assert prometheus["access"] == "proxy"


# --- queries ----------------------------------------------------------------------------------


def _recording_rules() -> set[str]:
    rules = ROOT / "alerting" / "rules.yml"
    if not rules.is_file():
        return set()
    doc = yaml.safe_load(rules.read_text(encoding="utf-8")) or {}
    return {r["record"] for g in doc.get("groups", []) for r in g.get("rules", []) if "record" in r}


def test_every_query_names_exposed_metrics_and_filters_job_and_rank(dashboards):
    allowed = {f"{n}_info" if s.kind == "info" else n for n, s in METRICS.items()} | {"ALERTS"} | _recording_rules()
    for _name, title, expr in _all_queries(dashboards):
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{title}: no selector in {expr}"
        for metric, matchers in selectors:
            assert metric in allowed, f"{title}: {metric} is not exposed by lossbeat"
            assert 'job=~"$job"' in matchers, f"{title}: {expr}"
            rank = 'rank=~"$rank|"' if metric == "ALERTS" else 'rank=~"$rank"'
            assert rank in matchers, f"{title}: {expr}"


def _bare_counters(expr: str) -> list[str]:
    """Counter selectors not read through rate/increase over $__rate_interval."""
    bare = []
    for counter in COUNTERS:
        total = len(re.findall(rf"\b{counter}\{{", expr))
        wrapped = len(re.findall(rf"\b(?:rate|increase)\({counter}\{{[^}}]*\}}\[\$__rate_interval\]\)", expr))
        bare += [counter] * (total - wrapped)
    return bare


def test_counters_only_through_rate_or_increase(dashboards):
    assert _bare_counters('training_steps_total{job=~"$job"}') == ["training_steps_total"]
    assert _bare_counters('rate(training_steps_total{job=~"$job"}[5m])') == ["training_steps_total"]
    counters_seen = set()
    for _name, title, expr in _all_queries(dashboards):
        assert _bare_counters(expr) == [], f"{title}: {expr}"
        counters_seen |= {c for c in COUNTERS if c in expr}
    assert {"training_steps_total", "training_tokens_total", "training_grad_explosions_total"} <= counters_seen


def test_dashboards_cover_the_required_views(dashboards):
    exprs = {title: expr for _, title, expr in _all_queries(dashboards)}
    assert exprs["Top 10 layers by gradient norm"].startswith("topk(10, training_layer_grad_norm{")
    assert exprs["Firing alerts"].startswith('ALERTS{alertstate="firing", alertname=~"Training.*"')
    assert "training_nonfinite_grad_first_layer_info{" in exprs["First layer with a non-finite gradient"]
    learning_rate = _panel(dashboards[OVERVIEW], "Learning rate")["targets"][0]["legendFormat"]
    assert "{{param_group}}" in learning_rate
    quiet = {title for _, title, expr in _all_queries(dashboards) if may_be_empty(title, expr)}
    assert "Firing alerts" in quiet and "First layer with a non-finite gradient" in quiet
    assert "Gradient norm" not in quiet and "Steps per second" not in quiet
    assert may_be_empty("Loss", 'training_loss{job=~"$job", rank=~"$rank"}') is False
    assert may_be_empty("Loss", 'training_loss_component{job=~"$job", rank=~"$rank"}') is True


def test_expand_query_substitutes_every_grafana_variable():
    expr = (
        'increase(x{job=~"$job", rank=~"${rank}"}[$__rate_interval]) / $__range_s '
        "+ y[$__range] + z[$__interval] + $__interval_ms"
    )
    assert expand_query(expr, job="train", rank="(0|1)", rate_interval="2m", time_range="3h", interval="30s") == (
        'increase(x{job=~"train", rank=~"(0|1)"}[2m]) / 10800 + y[3h] + z[30s] + 30000'
    )
    with pytest.raises(ValueError, match=r"\$instance"):
        expand_query('x{instance="$instance"}')
    with pytest.raises(TypeError, match="expr"):
        expand_query(None)


def test_panel_queries_lists_every_target(dashboards):
    queries = panel_queries(dashboards[OVERVIEW])
    assert len(queries) == sum(len(p["targets"]) for p in dashboards[OVERVIEW]["panels"])
    assert [e for t, e in queries if t == "Events"] == [
        f'sum by (rank) (increase({c}{{job=~"$job", rank=~"$rank"}}[$__rate_interval]))'
        for c in (
            "training_nonfinite_loss_total",
            "training_nonfinite_grad_total",
            "training_loss_spikes_total",
            "training_grad_explosions_total",
            "training_grad_scaler_overflows_total",
        )
    ]
    with pytest.raises(TypeError, match="dashboard"):
        panel_queries([])


# --- every query is PromQL a real Prometheus accepts -------------------------------------------------


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:  # 400/422 carry the parse error as JSON
        return json.load(exc)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> str:
    try:
        binary = find_binary("prometheus")
    except MissingBinaryError as exc:
        require(False, str(exc))
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n", encoding="utf-8")
    port = free_ports()
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus not ready after 30s")
            time.sleep(0.1)
        yield url
    finally:
        stop_pid(proc.pid, binary)
        log.close()


def _query(prometheus: str, expr: str) -> dict:
    return _get(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def test_prometheus_rejects_invalid_promql(prometheus):
    """The check below means something: a broken expression comes back as an error."""
    answer = _query(prometheus, expand_query('rate(training_steps_total{job=~"$job"})'))
    assert answer["status"] == "error" and answer["errorType"] == "bad_data"


def test_every_panel_query_is_valid_promql(prometheus, dashboards):
    queries = _all_queries(dashboards)
    assert len(queries) >= 30
    for variables in ({}, {"job": "training", "rank": "(0|1)"}):
        for name, title, expr in queries:
            answer = _query(prometheus, expand_query(expr, **variables))
            assert answer["status"] == "success", f"{name} / {title}: {expr}: {answer.get('error')}"


def test_every_variable_query_is_valid(prometheus, dashboards):
    for dashboard in dashboards.values():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
            assert match, variable["query"]
            selector, label = expand_query(match.group(1)), match.group(2)
            params = urllib.parse.urlencode({"match[]": selector})
            answer = _get(f"{prometheus}/api/v1/label/{label}/values?{params}")
            assert answer["status"] == "success", f"{variable['name']}: {answer.get('error')}"


def test_overview_opens_with_the_daily_checklist(dashboards):
    """The article's eight items, in its order, across the first row, each the worst
    training_health_status of its checks."""
    from lossbeat.analyze.checklist import ITEMS

    first = dashboards[OVERVIEW]["panels"][:8]
    assert [p["title"] for p in first] == [f"Daily checklist {n}: {name}" for n, (name, _, _) in enumerate(ITEMS, 1)]
    assert {p["gridPos"]["y"] for p in first} == {0} and sum(p["gridPos"]["w"] for p in first) == 24
    assert 'check=~"lr_schedule|learning_rate"' in first[4]["targets"][0]["expr"]
    assert (
        'check=~"memory"' in first[6]["targets"][0]["expr"] and 'check=~"throughput"' in first[7]["targets"][0]["expr"]
    )
