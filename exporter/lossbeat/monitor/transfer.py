"""The step's one device→host transfer: pack every device value into one tensor, copy it without
blocking, and apply the step once its values have arrived, in order, from the training thread or,
while the loop is away, from a scrape.

On CUDA the copy is read a step late (a pinned buffer and an event); on CPU there is nothing to
wait for and the values are read at once. A step of floats touches no torch (none need be loaded).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, TypeGuard

from lossbeat.monitor import loaded
from lossbeat.monitor.loaded import DeviceLike, TensorLike
from lossbeat.monitor.record import VECTORS, DeviceStep

__all__ = ["PendingStep", "DeviceTransfer", "start_host_copy", "unpack"]

MAX_PENDING = 4  # deferred host copies in flight before the oldest is waited for
# A scrape applies deferred device values that arrived once the training thread has not
# observed for this long (an evaluation, a checkpoint): a NaN just before them shows at once.
SCRAPE_DRAIN_AFTER_S = 1.0
READ_LOCK_WAIT_S = 0.1  # a read waits this long for the step being applied (what it computes needs the lock)


Part = tuple[str, str | None, TensorLike]
"""A tensor of a step's values: its field, its label in a field of values by name (else None), the tensor."""
Slice = tuple[str, str | None, int]
"""Where one slice of the packed tensor goes: its field, its label (else None), its length."""


class PendingStep:
    """One step whose device values are on their way to the host (or already there).

    A plain class with slots: one is built per observed step."""

    __slots__ = ("step", "wall_time", "duration", "epoch", "values", "layout", "packed", "event", "layer_names")

    def __init__(
        self,
        step: int,
        wall_time: float,
        duration: float | None,
        epoch: float | None,
        values: DeviceStep,
        layout: list[Slice],
        packed: Any = None,
        event: Any = None,
        layer_names: list[str] | None = None,
    ) -> None:
        self.step, self.wall_time, self.duration, self.epoch = step, wall_time, duration, epoch
        self.values = values
        """The step's values: each tensor's float is written back in place once it has arrived."""
        self.layout = layout
        """Where each slice of the packed device tensor goes."""
        self.packed = packed
        """The packed values: a pinned host buffer filling asynchronously, or a CPU tensor."""
        self.event = event
        """CUDA event recorded after the copy; None when the values are already on the host."""
        self.layer_names = layer_names if layer_names is not None else []


def start_host_copy(packed: Any) -> tuple[Any, Any]:
    """A pinned host buffer that a non-blocking copy of the CUDA tensor ``packed`` fills,
    and the CUDA event that completes after it.

    The copy runs on the current stream of ``packed``'s device, which need not be the
    current device (a model on ``cuda:1`` without ``set_device``; the last GPU of
    ``device_map="auto"``): the event is recorded on that same stream, else it could
    complete before the copy and the buffer be read early. Everything happens with
    ``packed``'s device current, so no CUDA context is created on GPU 0 for it.
    """
    torch = loaded.torch  # a CUDA tensor: torch is loaded
    device = packed.device
    with torch.cuda.device(device):
        buffer = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        buffer.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return buffer, event


_NO_PARTS: Any = ()  # a record's layout and layer names when it has neither (shared, never written)


def _is_tensor(value: object) -> TypeGuard[TensorLike]:
    """A tensor (inputs bound torch's names on seeing one; else they are bound here), not a host value."""
    return isinstance(value, loaded.Tensor) or (
        loaded.torch is None and loaded.refresh() is not None and isinstance(value, loaded.Tensor)
    )


def _tensors(values: DeviceStep) -> list[Part]:
    """The step's tensors; floats and host values stay where they are. Every step: the fields
    read one by one (no getattr by name), a tensor found with a type test (the usual) or, for a
    subclass or before torch's names are bound, :func:`_is_tensor`; a float costs one test."""
    found: list[Part] = []
    tensor = loaded.Tensor
    x = values.loss
    if x is not None and type(x) is not float and (type(x) is tensor or _is_tensor(x)):
        found.append(("loss", None, x))
    x = values.grad_norm
    if x is not None and type(x) is not float and (type(x) is tensor or _is_tensor(x)):
        found.append(("grad_norm", None, x))
    x = values.tokens
    if x is not None and type(x) is not float and (type(x) is tensor or _is_tensor(x)):
        found.append(("tokens", None, x))
    x = values.grad_scale
    if x is not None and (type(x) is tensor or _is_tensor(x)):  # never a float
        found.append(("grad_scale", None, x))
    x = values.clip
    if x is not None and (type(x) is tensor or _is_tensor(x)):  # never a float
        found.append(("clip", None, x))
    if values.learning_rates:
        for label, x in values.learning_rates.items():
            if type(x) is not float and (type(x) is tensor or _is_tensor(x)):
                found.append(("learning_rates", label, x))
    if values.components:
        for label, x in values.components.items():
            if type(x) is not float and (type(x) is tensor or _is_tensor(x)):
                found.append(("components", label, x))
    if values.signals:
        for label, x in values.signals.items():
            if type(x) is not float and (type(x) is tensor or _is_tensor(x)):
                found.append(("signals", label, x))
    y = values.layers
    if y is not None and (type(y) is tensor or _is_tensor(y)):
        found.append(("layers", None, y))
    y = values.guard
    if y is not None and (type(y) is tensor or _is_tensor(y)):  # a list on the host path
        found.append(("guard", None, y))
    y = values.experts
    if y is not None and (type(y) is tensor or _is_tensor(y)):
        found.append(("experts", None, y))
    return found


def _put(into: DeviceStep, name: str, label: str | None, x: float | list[float]) -> None:
    """One value, on the host now, in place of its tensor."""
    if label is None:
        setattr(into, name, x)
    else:
        getattr(into, name)[label] = x


def unpack(values: list[float], layout: list[Slice], into: DeviceStep) -> None:
    offset = 0
    for name, label, length in layout:
        _put(into, name, label, values[offset : offset + length] if name in VECTORS else values[offset])
        offset += length


def _read_cpu(parts: list[Part], into: DeviceStep, zero_d: bool = False) -> None:
    """CPU tensors' values, in the step's one host read (host memory: nothing to wait for).
    ``zero_d``: every one is a 0-d float tensor (a loss and a norm, the usual): one ``tolist()``
    of the one tensor, or of their ``stack`` (the float dtypes promote to one that holds each
    value exactly; a float32's value is a float64 exactly); anything else is packed into one
    float64 tensor as a device's values are."""
    torch = loaded.torch  # CPU tensors: torch is loaded
    if zero_d:
        if len(parts) == 1:
            name, label, value = parts[0]
            x = value.tolist()  # the step's one host read: a 0-d CPU tensor's value, no sync
            if label is None:
                setattr(into, name, [x] if name in VECTORS else x)
            else:
                _put(into, name, label, x)
            return
        # The step's one host read: one stack, one tolist() (not one read per tensor, which the
        # benchmarks count as a transfer each, and which would be a sync each on a device).
        read = torch.stack([value for _, _, value in parts]).tolist()
        for (name, label, _), x in zip(parts, read):
            if label is None:
                setattr(into, name, [x] if name in VECTORS else x)
            else:
                _put(into, name, label, x)
        return
    tensors = [value for _, _, value in parts]
    flats = [t.reshape(-1) if t.dtype == torch.float64 else t.reshape(-1).double() for t in tensors]
    packed = torch.cat(flats) if len(flats) > 1 else flats[0]
    layout = [(name, label, flat.numel()) for (name, label, _), flat in zip(parts, flats)]
    unpack(_as_float_list(packed), layout, into)  # the step's one host read


def _as_float_list(t: TensorLike) -> list[float]:
    floats: list[float] = t.tolist()  # a 1-d float64 tensor: a list of floats
    return floats


def with_lock_or_skip(lock: threading.Lock, timeout: float, fn: Callable[[], None]) -> bool:
    """Run ``fn`` holding ``lock`` if it can be had within ``timeout`` seconds; whether it ran."""
    if not lock.acquire(timeout=timeout):
        return False
    try:
        fn()
    finally:
        lock.release()
    return True


class DeviceTransfer:
    """The steps in flight to the host, and their application in order, exactly once each.

    The training thread submits and drains; a scrape drains only what has arrived, only once
    the loop has been idle for ``SCRAPE_DRAIN_AFTER_S``, and never waits (the lock guards the
    queue and the application of a step)."""

    def __init__(self, apply: Callable[[PendingStep], None], defer_device_reads: bool) -> None:
        self.apply = apply
        self.at_read: Callable[[], None] | None = getattr(apply, "at_read", None)
        """What a read (a scrape, a status request) computes under the lock after draining."""
        self.defer = defer_device_reads
        self.pending: collections.deque[PendingStep] = collections.deque()
        self.lock = threading.Lock()
        self.last_submit = time.perf_counter()
        """When the last step was submitted (``time.perf_counter``, monotonic): a scrape drains only
        once the loop has been away for ``SCRAPE_DRAIN_AFTER_S``."""
        self.cuda_device: int | None = None
        """Index of the CUDA device the step's tensors live on (for the memory reading), else None."""
        self.host_transfers = 0
        """Reads of a step's packed tensor values on the host: at most one per observed step
        (plus one for CPU tensors when a step mixes CPU and device tensors)."""
        self.blocking_waits = 0
        """Times ``observe()`` waited for a deferred device copy (more than ``MAX_PENDING``
        steps in flight); 0 while the device keeps up. Waits in ``flush()`` are not counted."""

    def submit(
        self,
        step: int,
        wall: float,
        duration: float | None,
        epoch: float | None,
        values: DeviceStep,
        layer_names: list[str],
        now: float | None = None,
    ) -> None:
        """Pack the tensors of ``values`` into one and start its host copy (floats stay as they are).

        ``now``: ``time.perf_counter()`` at the call, when the caller has read it already."""
        now = time.perf_counter() if now is None else now
        device_parts: list[Any] = []
        cpu_parts: list[Part] = []
        layout: list[Slice] = []
        device: DeviceLike | None = None  # set with the first device part
        zero_d = True  # every CPU tensor so far a 0-d float one
        for part in _tensors(values):
            value = part[2]
            if value.is_cpu:
                cpu_parts.append(part)
                if zero_d and (value.dtype not in loaded.FLOAT_DTYPES or value.dim()):
                    zero_d = False
                continue
            flat = value.reshape(-1)
            if flat.dtype != loaded.torch.float64:
                # float64: token counts stay exact past 2**24 and bf16/fp16 values lose nothing.
                flat = flat.double()
            if device is None:
                device = flat.device
                self.cuda_device = device.index if device.type == "cuda" else None
            elif flat.device != device:
                flat = flat.to(device, non_blocking=True)
            device_parts.append(flat)
            layout.append((part[0], part[1], flat.numel()))

        if cpu_parts:  # CPU tensors: reading them waits for nothing
            self.host_transfers += 1
            _read_cpu(cpu_parts, values, zero_d)

        record = PendingStep(step, wall, duration, epoch, values, layout, None, None, layer_names)
        if device is None:  # no device part: the values are on the host already
            self._apply_or_queue(record, now)
            return
        packed = loaded.torch.cat(device_parts) if len(device_parts) > 1 else device_parts[0]
        if device.type == "cuda" and self.defer:
            # The step's one device->host transfer, asynchronous: read at a later observe()
            # (or scrape) once its event is done.
            record.packed, record.event = start_host_copy(packed)
        else:
            # The step's one device->host transfer, synchronous (waits for the step's kernels).
            record.packed = packed.cpu()
        with self.lock:
            self.pending.append(record)
            self.last_submit = now
            self._drain_locked(block=False, may_wait=True)

    def submit_host(self, step: int, wall: float, duration: float | None, values: DeviceStep, now: float) -> None:
        """:meth:`submit` of a step whose values are all host floats already (a loss, a gradient
        norm, one learning rate), without the scan of its values: applied now, or queued behind
        the steps in flight."""
        self._apply_or_queue(PendingStep(step, wall, duration, None, values, _NO_PARTS, None, None, _NO_PARTS), now)

    def _apply_or_queue(self, record: PendingStep, now: float) -> None:
        """A record with its values on the host: applied now when nothing is in flight before it
        (no queue), else queued behind the steps in flight and drained as far as they arrived."""
        with self.lock:
            self.last_submit = now
            if not self.pending:
                self.apply(record)
                return
            self.pending.append(record)
            self._drain_locked(block=False, may_wait=True)

    def drain(self, block: bool, may_wait: bool = True) -> None:
        """Apply pending steps in order, as far as their values have arrived.

        ``block``: wait for all (flush); else wait only when more than ``MAX_PENDING``
        are in flight, and never when ``may_wait`` is False (a scrape)."""
        if not self.pending:  # nothing in flight (always, on CPU): no lock to take
            return
        with self.lock:  # the training thread and a scrape: one applies at a time, in order
            self._drain_locked(block, may_wait)

    def drain_at_scrape(self) -> None:
        """On the scrape thread: apply the steps whose device values have arrived while the
        training thread is away (an evaluation, a checkpoint). Never waits for the device or
        for the training thread: an event query only, and only if the lock is free.

        Caveat: an event query from this thread during a CUDA-graph capture in global mode on
        another thread would invalidate that capture; captures happen while the loop steps,
        and this runs only once the loop has not observed for ``SCRAPE_DRAIN_AFTER_S``.

        Then ``at_read`` (the gauges computed at read time) under the lock: it waits for a step
        being applied, at most ``READ_LOCK_WAIT_S``, else those gauges stay as last read."""
        self._drain_at_scrape()
        if self.at_read is not None:
            with_lock_or_skip(self.lock, READ_LOCK_WAIT_S, self.at_read)

    def _drain_at_scrape(self) -> None:
        if not self.pending or time.perf_counter() - self.last_submit < SCRAPE_DRAIN_AFTER_S:
            return
        if not self.lock.acquire(blocking=False):
            return
        try:
            self._drain_locked(block=False, may_wait=False)
        finally:
            self.lock.release()

    def _drain_locked(self, block: bool, may_wait: bool) -> None:
        pending = self.pending
        while pending:
            record = pending[0]
            if record.event is not None and not record.event.query():
                if not block and (len(pending) <= MAX_PENDING or not may_wait):
                    return
                if not block:
                    self.blocking_waits += 1
                record.event.synchronize()  # host sync: only when too many are in flight, or on flush()
            pending.popleft()
            if record.packed is not None:
                self.host_transfers += 1
                unpack(_as_float_list(record.packed), record.layout, record.values)
            self.apply(record)
