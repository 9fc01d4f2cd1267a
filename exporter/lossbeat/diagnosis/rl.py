"""An RL policy's health beside its reward spread: the ``rl_entropy`` and ``rl_kl`` checks.

* Entropy collapse: the policy's entropy (TRL's ``entropy``, verl's ``actor/entropy``, ...; the
  names are :data:`lossbeat.diagnosis.profiles.SIGNALS`') falls to ``rl_policy.entropy_collapse_fraction``
  of its early level (the first fifth of the run) while the reward stalls: the policy stopped
  exploring and stopped improving. Falling while the reward still rises is a warning.
* KL explosion: the KL to the reference above ``rl_policy.kl_bound`` nats per token, or grown
  ``rl_policy.kl_growth`` times over its early level: the policy left the reference.

Judged only with the ``rl`` profile (an SFT trainer logs a token entropy too, which falls as it
learns). The reward-spread collapse stays the ``learning`` check's (:mod:`lossbeat.diagnosis.learning`).
:func:`router_and_policy` adds these and the router check (:mod:`lossbeat.diagnosis.moe`) to a diagnosis.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lossbeat.diagnosis.findings import DANGER, GOOD, WARNING, Finding
from lossbeat.diagnosis.moe import check_moe_router

if TYPE_CHECKING:
    from lossbeat.diagnosis.history import History
    from lossbeat.diagnosis.profiles import SignalTrack
    from lossbeat.diagnosis.thresholds import Thresholds

__all__ = ["check_rl_entropy", "check_rl_kl", "router_and_policy", "reward_stalled"]

_FIX_ENTROPY = (
    "raise the sampling temperature, add an entropy bonus or clip-higher (DAPO's asymmetric clip), lower the "
    "learning rate, drop the KL coefficient's reference pull only if the KL is small, and look at the "
    "completions (one answer repeated?)"
)
_FIX_KL = (
    "raise the KL coefficient (beta), lower the learning rate, read the latest completions for reward "
    "hacking, and check that the reference model is the policy's starting point"
)


def reward_stalled(reward: SignalTrack | None, t: Thresholds) -> bool | None:
    """Whether the reward's last fifth is not above the fifth before it by ``loss.fall_min_z``
    standard errors (None: no reward, or too few records)."""
    if reward is None or reward.count < t.rl_policy.min_records:
        return None
    n0, m0, n1, m1 = reward.last_fifths()
    noise = reward.noise()
    if not (n0 and n1) or not math.isfinite(noise):
        return None
    se = noise * math.sqrt(1.0 / n0 + 1.0 / n1)
    return not (m1 - m0 > t.loss.fall_min_z * se)


def check_rl_entropy(history: History, t: Thresholds) -> Finding | None:
    entropy = history.signals.get("entropy")
    if entropy is None:
        return None
    p = t.rl_policy
    if entropy.count < p.min_records:
        return Finding.unknown("rl_entropy", f"{entropy.count} entropy records (judged from {p.min_records})")
    _, early, _, _ = entropy.ends()
    now = entropy.recent_median(10)
    if not (early > 0 and math.isfinite(now)):
        return Finding.unknown("rl_entropy", "no positive early entropy to compare with")
    ratio = now / early
    if ratio > p.entropy_collapse_fraction:
        return Finding("rl_entropy", GOOD, f"policy entropy {now:.4g}, {ratio:.0%} of its early {early:.4g}")
    what = (
        f"the policy's entropy fell to {now:.3g}, {ratio:.1%} of its early level {early:.3g} "
        f"(at most {p.entropy_collapse_fraction:.0%})"
    )
    stalled = reward_stalled(history.signals.get("reward"), t)
    if stalled:
        reward = history.signals["reward"]
        return Finding(
            "rl_entropy",
            DANGER,
            f"{what} while the reward stalls at {reward.recent_median(10):.4g}: the policy stopped exploring "
            "and stopped improving (entropy collapse)",
            _FIX_ENTROPY,
        )
    why = "no reward logged to tell whether it still improves" if stalled is None else "the reward still rises"
    return Finding("rl_entropy", WARNING, f"{what}; {why}", _FIX_ENTROPY)


def check_rl_kl(history: History, t: Thresholds) -> Finding | None:
    kl = history.signals.get("kl")
    if kl is None or kl.count < 2:
        return None
    p = t.rl_policy
    now = kl.recent_median(5)
    if now > p.kl_bound:
        return Finding(
            "rl_kl",
            DANGER,
            f"the KL to the reference is {now:.3g} nats per token, above {p.kl_bound:g}: the policy left the "
            "reference (reward hacking, or a learning rate too high)",
            _FIX_KL,
        )
    if kl.count < p.min_records:
        return Finding.unknown("rl_kl", f"KL {now:.3g} ({kl.count} records; its growth judged from {p.min_records})")
    _, early, _, _ = kl.ends()
    level = max(early, p.kl_early_floor) if math.isfinite(early) else p.kl_early_floor
    if now > p.kl_growth * level and now > p.kl_bound / 10:
        return Finding(
            "rl_kl",
            DANGER,
            f"the KL to the reference grew {now / level:.0f}x: {level:.3g} early in the run, {now:.3g} now "
            f"(above {p.kl_growth:g}x): the policy is leaving the reference",
            _FIX_KL,
        )
    return Finding("rl_kl", GOOD, f"KL to the reference {now:.3g} (early {level:.3g})")


def router_and_policy(history: History, t: Thresholds) -> list[Finding]:
    """The router finding (when expert loads were observed) and, with the ``rl`` profile, the policy's."""
    out = [check_moe_router(getattr(history, "moe", None), t.moe)]
    if t.profile.name == "rl":
        out += [check_rl_entropy(history, t), check_rl_kl(history, t)]
    return [f for f in out if f is not None]
