"""The metric contract: Prometheus naming conventions, and the README table in sync."""

import re
from pathlib import Path

from lossbeat.exposition.metrics import METRICS, PREFIX, markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_names_follow_prometheus_conventions():
    for name, spec in METRICS.items():
        assert name.startswith(PREFIX), name
        assert re.fullmatch(r"[a-z_]+", name), name
        assert (spec.kind == "counter") == name.endswith("_total"), name
        assert not name.endswith("_info"), "info metrics get the suffix from prometheus_client"
        assert "rank" not in spec.labels and len(spec.labels) <= 6
        assert spec.help.endswith(".") and len(spec.help) > 20
        for unit in ("_ms", "_milliseconds", "_kb", "_mb", "_percent"):
            assert not name.endswith(unit), f"{name}: use base units"


def test_readme_metric_table_is_generated_from_the_contract():
    text = README.read_text()
    assert markdown_table() in text, "README metric table drifted: run `make generate`"
    for name in METRICS:
        assert f"`{name}" in text
