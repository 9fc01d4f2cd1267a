"""What kind of run this is, from the names of what it logs, and the signals each kind is judged by.

Most logs say what they are: ``eval_accuracy`` or ``eval_f1`` (classification),
``eval_wer`` or ``eval_rouge1`` (seq2seq), ``rewards/margins`` and ``logps/chosen``
(preference: DPO, ORPO, KTO, SimPO), ``reward_std`` and ``frac_reward_zero_std`` (RL:
GRPO, PPO, RLOO). :func:`detect_profile` names the profile and the fields it was
named from; a profile given by the user (``--profile``, ``MonitorConfig.profile``) wins.

:data:`SIGNALS` is the bounded set of named signals read beside the loss, from logs
and from ``Monitor.observe(metrics=...)``; :class:`SignalTrack` keeps each one's
whole run in fixed memory, for the checks of :mod:`lossbeat.diagnosis.learning`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from lossbeat.diagnosis.window import Ring, StepSummary, fsum, median, robust_noise

__all__ = [
    "RLThresholds",
    "ClassPriorThresholds",
    "Detection",
    "detect_profile",
    "SIGNALS",
    "is_signal",
    "signal_kind",
    "SignalTrack",
    "MAX_SIGNALS",
]

MAX_SIGNALS = 16
"""Named signals kept per run (bounded label cardinality live, bounded memory offline)."""

# Canonical signal -> the names logs give it (TRL, LLaMA-Factory, the HF Trainer, Lightning).
SIGNALS: dict[str, tuple[str, ...]] = {
    "reward": (
        "reward",
        "rewards/mean",
        "env/reward_mean",
        "objective/scores",
        "rollout/ep_rew_mean",
        "critic/score/mean",
    ),
    "reward_std": ("reward_std", "rewards/std", "env/reward_std"),
    "frac_reward_zero_std": ("frac_reward_zero_std", "zero_std_ratio"),
    "kl": ("kl", "objective/kl", "actor/kl_loss", "actor/reward_kl_penalty"),
    # The policy's entropy and its step-to-step change (TRL, verl, OpenRLHF, prime-rl; docs/diagnosis.md).
    "entropy": (
        "entropy",
        "actor/entropy",
        "objective/entropy",
        "policy/entropy_avg",
        "policy_entropy",
        "entropy/mean",
        "entropy/all/mean",
        "train/entropy",  # stable-baselines3's progress.csv (negated train/entropy_loss)
    ),
    "policy_kl": ("actor/ppo_kl", "ppo_kl", "policy/approxkl_avg", "approx_kl"),
    "clip_ratio": (
        "clip_ratio",
        "clip_ratio/region_mean",
        "actor/pg_clipfrac",
        "policy/clipfrac_avg",
        "ppo_clip_ratio",
    ),
    "mismatch_kl": ("mismatch_kl", "mismatch/mismatch_kl", "mismatch_kl/mean", "mismatch_kl/all/mean", "vllm_kl"),
    "margins": ("rewards/margins",),
    "preference_accuracy": ("rewards/accuracies",),
    "eval_accuracy": ("eval_accuracy", "val_acc", "val_accuracy", "eval_acc"),
    "eval_f1": ("eval_f1", "val_f1"),
    "eval_wer": ("eval_wer", "val_wer"),
    "eval_cer": ("eval_cer", "val_cer"),
}
_ALIAS = {alias: name for name, aliases in SIGNALS.items() for alias in aliases}

_CLASSIFICATION = re.compile(
    r"^(?:eval|val|test)_(?:.+_)?(?:accuracy|acc|f1|matthews_correlation|mcc|auc|roc_auc|"
    r"precision|recall|balanced_accuracy)$"
)
_SEQ2SEQ = re.compile(
    r"^(?:eval|val|test|predict)_(?:.+_)?(?:wer|cer|rouge[-_]?\w*|bleu|sacrebleu|meteor|chrf|gen_len)$"
)
# Regression and forecasting report an error metric beside the loss (Lightning's val_MAE, pytorch-forecasting's
# val_SMAPE, a hydrology model's val_mse or val_nse): their loss is on the data's own scale, with no absolute
# range and no level to be "suspiciously low" against (a quantile loss of 0.03 is a good forecast, not a
# memorised LM). Case-insensitive: torchmetrics-style names are upper case.
_REGRESSION = re.compile(
    r"^(?:eval|val|valid|validation|test)[_/](?:.+_)?(?:mae|mse|rmse|msle|rmsle|mape|smape|wape|"
    r"r2|r2_score|nse|kge|mase)$",
    re.IGNORECASE,
)
_PREFERENCE = frozenset(
    {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "kto/rewards",
        "odds_ratio_loss",
    }
)
_RL = frozenset(
    {
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "zero_std_ratio",
        "kl",
        "clip_ratio",
        "objective/kl",
        "env/reward_mean",
        "env/reward_std",
        "objective/scores",
        "advantages",
        "critic/score/mean",
        "actor/entropy",
        "actor/kl_loss",
        "actor/ppo_kl",
        "actor/pg_clipfrac",
        "ppo_kl",
        "mismatch_kl",
        "mismatch_kl/mean",
        "vllm_kl",
        # Actor-critic (PPO) logs name the policy's and the value head's losses apart
        # (DeepSpeed-Chat, OpenRLHF, CleanRL, stable-baselines): no supervised run does.
        "act_loss",
        "actor_loss",
        "cri_loss",
        "critic_loss",
        "policy_loss",
        "value_loss",
        "vf_loss",
        "pg_loss",
        "policy_gradient_loss",
    }
)
_RL_PREFIXES = ("completions/", "clip_ratio/")


@dataclass(frozen=True)
class RLThresholds:
    """When an RL run's learning signal has collapsed (the ``learning`` check and TrainingRLSignalCollapsed)."""

    reward_std_zero: float
    """``reward_std`` at or below this: every completion of a group got the same reward."""
    zero_std_fraction: float
    """``frac_reward_zero_std`` at or above this: (nearly) every group is without spread."""
    collapse_records: int
    """Records in a row (the diagnosis) that must all say so: one such step is a group all solved or all failed."""
    grad_collapse_ratio: float
    """A grad norm at or below this fraction of the run's earlier level on each of those records: collapsed."""
    kl_floor: float
    """A KL below this (nats) is small, whatever its growth."""
    kl_growth: float
    """The KL's last fifth of the run above this x the fifth before it: it runs away."""


@dataclass(frozen=True)
class ClassPriorThresholds:
    """When a binary classifier predicts its class prior (the ``learning`` check, :mod:`lossbeat.diagnosis.prior`)."""

    z: float
    """Standard errors: an accuracy that rose, or an eval loss that fell below the prior's entropy, by more learned."""
    min_eval_examples: int
    """Fewer eval examples (recovered from the accuracies) are not judged: the band covers most of [0, 1]."""
    max_eval_examples: int
    """The largest eval set size looked for as the accuracies' common denominator."""
    loss_spread_floor: float
    """Per-example spread (nats) of the log loss, at least: a prior near 0.5 has none, a model near it some."""


def signal_kind(name: str) -> str | None:
    """The canonical signal a logged name stands for (None: not one of :data:`SIGNALS`)."""
    return _ALIAS.get(name)


def is_signal(name: str) -> bool:
    return name in _ALIAS


@dataclass(frozen=True)
class Detection:
    profile: str | None
    """The profile the fields name (None: nothing says; the default profile applies)."""
    fields: tuple[str, ...] = ()
    """The fields it was named from."""

    def describe(self, chosen: str, given: bool = False) -> str:
        if given:
            return f"profile {chosen} (given)"
        if self.profile is None:
            return f"profile {chosen} (the default: no field names a task)"
        shown = ", ".join(self.fields[:4]) + (", ..." if len(self.fields) > 4 else "")
        return f"profile {chosen} (detected from the fields {shown})"


def detect_profile(fields: Iterable[str]) -> Detection:
    """RL before preference (both log rewards) before seq2seq before classification before
    regression (an error metric such as ``val_MAE``); else None."""
    names = [f for f in fields if isinstance(f, str)]
    rl = [f for f in names if f in _RL or f.startswith(_RL_PREFIXES)]
    # A reward alone (e.g. a reward model's own log) is not RL: a reward and its spread, or a KL, is.
    actor_critic = {"act_loss", "actor_loss", "policy_loss", "pg_loss", "policy_gradient_loss"} & set(rl) and {
        "cri_loss",
        "critic_loss",
        "value_loss",
        "vf_loss",
    } & set(rl)  # a policy loss and a value loss
    if (
        actor_critic
        or any(
            f in ("reward_std", "frac_reward_zero_std", "zero_std_ratio", "env/reward_std", "objective/kl", "kl")
            or f
            in (
                "actor/entropy",
                "actor/kl_loss",
                "actor/ppo_kl",
                "actor/pg_clipfrac",
                "ppo_kl",
                "mismatch_kl",
                "vllm_kl",
            )
            or f == "mismatch_kl/mean"
            for f in rl
        )
        or (rl and any(f.startswith(_RL_PREFIXES) for f in rl))
    ):
        return Detection("rl", tuple(rl))
    pref = [f for f in names if f in _PREFERENCE]
    if pref:
        return Detection("preference", tuple(pref))
    seq = [f for f in names if _SEQ2SEQ.match(f)]
    if seq:
        return Detection("seq2seq", tuple(seq))
    # A token accuracy (TRL's SFT logs eval_mean_token_accuracy) is a language model's, not a classifier's.
    cls = [f for f in names if _CLASSIFICATION.match(f) and "token" not in f]
    if cls:
        return Detection("classification", tuple(cls))
    reg = [f for f in names if _REGRESSION.match(f)]
    if reg:
        return Detection("regression", tuple(reg))
    return Detection(None)


class SignalTrack:
    """One named signal over the whole run: fixed memory (a step summary and a ring)."""

    def __init__(self, blocks: int = 64, recent: int = 50) -> None:
        self.summary = StepSummary(blocks)
        self.recent = Ring(recent)
        self.first = math.nan
        self.count = 0
        self.zeros = 0

    def push(self, step: int, value: float) -> None:
        if not math.isfinite(value):
            return
        if self.count == 0:
            self.first = value
        self.count += 1
        self.zeros += value == 0.0
        self.summary.push(step, value)
        self.recent.push(value)

    @property
    def latest(self) -> float:
        return self.recent.back(0) if len(self.recent) else math.nan

    def recent_median(self, n: int = 10) -> float:
        return median(self.recent.last(n))

    def mean(self) -> float:
        """The mean over the whole run."""
        n = len(self.summary)
        return fsum(b[2] for b in self.summary.blocks) / n if n else math.nan

    def noise(self) -> float:
        return robust_noise(self.recent.last(len(self.recent)))

    def best_until(self, step: float, higher: bool) -> float:
        """The best block mean (highest when ``higher``) among the blocks that start by ``step``."""
        means = [b[2] / b[1] for b in self.summary.blocks if b[0] <= step and b[1]]
        if not means:
            return math.nan
        return max(means) if higher else min(means)

    def last_fifths(self) -> tuple[int, float, int, float]:
        """(count, mean) of the fifth of the steps seen before the last fifth, and of the last."""
        s = self.summary
        last = s.last_step
        if s.first_step is None or last is None:  # set together by the summary's first record
            return 0, math.nan, 0, math.nan
        width = max(1.0, 0.2 * s.span)
        n0, m0 = s.window(last - 2 * width, last - width)
        n1, m1 = s.window(last - width, last)
        return n0, m0, n1, m1

    def ends(self, fraction: float = 0.2) -> tuple[int, float, int, float]:
        """(count, mean) of the first and of the last ``fraction`` of the steps seen."""
        s = self.summary
        first, last = s.first_step, s.last_step
        if first is None or last is None:  # set together by the summary's first record
            return 0, math.nan, 0, math.nan
        width = max(1.0, fraction * s.span)
        n0, m0 = s.window(first - 1, first + width)
        n1, m1 = s.window(last - width, last)
        return n0, m0, n1, m1
