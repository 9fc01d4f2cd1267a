"""A mixture-of-experts router's load, measured on the device: per layer, never per expert.

``observe(expert_load={layer: tokens_per_expert})`` hands one 1-d tensor (or sequence) per MoE
layer. :class:`ExpertLoadMeter` stacks them into one ``[layers, experts]`` tensor and computes,
in a fixed handful of kernels whatever the number of layers and experts (no Python loop over
experts, no host read):

* the load imbalance of each layer: the busiest expert's tokens over the mean per expert;
* the dead experts of each layer: experts that got no token in the last ``window`` observed steps,
  from one ``[layers, experts]`` tensor of the step each expert last got a token (bounded memory).

The result is one 1-d float tensor of ``2 x layers`` values that joins the step's packed values:
it crosses to the host in the step's one transfer (:mod:`lossbeat.monitor.transfer`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["ExpertLoadMeter", "MAX_MOE_LAYERS", "counts_from_indices"]

MAX_MOE_LAYERS = 256
"""MoE layers exported per rank (bounded label values: the layers beyond are not measured)."""


def counts_from_indices(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert from a router's chosen expert indices (any shape; ``[tokens, k]`` for
    top-k routing): one ``scatter_add_`` on the indices' device (``bincount`` would read its
    maximum on the host), float32."""
    flat = indices.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))


class ExpertLoadMeter:
    """The per-layer router statistics of each step; one per monitor."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.names: tuple[str, ...] = ()
        self.experts: list[int] = []
        """Experts of each layer (from the shapes: no host read)."""
        self._last_seen = torch.zeros((0, 0), dtype=torch.int64)
        """``[layers, experts]`` int64: the step at which each expert last got a token (no layer yet:
        ``[0, 0]``, whose shape no measured step has)."""
        self._experts_t = torch.zeros(0, dtype=torch.float32)
        self.dropped = 0
        """Layers left out (beyond ``MAX_MOE_LAYERS``) at the last step."""
        self._dtype: torch.dtype | None = None
        """The layers' dtype when the last checked step took the fast path's shape (else None: checked every step)."""

    def measure(self, step: int, expert_load: Mapping[str, Any]) -> tuple[tuple[str, ...], torch.Tensor] | None:
        """``(layer names, [imbalance of each layer..., dead experts of each layer...])`` on the
        loads' device, without a host read; None when no layer has experts."""
        names = tuple(expert_load)
        if names == self.names and len(names) <= MAX_MOE_LAYERS:
            # The usual step: the same layers as the last one, each a tensor of as many experts on
            # one device: one stack, no per-layer check (a layer that changed makes it raise).
            try:
                with torch.no_grad():
                    x = torch.stack(list(expert_load.values()))
            except (TypeError, RuntimeError):
                x = None
            if x is not None and x.dim() == 2 and x.dtype == self._dtype and x.device == self._last_seen.device:
                return names, self._reduce(step, x.to(torch.float32), None)
        return self._measure_checked(step, expert_load)

    def _measure_checked(self, step: int, expert_load: Mapping[str, Any]):
        """A new set of layers (or a changed one): each layer checked, padded when their experts differ."""
        items = list(expert_load.items())
        self.dropped = max(0, len(items) - MAX_MOE_LAYERS)
        names = tuple(str(name) for name, _ in items[:MAX_MOE_LAYERS])
        loads = [_as_vector(name, value) for name, value in items[:MAX_MOE_LAYERS]]
        if not loads:
            return None
        device = loads[0].device
        loads = [x if x.device == device else x.to(device, non_blocking=True) for x in loads]
        sizes = [x.numel() for x in loads]  # metadata: no host read
        with torch.no_grad():
            # One [layers, experts] tensor; a layer with fewer experts is padded with -1 (never a
            # max, never counted: masked below).
            x = torch.nn.utils.rnn.pad_sequence(loads, batch_first=True, padding_value=-1.0).to(torch.float32)
        if names != self.names or sizes != self.experts or self._last_seen.shape != x.shape:
            # A new set of layers (the first step, or the caller's changed): its window starts now.
            self.names, self.experts = names, sizes
            self._last_seen = torch.full(x.shape, step, dtype=torch.int64, device=device)
            self._experts_t = torch.tensor(sizes, dtype=torch.float32, device=device)
        uniform = len(set(sizes)) == 1 and len(names) == len(expert_load)
        given = {v.dtype if isinstance(v, torch.Tensor) else None for v in expert_load.values()}
        self._dtype = given.pop() if uniform and len(given) == 1 and None not in given else None
        return names, self._reduce(step, x, None if uniform else x >= 0)

    def _reduce(self, step: int, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Imbalance and dead experts of each layer of ``x`` ([layers, experts] float32; ``valid``:
        the experts that exist, when the layers' counts differ): a dozen kernels, any size."""
        with torch.no_grad():
            if valid is None:
                mean = x.sum(dim=1) / self._experts_t
            else:
                mean = torch.where(valid, x, 0.0).sum(dim=1) / self._experts_t
            # max / mean; a layer that routed no token this step reads 0 / 0: NaN, no imbalance.
            imbalance = x.amax(dim=1) / mean
            seen = self._last_seen
            seen.masked_fill_(x > 0, step)  # in place: the same memory every step
            stale = seen <= step - self.window
            dead = (stale if valid is None else stale & valid).sum(dim=1)
            return torch.cat([imbalance, dead.to(torch.float32)])


def _as_vector(name: str, value: Any) -> torch.Tensor:
    """A 1-d float32 tensor of one layer's tokens per expert; a sequence becomes a CPU tensor (a
    host copy of host numbers, no device read); a wrong shape or type raises, naming the layer."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool or value.is_meta:
            raise TypeError(f"expert_load[{name!r}]: expected counts per expert, got a {value.dtype} tensor")
        if value.dim() != 1:
            raise TypeError(
                f"expert_load[{name!r}]: expected a 1-d tensor of tokens per expert, got shape {tuple(value.shape)}"
            )
        return value.detach().to(torch.float32)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"expert_load[{name!r}]: expected a 1-d tensor or a sequence, got {type(value).__name__}")
    try:
        return torch.tensor(list(value), dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"expert_load[{name!r}]: expected numbers of tokens per expert: {exc}") from None
