"""The pure diagnosis: judgments against the run's own level, in steps, with hysteresis.

Each test feeds whole series through the same Judge the monitor and `lossbeat analyze`
use (via replay), and asserts on the statuses, the step they were reached at, and the
number of status changes.
"""

import math
import random

import pytest

from lossbeat.analyze.replay import replay
from lossbeat.diagnosis import (
    History,
    Judge,
    Status,
    check_layer_grad_norms,
    diagnose,
    uniform_classes,
)
from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.logs import EvalRecord, ParsedLog, TrainRecord

T = load_thresholds()


def run(steps, loss, grad=None, lr=None, evals=None, profile=None):
    """Replay a series given as functions of the step; returns the Analysis."""
    log = ParsedLog("test", "synthetic")
    for s in steps:
        log.train.append(TrainRecord(s, loss(s), grad(s) if grad else None, lr(s) if lr else None))
    for step, value in (evals or {}).items():
        log.evals.append(EvalRecord(step, value))
    log.evals.sort(key=lambda e: e.step)
    return replay(log, load_thresholds(profile=profile) if profile else T)


def final(a, check, component=""):
    return next(f for f in a.findings if f.check == check and f.component == component)


def changes(a, check):
    return [c for c in a.changes if c.finding.check == check]


def noise(seed, scale):
    rng = random.Random(seed)
    return lambda: rng.gauss(0, scale)


def cosine(peak, total, floor=0.0):
    return lambda s: peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))


# --- gradients: against the run's own level ------------------------------------------


def test_a_stable_high_grad_norm_is_the_runs_own_level():
    n = noise(1, 0.5)
    a = run(range(0, 3000, 25), lambda s: 1.0 + math.exp(-s / 500), grad=lambda s: 17.5 + n())
    assert a.counters["grad_explosions"] == 0
    assert not a.reached("grad_norm")
    assert "above the absolute ceiling 10 but at the run's own level" in final(a, "grad_norm").message


def test_the_first_steps_of_a_run_from_scratch_do_not_explode():
    # llm.c GPT-2: a norm of 15.4 at step 0 that settles near 0.3.
    a = run(range(2000), lambda s: 3.3 + 7.7 * math.exp(-s / 100), grad=lambda s: 0.3 + 15.1 * math.exp(-s / 8))
    assert a.counters["grad_explosions"] == 0 and not a.reached("grad_norm")


def test_a_x10_jump_is_caught_within_a_few_steps():
    n = noise(2, 0.05)
    a = run(range(600), lambda s: 2.0, grad=lambda s: (10.0 if s >= 400 else 1.0) * math.exp(n()) * 1.1)
    assert a.event_steps["grad_explosions"][0] in (400, 401, 402)
    assert 400 <= a.worst[("grad_norm", "")].step <= 410  # danger at the first diagnosis after the jump
    assert a.worst[("grad_norm", "")].finding.status is Status.DANGER
    assert "jumped" in a.worst[("grad_norm", "")].finding.message


def test_a_steady_climb_is_caught_but_a_slow_drift_is_not():
    climb = run(range(800), lambda s: 2.0, grad=lambda s: 1.0 * (1.02 ** (s - 300) if s > 300 else 1.0))
    assert climb.reached("grad_norm", Status.DANGER)
    assert climb.worst[("grad_norm", "")].step < 420  # 5x the level after ~80 steps of +2%
    # TinyLlama: 1.0 -> 2.7 over the run; Qwen3: 0.45 -> 1.23 and back.
    drift = run(range(3000), lambda s: 2.0, grad=lambda s: 1.0 + 1.7 * s / 3000)
    assert not drift.reached("grad_norm") and drift.counters["grad_explosions"] == 0


def test_isolated_spikes_are_events_not_a_danger():
    a = run(range(0, 200000, 500), lambda s: 2.0 - s / 1e6, grad=lambda s: {164000: 13.2, 190000: 35.6}.get(s, 2.4))
    assert a.event_steps["grad_explosions"] == [164000, 190000]  # 13.2: above 10 and 3x; 35.6: x15
    assert not a.reached("grad_norm")


def test_layer_grad_norms_name_the_worst_layer_first():
    f = check_layer_grad_norms({"a": 1.0, "b": 50.0, "c": 12.0, "d": math.nan}, T.gradients)
    assert f.status is Status.WARNING
    assert f.message.startswith("2 layer(s) above 10: b (50), c (12)")
    assert check_layer_grad_norms({"a": 1.0}, T.gradients).status is Status.GOOD


# --- volatility: around the trend ---------------------------------------------------


def test_the_initial_descent_is_not_volatility():
    # 14.7, 1.2, 0.8 ... and a first fall from 11 to 1: the trend, not jitter.
    values = [14.7, 1.2, 0.8] + [0.75 - 0.0001 * i for i in range(200)]
    a = run(range(len(values)), lambda s: values[s])
    assert not a.reached("loss_volatility")
    fall = run(range(500), lambda s: 1.0 + 10.0 * math.exp(-s / 20))
    assert not fall.reached("loss_volatility")


def test_a_memorising_run_near_zero_is_not_volatile():
    n = noise(3, 0.0001)
    a = run(range(400), lambda s: 0.016 if s == 300 else 0.0002 + abs(n()), lr=lambda s: 1e-8)
    assert not a.reached("loss_volatility")


def test_an_oscillating_loss_is_volatile():
    n = noise(4, 0.3)
    a = run(range(1000), lambda s: 2.0 + 0.6 * math.sin(s / 4) + n())
    assert a.reached("loss_volatility", Status.WARNING)  # noise 0.3 on a level of 2: 0.15
    wild = run(range(1000), lambda s: 2.0 + noise(40, 0.8)())
    assert run(range(1000), lambda s: 2.0 + (0.8 if s % 2 else -0.8)).reached("loss_volatility", Status.DANGER)
    assert wild.counters["nonfinite_loss"] == 0


def test_noise_is_a_danger_only_where_it_grew_or_hides_the_trend():
    n = noise(41, 0.5)
    # A noisy small-batch run that keeps learning through its noise: a warning at most.
    learning = run(range(3000), lambda s: 1.0 + 3.0 * math.exp(-s / 800) + n())
    assert learning.reached("loss_volatility", Status.WARNING)
    assert not learning.reached("loss_volatility", Status.DANGER)
    # The same noise, then three times more once it stopped improving: it grew, a danger.
    m = noise(42, 0.5)
    grew = run(range(3000), lambda s: 1.0 + 3.0 * math.exp(-s / 300) + m() * (1 if s < 1500 else 3))
    assert final(grew, "loss_volatility").status is Status.DANGER


def test_noise_near_the_threshold_does_not_flap():
    n = noise(5, 0.148)  # robust noise / level hovering around cv_warning (0.15)
    a = run(range(6000), lambda s: 1.0 + n())
    assert len(changes(a, "loss_volatility")) <= 2


# --- trend and plateau: windows in steps -------------------------------------------


def healthy(s):
    return 2.0 + 1.5 * math.exp(-s / 500) + 0.5 * (1 + s / 1000) ** -0.5


def test_the_same_run_logged_every_step_or_every_100_steps_gets_the_same_verdict():
    n1, n2 = noise(6, 0.05), noise(7, 0.005)
    every = run(range(20000), lambda s: healthy(s) + n1(), lr=cosine(3e-4, 20000, 0.1))
    sparse = run(range(0, 20000, 100), lambda s: healthy(s) + n2(), lr=cosine(3e-4, 20000, 0.1))
    assert every.worst_status < Status.DANGER and sparse.worst_status < Status.DANGER
    verdict = lambda a: {k: w.finding.status for k, w in a.worst.items() if w.finding.status}  # noqa: E731
    assert verdict(every) == verdict(sparse)  # the same checks reach the same statuses ...
    for key in verdict(every):  # ... within 5% of the run's steps of each other
        assert abs(every.worst[key].step - sparse.worst[key].step) <= 1000
    assert every.status_changes == sparse.status_changes <= 1


def test_a_flat_loss_at_the_end_of_a_decayed_schedule_is_expected():
    n = noise(8, 0.01)
    a = run(range(0, 4000, 10), lambda s: 1.5 + 1.0 * math.exp(-s / 300) + n(), lr=cosine(2e-4, 3000))
    f = final(a, "loss_trend")
    assert f.status is Status.GOOD and "end of a decayed LR schedule" in f.message and "expected" in f.message
    assert final(a, "learning_rate").status is Status.GOOD
    assert final(a, "learning").status is Status.GOOD


def test_a_run_flat_from_its_start_is_not_excused_by_a_decayed_schedule():
    n = noise(8, 0.01)
    a = run(range(0, 4000, 10), lambda s: 1.5 + n(), lr=cosine(2e-4, 3000))
    f = final(a, "loss_trend")
    assert f.status is Status.WARNING and "never fell below its start" in f.message
    learning = final(a, "learning")
    assert learning.status is Status.WARNING and learning.message.startswith("never learned")


def test_a_real_plateau_is_a_warning_and_an_lr_that_collapsed_at_once_a_danger():
    n = noise(9, 0.05)
    lr = lambda s: 3e-4 if s < 1000 else 1e-8  # noqa: E731  (dropped, not decayed)
    a = run(range(3000), lambda s: (healthy(s) if s < 1000 else healthy(1000)) + n(), lr=lr)
    assert final(a, "loss_trend").status is Status.WARNING and "plateaued" in final(a, "loss_trend").message
    assert len(changes(a, "loss_trend")) == 1  # entered once, stays
    # 3e-4 -> 1e-8 in one step, the loss flat since: the model stopped learning mid-schedule.
    f = final(a, "learning_rate")
    assert f.status is Status.DANGER and "collapsed" in f.message and "at step 1000" in f.message
    assert "before step 1000" in f.fix


def test_an_lr_step_decay_of_10x_is_no_collapse():
    # A milestone schedule divides the LR by 10 at once: small LR, flat loss, not a collapse.
    n = noise(9, 0.05)
    lr = lambda s: 3e-4 if s < 1000 else 3e-5  # noqa: E731
    a = run(range(3000), lambda s: (healthy(s) if s < 1000 else healthy(1000)) + n(), lr=lr)
    assert not a.reached("learning_rate", Status.DANGER)


def test_a_rising_loss_is_a_danger():
    n = noise(10, 0.02)
    a = run(range(2000), lambda s: healthy(s) + (0.002 * (s - 1500) if s > 1500 else 0) + n())
    assert a.reached("loss_trend", Status.DANGER)
    assert 1500 < a.worst[("loss_trend", "")].step < 1800  # windows of a quarter of the run


# --- the start of a run and the absolute range --------------------------------------


def test_the_initial_loss_of_a_run_from_scratch_is_explained_not_flagged():
    # A small GPT from scratch: ln(1000) = 6.9 at step 0, above 5 while it learns.
    a = run(range(400), lambda s: 2.0 + 4.9 * math.exp(-s / 150))
    assert not a.reached("loss_range")
    start = run(range(50), lambda s: 6.9 - s * 0.01)
    f = final(start, "loss_range")
    assert f.status is Status.GOOD and "= ln 992" in f.message and "healthy start" in f.message


def test_an_initial_loss_no_vocabulary_explains_is_a_warning():
    a = run(
        range(100, 700, 100),
        lambda s: {100: 284.9, 200: 161.2}.get(s, 5.0),
        evals={s: 15.0 / s * 100 for s in range(100, 700, 100)},
    )
    f = a.worst[("loss_range", "")].finding
    assert f.status is Status.WARNING and "initial loss 284.9" in f.message and "reduction" in f.fix


def test_a_high_loss_that_stopped_falling_is_out_of_range():
    n = noise(11, 0.02)
    a = run(range(3000), lambda s: 6.0 + n())
    assert final(a, "loss_range").status is Status.WARNING and "above 5" in final(a, "loss_range").message


def test_chance_level_is_named():
    n = noise(12, 0.001)
    a = run(range(0, 3000, 10), lambda s: math.log(4) + n(), profile="classification")
    f = final(a, "loss_range")
    assert f.status is Status.WARNING and "equals ln 4" in f.message and "uniformly over 4 classes" in f.message
    assert uniform_classes(math.log(4)) == 4 and uniform_classes(1.5) is None


def test_preference_and_rl_profiles():
    n = noise(13, 0.005)
    dpo = run(range(0, 3000, 10), lambda s: 0.6931 - 0.3 * (1 - math.exp(-s / 1000)) + n(), profile="preference")
    assert dpo.worst_status is Status.GOOD
    rl = run(range(2000), lambda s: 0.001 * math.sin(s) + n(), profile="rl")
    assert not any(f.known for f in rl.findings if f.check in ("loss_range", "loss_trend", "loss_volatility"))
    assert "label leakage" not in " ".join(f.fix for f in rl.findings)


# --- overfitting -------------------------------------------------------------------


def test_sustained_overfitting_stays_reported_to_the_end():
    evals = {1000 * k: v for k, v in enumerate([0.5, 0.321, 0.359, 0.394, 0.412, 0.420], start=0)}
    a = run(range(25, 5001, 25), lambda s: 0.3 * math.exp(-s / 800) + 0.0001, evals=evals)
    f = final(a, "overfitting")
    assert f.status is Status.WARNING and "31% above its best 0.321" in f.message
    assert len(changes(a, "overfitting")) == 1  # entered once, never left


def test_a_one_evaluation_blip_is_not_overfitting():
    evals = {500: 1.0, 1000: 0.9, 1500: 0.96, 2000: 0.85, 2500: 0.8}
    a = run(range(0, 2600, 10), lambda s: 2.0 * math.exp(-s / 1000) + 0.5, evals=evals)
    assert not a.reached("overfitting")


# --- non-finite values -------------------------------------------------------------


def test_while_the_loss_is_nan_the_loss_checks_cannot_judge():
    a = run(range(2000), lambda s: math.nan if s >= 1500 else 2.0 + 0.001 * math.sin(s), lr=lambda s: 1e-4)
    for check in ("loss_range", "loss_trend", "loss_volatility"):
        f = final(a, check)
        assert not f.known and "cannot judge" in f.message
    assert final(a, "nonfinite").status is Status.DANGER
    assert a.event_steps["nonfinite_loss"][0] == 1500


def test_a_loss_that_climbs_into_a_nan_is_named_a_divergence():
    """The finite records before the NaN say whether the run diverged into it (an LR too high:
    the cure is the LR) or one batch broke it: a climb well above where the loss was is a
    loss_trend danger, in a run that blew up within its first records as in a long one."""
    short = [5.47, 7.25, 8.04, 8.47, 8.18, 9.55, 9.52, 8.99]  # nanochat's SFT: NaN from the 9th step
    a = run(range(1, 40), lambda s: short[s - 1] if s <= len(short) else math.nan)
    f = final(a, "loss_trend")
    assert f.status is Status.DANGER and "diverged before it went non-finite" in f.message, f.message
    assert "(to step 8)" in f.message and "7.25" in f.message
    wobble = noise(3, 0.02)
    climb = run(range(3000), lambda s: math.nan if s >= 2900 else (2.0 + wobble() if s < 2800 else 3.0 + wobble()))
    f = final(climb, "loss_trend")
    assert f.status is Status.DANGER and "50% above" in f.message, f.message


def test_a_nan_out_of_a_steady_or_noisy_loss_names_no_divergence():
    """One bad batch in a healthy run, however noisy its per-step loss (a third of its level, as a
    small-batch SFT has), or a loss that went NaN while falling: the trend cannot be judged."""
    for seed in range(20):
        jitter = noise(seed, 0.35)
        noisy = run(range(600), lambda s, jitter=jitter: math.nan if s >= 560 else max(0.05, 1.0 + jitter()))
        assert not final(noisy, "loss_trend").known, (seed, final(noisy, "loss_trend").message)
    falling = run(range(1, 30), lambda s: math.nan if s > 20 else 5.0 - 0.1 * s)
    assert not final(falling, "loss_trend").known


def test_non_finite_values_never_enter_the_windows():
    history = History(T)
    for i in range(30):
        events = history.add_step(i, math.nan if i in (10, 11) else 2.0, grad_norm=math.inf if i == 11 else 1.0)
        assert events.nonfinite_loss == (i in (10, 11))
        assert events.nonfinite_grad == (i == 11)
    assert len(history.loss) == 28
    f = {f.check: f for f in diagnose(history)}["nonfinite"]  # two records, then 18 finite: isolated, recovered
    assert f.status is Status.WARNING and "isolated" in f.message and "recovered" in f.message


def test_non_finite_values_ongoing_or_repeated_are_a_danger_isolated_ones_a_warning():
    def status(values, grads=None):
        history = History(T)
        for i, v in enumerate(values):
            history.add_step(i, v, grad_norm=None if grads is None else grads[i])
        return {f.check: f for f in diagnose(history)}["nonfinite"].status

    loss = [2.0 + 0.01 * (i % 3) for i in range(40)]
    assert status(loss[:39] + [math.nan]) is Status.DANGER  # the latest loss: ongoing
    assert status([math.nan if i % 5 == 0 else v for i, v in enumerate(loss)]) is Status.DANGER  # repeated
    one_grad = [math.inf if i == 39 else 1.0 for i in range(40)]  # one fp16 overflow skip, the loss finite
    assert status(loss, one_grad) is Status.WARNING
    assert status(loss, [1.0] * 40) is Status.GOOD


def test_a_step_going_backwards_resets_the_windows():
    history = History(T)
    for i in range(100):
        history.add_step(i, 2.0)
    history.add_step(40, 2.0)
    assert len(history.loss) == 1


# --- hysteresis ----------------------------------------------------------------------


@pytest.mark.parametrize("enter, leave", [(2, 3)])
def test_hysteresis_enters_and_leaves_after_a_dwell(enter, leave):
    judge = Judge(T)
    h = judge.history
    statuses = []
    for i in range(1200):  # volatile from record 200 to 600 (the noise window is 200 records)
        v = 2.0 + (0.9 if (200 <= i < 600 and i % 2) else 0.0)
        h.add_step(i, v)
        if (i + 1) % 10 == 0:
            findings, _ = judge.judge(i)
            statuses.append(next(f.status for f in findings if f.check == "loss_volatility"))
    flips = sum(a != b for a, b in zip(statuses, statuses[1:]))
    assert flips <= 4 and max(statuses) >= Status.WARNING


def test_components_are_diagnosed_on_their_own():
    n = noise(14, 0.01)
    history = History(T.with_profile("multi-task"))
    judge = Judge(T.with_profile("multi-task"))
    history = judge.history
    for i in range(2000):
        history.add_step(i, 2.0, components={"lm": 2.0 * math.exp(-i / 500) + 0.6 + n(), "aux": 0.5 + 0.001 * i + n()})
    findings = {(f.check, f.component): f for f in diagnose(history)}
    assert findings[("loss_trend", "lm")].status is Status.GOOD
    assert findings[("loss_trend", "aux")].status is Status.DANGER


def test_a_jump_that_settles_at_a_worse_level_is_rising():
    # LR x100 at step 1000: the loss jumps to 8 and comes back down to 3, far above its best of 2.
    n = noise(15, 0.02)
    a = run(range(1600), lambda s: (2.0 if s < 1000 else 3.0 + 5.0 * math.exp(-(s - 1000) / 30)) + n())
    f = final(a, "loss_trend")
    assert f.status is Status.DANGER and "% above its best 1.99" in f.message, f.message
    assert "went wrong at step 1000" in f.message, f.message
    healthy_run = run(range(1600), lambda s: 2.0 + math.exp(-s / 300) + n())
    assert not healthy_run.reached("loss_trend", Status.DANGER)
