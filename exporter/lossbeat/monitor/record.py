"""One observed step's values, typed: built by validation (:mod:`~lossbeat.monitor.inputs`), added
to on the training thread (the gradient norms, the router statistics, the guard's flags), carried
by the step's one host transfer (:mod:`~lossbeat.monitor.transfer`, which writes each device
value's float back in place) to the applier (:mod:`~lossbeat.monitor.apply`). No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from lossbeat.monitor.loaded import TensorLike

__all__ = ["StepValues", "DeviceStep", "HostStep", "FIRST_LR", "VECTORS"]

S = TypeVar("S")
"""A single value: a float, or (before the transfer) a 0-d tensor left on its device."""
V = TypeVar("V")
"""A vector: a 1-d tensor before the transfer, a list of floats after it."""

FIRST_LR = "0"
"""The label of the first param group's learning rate, or of the one given without an optimizer."""


# Not kw_only: CPython fills a keyword-only parameter's default by a dict lookup, a positional
# one's from a tuple; with a dozen defaults that is ~1,400 instructions on every observe().
@dataclass(slots=True)
class StepValues(Generic[S, V]):
    """A step's values; None (or empty) where the step has none. Built by keyword (every caller)."""

    loss: S | None = None
    """The training loss (None: no loss on this rank, a pipeline stage before the last)."""
    grad_norm: S | None = None
    """The global gradient norm, given or measured."""
    tokens: S | None = None
    """Tokens processed in the step."""
    grad_scale: S | None = None
    """An enabled GradScaler's scale."""
    learning_rates: dict[str, S] | None = None
    """Learning rates by param-group label (``"0"`` alone: one, the usual)."""
    components: dict[str, S] | None = None
    """A multi-task loss's components by name."""
    signals: dict[str, S] | None = None
    """Known named signals of ``observe(metrics=...)`` by canonical name."""
    fields: tuple[str, ...] = ()
    """``observe(metrics=...)`` names first seen this step (for the profile detection)."""
    clip: S | None = None
    """The clip coefficient of ``Monitor.clip_grad_norm_``."""
    layers: V | None = None
    """Per-layer gradient norms, in the layer grouping's order (-1: a layer without a gradient)."""
    guard: V | None = None
    """The guard's flags: its three reasons (non-finite, explosion, spike), then the loss above its spike limit."""
    guard_index: float | None = None
    """The guard's decision index of the step."""
    experts: V | None = None
    """Per MoE layer, imbalances then dead experts."""
    expert_layers: tuple[str, ...] | None = None
    """The MoE layers' names, in ``experts``' order."""
    expert_sizes: list[int] | None = None
    """Experts per MoE layer."""


DeviceStep = StepValues[float | TensorLike, TensorLike | list[float]]
"""A step on the training thread: floats, and tensors that the transfer reads."""
HostStep = StepValues[float, list[float]]
"""A step whose values have all reached the host (what the applier reads)."""

VECTORS = ("layers", "guard", "experts")
"""The vector fields (a list of floats on the host, even of one value)."""
