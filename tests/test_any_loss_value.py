"""No loss value can break the judgment: every check, live and offline, over series of any scale.

Losses from 1e-12 to 1e12, negative losses (RL objectives, some regression and contrastive
losses), infinities, NaN and long runs of one value are data: the diagnosis turns them into
findings and never raises. Offline, each profile's :class:`Judge` is driven over generated
series; live, a :class:`Monitor` is fed them and its ``exporter_errors_total{where="diagnose"}``
stays 0 while every check still gets a status.
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from lossbeat import Monitor, MonitorConfig
from lossbeat.diagnosis import Judge
from lossbeat.diagnosis.thresholds import load_thresholds

# Its own settings (not a registered profile, which would change other modules' counts).
EXAMPLES = settings(
    max_examples=400 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PROFILES = sorted(load_thresholds().profiles)


@st.composite
def loss_series(draw) -> list[float]:
    """A run's losses: a scale from 1e-12 to 1e12 (either sign), a shape (falling, rising, flat,
    exploding), noise, and stretches of one repeated value, NaN or +-Inf."""
    scale = draw(st.sampled_from([1e-12, 1e-6, 1e-3, 1.0, 7.0, 800.0, 1e6, 1e12]))
    sign = draw(st.sampled_from([1.0, -1.0]))
    n = draw(st.integers(min_value=1, max_value=400))
    shape = draw(st.sampled_from(["fall", "rise", "flat", "explode", "zero"]))
    noise = draw(st.sampled_from([0.0, 0.01, 0.3, 2.0]))
    seed = draw(st.integers(min_value=0, max_value=2**16))
    values = []
    x = seed
    for i in range(n):
        x = (1103515245 * x + 12345) % 2**31  # a deterministic noise source per example
        jitter = 1.0 + noise * (x / 2**31 - 0.5)
        level = {
            "fall": 1.0 + 9.0 * math.exp(-i / 50),
            "rise": 1.0 + i / 20,
            "flat": 1.0,
            "explode": 1.0 if i < n // 2 else 10.0 ** min(12, i - n // 2),
            "zero": 0.0,
        }[shape]
        values.append(sign * scale * level * jitter)
    for _ in range(draw(st.integers(min_value=0, max_value=3))):  # stretches of a special value
        start = draw(st.integers(min_value=0, max_value=max(0, n - 1)))
        length = draw(st.integers(min_value=1, max_value=120))
        special = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, values[start], 1e12, -1e12, 1e-12]))
        values[start : start + length] = [special] * len(values[start : start + length])
    return values


def _drive(judge: Judge, losses: list[float]) -> None:
    for step, loss in enumerate(losses):
        grad = abs(loss) if math.isfinite(loss) else loss
        judge.history.add_step(step, loss, grad_norm=grad, learning_rate=1e-3 if step < len(losses) // 2 else 0.1)
        if step % 25 == 24:
            judge.history.add_eval(loss, step=step)
        if judge.due(step):
            judge.judge(step)
    judge.judge(len(losses))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_check_judges_any_loss_series_offline(profile):
    t = load_thresholds(profile=profile)

    @EXAMPLES
    @given(losses=loss_series())
    def check(losses):
        judge = Judge(t)
        _drive(judge, losses)  # raises on any exception in the checks
        assert judge.findings, "every diagnosis returns findings"
        for f in judge.findings:
            assert f.check and isinstance(f.message, str)

    check()


def test_the_live_diagnosis_never_errs_on_any_loss_series():
    @EXAMPLES
    @given(losses=loss_series())
    def check(losses):
        m = Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False, registry=CollectorRegistry())
        for step, loss in enumerate(losses):
            m.observe(step, loss=loss, learning_rate=1e-3)
            if step % 50 == 49:
                m.observe_eval(step, loss)
        report = m.report()
        assert m.state.errors.get("diagnose", 0) == 0
        assert report.findings, "the report holds findings"

    check()


@pytest.mark.parametrize("initial", [23.74, 800.0, 1e6, 1e12, -5.0])
def test_a_loss_starting_above_any_vocabulary_is_judged_without_vocabulary_words(initial):
    """A loss starting above ln of any plausible vocabulary (a regression on raw units, a CTC or
    summed loss) is judged like any loss: no exception (exp(800) overflows) and no talk of
    tokens or classes it cannot be a uniform prediction over."""
    judge = Judge(load_thresholds())
    for step in range(300):
        judge.history.add_step(step, initial * (0.5 + 0.5 * math.exp(-step / 60)), grad_norm=1.0, learning_rate=1e-3)
        if judge.due(step):
            judge.judge(step)
    findings, _ = judge.judge(300)
    text = " ".join(f.message for f in findings)
    assert "tokens" not in text and "uniform prediction" not in text, text


def _range_after(profile: str | None) -> str:
    m = Monitor(
        MonitorConfig(port=0, log_status_changes=False, profile=profile), serve=False, registry=CollectorRegistry()
    )
    for step in range(700):  # a regression on raw units, flat at 23.7
        m.observe(step, loss=23.74 + 0.1 * ((7 * step) % 5 - 2), grad_norm=1.0, learning_rate=1e-3)
    return next(f for f in m.report().findings if f.check == "loss_range").message


def test_an_unknown_task_is_judged_as_unknown():
    """No task named or detected: the causal-LM range is a guess, and the finding says so; a task
    named causal-lm is judged in its terms."""
    unnamed = _range_after(None)
    assert "no task was named or detected" in unnamed and "tokens" not in unnamed, unnamed
    named = _range_after("causal-lm")
    assert "no task was named" not in named and "above" in named, named
