"""The metric contract: Prometheus naming conventions, and the table of docs/metrics.md in sync."""

import re
from pathlib import Path

import pytest

from lossbeat.exposition.metrics import (
    METRICS,
    PREFIX,
    REFERENCE_DOC,
    TABLE_END,
    TABLE_START,
    markdown_table,
    update_reference_doc,
)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / REFERENCE_DOC


def test_names_follow_prometheus_conventions():
    for name, spec in METRICS.items():
        assert name.startswith(PREFIX), name
        assert re.fullmatch(r"[a-z_]+", name), name
        assert (spec.kind == "counter") == name.endswith("_total"), name
        assert not name.endswith("_info"), "info metrics get the suffix from prometheus_client"
        # an info metric is one constant series per rank: its labels (metadata) add no series
        assert "rank" not in spec.labels and len(spec.labels) <= (7 if spec.kind == "info" else 6)
        assert spec.help.endswith(".") and len(spec.help) > 20
        for unit in ("_ms", "_milliseconds", "_kb", "_mb", "_percent"):
            assert not name.endswith(unit), f"{name}: use base units"


def test_metric_table_of_the_docs_is_generated_from_the_contract():
    text = DOC.read_text(encoding="utf-8")
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    region = text[text.index(TABLE_START) : text.index(TABLE_END) + len(TABLE_END)]
    assert region == markdown_table(), f"{REFERENCE_DOC} metric table drifted: run `make generate`"
    for name in METRICS:
        assert f"`{name}" in region


def test_update_reference_doc_rewrites_only_the_table(tmp_path):
    doc = tmp_path / "metrics.md"
    doc.write_text(f"# x\n\nbefore\n\n{TABLE_START}\n| `stale_metric` |\n{TABLE_END}\n\nafter\n", encoding="utf-8")
    assert update_reference_doc(str(doc)) is True
    text = doc.read_text(encoding="utf-8")
    assert text == f"# x\n\nbefore\n\n{markdown_table()}\n\nafter\n"
    assert update_reference_doc(str(doc)) is False  # generated once: a second run changes nothing
    doc.write_text("# no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="markers"):
        update_reference_doc(str(doc))


def test_the_readme_no_longer_carries_a_generated_table():
    """The tables live in docs/metrics.md alone: a second copy in the README would drift unseen."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert TABLE_START not in readme and "<!-- alerts:start -->" not in readme
