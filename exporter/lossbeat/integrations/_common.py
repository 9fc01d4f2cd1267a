"""Shared by the integrations: picking the monitor, the eval loss, measuring gradients before clipping."""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch

from ..monitor import Monitor, NullMonitor, start_exporter

__all__ = ["resolve_monitor", "eval_loss_from", "AfterBackward"]


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


class AfterBackward:
    """Measures a model's gradients once a backward pass has finished, before anything clips them.

    A hook on the loss queues an autograd-engine callback for the end of the
    backward pass; that callback queues the measurement, so it runs after
    every callback queued during the pass, among them DistributedDataParallel's,
    which writes the all-reduced gradients back: the norms are the job's, not
    this rank's local ones. The measurement is ``monitor.measure_gradients``: one
    fused reduction left on the device (no host sync), reported by the next
    ``observe(model=model)``.
    """

    def __init__(self, monitor: Monitor | NullMonitor) -> None:
        self.monitor = monitor
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        self._queue = getattr(engine, "queue_callback", None)

    def watch(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        """Measure ``model``'s gradients when the backward pass through ``loss`` ends."""
        queue = self._queue
        if queue is None or not loss.requires_grad:
            return

        def measure() -> None:
            self.monitor.measure_gradients(model)  # never raises: errors are counted

        def at_end_of_backward(grad: torch.Tensor) -> None:
            # Queued from the first callback: it runs after those queued during the pass.
            queue(lambda: queue(measure))

        loss.register_hook(at_end_of_backward)
