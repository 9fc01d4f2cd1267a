"""Counts what a training step asks of the device: aten ops and host reads.

A host read is a value copied to Python: ``.item()`` (and ``float(t)``, ``bool(t)``)
reach aten as ``_local_scalar_dense``, which a TorchDispatchMode sees; ``.tolist()``,
``.cpu()`` and ``.numpy()`` do not dispatch such an op on CPU, and ``torch.tensor()``
reads a list of tensors in C++ with the dispatch mode excluded, so those are
wrapped for the duration of the count. On CPU no read waits for anything; on an
accelerator each one on a device tensor is a blocking sync, and so is each wait
on ``torch.cuda.synchronize()`` or a CUDA event's ``synchronize()``, also counted.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StepCounts", "OpCounter", "count_host_reads"]

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_WRAPPED_METHODS = ("tolist", "cpu", "numpy")


@dataclass
class StepCounts:
    """Totals over a counted stretch of steps."""

    ops: int = 0
    view_ops: int = 0
    """Of those, views and aliases (detach, view, t...): metadata only, no kernel, no memory traffic."""
    scalar_reads: int = 0
    """``_local_scalar_dense`` calls: ``.item()``, ``float(t)``, ``bool(t)``."""
    method_reads: int = 0
    """``.tolist()``, ``.cpu()``, ``.numpy()`` calls on tensors."""
    list_reads: int = 0
    """Tensors inside a list given to ``torch.tensor()``: each is read to the host in C++,
    below the dispatch mode (one sync each on an accelerator)."""
    device_list_reads: int = 0
    device_method_reads: int = 0
    """Of those, calls on a non-CPU tensor (each a blocking device sync)."""
    device_waits: int = 0
    """``torch.cuda.synchronize()`` and ``torch.cuda.Event.synchronize()`` calls."""
    op_names: collections.Counter = field(default_factory=collections.Counter)

    @property
    def host_reads(self) -> int:
        return self.scalar_reads + self.method_reads + self.list_reads


def _is_view(func) -> bool:
    """An op whose result aliases an input without writing it (in-place ops alias *and* write)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (forward, backward, optimizer alike)."""

    def __init__(self, counts: StepCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.ops += 1
        if _is_view(func):
            self.counts.view_ops += 1
        self.counts.op_names[func.__name__] += 1
        if func is _SCALAR_READ:
            self.counts.scalar_reads += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads(counts: StepCounts) -> Iterator[StepCounts]:
    """Counts ops and host reads inside the block; restores the tensor methods after."""
    originals = {name: getattr(torch.Tensor, name) for name in _WRAPPED_METHODS}

    def wrap(name: str):
        original = originals[name]

        def counted(self, *args, **kwargs):
            counts.method_reads += 1
            if self.device.type != "cpu":
                counts.device_method_reads += 1
            return original(self, *args, **kwargs)

        return counted

    original_tensor = torch.tensor

    def counted_tensor(data, *args, **kwargs):
        if isinstance(data, (list, tuple)):
            tensors = [x for x in data if isinstance(x, torch.Tensor)]
            counts.list_reads += len(tensors)
            counts.device_list_reads += sum(x.device.type != "cpu" for x in tensors)
        return original_tensor(data, *args, **kwargs)

    original_sync, original_event_sync = torch.cuda.synchronize, torch.cuda.Event.synchronize

    def counted_sync(*args, **kwargs):
        counts.device_waits += 1
        return original_sync(*args, **kwargs)

    def counted_event_sync(self, *args, **kwargs):
        counts.device_waits += 1
        return original_event_sync(self, *args, **kwargs)

    for name in _WRAPPED_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    torch.tensor = counted_tensor
    torch.cuda.synchronize, torch.cuda.Event.synchronize = counted_sync, counted_event_sync
    try:
        with OpCounter(counts):
            yield counts
    finally:
        torch.tensor = original_tensor
        torch.cuda.synchronize, torch.cuda.Event.synchronize = original_sync, original_event_sync
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
