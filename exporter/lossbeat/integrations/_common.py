"""Shared by the integrations: picking the monitor, the eval loss, a pre-clip global norm."""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch

from ..gradients import LayerGrouping, compute_grad_norms
from ..monitor import Monitor, NullMonitor, start_exporter

__all__ = ["resolve_monitor", "eval_loss_from", "PreClipNorm"]


def resolve_monitor(monitor: Monitor | NullMonitor | None) -> Monitor | NullMonitor:
    """The given monitor, or the process's exporter (:func:`start_exporter`, default port)."""
    if monitor is None:
        return start_exporter()
    if not isinstance(monitor, (Monitor, NullMonitor)):
        raise TypeError(f"monitor: expected a lossbeat Monitor, got {type(monitor).__name__}")
    return monitor


def _real(value: Any) -> float | torch.Tensor | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def eval_loss_from(metrics: Mapping[str, Any] | None, key: str | None, prefix: str = "eval_") -> tuple[str, Any] | None:
    """(key, value) of the eval loss in ``metrics``: ``key`` if given, else ``{prefix}loss``,
    else the first ``{prefix}<set>_loss`` in sorted order (one eval set feeds the monitor)."""
    if not metrics:
        return None
    if key is not None:
        value = _real(metrics.get(key))
        return (key, value) if value is not None else None
    candidates = [f"{prefix}loss"] + sorted(
        k for k in metrics if isinstance(k, str) and k.startswith(prefix) and k.endswith("_loss")
    )
    for k in candidates:
        value = _real(metrics.get(k))
        if value is not None:
            return k, value
    return None


class PreClipNorm:
    """The global grad norm measured at the end of each backward pass, before any clipping.

    The autograd engine runs a queued callback once a backward pass has
    finished accumulating every gradient; a hook on the loss tensor queues it.
    One fused reduction per backward, left on the device (no host sync).
    """

    def __init__(self) -> None:
        self._grouping: LayerGrouping | None = None
        self.value: torch.Tensor | None = None
        self.available = hasattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback")

    def watch(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        """Measure ``model``'s gradients when the backward pass through ``loss`` ends."""
        if not self.available or not loss.requires_grad:
            return

        def measure() -> None:
            grouping = self._grouping
            if grouping is None or grouping.model_ref is not model:
                grouping = self._grouping = LayerGrouping(model)
            norms = compute_grad_norms(grouping, per_layer=False)
            self.value = None if norms is None else norms.global_norm

        def queue(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(measure)

        loss.register_hook(queue)

    def take(self) -> torch.Tensor | None:
        value, self.value = self.value, None
        return value

