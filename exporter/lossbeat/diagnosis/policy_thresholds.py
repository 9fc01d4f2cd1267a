"""The thresholds of the router and policy checks: ``moe`` (mixture-of-experts routers) and
``rl_policy`` (an RL policy's entropy and KL) in ``thresholds.yaml``.

Parsed by :mod:`lossbeat.diagnosis.thresholds` with its own validators (passed in: this module
imports nothing of it), so a bad value is a ``ThresholdsError`` naming its key like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypedDict

__all__ = ["MoEThresholds", "RLPolicyThresholds", "PolicyThresholds", "parse_policy"]


@dataclass(frozen=True)
class MoEThresholds:
    """When a mixture-of-experts router has collapsed (the ``moe_router`` check, TrainingMoERouterCollapse)."""

    dead_window_steps: int
    """Observed steps without a token after which an expert is dead (``training_moe_dead_experts``)."""
    imbalance_max: float
    """Tokens of the busiest expert over the mean per expert above this: collapsed (capacity factors' basis)."""
    dead_fraction: float
    """Dead experts as a fraction of a layer's, at or above this: collapsed."""
    collapse_diagnoses: int
    """Diagnoses in a row that must all find the same layer past a bound."""
    for_: str
    """How long the alert waits (the thresholds file's ``for``)."""


@dataclass(frozen=True)
class RLPolicyThresholds:
    """When an RL policy's entropy collapsed or its KL to the reference exploded
    (the ``rl_entropy`` and ``rl_kl`` checks, TrainingRLEntropyCollapse, TrainingRLKLExploded)."""

    entropy_collapse_fraction: float
    """The recent entropy at or below this fraction of its early level: collapsed."""
    min_records: int
    """Records of a signal before it is judged."""
    kl_bound: float
    """A KL to the reference (nats per token) above this: exploded."""
    kl_growth: float
    """... or grown by this factor over its early level (and above ``kl_bound / 10``)."""
    kl_early_floor: float
    """The early KL level is at least this (the KL starts at exactly 0)."""
    entropy_for: str
    kl_for: str


class PolicyThresholds(TypedDict):
    """The two sections :func:`parse_policy` returns, keyed as ``Thresholds``' fields."""

    moe: MoEThresholds
    rl_policy: RLPolicyThresholds


def parse_policy(
    doc: Mapping[str, Any],
    section: Callable[[Mapping[str, Any], str], Mapping[str, Any]],
    number: Callable[..., Any],
    durations: Callable[[Mapping[str, Any], str, tuple[str, ...]], dict[str, str]],
    error: type[Exception],
) -> PolicyThresholds:
    """``{"moe": MoEThresholds, "rl_policy": RLPolicyThresholds}`` from the merged document."""
    moe = section(doc, "moe")
    _known(moe, "moe", ("dead_window_steps", "imbalance_max", "dead_fraction", "collapse_diagnoses", "for"), error)
    fraction = number(moe, "dead_fraction", "moe")
    if not fraction <= 1:
        raise error(f"moe.dead_fraction: expected a fraction of a layer's experts (at most 1), got {fraction!r}")
    imbalance = number(moe, "imbalance_max", "moe")
    if not imbalance > 1:
        raise error(f"moe.imbalance_max: expected a ratio above 1 (1 is a uniform load), got {imbalance!r}")
    rl = section(doc, "rl_policy")
    keys = ("entropy_collapse_fraction", "min_records", "kl_bound", "kl_growth", "kl_early_floor")
    _known(rl, "rl_policy", keys + ("entropy_for", "kl_for"), error)
    collapse = number(rl, "entropy_collapse_fraction", "rl_policy")
    if not collapse < 1:
        raise error(f"rl_policy.entropy_collapse_fraction: expected a fraction below 1, got {collapse!r}")
    return {
        "moe": MoEThresholds(
            dead_window_steps=number(moe, "dead_window_steps", "moe", integer=True),
            imbalance_max=imbalance,
            dead_fraction=fraction,
            collapse_diagnoses=number(moe, "collapse_diagnoses", "moe", integer=True),
            for_=durations(moe, "moe", ("for",))["for"],
        ),
        "rl_policy": RLPolicyThresholds(
            entropy_collapse_fraction=collapse,
            min_records=number(rl, "min_records", "rl_policy", integer=True),
            kl_bound=number(rl, "kl_bound", "rl_policy"),
            kl_growth=number(rl, "kl_growth", "rl_policy"),
            kl_early_floor=number(rl, "kl_early_floor", "rl_policy"),
            **durations(rl, "rl_policy", ("entropy_for", "kl_for")),
        ),
    }


def _known(doc: Mapping[str, Any], where: str, keys: tuple[str, ...], error: type[Exception]) -> None:
    unknown = set(doc) - set(keys)
    if unknown:
        raise error(f"{where}.{sorted(unknown)[0]}: unknown key")
