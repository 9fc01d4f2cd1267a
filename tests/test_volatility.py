"""Volatility judged against the noise the run itself had while healthy, and what it learned."""

from __future__ import annotations

import math
import random

from lossbeat.diagnosis import Judge, Status
from lossbeat.diagnosis.thresholds import load_thresholds


def _judge(levels, noise_of, seed: int = 3) -> tuple[dict[str, Status], dict[str, Status]]:
    """(worst status per check over the run, final status per check)."""
    judge = Judge(load_thresholds())
    r = random.Random(seed)
    worst: dict[str, Status] = {}
    findings = []
    for step, level in enumerate(levels):
        loss = level * max(0.05, 1.0 + noise_of(step) * r.gauss(0, 1))
        judge.history.add_step(step, loss, grad_norm=1.0, learning_rate=1e-5)
        if judge.due(step):
            findings, _ = judge.judge(step)
            for f in findings:
                worst[f.check] = max(worst.get(f.check, Status.GOOD), f.status)
    return worst, {f.check: f.status for f in findings}


def test_a_noisy_fine_tune_that_learns_is_not_a_danger():
    """SFT on small batches of variable-length samples: per-step noise a third of the level while
    the loss falls 1.9 -> 1.2 (real-logs-4's Gemma SFT): one noisy first record cannot show the fall,
    the first window's mean does; the noise is the run's own, a warning at most."""
    levels = [1.2 + 0.7 * math.exp(-s / 400) for s in range(2400)]
    worst, final = _judge(levels, lambda s: 0.33)
    assert worst["loss_volatility"] is not Status.DANGER
    assert final["learning"] is Status.GOOD


def test_noise_rising_well_above_its_own_earlier_level_is_a_danger():
    """The same loss, quiet for 1200 steps, then jumping around its level at 10x its early noise
    while it no longer falls: a danger."""
    levels = [1.2 + 0.7 * math.exp(-s / 200) if s < 1200 else 1.2 for s in range(2400)]
    _, final = _judge(levels, lambda s: 0.03 if s < 1200 else 0.4)
    assert final["loss_volatility"] is Status.DANGER
