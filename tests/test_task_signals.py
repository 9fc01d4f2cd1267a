"""The task's own signals judged offline and live alike: an RL gradient norm that
collapses, a KL that runs away, an eval loss that rises while the eval metric still improves."""

from __future__ import annotations

import math
import random

import pytest
from helpers.synthetic_logs import synthetic_log as _log

from lossbeat import Monitor, MonitorConfig
from lossbeat.analyze.replay import replay
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.logs import ParsedLog, TrainRecord

T = load_thresholds()


def _final(findings, check="learning"):
    return next(f for f in findings if f.check == check and not f.component)


def _live(log, profile, learning_rates=False):
    """The same series through a real Monitor: observe(metrics=...), observe_eval(metrics=...)."""
    m = Monitor(MonitorConfig(run_name="t", profile=profile), serve=False)
    by_step = {}
    for name, points in log.signals.items():
        for step, value in points:
            by_step.setdefault(step, {})[name] = value
    evals = {e.step: e.loss for e in log.evals}
    for r in log.train:
        named = by_step.get(r.step, {})
        m.observe(
            r.step,
            loss=r.loss,
            grad_norm=r.grad_norm,
            learning_rate=r.learning_rate if learning_rates else None,
            metrics={k: v for k, v in named.items() if not k.startswith("eval_")} or None,
        )
        if r.step in evals:
            m.observe_eval(r.step, evals[r.step], metrics={k: v for k, v in named.items() if k.startswith("eval_")})
    report = m.report()
    m.close()
    return report.findings


def _rl_run(grads, n=200, seed=0, kl=None):
    rng = random.Random(seed)
    reward = [(i, 0.5 + 0.002 * i + rng.gauss(0, 0.05)) for i in range(1, n + 1)]
    signals = {"reward": reward}
    if kl is not None:
        signals["kl"] = [(i, kl(i)) for i in range(1, n + 1)]
    return _log([rng.gauss(0, 1e-3) for _ in range(n)], grads, signals)


def test_an_rl_gradient_norm_exactly_zero_collapsed_the_learning_signal_offline_and_live():
    t = T.with_profile("rl")
    rng = random.Random(3)
    log = _rl_run([0.05 + rng.gauss(0, 0.005) if i < 150 else 0.0 for i in range(200)])
    for findings in (replay(log, t).findings, _live(log, "rl")):
        f = _final(findings)
        assert f.status is Status.DANGER and "learning signal collapsed" in f.message
        assert "exactly 0 on each of the last 50 records" in f.message


def test_an_rl_gradient_norm_a_hundredth_of_its_level_collapsed_scattered_zeros_did_not():
    t = T.with_profile("rl")
    rng = random.Random(4)
    collapsed = _rl_run([0.05 + rng.gauss(0, 0.005) if i < 150 else 2e-5 for i in range(200)])
    f = _final(replay(collapsed, t).findings)
    assert f.status is Status.DANGER and "at most 1% of its earlier level" in f.message
    # A healthy policy: exact zeros now and then (a batch all solved), a norm drifting down 3x.
    healthy = _rl_run([0.0 if i % 7 == 0 else 0.06 - 0.0002 * i for i in range(200)])
    f = _final(replay(healthy, t).findings)
    assert f.status is Status.GOOD and "collapsed" not in f.message


def test_a_kl_that_runs_away_is_named_offline_and_live_a_settled_one_is_not():
    t = T.with_profile("rl")
    grads = [0.05] * 200
    runaway = _rl_run(grads, kl=lambda i: 0.02 if i <= 120 else 0.02 * 1.06 ** (i - 120))
    for findings in (replay(runaway, t).findings, _live(runaway, "rl")):
        f = _final(findings)
        assert f.status is Status.WARNING and f.message.startswith("the KL to the reference runs away")
    settled = _rl_run(grads, kl=lambda i: 0.08 * (1 - math.exp(-i / 20)))
    f = _final(replay(settled, t).findings)
    assert f.status is Status.GOOD and "KL" not in f.message


def _eval_run(accuracy):
    """A classifier whose eval loss is best at step 400 and then rises 40 %, with ``accuracy(step)``."""
    rng = random.Random(5)
    losses = [0.9 * math.exp(-i / 300) + 0.1 + rng.gauss(0, 0.01) for i in range(1200)]
    steps = range(100, 1201, 100)
    evals = {s: 0.5 - 0.05 * s / 100 if s <= 400 else 0.3 * (1 + 0.07 * (s - 400) / 100) for s in steps}
    return _log(losses, signals={"eval_accuracy": [(s, accuracy(s)) for s in steps]}, evals=evals)


def test_an_eval_loss_rising_while_the_accuracy_still_rises_is_over_confidence_offline_and_live():
    t = T.with_profile("classification")
    rising = _eval_run(lambda s: 0.70 + 0.01 * s / 100)
    for findings in (replay(rising, t).findings, _live(rising, "classification")):
        f = _final(findings, "overfitting")
        assert f.status is Status.WARNING and f.message.startswith("over-confident")
        assert "eval accuracy still improves (0.74 by then, 0.81 now)" in f.message
    falling = _eval_run(lambda s: 0.74 if s <= 400 else 0.74 - 0.01 * (s - 400) / 100)
    f = _final(replay(falling, t).findings, "overfitting")
    assert f.status is Status.WARNING and "over-confident" not in f.message and "above its best" in f.message


def test_a_run_that_never_learned_at_a_large_peak_lr_names_the_lr():
    rng = random.Random(6)
    lr = [min(i / 50, 1.0) * 3e-3 for i in range(400)]  # a fine-tune warmed up to 3e-3

    def with_lr(losses):
        log = ParsedLog("test", "synthetic")
        log.train.extend(TrainRecord(i + 1, v, None, lr[i]) for i, v in enumerate(losses))
        return log

    failed = with_lr([1.2 + 0.3 * min(i / 100, 1.0) + rng.gauss(0, 0.05) for i in range(400)])
    f = _final(replay(failed, T).findings, "learning_rate")
    assert f.status is Status.WARNING and f.message.startswith("learning rate peaked at 0.003 and the loss never fell")
    healthy = with_lr([1.2 * math.exp(-i / 200) + 0.5 + rng.gauss(0, 0.02) for i in range(400)])
    assert _final(replay(healthy, T).findings, "learning_rate").status is Status.GOOD


@pytest.mark.parametrize(
    "name",
    [
        "hf-llada-grpo-remasking-policy-ckpt1000-trainer_state.json",
        "hf-vit-skin-cancer-10ep-overfit-trainer_state.json",
    ],
)
def test_a_real_log_fed_to_a_monitor_with_its_signals_gives_the_findings_analyze_gives(name):
    """Live = offline on real logs whose task signals judge them (GRPO's reward; ViT's eval accuracy)."""
    from lossbeat.analyze import judge_log
    from lossbeat.analyze.evaluation import DATA
    from lossbeat.diagnosis.vitals import LIVE_ONLY_CHECKS
    from lossbeat.logs import parse_log

    path = DATA / "real-logs-3" / name
    log = parse_log(path)
    (offline,) = judge_log(log, T).runs
    live = _live(log, offline.profile, learning_rates=True)

    def shared(findings):
        return sorted((f.check, f.component, f.status, f.message) for f in findings if f.check not in LIVE_ONLY_CHECKS)

    assert shared(live) == shared(offline.findings)


def test_values_logged_after_their_step_are_judged_and_exported_without_a_step():
    from prometheus_client import generate_latest

    from lossbeat import NullMonitor

    m = Monitor(MonitorConfig(run_name="t"), serve=False)
    for step in range(1, 4):
        m.observe(step, loss=2.0 - 0.1 * step, grad_norm=1.0)
    m.observe_metrics(3, {"kl": 0.25, "reward_std": 0.5, "completions/mean_length": 7.0})
    assert m.state.step == 3 and m.history.signals["kl"].count == 1  # no step added, the value kept
    assert m.state.signals["kl"] == 0.25 and m._judge.thresholds.profile.name == "rl"
    body = generate_latest(m.registry).decode().splitlines()
    assert [ln.rsplit(" ", 1)[1] for ln in body if ln.startswith("training_signal{") and 'signal="kl"' in ln] == [
        "0.25"
    ]
    with pytest.raises(TypeError, match="metrics"):
        m.observe_metrics(3, [("kl", 0.25)])
    with pytest.raises(TypeError, match="metrics"):
        m.observe_metrics(3, {"kl": "high"})
    m.close()
    NullMonitor().observe_metrics(3, {"kl": 0.25})
