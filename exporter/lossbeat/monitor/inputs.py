"""Validate what ``observe`` is given: programming errors (a wrong type) raise at once, naming the
argument; values stay as they are (floats, or 0-d tensors left on their device: reading them would sync).
torch is read as the process has loaded it (:mod:`~lossbeat.monitor.loaded`): floats never import it."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

from lossbeat.diagnosis.profiles import signal_kind
from lossbeat.monitor import loaded
from lossbeat.monitor.record import FIRST_LR, DeviceStep, StepValues

__all__ = [
    "step_values",
    "scalar",
    "per_step",
    "real_to_float",
    "loss_scale",
    "refuse_graph_capture",
    "learning_rates",
    "components",
    "signals",
    "check_step",
    "check_model",
    "check_epoch",
]

MAX_PARAM_GROUPS = 32
MAX_COMPONENTS = 32
MAX_FIELDS = 64
"""Names of ``observe(metrics=...)`` remembered per run for the profile detection."""


def step_values(
    *,
    loss: Any,
    optimizer: Any,
    learning_rate: Any,
    grad_norm: Any,
    tokens: Any,
    losses: Mapping[str, Any] | None,
    grad_scaler: Any,
    metrics: Mapping[str, Any] | None,
    model: Any,
    seen: set[str],
) -> tuple[DeviceStep, list[str]]:
    """One ``observe`` call's values, validated, and the names of its per-step data that was not
    one value (reduced to its mean: counted by the caller, never raised). ``seen``: the
    ``metrics`` names already given (the profile detection's); the new ones are ``values.fields``.

    Every step: floats and plain 0-d float tensors go through without a call, an argument left
    out costs one test."""
    anomalies: list[str] = []
    values: DeviceStep = StepValues(  # loss None: no loss on this rank
        loss=loss if type(loss) is float or _plain_0d(loss) else per_step("loss", loss, anomalies),
        grad_norm=grad_norm
        if type(grad_norm) is float or _plain_0d(grad_norm)
        else scalar("grad_norm", grad_norm, optional=True),
        tokens=None if tokens is None else scalar("tokens", tokens),
        grad_scale=None if grad_scaler is None else loss_scale(grad_scaler),
    )
    if optimizer is None and type(learning_rate) is float:
        values.learning_rates = {FIRST_LR: learning_rate}
    elif optimizer is not None or learning_rate is not None:
        values.learning_rates = learning_rates(optimizer, learning_rate) or None
    if losses is not None:
        values.components = components(losses, anomalies) or None
    if metrics is not None:
        found, values.fields = signals(metrics, seen, anomalies)
        values.signals = found or None
    if model is not None:
        check_model(model)
    return values, anomalies


def _plain_0d(value: Any) -> bool:
    """A 0-d float tensor holding a value that needs nothing done to it (what a loss or a clip's norm
    is, detached): what :func:`scalar` would return as it is, found with a few metadata reads.
    False for any tensor until torch's names are bound (:func:`scalar` binds them, and does the same)."""
    return (
        type(value) is loaded.Tensor
        and value.dtype in loaded.FLOAT_DTYPES
        and value.dim() == 0
        and not value.requires_grad
        and not value.is_meta
    )


def check_step(step: Any) -> int:
    if type(step) is int:  # every step: no ABC check
        return step
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step: expected an int, got {type(step).__name__}")
    return int(step)


def check_model(model: Any) -> None:
    """A model is a ``torch.nn.Module`` (so torch is loaded); anything else, None too, raises."""
    torch = loaded.refresh()
    if torch is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")


def check_epoch(epoch: Any) -> float | None:
    if epoch is None:
        return None
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Real):
        raise TypeError(f"epoch: expected a number, got {type(epoch).__name__}")
    return real_to_float(epoch)


def learning_rates(optimizer: Any, learning_rate: Any) -> dict[str, Any]:
    """``{group label: value}`` from the optimizer's param groups and/or an explicit LR."""
    out: dict[str, Any] = {}
    if optimizer is not None:
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, (list, tuple)):
            raise TypeError(f"optimizer: expected a torch optimizer with param_groups, got {type(optimizer).__name__}")
        for i, group in enumerate(groups[:MAX_PARAM_GROUPS]):
            label = str(group.get("name", i)) if isinstance(group, Mapping) else str(i)
            lr = group.get("lr") if isinstance(group, Mapping) else None
            if lr is not None:
                out[label] = scalar(f"optimizer.param_groups[{i}]['lr']", lr)
    if learning_rate is not None:
        out[FIRST_LR if not out else "explicit"] = scalar("learning_rate", learning_rate)
    return out


def components(losses: Mapping[str, Any] | None, anomalies: list[str] | None = None) -> dict[str, Any]:
    """``{name: value}`` of a multi-task loss (at most MAX_COMPONENTS).

    A component that is None is absent this step (an auxiliary loss some batches lack): skipped,
    not an error. A tensor of several values is :func:`per_step` data (reduced, noted)."""
    if losses is None:
        return {}
    if not isinstance(losses, Mapping):
        raise TypeError(f"losses: expected a mapping of component name to loss, got {type(losses).__name__}")
    out: dict[str, Any] = {}
    for name, value in list(losses.items())[:MAX_COMPONENTS]:
        if not isinstance(name, str):
            raise TypeError(f"losses: component names must be strings, got {name!r}")
        value = per_step(f"losses[{name!r}]", value, anomalies)
        if value is not None:
            out[name] = value
    return out


def signals(
    metrics: Mapping[str, Any] | None, seen: set[str], anomalies: list[str] | None = None
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``({canonical name: value}, names not in ``seen``)`` from ``observe(metrics=...)``.

    Every name counts for the profile detection (bounded: at most MAX_FIELDS names per run are
    remembered); the values of the names :data:`~lossbeat.diagnosis.profiles.SIGNALS` knows are
    kept (others are not exported: bounded label values). A value that is None is absent."""
    if metrics is None:
        return {}, ()
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics: expected a mapping of name to value, got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    new = []
    for name, value in list(metrics.items())[:MAX_FIELDS]:
        if not isinstance(name, str):
            raise TypeError(f"metrics: names must be strings, got {name!r}")
        kind = signal_kind(name)
        if kind is not None:
            value = per_step(f"metrics[{name!r}]", value, anomalies)
            if value is not None:
                out[kind] = value
        elif value is not None and not isinstance(value, loaded.Tensor):
            scalar(f"metrics[{name!r}]", value)  # a wrong type raises, as for the signals
        if name not in seen and len(seen) < MAX_FIELDS:
            seen.add(name)
            new.append(name)
    return out, tuple(new)


def per_step(name: str, value: Any, anomalies: list[str] | None) -> Any:
    """:func:`scalar` (optional) for per-step data, which must not stop a run mid-way: a real
    tensor of several values (``nn.DataParallel``'s per-device losses) is reduced to its mean on
    its device (one kernel, no host sync), an empty one is dropped (None); either is appended to
    ``anomalies``, which the caller counts. A wrong *type* still raises TypeError."""
    if type(value) is float or value is None:
        return value
    torch = loaded.refresh()  # not a float: maybe a tensor (then torch is loaded)
    if (
        torch is not None
        and isinstance(value, torch.Tensor)
        and value.numel() != 1
        and not value.is_meta
        and not value.is_complex()
        and value.dtype != torch.bool
    ):
        if anomalies is not None:
            anomalies.append(name)
        if value.numel() == 0:
            return None
        value = value.detach().to(torch.float32).mean()
    return scalar(name, value, optional=True)


def scalar(name: str, value: Any, *, optional: bool = False) -> Any:
    """A float, or a detached 0-d tensor left on its device (reading it would sync), or None."""
    kind = type(value)
    if kind is float:  # the common case, without ABC checks
        return value
    if kind is int:
        return _int_to_float(value)
    if value is None:
        if optional:
            return None
        raise TypeError(f"{name}: required, got None")
    torch = loaded.refresh()  # a tensor means torch is loaded: its names are bound from here on
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1:  # metadata only: no sync
            raise TypeError(f"{name}: expected a single value, got a tensor of shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name}: expected a real number, got a {value.dtype} tensor")
        if value.is_meta:
            raise TypeError(f"{name}: a meta tensor holds no value")
        if hasattr(value, "full_tensor"):
            # A DTensor (torch's clip_grad_norm_ returns one under FSDP2): its value on every
            # rank; a partial one is all-reduced, enqueued on the device like any kernel.
            value = value.full_tensor()
        if value.requires_grad:  # a device value read a step later must not hold the graph
            value = value.detach()
        return value if value.dim() == 0 else value.reshape(())  # a reshape costs 5 µs
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float or a 0-d tensor, got {type(value).__name__}")
    return real_to_float(value)


def real_to_float(value: numbers.Real) -> float:
    if isinstance(value, numbers.Integral):
        return _int_to_float(int(value))
    try:
        return float(value)
    except OverflowError:  # a Fraction beyond float range: a huge value is data, not an error
        return -math.inf if value < 0 else math.inf


def _int_to_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond 1.8e308: data (counted as non-finite), never raised
        return math.inf if value > 0 else -math.inf


def loss_scale(grad_scaler: Any) -> Any:
    """The scale of an enabled GradScaler as a 0-d device tensor (no sync), else None."""
    if grad_scaler is None:
        return None
    is_enabled = getattr(grad_scaler, "is_enabled", None)
    if not callable(is_enabled) or not callable(getattr(grad_scaler, "get_scale", None)):
        raise TypeError(f"grad_scaler: expected a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if not is_enabled():
        return None
    # get_scale() would read it with .item(): the tensor behind it is read with the step's values.
    scale = getattr(grad_scaler, "_scale", None)
    loaded.refresh()  # a GradScaler: torch is loaded
    return scale.detach().reshape(()) if isinstance(scale, loaded.Tensor) and scale.numel() == 1 else None


def refuse_graph_capture(where: str) -> None:
    """Raise if called while the current CUDA stream is capturing a graph: the event query
    and the pinned allocation would break the capture, and a captured observe() would
    replay stale values. Checked only once CUDA is initialised (no cost on CPU); the query
    creates no CUDA context on the current device when it has none. Without torch loaded there
    is no CUDA (the same module attribute test as any step's ``torch.cuda``)."""
    torch = loaded.torch or loaded.refresh()  # bound: one attribute read; unbound: a dict lookup
    if torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{where}: called during CUDA graph capture; call it outside the captured region "
            "(after graph.replay(), with the step's output tensors)"
        )
