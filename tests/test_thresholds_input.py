"""A bad thresholds file, of every kind: a ThresholdsError (a ValueError) naming the key,
never a traceback from deeper down, and never a Python object built from a YAML tag."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lossbeat.diagnosis.thresholds import MAX_WINDOW_STEPS, ThresholdsError, _default_document, load_thresholds


@pytest.mark.parametrize(
    "text, message",
    [
        ("windws:\n  cv_steps: 3\n", "windws: unknown key"),
        ("gradients:\n  explosoin: 3\n", "gradients.explosoin: unknown key"),
        ("gradients:\n  explosion: true\n", "gradients.explosion: expected a number, got True"),
        ("gradients:\n  explosion: '10'\n", "gradients.explosion: expected a number"),
        ("gradients:\n  explosion: .nan\n", "gradients.explosion: expected a finite number"),
        ("gradients:\n  explosion: .inf\n", "gradients.explosion: expected a finite number"),
        ("gradients:\n  explosion: 2001-12-14\n", "gradients.explosion: expected a number"),
        ("gradients:\n  explosion: !!binary aGVsbG8=\n", "gradients.explosion: expected a number"),
        ("windows:\n  trend_steps: -5\n", "windows.trend_steps: must be > 0"),
        ("windows:\n  cv_steps: 0\n", "windows.cv_steps: must be > 0"),
        ("windows:\n  cv_steps: 2.5\n", "windows.cv_steps: expected an integer"),
        ("windows:\n  cv_steps: 100000000000\n", f"windows.cv_steps: at most {MAX_WINDOW_STEPS} steps"),
        ("learning_rate:\n  too_small_window: 10000000\n", "learning_rate.too_small_window: at most"),
        ("gradients: [1, 2]\n", "gradients: expected a mapping"),
        ("gradients: null\n", "gradients: expected a mapping"),
        ("gradients:\n  healthy_low: 6\n", "gradients: expected vanishing < healthy_low < healthy_high < explosion"),
        ("gradients:\n  layer_vanishing: 20\n", "gradients.layer_vanishing: must be below gradients.layer_explosion"),
        ("learning_rate:\n  too_small: 0.01\n", "learning_rate.too_small: must be below learning_rate.too_large"),
        ("loss:\n  trend_rising: 0.01\n", "loss.trend_rising: must be <= 0"),
        ("loss:\n  cv_warning: 0.5\n", "loss.cv_warning: must be below loss.cv_danger"),
        ("profiles:\n  causal-lm:\n    loss_good: [3, 1]\n", r"profiles.causal-lm.loss_good: expected \[low, high\]"),
        ("profiles:\n  causal-lm:\n    loss_good: [.nan, 2]\n", "profiles.causal-lm.loss_good"),
        ("profiles:\n  causal-lm:\n    loss_good: '1,2'\n", "profiles.causal-lm.loss_good"),
        ("profiles:\n  causal-lm:\n    loss_bad: 1\n", "profiles.causal-lm.loss_bad: unknown key"),
        ("profile: 3\n", "profile: unknown profile 3"),
        ("version: 2\n", "version: expected 1"),
        ("alerts:\n  plateau_for: -5m\n", "alerts.plateau_for: expected a Prometheus duration"),
        ("alerts:\n  runbook_url: javascript:alert(1)\n", "alerts.runbook_url: expected an http"),
        ("gradients:\n  explosion: 3\n  explosion: 30\n", "explosion: duplicate key"),
        ("gradients: !!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
        ("gradients:\n  explosion: !!python/name:os.system\n", "not valid YAML"),
        ("gradients:\n  explosion: !custom 3\n", "not valid YAML"),
        ("\x00\x01garbage", "not valid YAML"),
        ("- a\n- list\n", "expected a mapping at the top level"),
        ("? [a, b]\n: 1\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_a_clear_error_naming_the_key(tmp_path, text, message):
    path = tmp_path / "t.yaml"
    path.write_bytes(text.encode())
    with pytest.raises(ThresholdsError, match=message):
        load_thresholds(path)


def test_not_utf8_and_not_a_file(tmp_path):
    path = tmp_path / "utf16.yaml"
    path.write_bytes("gradients:\n  explosion: 3\n".encode("utf-16"))
    with pytest.raises(ThresholdsError, match="not UTF-8 text"):
        load_thresholds(path)
    with pytest.raises(ThresholdsError, match="cannot read thresholds file"):
        load_thresholds(tmp_path)  # a directory
    with pytest.raises(TypeError, match="thresholds: expected a path"):
        load_thresholds(3)


def test_an_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_thresholds(path) == load_thresholds()


# Values of every YAML type, placed at known and unknown keys of a thresholds document.
YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def documents(draw):
    default = _default_document()
    doc: dict = {}
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(default) + ["unknown"]))
        body = default.get(section)
        if isinstance(body, dict) and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(body) + ["unknown"]))
            doc.setdefault(section, {})
            if isinstance(doc[section], dict):
                doc[section][key] = draw(YAML_VALUES)
        else:
            doc[section] = draw(YAML_VALUES)
    return doc


@settings(max_examples=300, deadline=None)
@given(doc=documents())
def test_any_document_loads_or_names_a_key(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("t") / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        load_thresholds(path)
    except ThresholdsError as exc:
        assert ":" in str(exc), exc  # "<key>: <problem>"
