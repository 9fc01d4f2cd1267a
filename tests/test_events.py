"""Loss spikes and grad-norm explosions as findings (lossbeat.diagnosis.events): isolated and
recovered is a warning that holds, repeated or followed by a lasting worse loss is a danger, a
long run's sparse events do not make the status come and go."""

from __future__ import annotations

import random

from lossbeat.diagnosis import Judge, Status
from lossbeat.diagnosis.thresholds import load_thresholds


def judge(loss, steps: int = 1500, grad=None, seed: int = 1):
    """(step, status, message) of each change of the two event checks, and the final findings."""
    j = Judge(load_thresholds())
    rnd = random.Random(seed)
    changes = []
    for s in range(steps):
        j.history.add_step(s, loss=loss(s, rnd), grad_norm=grad(s) if grad else None)
        if j.due(s):
            _, ch = j.judge(s)
            changes += [
                (s, c.finding.check, c.finding.status, c.finding.message)
                for c in ch
                if c.finding.check in ("loss_spikes", "grad_explosions")
            ]
    return changes, {f.check: f for f in j.findings}


def entries(changes, check: str) -> int:
    """How many times the check entered a worse status (what the evaluation counts as flapping)."""
    order, n, last = [Status.GOOD, Status.WARNING, Status.DANGER], 0, Status.GOOD
    for _, c, status, _ in changes:
        if c == check:
            n += order.index(status) > order.index(last)
            last = status
    return n


def test_an_isolated_recovered_spike_is_a_warning_that_says_so_then_a_note():
    changes, final = judge(lambda s, r: (4.0 if s == 600 else 2.0) + r.gauss(0, 0.02))
    spikes = [c for c in changes if c[1] == "loss_spikes"]
    assert [c[2] for c in spikes] == [Status.WARNING, Status.GOOD]
    assert "1 isolated loss spike" in spikes[0][3] and "step 600" in spikes[0][3]
    assert final["loss_spikes"].status is Status.GOOD and "step 600" in final["loss_spikes"].message


def test_a_spike_followed_by_a_lasting_worse_loss_is_a_danger():
    changes, _ = judge(lambda s, r: (4.0 if s == 600 else 2.5 if s > 600 else 2.0) + r.gauss(0, 0.02))
    danger = [c for c in changes if c[1] == "loss_spikes" and c[2] is Status.DANGER]
    message = danger[0][3] if danger else ""
    assert ("followed by a worse loss" in message or "never came back to its level" in message) and "1.99" in message


def test_an_explosion_followed_by_a_worse_loss_is_a_danger():
    changes, _ = judge(
        lambda s, r: 2.0 + (0.6 if s > 600 else 0.0) + r.gauss(0, 0.02), grad=lambda s: 80.0 if s == 600 else 1.0
    )
    assert any(c[1] == "grad_explosions" and c[2] is Status.DANGER and "step 600" in c[3] for c in changes)


def test_repeated_spikes_are_a_danger_unless_the_loss_recovers():
    burst = (600, 610, 620)
    changes, _ = judge(lambda s, r: (4.0 if s in burst else 2.2 if s > 620 else 2.0) + r.gauss(0, 0.02))
    assert any(c[2] is Status.DANGER and "repeated, and the loss did not recover" in c[3] for c in changes)
    changes, _ = judge(lambda s, r: (4.0 if s in burst else 2.0) + r.gauss(0, 0.02))
    assert Status.DANGER not in [c[2] for c in changes]
    assert any(c[2] is Status.WARNING for c in changes)


def test_a_level_drop_after_a_spike_is_not_damage():
    # A new epoch's drop: the level after the spike is lower, never "worse".
    changes, _ = judge(lambda s, r: (4.0 if s == 600 else 1.5 if s > 620 else 2.0) + r.gauss(0, 0.02))
    assert Status.DANGER not in [c[2] for c in changes if c[1] == "loss_spikes"]


def test_the_level_wandering_within_its_noise_is_not_damage():
    # A noisy loss (sigma 17 % of the level, as a memorising LoRA run's per-step loss) whose
    # 50-record medians wander by their standard error: a spike is not followed by "worse".
    for seed in range(5):
        changes, _ = judge(lambda s, r: (1.0 if s == 600 else 0.14) + r.gauss(0, 0.024), seed=seed)
        assert Status.DANGER not in [c[2] for c in changes if c[1] == "loss_spikes"], seed


def test_sparse_spikes_in_a_long_run_do_not_flap():
    # A spike every 300 records for 6000 records, each absorbed: one warning, then notes.
    changes, final = judge(lambda s, r: (4.0 if s % 300 == 250 else 2.0) + r.gauss(0, 0.02), steps=6000)
    assert entries(changes, "loss_spikes") == 1
    f = final["loss_spikes"]
    assert f.status is Status.GOOD and "own pattern" in f.message and "so far" in f.message
