"""Judgments that know the task: the profile from the fields, the learning check,
RL and preference signals, zero-inflated losses, late rises and rises near zero, the truth score."""

from __future__ import annotations

import math
import random

import pytest
from helpers.synthetic_logs import synthetic_log as _log

from lossbeat.analyze import judge_log
from lossbeat.analyze.evaluation import DATA
from lossbeat.analyze.replay import replay
from lossbeat.analyze.truth import score_dir, totals
from lossbeat.diagnosis import History, Status
from lossbeat.diagnosis.profiles import detect_profile
from lossbeat.diagnosis.thresholds import load_thresholds

T = load_thresholds()


def _final(a, check):
    return next(f for f in a.findings if f.check == check and not f.component)


@pytest.mark.parametrize(
    "fields, profile",
    [
        (["loss", "reward", "reward_std", "frac_reward_zero_std", "kl"], "rl"),
        (["loss", "rewards/chosen", "rewards/margins", "logps/chosen"], "preference"),
        (["loss", "eval_loss", "eval_wer"], "seq2seq"),
        (["loss", "eval_rouge-1"], "seq2seq"),
        (["loss", "eval_loss", "eval_accuracy", "eval_f1"], "classification"),
        (["loss", "eval_mnli_matthews_correlation"], "classification"),
        (["loss", "grad_norm", "learning_rate", "train/acc_0"], None),  # a draft model's own accuracy: not a classifier
        (["loss", "rewards/answer_reward/mean"], None),
    ],
)
def test_the_profile_is_named_from_the_fields(fields, profile):
    assert detect_profile(fields).profile == profile


def test_the_report_says_which_profile_and_why_and_a_given_one_wins():
    log = _log([0.0] * 30, fields=("loss", "reward", "reward_std"))
    fa = judge_log(log, T)
    assert fa.runs[0].profile == "rl" and "reward_std" in fa.runs[0].profile_reason
    given = judge_log(log, T.with_profile("classification"), given=True)
    assert given.runs[0].profile == "classification" and given.runs[0].profile_reason.endswith("(given)")


def test_an_rl_run_whose_reward_spread_collapsed_is_named_not_exploding_gradients():
    t = T.with_profile("rl")
    n = 200
    rng = random.Random(0)
    std = [(i, 0.5 if i < 100 else 0.0) for i in range(1, n + 1)]
    zero = [(i, 0.3 if i < 100 else 1.0) for i in range(1, n + 1)]
    reward = [(i, 1.0 + 0.01 * rng.random()) for i in range(1, n + 1)]
    grads = [0.1 if i < 100 else 1e-9 for i in range(n)]
    a = replay(
        _log(
            [0.0 if i >= 100 else rng.gauss(0, 1e-3) for i in range(n)],
            grads,
            {"reward_std": std, "frac_reward_zero_std": zero, "reward": reward},
        ),
        t,
    )
    f = _final(a, "learning")
    assert f.status is Status.DANGER and "learning signal collapsed" in f.message
    assert not a.reached("grad_norm", Status.DANGER) and a.counters["loss_spikes"] == 0


def test_an_rl_reward_that_does_not_improve_is_not_learning():
    t = T.with_profile("rl")
    rng = random.Random(1)
    reward = [(i, 1.8 + rng.gauss(0, 0.2)) for i in range(1, 201)]
    a = replay(_log([rng.gauss(0, 1e-6) for _ in range(200)], [0.08] * 200, {"reward": reward}), t)
    f = _final(a, "learning")
    assert f.status is Status.WARNING and "reward is not improving" in f.message
    rising = [(i, 1.0 + i / 100 + rng.gauss(0, 0.2)) for i in range(1, 201)]
    assert _final(replay(_log([0.0] * 200, [0.08] * 200, {"reward": rising}), t), "learning").status is Status.GOOD


def test_a_preference_run_at_ln_2_is_not_learning_preferences_not_volatile():
    t = T.with_profile("preference")
    rng = random.Random(2)
    losses = [math.log(2) + rng.gauss(0, 0.02) for _ in range(300)]
    acc = [(i, 0.5 + rng.gauss(0, 0.05)) for i in range(1, 301)]
    a = replay(_log(losses, [1.0] * 300, {"preference_accuracy": acc}), t)
    f = _final(a, "learning")
    assert f.status is Status.WARNING and f.message.startswith("not learning preferences")
    assert not a.reached("loss_volatility", Status.DANGER)


def test_a_loss_exactly_zero_with_zero_gradients_is_nothing_trained_not_memorisation():
    a = replay(_log([0.0] * 50, [0.0] * 50), T)
    f = _final(a, "learning")
    assert f.status is Status.DANGER and f.message.startswith("nothing is trained") and "detached" in f.message
    assert _final(a, "loss_range").status is not Status.DANGER


def test_a_loss_exactly_ln_v_with_non_finite_gradients_never_moves():
    v = math.log(128256)
    a = replay(_log([v] * 101, [math.inf] * 101), T)
    f = _final(a, "learning")
    assert f.status is Status.DANGER and "never moves" in f.message and "uniform prediction" in f.message


def test_chance_is_judged_within_the_losss_own_noise_not_a_fixed_tolerance():
    t = T.with_profile("classification")
    rng = random.Random(3)
    # Noisy per-step losses whose mean sits 0.8 % above ln 2 (a fixed 0.5 % misses it) ...
    noisy = [math.log(2) * 1.008 + rng.gauss(0, 0.05) for _ in range(600)]
    assert "at chance" in _final(replay(_log(noisy), t), "learning").message
    # ... while a quiet loss 0.8 % above ln 2 is not at chance: it is its own level.
    quiet = [0.5 + 0.5 * math.exp(-i / 50) + rng.gauss(0, 0.0005) for i in range(600)]
    assert "at chance" not in _final(replay(_log(quiet), t), "learning").message


def test_zero_inflated_losses_count_no_spikes():
    for profile in ("rl", "classification"):
        rng, h, spikes = random.Random(0), History(load_thresholds(profile=profile)), 0
        for step in range(1, 2001):
            loss = 0.0 if rng.random() < 0.6 else abs(rng.gauss(0, 0.01))
            spikes += h.add_step(step, loss, 0.5, 1e-6).spike
        assert spikes <= 2, (profile, spikes)


def test_a_converged_loss_near_zero_drifting_by_noise_is_not_diverging():
    t = T.with_profile("classification")
    rng = random.Random(4)
    losses = [
        0.010 * (1 + 0.5 * math.exp(-i / 500)) * (1 + 0.3 * rng.gauss(0, 1))
        + (0.0015 * (i - 8000) / 2000 if i > 8000 else 0.0)
        for i in range(10000)
    ]
    a = replay(_log(losses), t)
    assert not a.reached("loss_trend", Status.DANGER)


def test_a_late_regression_in_a_long_run_is_found_as_fast_as_an_early_one():
    rng = random.Random(5)

    def delay(start):
        losses = [
            2.0
            + 3.0 * math.exp(-i / 2000)
            + rng.gauss(0, 0.04)
            + (0.3 * min(1.0, (i - start) / 500) if i > start else 0.0)
            for i in range(start + 4000)
        ]
        a = replay(_log(losses, step0=0), T)
        first = next(
            (c.step for c in a.changes if c.finding.check == "loss_trend" and c.finding.status is Status.DANGER), None
        )
        assert first is not None
        return first - start

    assert delay(30000) <= 2500


def test_an_isolated_huge_spike_that_recovers_is_not_a_rising_loss():
    rng = random.Random(6)
    losses = [0.05 + rng.gauss(0, 0.002) for _ in range(1200)]
    losses[800] = 125.0
    a = replay(_log(losses), T.with_profile("regression"))
    assert not a.reached("loss_trend", Status.DANGER) and a.counters["loss_spikes"] >= 1


def test_messages_say_rose_or_fell_never_a_signed_flat():
    rng = random.Random(7)
    losses = [2.0 + 0.001 * rng.gauss(0, 1) for _ in range(2000)]
    f = _final(replay(_log(losses), T), "loss_trend")
    assert (
        "(+" not in f.message
        and "(-" not in f.message
        and ("rose" in f.message or "fell" in f.message or "unchanged" in f.message)
    )


REAL2 = DATA / "real-logs-2"


def test_the_score_against_the_independent_truth():
    scores = score_dir(REAL2)
    n = totals(scores)
    # Targets reached on real-logs-2 (docs/analyze.md lists what still fails and why).
    assert n["healthy_danger"] == 0 and n["healthy_pages"] == 0
    assert (
        n["healthy_flapping"] == 0
    )  # the TFT forecaster: regression named from val_MAE, its noisy val judged by its noise
    assert n["wrong_dangers"] == 0
    assert n["named"] == n["faults"] == 13
    assert n["read_in_full"] == n["files"] == 23
    by = {s.file: s for s in scores}
    assert by["hf-whisper-small-braj-lr3e-3-no-learning-trainer_state.json"].named == ["lr_problem", "no_learning"]
    assert by["hf-trl-grpo-telelogs-reward-flat-no-learning-trainer_state.json"].named == ["no_learning"]
    assert by["hf-distilbert-binary-classifier-near-chance-trainer_state.json"].named == ["no_learning"]
    assert by["hf-lora-sft-fp16-nan-gradnorm-skips-trainer_state.json"].worst == "warning"
    assert by["custom-fp16-pretrain-several-runs-overflow-train.log"].named == ["no_learning"]
    tft = next(s for f, s in by.items() if f.startswith("tensorboard-tft-"))
    assert tft.profile == "regression" and not tft.flapping


REAL3 = DATA / "real-logs-3"


def test_the_score_against_the_ground_truth_of_real_logs_3():
    """Scored against tests/data/truth/real-logs-3.json (its SOURCES.md's ground truth column)."""
    scores = score_dir(REAL3)
    n = totals(scores)
    assert n["files"] == n["read_in_full"] == 12 and n["unread"] == 0
    assert n["healthy_danger"] == 0 and n["healthy_pages"] == 0 and n["wrong_dangers"] == 0
    assert n["healthy_flapping"] == 0  # the medical LoRA's plateau episodes, the YOLO loss's range
    assert n["named"] == n["faults"] == 5
    by = {s.file: s for s in scores}
    vit = by["hf-vit-skin-cancer-10ep-overfit-trainer_state.json"]
    assert vit.named == ["overfitting"] and "no_learning" not in vit.found  # over-confidence, never "at chance"
    assert by["llamafactory-qwen2.5-7b-medical-lora-trainer_log.jsonl"].worst == "warning"  # its 3.5-sigma bump


REAL4 = DATA / "real-logs-4"


def test_the_score_against_the_truth_of_real_logs_4():
    """Scored against real-logs-4's truth.json: no healthy run reaches a danger (a noisy Gemma SFT whose
    per-step noise is a third of its level while it learns), no danger the truth rules out, and the
    faults named: among them a GRPO run printed by the Trainer (its reward spread collapsed), and a
    divergence that ends in NaN before it settles."""
    scores = score_dir(REAL4)
    n = totals(scores)
    assert n["files"] == n["read_in_full"] == 18 and n["unread"] == 0
    assert n["healthy_danger"] == 0 and n["healthy_pages"] == 0 and n["healthy_flapping"] == 0
    assert n["wrong_dangers"] == 0
    assert n["faults"] == n["named"] == 13
    by = {s.file: s for s in scores}
    grpo = by["hfstdout-strvalues-trl-grpo-reward-collapse-kaggle-vsr-new.log"]
    assert grpo.profile == "rl" and grpo.named == ["no_learning"]
    assert by["nanochat-stdout-d2-sft-diverges-then-nan-sft_run.log"].named == ["divergence", "nan"]
    gemma = next(s for f, s in by.items() if f.startswith("tensorboard-gemma4-"))
    assert gemma.worst == "warning" and "no_learning" not in gemma.found
    lora = by["hf-state-llama3-8b-lora-lr2e-3-gradexplosion-divergence-trainer_state.json"]
    assert {"divergence", "lr_problem"} <= set(lora.named)
