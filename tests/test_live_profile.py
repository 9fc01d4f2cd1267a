"""The live Monitor detects the task profile from the names observe is given
(docs/decisions.md#the-task-profile-comes-from-the-logged-names)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from lossbeat import Monitor, MonitorConfig


def _monitor(**kwargs) -> Monitor:
    return Monitor(MonitorConfig(run_name="t", **kwargs), serve=False)


def _text(m: Monitor) -> str:
    return generate_latest(m.registry).decode()


def test_rl_is_detected_from_the_metrics_observe_is_given():
    m = _monitor()
    assert m._profile.name == "causal-lm"
    assert 'source="default"' in _text(m)
    for step in range(1, 30):
        m.observe(
            step,
            loss=0.01,
            grad_norm=0.5,
            metrics={
                "reward": 0.1 * step,
                "reward_std": 0.3,
                "frac_reward_zero_std": 0.1,
                "kl": 0.01,
                "completions/mean_length": 200.0,
            },
        )
    text = _text(m)
    assert m._judge.thresholds.profile.name == "rl"
    assert "training_profile_info{" in text and 'profile="rl"' in text and 'source="detected"' in text
    assert 'fields="reward,reward_std,frac_reward_zero_std,kl"' in text
    assert "training_run_info{" in text and 'profile="rl"' in text
    assert "training_signal{" in text and 'signal="reward_std"' in text
    assert 'signal="completions/mean_length"' not in text  # only the known signals are exported
    assert m.history.signals["reward"].count == 29
    m.close()


def test_preference_names_and_trl_aliases():
    m = _monitor()
    for step in range(1, 5):
        m.observe(step, loss=0.69, metrics={"rewards/margins": 0.0, "rewards/accuracies": 0.5})
    assert m._judge.thresholds.profile.name == "preference"
    text = _text(m)
    assert 'signal="margins"' in text and 'signal="preference_accuracy"' in text
    m.close()


def test_eval_metric_names_detect_classification():
    m = _monitor()
    m.observe(1, loss=0.7)
    m.observe_eval(1, 0.69, metrics={"eval_accuracy": 0.52, "eval_f1": 0.4})
    assert m._judge.thresholds.profile.name == "classification"
    assert 'signal="eval_accuracy"' in _text(m)
    assert m.history.signals["eval_accuracy"].latest == 0.52
    m.close()


def test_a_given_profile_wins():
    m = _monitor(profile="classification")
    m.observe(1, loss=0.1, metrics={"reward": 1.0, "reward_std": 0.0})
    assert m._judge.thresholds.profile.name == "classification"
    text = _text(m)
    assert 'source="given"' in text and 'profile="classification"' in text
    m.close()


def test_no_names_keeps_the_default_and_wrong_types_raise():
    m = _monitor()
    m.observe(1, loss=1.0, metrics={"lr_scale": 1.0})
    assert m._judge.thresholds.profile.name == "causal-lm"
    with pytest.raises(TypeError, match="metrics"):
        m.observe(2, loss=1.0, metrics=[1.0])
    with pytest.raises(TypeError, match="reward"):
        m.observe(2, loss=1.0, metrics={"reward": "high"})
    m.close()


def test_rl_collapse_is_judged_live():
    m = _monitor()
    for step in range(1, 80):
        m.observe(
            step, loss=0.0, grad_norm=0.1, metrics={"reward": 1.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0}
        )
    learning = next(f for f in m.report().findings if f.check == "learning")
    assert learning.status.name == "DANGER" and "collapsed" in learning.message
    m.close()
