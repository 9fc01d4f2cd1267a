"""A binary classifier that predicts its class prior is named, and a WARNING at the end
(docs/decisions.md#a-run-that-never-learned-is-at-least-a-warning).

Its chance level is the entropy of its class prior H(a), not ln 2: a constant predictor at the
majority share a has accuracy a, log loss H(a) and positive-class F1 2a/(1+a) (0 when the
majority is negative). Each "not warned" case is paired with the same run at its prior, warned."""

from __future__ import annotations

import math
import random

import pytest
from helpers.synthetic_logs import synthetic_log

from lossbeat.analyze.replay import replay
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.prior import eval_set_size, prior_entropy
from lossbeat.diagnosis.thresholds import load_thresholds

T = load_thresholds().with_profile("classification")
EVAL_STEPS = (50, 100, 150, 200)


def _log(losses, evals, accuracies, f1s=None):
    signals = {"eval_accuracy": zip(EVAL_STEPS, accuracies), **({"eval_f1": zip(EVAL_STEPS, f1s)} if f1s else {})}
    fields = ("loss", "eval_loss", "eval_accuracy") + (("eval_f1",) if f1s else ())
    return synthetic_log(losses, [1.0] * len(losses), signals, dict(zip(EVAL_STEPS, evals)), fields, step0=1, lr=1e-5)


def _train(end: float, seed: int = 0, noise: float = 0.03):
    """A train loss from ln 2 down to ``end`` (the head learns the class balance, or more)."""
    rng = random.Random(seed)
    return [math.log(2) + (end - math.log(2)) * min(1.0, i / 150) + rng.gauss(0, noise) for i in range(200)]


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn)


# 200 eval examples, 124 positive (a = 0.62): first every example predicted positive, then a few negatives.
AT_PRIOR_ACC = [124 / 200, 126 / 200, 125 / 200, 126 / 200]
AT_PRIOR_F1 = [_f1(124, 76, 0), _f1(120, 70, 4), _f1(121, 72, 3), _f1(120, 70, 4)]
AT_PRIOR_EVAL = [0.668, 0.662, 0.660, 0.657]  # H(0.62) = 0.664


def _learning(a):
    return next(f for f in a.findings if f.check == "learning" and not f.component)


def test_the_eval_set_size_is_the_accuracies_common_denominator():
    assert eval_set_size([0.6056338028169014, 0.6197183098591549], 100000) == 71  # 43/71, 44/71
    assert eval_set_size([124 / 200, 125 / 200, 126 / 200], 100000) == 200
    assert eval_set_size([0.6213457, 0.6287391], 100000) is None  # batch-averaged: no common count
    assert eval_set_size([float(f"{0.3 + i / 7:.7g}") for i in range(3)], 1000) is None
    assert prior_entropy(0.5) == pytest.approx(math.log(2)) and prior_entropy(0.62) == pytest.approx(0.6641, abs=1e-4)


@pytest.mark.parametrize("with_f1", [True, False])
def test_a_binary_classifier_at_its_prior_is_warned_at_the_end(with_f1):
    # The train loss falls 14 % (ln 2 -> 0.60; it "learned"), the accuracy stays at the majority share.
    train = _train(0.60) if with_f1 else _train(0.655)
    a = replay(_log(train, AT_PRIOR_EVAL, AT_PRIOR_ACC, AT_PRIOR_F1 if with_f1 else None), T)
    f = _learning(a)
    assert f.status is Status.WARNING and f.message.startswith("at the class prior"), f.message
    assert "0.620" in f.message and "200 examples" in f.message and "class balance, not the task" in f.message
    assert f.fix and "balanced" in f.fix


def test_a_healthy_binary_classifier_whose_accuracy_rises_is_not_warned():
    rising_acc = [124 / 200, 150 / 200, 170 / 200, 180 / 200]  # 0.62 -> 0.90
    rising_f1 = [_f1(124, 76, 0), _f1(110, 36, 14), _f1(115, 21, 9), _f1(117, 13, 7)]
    f = _learning(replay(_log(_train(0.25), [0.66, 0.50, 0.35, 0.28], rising_acc, rising_f1), T))
    assert "class prior" not in f.message and f.status is Status.GOOD, f.message
    # The same run with its accuracy left at the share: warned.
    f = _learning(replay(_log(_train(0.60), AT_PRIOR_EVAL, AT_PRIOR_ACC, AT_PRIOR_F1), T))
    assert f.message.startswith("at the class prior")


@pytest.mark.parametrize("with_f1", [True, False])
def test_an_unbalanced_healthy_classifier_at_095_with_a_low_loss_is_not_warned(with_f1):
    # 400 examples, 40 positive (the majority share 0.9 is negative): the model is right on 95 %.
    acc = [378 / 400, 380 / 400, 380 / 400, 381 / 400]
    f1 = [_f1(28, 10, 12), _f1(30, 10, 10), _f1(30, 10, 10), _f1(31, 10, 9)]
    log = _log(_train(0.08, noise=0.01), [0.13, 0.12, 0.12, 0.118], acc, f1 if with_f1 else None)
    f = _learning(replay(log, T))
    assert "class prior" not in f.message and f.status is Status.GOOD, f.message
    # The same task at its prior (all or all but one predicted negative: F1 0, accuracy 0.9, loss H(0.9)): warned.
    h = prior_entropy(0.9)
    prior = _log(
        _train(h if not with_f1 else 0.2, noise=0.01),
        [h + 0.004, h, h - 0.003, h - 0.002],
        [360 / 400, 361 / 400, 360 / 400, 360 / 400],
        [0.0, _f1(1, 0, 39), 0.0, 0.0] if with_f1 else None,
    )
    assert _learning(replay(prior, T)).message.startswith("at the class prior")


def test_accuracies_whose_denominator_cannot_be_recovered_are_not_judged():
    # The same run at its prior, its accuracies averaged over batches of unequal size: no common count.
    rng = random.Random(5)
    blurred = [a + rng.uniform(-1e-3, 1e-3) for a in AT_PRIOR_ACC]
    assert eval_set_size(blurred, T.class_prior.max_eval_examples) is None
    # A constant 0.9 is 9/10 however large the set: too few examples to band, not judged.
    assert eval_set_size([0.9] * 4, T.class_prior.max_eval_examples) == 10 < T.class_prior.min_eval_examples
    h = prior_entropy(0.9)
    flat = _log(_train(0.2, noise=0.01), [h] * 4, [0.9] * 4, [0.0] * 4)
    assert "class prior" not in _learning(replay(flat, T)).message
    f = _learning(replay(_log(_train(0.60), AT_PRIOR_EVAL, blurred, AT_PRIOR_F1), T))
    assert "class prior" not in f.message, f.message
    assert _learning(replay(_log(_train(0.60), AT_PRIOR_EVAL, AT_PRIOR_ACC, AT_PRIOR_F1), T)).message.startswith(
        "at the class prior"
    )


def test_the_class_prior_is_judged_for_classification_only():
    log = _log(_train(0.60), AT_PRIOR_EVAL, AT_PRIOR_ACC, AT_PRIOR_F1)
    assert "class prior" not in _learning(replay(log, T.with_profile("causal-lm"))).message


def test_the_live_monitor_names_the_class_prior_as_analyze_does():
    from test_task_signals import _live

    log = _log(_train(0.60), AT_PRIOR_EVAL, AT_PRIOR_ACC, AT_PRIOR_F1)
    for findings in (replay(log, T).findings, _live(log, "classification")):
        f = next(f for f in findings if f.check == "learning" and not f.component)
        assert f.status is Status.WARNING and f.message.startswith("at the class prior"), f.message
