"""The causes of flapping and of runs read as good that never learned, each on a short
synthetic series: a plateau needs a small fall (not a fall the windows lack the power to see), is
left for a fall that lasts, a high loss still falling by the fall's size, overfitting beyond the
evaluations' own noise, regression named from its error metrics, short sparse runs judged before
their end, a loss constant after its first record."""

from __future__ import annotations

import random

import pytest
from helpers.synthetic_logs import synthetic_log as _log

from lossbeat.analyze.replay import replay
from lossbeat.analyze.truth import flapping
from lossbeat.diagnosis import Judge, Status
from lossbeat.diagnosis.profiles import detect_profile
from lossbeat.diagnosis.thresholds import load_thresholds

T = load_thresholds()


@pytest.mark.parametrize(
    "fields",
    [("train_loss", "val_loss", "val_MAE", "val_SMAPE"), ("train_loss", "val_loss", "val_mse"), ("loss", "eval/rmse")],
)
def test_regression_is_named_from_its_error_metric(fields):
    assert detect_profile(fields).profile == "regression"


def test_a_noisy_sparse_descent_is_never_a_plateau():
    """A loss logged every 50 steps, falling ~6 % per quarter-run window with 8 % per-record noise:
    the two windows' fall is often under 3 standard errors, never small. No plateau, no flapping."""
    rng = random.Random(3)
    losses = [40.0 * (1 + i) ** -0.35 * (1 + 0.08 * rng.gauss(0, 1)) for i in range(700)]
    a = replay(_log(losses, every=50), T.with_profile("regression"))
    assert not a.reached("loss_trend", Status.WARNING), [c.finding.message for c in a.changes]
    assert flapping(a) == []


def test_a_real_plateau_is_still_one():
    rng = random.Random(5)
    losses = [3.0 * (1 + i) ** -0.3 for i in range(300)] + [
        3.0 * 300**-0.3 + 0.05 * rng.gauss(0, 1) for _ in range(1200)
    ]
    a = replay(_log(losses, every=1), T)
    assert _final(a, "loss_trend").status is Status.WARNING


def test_a_high_loss_still_falling_is_not_out_of_range_on_and_off():
    rng = random.Random(2)
    losses = [45.0 * (1 + i) ** -0.4 * (1 + 0.08 * rng.gauss(0, 1)) for i in range(500)]
    a = replay(_log(losses, every=50), T)
    entries = [c for c in a.changes if c.finding.check == "loss_range" and c.finding.status > c.previous]
    assert len(entries) <= 1, [(c.step, c.finding.message) for c in a.changes if c.finding.check == "loss_range"]


def _final(a, check):
    return next(f for f in a.findings if f.check == check and not f.component)


def test_a_noisy_eval_loss_that_trends_down_is_not_overfitting():
    rng = random.Random(4)
    train = [0.2 * (1 + i) ** -0.3 for i in range(700)]
    evals = {50 * (k + 1) * 24: 0.12 * (1 + k) ** -0.3 * (1 + 0.25 * rng.gauss(0, 1)) for k in range(29)}
    a = replay(_log(train, every=50, evals=evals), T.with_profile("regression"))
    entries = [c for c in a.changes if c.finding.check == "overfitting" and c.finding.status > c.previous]
    assert len(entries) <= 1


def test_a_steady_eval_rise_is_overfitting_and_stays_so():
    train = [2.0 * (1 + i) ** -0.3 for i in range(2000)]
    evals = {100 * k: 1.0 - 0.02 * k if k <= 10 else 0.8 + 0.02 * (k - 10) + 0.01 * (-1) ** k for k in range(1, 20)}
    a = replay(_log(train, evals=evals), T)
    assert _final(a, "overfitting").status is Status.WARNING
    entries = [c for c in a.changes if c.finding.check == "overfitting" and c.finding.status > c.previous]
    assert len(entries) == 1


def test_a_short_sparse_run_is_judged_before_its_end():
    j = Judge(T)
    assert [j.due(s) for s in (9, 19, 29)] == [False, True, True]


def test_a_loss_exactly_constant_after_its_first_record_is_nothing_trained():
    a = replay(_log([55.84] + [54.75] * 6, every=10, step0=9), T)
    f = _final(a, "learning")
    assert f.status is Status.DANGER and "after the first" in f.message


def test_a_fine_tune_that_falls_then_varies_is_not_nothing_trained():
    a = replay(_log([2.1, 1.52, 1.49, 1.47, 1.5, 1.46, 1.48], every=10), T)
    assert _final(a, "learning").status is not Status.DANGER


def test_a_high_start_left_fast_is_a_note_not_a_warning():
    a = replay(_log([19.2, 15.1, 13.0, 9.1, 6.6, 3.0, 1.2, 0.9, 0.8, 0.7] * 1, every=10), T)
    assert not a.reached("loss_range", Status.WARNING), [c.finding.message for c in a.changes]
