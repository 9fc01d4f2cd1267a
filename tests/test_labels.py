"""Label values that come from the user's code (layer names, param-group names, loss component
names, the run name) with quotes, backslashes, newlines and unicode: escaped on the wire, read
back exactly by prometheus_client's parsers, and clean for `promtool check metrics`."""

from __future__ import annotations

import subprocess
import urllib.request

import pytest
import torch
from conftest import require_binary
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from lossbeat import Monitor, MonitorConfig

NASTY = ['say "hi"', "back\\slash", "new\nline", "tab\there", "слой_层_🔥", "trailing\\", '\\"\\n', "} { =,", ""]


def nasty_model() -> torch.nn.Module:
    model = torch.nn.Module()
    for i, name in enumerate(n for n in NASTY if n):  # torch refuses "" and "." in module names
        model.add_module(name.replace(".", "_"), torch.nn.Linear(2, 2, bias=i % 2 == 0))
    return model


def labels_of(text: str, parse=text_string_to_metric_families) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in parse(text):
        for sample in family.samples:
            for key, value in sample.labels.items():
                out.setdefault(key, set()).add(value)
    return out


@pytest.mark.servers
def test_nasty_label_values_are_escaped_and_parse_back(tmp_path):
    model = nasty_model()
    optimizer = torch.optim.SGD(
        [{"params": [p], "name": NASTY[i % len(NASTY)]} for i, p in enumerate(model.parameters())], lr=0.1
    )
    run_name = 'run "α"\\\nβ'
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", run_name=run_name, layer_depth=None)) as m:
        sum(layer(torch.ones(1, 2)).sum() for layer in model.children()).backward()
        m.observe(1, loss=1.0, optimizer=optimizer, model=model, losses={name: 0.5 for name in NASTY})
        body = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read().decode()
        openmetrics = (
            urllib.request.urlopen(
                urllib.request.Request(
                    f"http://127.0.0.1:{m.port}/metrics",
                    headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                ),
                timeout=10,
            )
            .read()
            .decode()
        )

    expected_layers = {n.replace(".", "_") for n in NASTY if n}
    for text, parse in ((body, text_string_to_metric_families), (openmetrics, openmetrics_families)):
        labels = labels_of(text, parse)
        assert expected_layers <= labels["layer"]
        assert set(NASTY) <= labels["component"]
        assert set(NASTY) <= labels["param_group"]
        assert run_name in labels["run"]
    # Escaped on the wire: a raw newline or quote would end the sample early.
    assert 'component="new\\nline"' in body and 'component="back\\\\slash"' in body
    assert 'component="say \\"hi\\""' in body

    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "check", "metrics"], input=body.encode(), capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@settings(max_examples=100, deadline=None)
@given(name=st.text(min_size=0, max_size=20), run=st.text(max_size=20))
def test_any_text_round_trips(name, run):
    registry = CollectorRegistry()
    m = Monitor(MonitorConfig(port=0, run_name=run, log_status_changes=False), serve=False, registry=registry)
    m.observe(0, loss=1.0, losses={name: 2.0})
    text = generate_latest(registry).decode()
    labels = labels_of(text)
    assert name in labels["component"] and run in labels["run"]
