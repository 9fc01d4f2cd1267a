"""The thresholds file: typed, validated, one source for diagnosis, rules and dashboards.

``load_thresholds()`` reads the packaged ``thresholds.yaml`` (or a user's file, which may override any subset
of keys) and returns a frozen :class:`Thresholds`. A bad file raises :class:`ThresholdsError` naming the offending key.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, Mapping, TypeVar, overload

import yaml

from lossbeat.diagnosis.event_thresholds import EventThresholds
from lossbeat.diagnosis.policy_thresholds import MoEThresholds, RLPolicyThresholds, parse_policy
from lossbeat.diagnosis.profiles import ClassPriorThresholds, RLThresholds

__all__ = ["Thresholds", "Profile", "ThresholdsError", "load_thresholds", "DEFAULT_PATH"]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_PATH = "thresholds.yaml"  # package data of ``lossbeat``
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
# Every window is a ring buffer allocated in full at start-up (and one per loss component): a typo like
# 10000000000 must be an error here, not a MemoryError in the training script.
MAX_WINDOW_STEPS = 100_000


class ThresholdsError(ValueError):
    """A thresholds file is malformed; the message names the key."""


@dataclass(frozen=True)
class Windows:
    cv_steps: int
    """Steps in the loss coefficient-of-variation window."""
    trend_steps: int
    """Steps in each half of the trend comparison (recent vs previous)."""
    range_steps: int
    """Steps averaged for the absolute loss-range check."""
    grad_steps: int
    """Records averaged for the raw grad-norm mean (dashboards)."""
    noise_records: int
    """Records in the robust noise window (volatility, spikes)."""
    trend_min_steps: int
    """Minimum steps in each half of the judged trend comparison."""
    trend_fraction: float
    """Each trend window spans this fraction of the steps seen so far (in steps, not records)."""
    trend_min_records: int
    """Records each trend window must hold before the trend is judged."""
    rise_max_steps: int
    """A rise is also looked for over windows of at most this many steps (late in a long run)."""
    baseline_records: int
    """Finite grad norms (records) in the rolling baseline."""
    baseline_min_records: int
    """Grad norms needed before the baseline judges anything (the first steps of a run)."""
    summary_blocks: int
    """Blocks of the whole-run loss summary (even, >= 4)."""
    diagnose_every: int
    """The diagnosis runs every N observed steps."""


@dataclass(frozen=True)
class LossThresholds:
    trend_improving: float
    """Trend ratio above which the loss is falling well."""
    trend_rising: float
    """Trend ratio below which the loss is rising (danger)."""
    trend_min_z: float
    trend_danger_z: float
    """A rise counts only beyond this many standard errors of the step-to-step noise."""
    cv_warning: float
    """Loss CV at or above which volatility is a warning."""
    cv_danger: float
    """Loss CV at or above which volatility is dangerous."""
    plateau_max_fall: float
    """A relative fall across the trend windows below this (or not significant) is a plateau."""
    fall_min_z: float
    """A fall counts only beyond this many standard errors of the noise."""
    regress_max: float
    """The recent window this fraction above the run's best window (and significantly) is rising."""
    spike_sigma: float
    """A loss above the recent median + spike_sigma robust noise std is a spike."""
    spike_min_rise: float
    """... and at least this fraction above the median."""
    spike_min_steps: int
    """Finite losses needed before spikes are called."""
    range_after_steps: int
    """Steps after the first before the absolute range is judged (unless the loss stopped falling)."""


@dataclass(frozen=True)
class GradientThresholds:
    explosion: float
    """Absolute ceiling: a norm above it counts as an explosion event when also ceiling_ratio x the baseline."""
    ceiling_ratio: float
    """Departure from the baseline a norm above the ceiling needs to count."""
    jump_ratio: float
    """A norm above jump_ratio x the baseline median is an explosion event."""
    climb_ratio: float
    """The recent median above climb_ratio x the run's slow level is a sustained climb."""
    climb_half_life_steps: float
    """Steps in which the slow level may rise by half of itself (it follows drifts, not climbs)."""
    vanishing: float
    """Global grad norm below which gradients vanish."""
    healthy_low: float
    """Lower edge of the healthy grad-norm band."""
    healthy_high: float
    """Upper edge of the healthy grad-norm band."""
    layer_explosion: float
    """A layer's grad norm above which that layer explodes."""
    layer_vanishing: float
    """A layer's grad norm below which that layer vanishes."""
    # A layer's grad norm below this fraction of its own earlier level (and below layer_vanishing) ...
    layer_vanished_drop: float
    # ... at this many diagnoses in a row: the layer stopped learning (danger).
    layer_vanished_diagnoses: int
    loss_scale_min: float
    """fp16 loss scaling: a GradScaler scale below this means nearly every step overflows."""


@dataclass(frozen=True)
class LearningRateThresholds:
    too_small: float
    """LR below which, with little loss decrease, the LR is too small."""
    too_small_min_decrease: float
    """Minimum relative loss decrease over ``too_small_window`` steps."""
    too_small_window: int
    """Steps over which the loss decrease is measured."""
    too_large: float
    """LR above which, with a volatile loss, the LR is too large."""
    too_large_cv: float
    """Loss CV above which a large LR is flagged."""
    warmup_check_step: int
    """Observed step at which the warmup check compares against the first loss."""
    warmup_max_ratio: float
    """Loss at the check step above this fraction of the first loss: warmup insufficient."""
    decayed_fraction: float
    """LR below this fraction of its peak, after a gradual decay: the end of the schedule."""
    gradual_min_fraction: float
    """The decay from half the peak to ``decayed_fraction`` took at least this fraction of the steps before it."""
    # An LR that falls in one record from near its peak to this fraction of it or less has collapsed.
    collapse_fraction: float


@dataclass(frozen=True)
class OverfittingThresholds:
    eval_rise: float
    """Relative rise of the eval loss over its best that counts as overfitting."""
    evals: int
    """Evaluations in a row above that rise before it is overfitting."""
    noise_z: float  # ... each above the best by more than this many of the evaluations' own robust noise


@dataclass(frozen=True)
class Hysteresis:
    warning_enter: int
    """Diagnoses in a row that say warning (or worse) before a check enters warning."""
    danger_enter: int
    """Diagnoses in a row that say danger before a check enters danger."""
    leave: int
    """Diagnoses in a row that say better before a check leaves its status."""
    release: float
    """A value must fall below release x the threshold it crossed before its status may leave."""


@dataclass(frozen=True)
class MemoryThresholds:
    near_limit: float
    """Peak allocated / device total above which an OOM is near."""
    growth_fraction: float
    """Growth over ``window``, as a fraction of the device total, that counts as a leak ..."""
    window: str
    """... over this Prometheus duration ..."""
    oom_horizon: str
    """... when the trend would reach the limit within this duration."""
    near_limit_for: str
    """How long the near-limit condition holds before its alert fires."""
    growing_for: str
    """How long the growth condition holds before its alert fires."""
    samples: int
    """Memory samples (one per diagnosis) in the live check's slope window."""
    warmup_samples: int
    """Samples skipped at the start of a run (allocation of weights and optimizer state)."""
    # Steady growth (three thirds rising, no plateau) by this fraction of the first third's level: a leak.
    leak_growth: float
    # Samples (after the warm-up) before the steady-growth judgment.
    leak_min_samples: int


@dataclass(frozen=True)
class ThroughputThresholds:
    drop_fraction: float
    """Steps/s below this fraction of the run's own median is a drop."""
    rate_window: str
    """Prometheus: the steps/s compared is a rate over this window."""
    baseline: str
    """Prometheus: window of the median the current rate is compared with."""
    for_: str
    """Prometheus: how long the drop holds before the alert fires (key ``for``)."""
    steps: int
    """Live check: step times per block; a block's median is one throughput sample."""
    baseline_blocks: int
    """Live check: the run's level is the median of this many normal blocks."""
    warmup_steps: int
    """Live check: steps ignored at the start (compilation, warm-up)."""
    # Live check: steps/s below this fraction of the run's level in ``danger_blocks`` blocks in a row: danger.
    danger_fraction: float
    # Live check: slow blocks in a row before a several-fold drop is a danger.
    danger_blocks: int


@dataclass(frozen=True)
class ScheduleThresholds:
    tolerance: float
    """Relative difference between the observed and the declared LR that counts as a departure."""
    consecutive: int
    """Departures in a row before the schedule check warns."""


@dataclass(frozen=True)
class Profile:
    name: str
    """Task profile name (causal-lm, classification, regression, multi-task, preference, rl)."""
    loss_good: tuple[float, float] | None
    """Healthy loss range, or None when the task has no absolute scale."""
    loss_warn_low: float | None
    """Mean loss below which it is suspiciously low (leakage, memorisation)."""
    loss_warn_high: float | None
    """Mean loss above which it is too high."""
    loss_init_high: float | None = None
    """Initial loss above which the initialisation, labels or loss reduction are broken."""
    volatility_floor: float | None = None
    """Level under the volatility ratio when the loss is below it; None: no volatility ratio."""
    trend: bool = True
    """Whether the loss is meant to fall (False for RL policy losses)."""


@dataclass(frozen=True)
class AlertSettings:
    runbook_url: str
    """Base URL of the runbooks; each alert links ``runbook_url#alertname``."""
    event_window: str
    explosion_for: str
    explosion_events: int
    vanishing_for: str
    layer_for: str
    diverging_for: str
    plateau_for: str
    volatile_for: str
    spikes_events: int
    spikes_window: str
    out_of_range_for: str
    overfitting_for: str
    learning_rate_for: str
    stalled_after: str
    stalled_phase_after: str
    """Stall limit inside an evaluation or checkpoint phase (``Monitor.phase``)."""
    exporter_down_for: str
    loss_scale_for: str
    rank_down_for: str
    loss_spread_for: str
    straggler_for: str
    grad_mismatch_for: str
    nonfinite_events: int
    """Non-finite steps within ``event_window`` that page; fewer (with a finite value now) are a ticket."""
    rl_collapse_for: str
    guard_window: str
    """Window over which the optimizer guard's skips are counted (a ticket, or a page past ``guard.page_skips``)."""


@dataclass(frozen=True)
class CrossRankThresholds:
    loss_spread_z: float
    """A rank's robust z-score (0.6745 * (x - median) / MAD over the job's ranks) beyond which its loss departs."""
    loss_spread_min_relative: float
    """...and its departure from the job's median loss must exceed this fraction of that median."""
    min_ranks: int
    """Ranks a job needs before the loss spread or stragglers are judged."""
    straggler_ratio: float
    """A rank whose mean work time exceeds this multiple of the job's median is a straggler."""
    straggler_min_seconds: float
    """...and exceeds the median by at least this many seconds."""
    grad_norm_rtol: float
    """Relative tolerance between the replicas' step-aligned gradient norms."""


@dataclass(frozen=True)
class GuardThresholds:
    max_consecutive: int
    """Skips in a row after which ``guard="skip"`` stops the run (a fault that persists is not one bad batch)."""
    page_skips: int
    """Skips within ``alerts.guard_window`` that page (TrainingSkippingRepeatedly); fewer are a ticket."""
    accept_level_after: int
    """Explosions skipped in a row with a healthy loss after which their gradient-norm level becomes the baseline."""


@dataclass(frozen=True)
class Thresholds:
    profile: Profile
    """The active task profile."""
    profiles: Mapping[str, Profile]
    """Every profile the file defines."""
    windows: Windows
    loss: LossThresholds
    gradients: GradientThresholds
    learning_rate: LearningRateThresholds
    overfitting: OverfittingThresholds
    hysteresis: Hysteresis
    alerts: AlertSettings
    memory: MemoryThresholds
    throughput: ThroughputThresholds
    lr_schedule: ScheduleThresholds
    cross_rank: CrossRankThresholds
    guard: GuardThresholds
    events: EventThresholds
    rl: RLThresholds
    class_prior: ClassPriorThresholds
    moe: MoEThresholds
    rl_policy: RLPolicyThresholds
    source: str = field(default="<package>", compare=False)
    """Where the values came from (for error messages and the run info)."""
    profile_named: bool = field(default=True, compare=False)
    """Whether the task was named (a profile given, set in a thresholds file, or detected from the
    fields): False for the packaged default alone, where the task is unknown."""

    def with_profile(self, name: str) -> Thresholds:
        if name not in self.profiles:
            raise ThresholdsError(f"profile: unknown profile {name!r}; known: {', '.join(sorted(self.profiles))}")
        return dataclasses.replace(self, profile=self.profiles[name], profile_named=True)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no tags beyond plain YAML), refusing a key given twice in one mapping:
    safe_load keeps the last silently, so an edited threshold could be overridden unnoticed."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader refuses it below ("found unhashable key")
            if key in seen:
                raise ThresholdsError(f"{key}: duplicate key (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _default_document() -> dict[str, Any]:
    """The packaged defaults, a fresh copy each call (parsed once: every Monitor loads them)."""
    return copy.deepcopy(_parsed_defaults())


@functools.lru_cache(maxsize=1)
def _parsed_defaults() -> dict[str, Any]:
    text = resources.files("lossbeat").joinpath(DEFAULT_PATH).read_text(encoding="utf-8")
    doc: dict[str, Any] = yaml.safe_load(text)  # the packaged file: a mapping, checked by parse_thresholds
    return doc


def _merge(base: dict[str, Any], override: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in base and path not in ("profiles",):
            raise ThresholdsError(f"{where}: unknown key")
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            out[key] = _merge(base[key], value, where)
        else:
            out[key] = value
    return out


@overload
def _number(
    doc: Mapping[str, Any], key: str, where: str, *, positive: bool = ..., integer: Literal[False] = ...
) -> float: ...
@overload
def _number(doc: Mapping[str, Any], key: str, where: str, *, positive: bool = ..., integer: Literal[True]) -> int: ...
@overload
def _number(doc: Mapping[str, Any], key: str, where: str, *, positive: bool = ..., integer: bool) -> int | float: ...
def _number(
    doc: Mapping[str, Any], key: str, where: str, *, positive: bool = True, integer: bool = False
) -> int | float:
    if key not in doc:
        raise ThresholdsError(f"{where}.{key}: missing")
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ThresholdsError(f"{where}.{key}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ThresholdsError(f"{where}.{key}: expected a finite number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ThresholdsError(f"{where}.{key}: expected an integer, got {value!r}")
    if positive and not value > 0:
        raise ThresholdsError(f"{where}.{key}: must be > 0, got {value!r}")
    return int(value) if integer else float(value)


def _section(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = doc.get(name)
    if not isinstance(value, Mapping):
        raise ThresholdsError(f"{name}: expected a mapping, got {value!r}")
    return value


_D = TypeVar("_D", bound="DataclassInstance")


def _build(cls: type[_D], doc: Mapping[str, Any], where: str, signed: tuple[str, ...] = ()) -> _D:
    kwargs: dict[str, float] = {}
    for f in dataclasses.fields(cls):
        integer = f.type in ("int", int)
        kwargs[f.name] = _number(doc, f.name, where, positive=f.name not in signed, integer=integer)
    unknown = set(doc) - set(kwargs)
    if unknown:
        raise ThresholdsError(f"{where}.{sorted(unknown)[0]}: unknown key")
    return cls(**kwargs)


def _profile(name: str, doc: Any) -> Profile:
    where = f"profiles.{name}"
    if not isinstance(doc, Mapping):
        raise ThresholdsError(f"{where}: expected a mapping, got {doc!r}")
    good = doc.get("loss_good")
    if good is not None:
        if (
            not isinstance(good, (list, tuple))
            or len(good) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in good)
            or not 0 <= good[0] < good[1]
        ):
            raise ThresholdsError(f"{where}.loss_good: expected [low, high] with 0 <= low < high, got {good!r}")
        good = (float(good[0]), float(good[1]))
    bounds = {}
    for key in ("loss_warn_low", "loss_warn_high", "loss_init_high", "volatility_floor"):
        value = doc.get(key)
        if value is not None:
            value = _number(doc, key, where)
        bounds[key] = value
    trend = doc.get("trend", True)
    if not isinstance(trend, bool):
        raise ThresholdsError(f"{where}.trend: expected true or false, got {trend!r}")
    unknown = set(doc) - {"loss_good", "loss_warn_low", "loss_warn_high", "loss_init_high", "volatility_floor", "trend"}
    if unknown:
        raise ThresholdsError(f"{where}.{sorted(unknown)[0]}: unknown key")
    low, high = bounds["loss_warn_low"], bounds["loss_warn_high"]
    if good and low is not None and low > good[0]:
        raise ThresholdsError(f"{where}.loss_warn_low: must not exceed loss_good's low bound {good[0]}")
    if good and high is not None and high < good[1]:
        raise ThresholdsError(f"{where}.loss_warn_high: must not be below loss_good's high bound {good[1]}")
    return Profile(
        name=name,
        loss_good=good,
        loss_warn_low=low,
        loss_warn_high=high,
        loss_init_high=bounds["loss_init_high"],
        volatility_floor=bounds["volatility_floor"],
        trend=trend,
    )


def _alerts(doc: Mapping[str, Any]) -> AlertSettings:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(AlertSettings):
        where = f"alerts.{f.name}"
        if f.name not in doc:
            raise ThresholdsError(f"{where}: missing")
        value = doc[f.name]
        if f.name == "runbook_url":
            if not isinstance(value, str) or not value.startswith(("http://", "https://")):
                raise ThresholdsError(f"{where}: expected an http(s) URL, got {value!r}")
        elif f.type in ("int", int):
            value = _number(doc, f.name, "alerts", integer=True)
        elif not isinstance(value, str) or not _DURATION.match(value):
            raise ThresholdsError(f"{where}: expected a Prometheus duration like 5m, got {value!r}")
        kwargs[f.name] = value
    unknown = set(doc) - set(kwargs)
    if unknown:
        raise ThresholdsError(f"alerts.{sorted(unknown)[0]}: unknown key")
    return AlertSettings(**kwargs)


def _durations(doc: Mapping[str, Any], where: str, keys: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for key in keys:
        value = doc.get(key)
        if not isinstance(value, str) or not _DURATION.match(value):
            raise ThresholdsError(f"{where}.{key}: expected a Prometheus duration like 5m, got {value!r}")
        out[key] = value
    return out


def _fraction(doc: Mapping[str, Any], key: str, where: str) -> float:
    value = _number(doc, key, where)
    if not value < 1:
        raise ThresholdsError(f"{where}.{key}: expected a fraction between 0 and 1, got {value!r}")
    return value


def _non_negative(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = _number(doc, key, where, positive=False, integer=True)
    if value < 0:
        raise ThresholdsError(f"{where}.{key}: must be >= 0, got {value!r}")
    return value


def _memory(doc: Mapping[str, Any]) -> MemoryThresholds:
    where = "memory"
    known = {f.name for f in dataclasses.fields(MemoryThresholds)}
    unknown = set(doc) - known
    if unknown:
        raise ThresholdsError(f"{where}.{sorted(unknown)[0]}: unknown key")
    return MemoryThresholds(
        near_limit=_fraction(doc, "near_limit", where),
        growth_fraction=_fraction(doc, "growth_fraction", where),
        samples=_number(doc, "samples", where, integer=True),
        warmup_samples=_non_negative(doc, "warmup_samples", where),
        leak_growth=_number(doc, "leak_growth", where),
        leak_min_samples=_number(doc, "leak_min_samples", where, integer=True),
        **_durations(doc, where, ("window", "oom_horizon", "near_limit_for", "growing_for")),
    )


def _throughput(doc: Mapping[str, Any]) -> ThroughputThresholds:
    where = "throughput"
    unknown = set(doc) - {
        "drop_fraction",
        "rate_window",
        "baseline",
        "for",
        "steps",
        "baseline_blocks",
        "warmup_steps",
        "danger_fraction",
        "danger_blocks",
    }
    if unknown:
        raise ThresholdsError(f"{where}.{sorted(unknown)[0]}: unknown key")
    durations = _durations(doc, where, ("rate_window", "baseline", "for"))
    return ThroughputThresholds(
        drop_fraction=_fraction(doc, "drop_fraction", where),
        rate_window=durations["rate_window"],
        baseline=durations["baseline"],
        for_=durations["for"],
        steps=_number(doc, "steps", where, integer=True),
        baseline_blocks=_number(doc, "baseline_blocks", where, integer=True),
        warmup_steps=_non_negative(doc, "warmup_steps", where),
        danger_fraction=_fraction(doc, "danger_fraction", where),
        danger_blocks=_number(doc, "danger_blocks", where, integer=True),
    )


def parse_thresholds(doc: Mapping[str, Any], source: str = "<document>") -> Thresholds:
    """Validate a complete thresholds document (already merged with defaults)."""
    if not isinstance(doc, Mapping):
        raise ThresholdsError(f"{source}: expected a mapping at the top level")
    if doc.get("version") != 1:
        raise ThresholdsError(f"version: expected 1, got {doc.get('version')!r}")
    profiles_doc = _section(doc, "profiles")
    profiles = {str(name): _profile(str(name), body) for name, body in profiles_doc.items()}
    active = doc.get("profile")
    if not isinstance(active, str) or active not in profiles:
        raise ThresholdsError(f"profile: unknown profile {active!r}; known: {', '.join(sorted(profiles))}")
    loss = _build(LossThresholds, _section(doc, "loss"), "loss", signed=("trend_rising",))
    if not loss.trend_rising < loss.trend_improving:
        raise ThresholdsError("loss.trend_rising: must be below loss.trend_improving")
    if loss.trend_rising > 0:
        raise ThresholdsError(
            f"loss.trend_rising: must be <= 0 (a falling loss is not rising), got {loss.trend_rising}"
        )
    if not loss.cv_warning < loss.cv_danger:
        raise ThresholdsError("loss.cv_warning: must be below loss.cv_danger")
    grads = _build(GradientThresholds, _section(doc, "gradients"), "gradients")
    windows = _build(Windows, _section(doc, "windows"), "windows")
    if not windows.trend_fraction < 0.5:
        raise ThresholdsError("windows.trend_fraction: must be below 0.5 (two windows must fit in the run)")
    if windows.summary_blocks < 4 or windows.summary_blocks % 2:
        raise ThresholdsError("windows.summary_blocks: expected an even number >= 4")
    hysteresis = _build(Hysteresis, _section(doc, "hysteresis"), "hysteresis")
    overfitting = _build(OverfittingThresholds, _section(doc, "overfitting"), "overfitting")
    if not grads.vanishing < grads.healthy_low < grads.healthy_high < grads.explosion:
        raise ThresholdsError("gradients: expected vanishing < healthy_low < healthy_high < explosion")
    if not grads.layer_vanishing < grads.layer_explosion:
        raise ThresholdsError("gradients.layer_vanishing: must be below gradients.layer_explosion")
    learning_rate = _build(LearningRateThresholds, _section(doc, "learning_rate"), "learning_rate")
    if not learning_rate.too_small < learning_rate.too_large:
        raise ThresholdsError("learning_rate.too_small: must be below learning_rate.too_large")
    for where, steps in [(f"windows.{f.name}", getattr(windows, f.name)) for f in dataclasses.fields(Windows)] + [
        ("learning_rate.too_small_window", learning_rate.too_small_window)
    ]:
        if steps > MAX_WINDOW_STEPS:
            raise ThresholdsError(
                f"{where}: at most {MAX_WINDOW_STEPS} steps (memory is allocated up front), got {steps}"
            )
    return Thresholds(
        profile=profiles[active],
        profiles=profiles,
        windows=windows,
        loss=loss,
        gradients=grads,
        learning_rate=learning_rate,
        overfitting=overfitting,
        hysteresis=hysteresis,
        alerts=_alerts(_section(doc, "alerts")),
        memory=_memory(_section(doc, "memory")),
        throughput=_throughput(_section(doc, "throughput")),
        lr_schedule=_build(ScheduleThresholds, _section(doc, "lr_schedule"), "lr_schedule"),
        cross_rank=_build(CrossRankThresholds, _section(doc, "cross_rank"), "cross_rank"),
        guard=_build(GuardThresholds, _section(doc, "guard"), "guard"),
        events=_build(EventThresholds, _section(doc, "events"), "events"),
        rl=_build(RLThresholds, _section(doc, "rl"), "rl"),
        class_prior=_build(ClassPriorThresholds, _section(doc, "class_prior"), "class_prior"),
        **parse_policy(doc, _section, _number, _durations, ThresholdsError),
        source=source,
    )


def load_thresholds(path: str | os.PathLike[str] | None = None, *, profile: str | None = None) -> Thresholds:
    """Load the packaged defaults, overlaid with ``path`` when given.

    ``path`` may hold any subset of the keys; unknown keys are errors.
    ``profile`` selects a task profile by name and wins over the file's ``profile``."""
    doc = _default_document()
    source = "<package>"
    if path is not None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"thresholds: expected a path, got {type(path).__name__}")
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as fh:
                user = yaml.load(fh, Loader=_UniqueKeyLoader)  # yaml.safe_load, plus duplicate keys refused
        except OSError as exc:
            raise ThresholdsError(f"{source}: cannot read thresholds file: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ThresholdsError(f"{source}: not UTF-8 text: {exc}") from exc
        except ThresholdsError as exc:  # a duplicate key, found while reading
            raise ThresholdsError(f"{source}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ThresholdsError(f"{source}: not valid YAML: {exc}") from exc
        if user is None:
            user = {}
        if not isinstance(user, Mapping):
            raise ThresholdsError(f"{source}: expected a mapping at the top level")
        doc = _merge(doc, user)
    result = parse_thresholds(doc, source)
    if profile is None and not (path is not None and "profile" in user):
        result = dataclasses.replace(result, profile_named=False)  # the packaged default: no task named
    if profile is not None:
        if not isinstance(profile, str):
            raise TypeError(f"profile: expected a profile name, got {type(profile).__name__}")
        result = result.with_profile(profile)
    return result
