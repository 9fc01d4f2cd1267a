"""A monitor that does nothing (same API, so training code needs no ``if enabled:``), and the
scope :meth:`Monitor.phase` returns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lossbeat.diagnosis import Finding
from lossbeat.exposition.metrics import PHASES
from lossbeat.monitor.report import Report

if TYPE_CHECKING:
    import torch

__all__ = ["NullMonitor", "PhaseScope"]


class PhaseScope:
    """What :meth:`Monitor.phase` returns: the phase is already set; leaving the ``with``
    block restores the one before."""

    def __init__(self, monitor: Any, previous: str) -> None:
        self._monitor = monitor
        self.previous = previous

    def __enter__(self) -> PhaseScope:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._monitor.phase(self.previous)  # the phase before, again (the scope it returns unused)


class NullMonitor:
    """A monitor that does nothing: same API, so training code needs no ``if enabled:``."""

    port = None
    closed = False
    findings: tuple[Finding, ...] = ()

    def observe(self, step: int, **kwargs: Any) -> None:
        pass

    def observe_eval(self, step: int, eval_loss: Any, **kwargs: Any) -> None:
        pass

    def observe_metrics(self, step: int, metrics: Any) -> None:
        pass

    def phase(self, name: str) -> PhaseScope:
        if name not in PHASES:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {name!r}")
        return PhaseScope(None, name)

    def heartbeat(self) -> None:
        pass

    def step(self, optimizer: Any, *, grad_scaler: Any = None, scheduler: Any = None, closure: Any = None) -> Any:
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        out = None
        for one in optimizers:
            if grad_scaler is not None:
                out = grad_scaler.step(one) if closure is None else grad_scaler.step(one, closure)
            else:
                out = one.step() if closure is None else one.step(closure)
        if grad_scaler is not None:
            grad_scaler.update()
        if scheduler is not None:
            scheduler.step()
        return out

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        import torch  # a model: torch is loaded (a NullMonitor never imports it before)

        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def measure_gradients(
        self, model: torch.nn.Module, *, grad_scaler: Any = None, step: int | None = None
    ) -> torch.Tensor | None:
        return None

    def flush(self) -> None:
        pass

    def report(self) -> Report:
        return Report((), {}, None)

    def close(self, *, completed: bool = True) -> None:
        pass

    def __enter__(self) -> NullMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
