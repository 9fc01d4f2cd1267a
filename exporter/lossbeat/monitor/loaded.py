"""torch as far as this process has loaded it: the monitor reads torch from ``sys.modules``, never imports it.

A process that never imported torch holds no tensor, no model, no optimizer and no process group,
so a monitor fed floats (``lossbeat watch``, a script that logs numbers) has no use for torch and
need not pay its import (seconds of CPU). Whatever hands the monitor a torch object has loaded
torch already; :func:`refresh` binds its names here then (once; a monitor built after
``import torch`` binds them at construction), and the hot path reads ``loaded.Tensor`` as it
read ``torch.Tensor``.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, cast

__all__ = [
    "torch",
    "Tensor",
    "TensorLike",
    "DeviceLike",
    "FLOAT_DTYPES",
    "refresh",
    "distributed",
    "torch_version",
]


class DeviceLike(Protocol):
    """What the monitor reads of a ``torch.device``."""

    @property
    def type(self) -> str:
        """``"cuda"``, ``"cpu"``, ..."""

    @property
    def index(self) -> int | None:
        """The device's index (None: the current one)."""


class TensorLike(Protocol):
    """What the monitor reads of a ``torch.Tensor``, described without importing torch (a monitor
    fed floats never loads it). dtypes are torch's, hence ``Any``."""

    @property
    def dtype(self) -> Any: ...
    @property
    def device(self) -> DeviceLike: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def requires_grad(self) -> bool: ...
    @property
    def is_meta(self) -> bool: ...
    @property
    def is_cpu(self) -> bool: ...
    def dim(self) -> int: ...
    def numel(self) -> int: ...
    def is_complex(self) -> bool: ...
    def detach(self) -> TensorLike: ...
    def reshape(self, *shape: int | tuple[int, ...]) -> TensorLike: ...
    def double(self) -> TensorLike: ...
    def mean(self) -> TensorLike: ...
    def to(self, *args: Any, **kwargs: Any) -> TensorLike: ...
    def tolist(self) -> Any:
        """A float for a 0-d tensor, else a (nested) list of floats."""


class _NoTensor:
    """What ``Tensor`` is while torch is not loaded: nothing is an instance of it."""


torch: Any = None
"""The torch module once the process has imported it, else None."""
# cast: _NoTensor describes no value (nothing is an instance of it), so narrowing with it as a
# TensorLike's type is never wrong; from refresh() on it is torch.Tensor, which is one.
Tensor = cast("type[TensorLike]", _NoTensor)
"""``torch.Tensor`` once torch is loaded: ``type(x) is loaded.Tensor`` is then the usual test."""
FLOAT_DTYPES: frozenset[Any] = frozenset()  # torch.dtype values: torch is not imported
"""The floating-point dtypes a loss or a norm comes in, once torch is loaded."""


def refresh() -> Any:
    """Bind torch's names here if the process has imported torch (a dict lookup until it has);
    torch or None. Called where a value that is no plain number arrives, before it is judged."""
    global torch, Tensor, FLOAT_DTYPES
    if torch is None:
        module = sys.modules.get("torch")
        if module is not None and hasattr(module, "Tensor"):  # not half-way through its own import
            FLOAT_DTYPES = frozenset({module.float32, module.float64, module.bfloat16, module.float16})
            Tensor, torch = module.Tensor, module
    return torch


_distributed: Any = None


def distributed() -> Any:
    """``torch.distributed`` when torch is loaded and built with it, else None: without torch
    there is no process group (the rank and world size then come from the launcher's variables)."""
    global _distributed
    if _distributed is None:
        if refresh() is None:
            return None
        import torch.distributed as dist  # torch is loaded: its distributed package (loaded with it)

        _distributed = dist
    return _distributed if _distributed.is_available() else None


def torch_version() -> str:
    """The version of the loaded torch, else of the installed one (a metadata read, not an
    import), without its local part (``2.5.1+cu124`` -> ``2.5.1``); "" when none is installed."""
    if refresh() is not None:
        version = str(torch.__version__)
    else:
        from importlib import metadata

        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return ""
    return version.split("+")[0]
