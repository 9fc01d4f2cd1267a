"""The pure diagnosis: each rule at its edges, then the five classic loss curves."""

import math

import numpy as np
import pytest

from lossbeat.diagnosis import (
    History,
    Status,
    check_grad_norm,
    check_layer_grad_norms,
    check_learning_rate,
    check_loss_range,
    check_loss_trend,
    check_loss_volatility,
    check_overfitting,
    check_warmup,
    diagnose,
)
from lossbeat.thresholds import load_thresholds

T = load_thresholds()


def by_check(findings):
    return {(f.check, f.component): f for f in findings}


# --- each rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "mean, status, text",
    [(1.5, Status.GOOD, "usual range"), (4.0, Status.GOOD, "mean loss 4"), (5.2, Status.WARNING, "above 5"),
     (0.05, Status.WARNING, "suspiciously low"), (0.3, Status.GOOD, "mean loss 0.3")],
)
def test_loss_range_causal_lm(mean, status, text):
    f = check_loss_range([mean] * 10, T.profile)
    assert f.status is status and text in f.message


def test_loss_range_profiles():
    classification = T.profiles["classification"]
    assert check_loss_range([2.5] * 10, classification).status is Status.WARNING
    assert check_loss_range([0.5] * 10, classification).status is Status.GOOD
    assert not check_loss_range([1e6] * 10, T.profiles["regression"]).known
    assert not check_loss_range([math.nan] * 3, T.profile).known


@pytest.mark.parametrize(
    "ratio, status",
    [(0.051, Status.GOOD), (0.05, Status.WARNING), (0.0, Status.WARNING), (-0.02, Status.WARNING),
     (-0.0201, Status.DANGER), (-0.5, Status.DANGER)],
)
def test_loss_trend_edges(ratio, status):
    assert check_loss_trend(ratio, T.loss).status is status


def test_loss_trend_ignores_a_rise_within_the_noise():
    # -3% is beyond -2%, but with a 2% standard error it is not a significant rise.
    assert check_loss_trend(-0.03, T.loss, noise_ratio=0.02).status is Status.WARNING
    assert check_loss_trend(-0.07, T.loss, noise_ratio=0.02).status is Status.DANGER


@pytest.mark.parametrize(
    "cv, status", [(0.149, Status.GOOD), (0.15, Status.WARNING), (0.299, Status.WARNING), (0.3, Status.DANGER)]
)
def test_loss_volatility_edges(cv, status):
    assert check_loss_volatility(cv, T.loss).status is status


@pytest.mark.parametrize(
    "norm, status, text",
    [(10.5, Status.DANGER, "exploding"), (9.9, Status.GOOD, "9.9"), (1.0, Status.GOOD, "healthy"),
     (5e-5, Status.WARNING, "vanishing"), (0.01, Status.GOOD, "0.01")],
)
def test_grad_norm_edges(norm, status, text):
    f = check_grad_norm([norm] * 20, T.gradients)
    assert f.status is status and text in f.message


def test_grad_norm_ignores_non_finite_values():
    assert check_grad_norm([math.nan, math.inf, 1.0], T.gradients).status is Status.GOOD
    assert not check_grad_norm([math.nan], T.gradients).known


def test_layer_grad_norms_name_the_worst_layer_first():
    f = check_layer_grad_norms({"a": 1.0, "b": 50.0, "c": 12.0, "d": math.nan}, T.gradients)
    assert f.status is Status.WARNING
    assert f.message.startswith("2 layer(s) above 10: b (50), c (12)")
    vanishing = check_layer_grad_norms({"a": 1.0, "frozen.head": 1e-7}, T.gradients)
    assert vanishing.status is Status.WARNING and "frozen.head" in vanishing.message
    assert check_layer_grad_norms({"a": 1.0}, T.gradients).status is Status.GOOD


def test_learning_rate_rules():
    lr = T.learning_rate
    flat = [2.0] * 100
    assert check_learning_rate([1e-7] * 20, flat, 0.01, lr).status is Status.WARNING  # too small, no progress
    falling = list(np.linspace(2.0, 1.0, 100))
    assert check_learning_rate([1e-7] * 20, falling, 0.01, lr).status is Status.GOOD  # small but learning
    assert check_learning_rate([5e-3] * 20, flat, 0.25, lr).status is Status.WARNING  # too large with CV > 0.2
    assert check_learning_rate([5e-3] * 20, flat, 0.1, lr).status is Status.GOOD
    assert check_learning_rate([0.0] * 20, flat, 0.01, lr).status is Status.WARNING  # zero
    assert check_learning_rate([0.0, 1e-5], flat, 0.01, lr).status is Status.GOOD  # warmup from zero
    assert check_learning_rate([math.nan], flat, 0.01, lr).status is Status.DANGER


def test_warmup_rule():
    lr = T.learning_rate
    assert check_warmup(4.0, 3.7, 50, lr).status is Status.WARNING  # above 0.9 x first
    assert check_warmup(4.0, 3.5, 50, lr).status is Status.GOOD
    assert not check_warmup(4.0, 3.9, 10, lr).known  # too early to judge


def test_overfitting_rule():
    assert check_overfitting([1.0, 0.9, 0.95, 1.0], 0.1, T.overfitting, T.loss).status is Status.WARNING
    assert check_overfitting([1.0, 0.9, 0.85], 0.1, T.overfitting, T.loss).status is Status.GOOD
    # Eval rising while training also rises is not overfitting (it is divergence).
    assert check_overfitting([1.0, 0.9, 0.95, 1.0], -0.1, T.overfitting, T.loss).status is Status.GOOD


# --- the five classic curves -----------------------------------------------------


def run_curve(train, eval_every=0, eval_curve=None, grad=None, lr=1e-4, until=None):
    """Feed a curve step by step; returns (history, worst status seen per check)."""
    history = History(T)
    worst: dict = {}
    counts = {"spikes": 0, "explosions": 0, "nonfinite": 0}
    for i, loss in enumerate(train[:until]):
        events = history.add_step(i, float(loss), grad_norm=(grad[i] if grad is not None else 1.0), learning_rate=lr)
        counts["spikes"] += events.spike
        counts["explosions"] += events.explosion
        counts["nonfinite"] += events.nonfinite_loss
        if eval_every and (i + 1) % eval_every == 0:
            history.add_eval(float(eval_curve[i]))
        if (i + 1) % 10 == 0:
            for f in diagnose(history):
                worst[f.check] = max(worst.get(f.check, Status.GOOD), f.status)
    return history, worst, counts


STEPS = np.arange(1000)
RNG = np.random.default_rng(7)


def test_ideal_curve_is_healthy_while_it_learns():
    # Per-step records: 20 steps must cover >5% of the fall, so a 100-step time constant.
    ideal = 3.0 * np.exp(-STEPS / 100) + 0.8 + 0.02 * RNG.standard_normal(1000)
    history, worst, counts = run_curve(ideal, until=150)
    findings = by_check(diagnose(history))
    assert findings[("loss_trend", "")].status is Status.GOOD
    assert findings[("loss_volatility", "")].status is Status.GOOD
    assert findings[("loss_range", "")].status is Status.GOOD
    assert counts["spikes"] == 0
    # Converged, it plateaus (a warning), but never a danger over the whole run.
    history, worst, counts = run_curve(ideal)
    assert max(worst.values()) < Status.DANGER
    assert by_check(diagnose(history))[("loss_trend", "")].status is Status.WARNING


def test_oscillating_curve_is_volatile():
    oscillating = 2.0 + 0.6 * np.sin(STEPS / 4) + 0.3 * RNG.standard_normal(1000)
    history, worst, _ = run_curve(oscillating)
    assert worst["loss_volatility"] >= Status.WARNING
    assert history.loss.cv() > T.loss.cv_warning


def test_overfitting_curve_is_flagged_once_eval_rises():
    train = 2.0 * np.exp(-STEPS / 200) + 0.3 + 0.01 * RNG.standard_normal(1000)
    val = 2.0 * np.exp(-STEPS / 300) + 0.8
    val[600:] += 0.5 * np.arange(400) / 400
    history, _, _ = run_curve(train, eval_every=50, eval_curve=val, until=550)
    assert by_check(diagnose(history))[("overfitting", "")].status is Status.GOOD
    history, _, _ = run_curve(train, eval_every=50, eval_curve=val)
    overfitting = by_check(diagnose(history))[("overfitting", "")]
    assert overfitting.status is Status.WARNING and "above its best" in overfitting.message


def test_exploding_curve_counts_spikes_and_explosions():
    normal = 2.0 * np.exp(-STEPS / 200) + 0.5 + 0.01 * RNG.standard_normal(1000)
    exploding = normal.copy()
    exploding[900:] += 100 * np.abs(RNG.standard_normal(100))
    grads = np.where(STEPS >= 900, 50.0, 1.0)
    history, worst, counts = run_curve(exploding, grad=grads)
    findings = by_check(diagnose(history))
    assert findings[("loss_volatility", "")].status is Status.DANGER
    assert findings[("grad_norm", "")].status is Status.DANGER
    assert findings[("loss_range", "")].status is Status.WARNING
    assert counts["explosions"] == 100
    assert counts["spikes"] >= 1
    # The same curve without the explosion has none of it.
    _, _, calm = run_curve(normal)
    assert calm["spikes"] == 0 and calm["explosions"] == 0


def test_underfitting_curve_plateaus_high():
    underfitting = 3.0 - 0.3 * (1 - np.exp(-STEPS / 500)) + 0.02 * RNG.standard_normal(1000)
    history, worst, _ = run_curve(underfitting)
    findings = by_check(diagnose(history))
    assert findings[("loss_trend", "")].status is Status.WARNING  # plateau
    assert findings[("warmup", "")].status is Status.WARNING  # barely moved in the first 50 steps
    assert worst["loss_trend"] < Status.DANGER


def test_nonfinite_losses_are_data_not_errors():
    history = History(T)
    for i in range(30):
        events = history.add_step(i, math.nan if i in (10, 11) else 2.0, grad_norm=math.inf if i == 11 else 1.0)
        assert events.nonfinite_loss == (i in (10, 11))
        assert events.nonfinite_grad == (i == 11)
    assert len(history.loss) == 28  # non-finite values never enter the windows
    assert by_check(diagnose(history))[("nonfinite", "")].status is Status.DANGER


def test_a_step_going_backwards_resets_the_windows():
    history = History(T)
    for i in range(100):
        history.add_step(i, 2.0)
    history.add_step(40, 2.0)  # resumed from a checkpoint
    assert len(history.loss) == 1


def test_components_are_diagnosed_on_their_own():
    history = History(T.with_profile("multi-task"))
    for i in range(100):
        history.add_step(i, 2.0, components={"lm": 2.0 - i * 0.01, "aux": 0.5 + 0.02 * i})
    findings = by_check(diagnose(history))
    assert findings[("loss_trend", "lm")].status is Status.GOOD
    assert findings[("loss_trend", "aux")].status is Status.DANGER
