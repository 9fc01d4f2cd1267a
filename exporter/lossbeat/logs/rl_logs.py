"""Printed logs of RL post-training frameworks, read from their own print statements.

* ``openrlhf``: OpenRLHF's PPO / GRPO / REINFORCE++ trainer (``openrlhf/trainer/ppo_trainer.py``,
  since May 2025): after each global step it logs the step's status dict through its logger
  (``openrlhf/utils/logging_utils.py``: ``%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s``),
  ``✨ Global step {global_step}: {log_status}`` (the streaming async trainer without the ✨), in a
  Ray actor whose output Ray prefixes with ``(PPOTrainer pid=N)``. The dict is the actor's and the
  critic's ``fit()`` means over the step's micro-batches (its keys in set order), the rollout's
  statistics and timings. Read:

  - the loss: ``policy_loss`` (the actor's clipped policy-gradient loss);
  - the grad norm and LR: ``actor_grad_norm`` and ``actor_lr`` (the last micro-batch's);
  - the RL signals (:data:`lossbeat.diagnosis.profiles.SIGNALS`): ``entropy_loss`` is the policy's
    mean token entropy (``ppo_actor.py`` aggregates ``output.entropy``; logged when
    ``actor.entropy_coef`` is set), read as ``entropy``; ``kl`` (to the reference, the configured
    estimator), ``ppo_kl`` (old vs new policy), ``ppo_clip_ratio``, ``vllm_kl`` (the trainer against
    the inference engine), ``reward`` (the samples' mean reward; ``rollout/reward_mean`` when absent)
    and ``group_reward_std`` (the mean spread of a prompt's group, ``group_norm`` advantages) as
    ``reward_std``.

  What it cannot show: the progress bars' postfixes (``act_loss=...``, per micro-batch, drawn over
  each other) are not records and are skipped; the evaluation line holds pass rates, not a loss; a
  step before ``critic.freezing_steps`` has no ``policy_loss`` (its record has no loss, its signals
  are read); the logs of OpenRLHF before the status line existed print only progress bars.

* ``verl``: verl's console logger (``verl/utils/logger/aggregate_logger.py``, ``trainer.logger`` with
  ``console``): one ``step:N - key:value - ...`` line per step, each number printed with
  ``pprint.pformat`` (since July 2025; ``{v:.3f}`` before), so under numpy 2 the means
  ``reduce_metrics`` takes print as ``np.float64(0.323)``. Read:

  - the loss: ``actor/pg_loss`` (the policy-gradient loss; not the first ``*_loss`` in the line,
    which is often ``actor/kl_loss``, the KL term, or ``critic/vf_loss``, the value head's);
  - the grad norm and LR: ``actor/grad_norm``, ``actor/lr``;
  - the RL signals by their names (``actor/entropy``, ``actor/kl_loss``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac``, ``critic/score/mean``, ...); verl's old ``actor/entropy_loss`` (the
    entropy itself, positive) as ``entropy``.

  What it cannot show: a step whose actor did not update (``critic_warmup``) has no loss; the
  ``val-core/...`` lines hold accuracies, not a loss; with three decimals (before July 2025) an
  LR below 5e-4 prints as ``0.000`` and is not read (it is not zero), nor are KLs below 5e-4.
"""

from __future__ import annotations

import re

from lossbeat.diagnosis.profiles import is_signal
from lossbeat.logs.records import RecordBuilder
from lossbeat.logs.source import Source, text_lines
from lossbeat.logs.text_logs import _dict_items, _py_number

__all__ = ["OPENRLHF_STEP", "OPENRLHF_SIGNALS", "parse_openrlhf", "VERL_STEP", "parse_verl"]

OPENRLHF_STEP = re.compile(r"(?:^|\s|\])Global step (\d+): (\{.*\})\s*$")
"""OpenRLHF's status line (anywhere after the logger's and Ray's prefixes)."""

OPENRLHF_SIGNALS: dict[str, str] = {
    "entropy_loss": "entropy",  # the mean token entropy, positive, despite its name
    "kl": "kl",
    "ppo_kl": "ppo_kl",
    "ppo_clip_ratio": "ppo_clip_ratio",
    "vllm_kl": "vllm_kl",
    "reward": "reward",
    "group_reward_std": "reward_std",
}
"""OpenRLHF's status keys -> the names :data:`~lossbeat.diagnosis.profiles.SIGNALS` knows them by."""


def parse_openrlhf(src: Source, out: RecordBuilder) -> None:
    """One train record per status line; its step is the global step OpenRLHF prints."""
    steps = 0
    for line in text_lines(src, out):
        m = OPENRLHF_STEP.search(line)
        if m is None:
            out.skip("lines that are not status records (progress bars, samples, evaluations, banners)")
            continue
        step = int(m.group(1))
        items = _dict_items(m.group(2)[1:-1])
        out.field_names(items)  # the task profile is detected from them (policy_loss, kl, ppo_kl, ...)
        if "reward" not in items and "rollout/reward_mean" in items:
            items["reward"] = items["rollout/reward_mean"]
        for key, name in OPENRLHF_SIGNALS.items():
            if key in items:
                out.signal(step, name, _py_number(out, key, items[key]))
        steps += 1
        out.train(
            step,
            _py_number(out, "policy_loss", items.get("policy_loss")),
            _py_number(out, "actor_grad_norm", items.get("actor_grad_norm")),
            _py_number(out, "actor_lr", items.get("actor_lr")),
        )
    if steps:
        out.note(
            "OpenRLHF status lines: loss policy_loss, grad norm actor_grad_norm, LR actor_lr; "
            "entropy_loss read as the policy's entropy, group_reward_std as reward_std"
        )


VERL_STEP = re.compile(r"(?:^|\s)step:(\d+) - ([\w@/.()-]+:\S.*)$")
"""verl's console line (anywhere after Ray's ``(TaskRunner pid=N)`` prefix)."""
_VERL_ROUNDED_ZERO = re.compile(r"^-?0\.000$")


def parse_verl(src: Source, out: RecordBuilder) -> None:
    """One train record per step line whose actor updated (``actor/pg_loss``)."""
    rounded_lr = 0
    for line in text_lines(src, out):
        m = VERL_STEP.search(line)
        if m is None:
            out.skip("lines that are not step records (banners, warnings, progress)")
            continue
        step = int(m.group(1))
        items: dict[str, str] = {}
        for part in m.group(2).split(" - "):
            key, sep, value = part.rpartition(":")
            if sep and key:
                items[key.strip()] = value.strip()
        out.field_names(items)  # the task profile is detected from them (actor/entropy, actor/ppo_kl, ...)
        if "actor/pg_loss" not in items:
            out.skip("step lines without actor/pg_loss (validation, critic warm-up)")
            continue
        for key, text in items.items():
            name = "entropy" if key == "actor/entropy_loss" else key
            if is_signal(name) and not _VERL_ROUNDED_ZERO.match(text):
                out.signal(step, name, _py_number(out, key, text))
        lr = items.get("actor/lr")
        if lr is not None and _VERL_ROUNDED_ZERO.match(lr):
            lr, rounded_lr = None, rounded_lr + 1
        out.train(
            step,
            _py_number(out, "actor/pg_loss", items["actor/pg_loss"]),
            _py_number(out, "actor/grad_norm", items.get("actor/grad_norm")),
            _py_number(out, "actor/lr", lr),
        )
    if rounded_lr:
        out.note(f"actor/lr printed as 0.000 on {rounded_lr} lines (three decimals): not read")
