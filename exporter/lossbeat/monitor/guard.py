"""The optimizer guard: skip (or stop) a bad step before the optimizer applies it.

``observe`` decides on the device: a step is bad when its loss or grad norm is non-finite,
when its grad norm departs from the run's baseline as an explosion event does, or (opt-in)
when its loss spikes. The three flags are MAX-reduced over the world, so every rank skips the
same steps, and travel to the host with the step's one transfer, where they are counted.
``Monitor.step(optimizer)`` then applies the step, or not:

- flags already on the host (CPU runs, float inputs): a Python branch, no extra read;
- with a GradScaler: the flag joins the scaler's own ``found_inf`` (on the device), so the
  scaler skips the step as an overflow; its scale and growth tracker are put back afterwards,
  so a guard skip leaves the scaler as it was;
- fused optimizers: ``found_inf`` (the fused kernels skip the update and the step count);
- SGD, and Adam/AdamW whose step counters live on the device (capturable, or CPU): the update
  is masked, parameters and optimizer state restored with ``torch.where`` (a copy of both
  is held for the step: memory);
- any other optimizer on CUDA: one host read of the decision (documented, counted).

A stop (``guard="stop"`` on a bad step, or more than ``guard.max_consecutive`` skips in a row)
raises :class:`TrainingHalted` from ``Monitor.step`` on every rank at the same step: at once
when the flags are on the host, else ``MAX_PENDING`` steps after the bad one, when every rank
has its flags on the host without waiting for the device.

Floats without a process group decide in Python: torch is used only where a tensor, a process
group or a GradScaler is, so torch is loaded (:mod:`~lossbeat.monitor.loaded`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from lossbeat.diagnosis import History
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.exposition.metrics import SKIP_REASONS
from lossbeat.exposition.state import MonitorState
from lossbeat.monitor import loaded
from lossbeat.monitor.transfer import MAX_PENDING

if TYPE_CHECKING:
    import torch

__all__ = ["Guard", "NoGuard", "TrainingHalted", "GUARD_MODES", "REASONS", "make_guard"]

GUARD_MODES = ("off", "skip", "stop")
REASONS = SKIP_REASONS
"""The reasons a step is skipped, in the order of the flags (the first set one is counted)."""


class TrainingHalted(RuntimeError):
    """Raised by ``Monitor.step`` on every rank when the guard stops the run."""

    def __init__(self, step: int, reason: str, values: dict[str, float], consecutive: int) -> None:
        self.step, self.reason, self.values, self.consecutive = step, reason, values, consecutive
        shown = ", ".join(f"{k} {v:.6g}" for k, v in values.items())
        super().__init__(
            f"lossbeat guard stopped the run at step {step}: {reason} ({shown}); "
            f"{consecutive} bad step(s) in a row, none applied"
        )


class Guard:
    """The decision per step (``decide``, from ``observe``), its application (``step``), and the
    host-side count of what it did (``record``, from the step's applier)."""

    decides = True

    def __init__(
        self,
        mode: str,
        spikes: bool,
        hold_schedule: bool,
        thresholds: Thresholds,
        history: History,
        state: MonitorState,
        defer: bool,
    ) -> None:
        self.mode, self.spikes, self.hold_schedule = mode, spikes, hold_schedule
        self.max_consecutive = thresholds.guard.max_consecutive
        self.history, self.state = history, state
        self.defer = defer
        """Device values read a step late (``defer_device_reads``): on CUDA, a halt waits MAX_PENDING steps."""
        self.decisions = 0
        self.host_reads = 0
        """Host reads of a device decision (an optimizer the device cannot skip for): 0 on CPU."""
        self._pending: tuple[int, Any] | None = None  # (decision index, flags) awaiting step()
        self._host: tuple[int, tuple[float, ...]] | None = None  # the latest flags that reached the host
        self._halt: tuple[int, TrainingHalted] | None = None  # (decision index to raise at, error)
        self._consecutive = 0
        self._strategies: dict[int, str] = {}

    # --- observe(): the decision, on the device -------------------------------------------

    def decide(self, values: dict[Any, Any]) -> None:
        """Adds ``values["guard"]`` (3 flags) and ``values["guard_index"]`` for the step's transfer."""
        loss, grad = values.get("loss"), values.get("grad_norm")
        scaled = values.get("grad_scale") is not None  # overflowing grads are the scaler's to skip
        explosion_limit = self.history.grad.event_limit()
        spike_limit = self.history.loss.spike_limit() if self.spikes else math.inf
        tensors = [x for x in (loss, grad) if isinstance(x, loaded.Tensor)]
        dist = loaded.distributed()  # None without torch: no process group
        distributed = dist is not None and dist.is_initialized() and dist.get_world_size() > 1
        if tensors or distributed:
            device = tensors[0].device if tensors else _collective_device()
            flags = _device_flags(loss, grad, scaled, explosion_limit, spike_limit, device)
            if distributed:
                # Every rank skips the same steps: a MAX of three flags, enqueued like any kernel.
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        else:
            flags = _host_flags(loss, grad, scaled, explosion_limit, spike_limit)
        self._pending = (self.decisions, flags)
        values["guard"] = flags
        values["guard_index"] = float(self.decisions)
        self.decisions += 1

    # --- the applier: the flags on the host -------------------------------------------------

    def record(
        self,
        flags: list[float] | tuple[float, ...],
        index: float,
        step: int,
        loss: float | None,
        grad_norm: float | None,
    ) -> bool:
        """Count one step's decision; returns whether it was skipped."""
        index = int(index)
        self._host = (index, tuple(flags))
        bad = next((reason for reason, f in zip(REASONS, flags) if f > 0), None)
        if bad is None:
            self._consecutive = 0
            self.state.guard_consecutive_skips = 0
            return False
        self._consecutive += 1
        skipped = dict(self.state.skipped_steps)
        skipped[bad] = skipped.get(bad, 0) + 1
        self.state.skipped_steps = skipped  # swapped whole: a scrape sees all or nothing
        self.state.guard_consecutive_skips = self._consecutive
        if self._halt is None and (self.mode == "stop" or self._consecutive > self.max_consecutive):
            values = {k: v for k, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None}
            self._halt = (index + self.lag(), TrainingHalted(step, bad, values, self._consecutive))
        return True

    def lag(self) -> int:
        """Decisions between a bad step and its halt: every rank has its flags on the host by then
        (on CUDA with deferred reads, ``MAX_PENDING``; else none)."""
        torch = loaded.refresh()
        return MAX_PENDING if self.defer and torch is not None and torch.cuda.is_available() else 0

    # --- Monitor.step(): apply the decision ---------------------------------------------------

    def step(self, optimizer: Any, grad_scaler: Any = None, scheduler: Any = None) -> None:
        pending, self._pending = self._pending, None
        if self.mode == "off" or pending is None:
            _plain_step(optimizer, grad_scaler)
            applied: bool | None = True
        else:
            index, flags = pending
            host = self._host
            if host is not None and host[0] == index:  # on the host already: a Python branch
                applied = not any(f > 0 for f in host[1])
                if applied:
                    _plain_step(optimizer, grad_scaler)
                elif grad_scaler is not None:
                    import torch  # a GradScaler: torch is loaded

                    _skip_with_scaler(optimizer, grad_scaler, torch.ones((), dtype=torch.bool))
            else:
                applied = self._device_step(optimizer, grad_scaler, flags.amax() > 0)
        if scheduler is not None:
            if applied is None and self.hold_schedule:
                self.host_reads += 1
                applied = not bool(flags.amax() > 0)  # host sync: guard_schedule="hold" on the device path
            if applied or not self.hold_schedule:
                scheduler.step()
        self._raise_if_halted()

    def _device_step(self, optimizer: Any, grad_scaler: Any, bad: torch.Tensor) -> bool | None:
        """Skip on the device where the optimizer allows it; returns None when it did (unknown here)."""
        import torch  # flags on the device: torch is loaded

        if grad_scaler is not None and grad_scaler.is_enabled():
            _skip_with_scaler(optimizer, grad_scaler, bad)
            return None
        strategy = self._strategies.get(id(optimizer))
        if strategy is None:
            strategy = self._strategies[id(optimizer)] = _strategy(optimizer, bad.device)
        if strategy == "found_inf":
            optimizer.grad_scale, optimizer.found_inf = None, bad.to(torch.float32)
            try:
                optimizer.step()  # the fused kernels skip the update and the step count where found_inf
            finally:
                del optimizer.grad_scale, optimizer.found_inf
            return None
        if strategy == "mask":
            _masked_step(optimizer, bad)
            return None
        self.host_reads += 1
        if bool(bad):  # host sync: an optimizer the device cannot skip for (documented)
            return False
        optimizer.step()
        return True

    def _raise_if_halted(self) -> None:
        halt = self._halt
        if halt is not None and self.decisions - 1 >= halt[0]:
            self.state.halted = True
            raise halt[1]


def _collective_device() -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_tensor(x: Any, device: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().to(device=device, dtype=torch.float32, non_blocking=True)
    return torch.tensor(float(x), device=device)


def _device_flags(loss: Any, grad: Any, scaled: bool, explosion_limit: float, spike_limit: float, device: Any) -> Any:
    import torch

    false = torch.zeros((), dtype=torch.bool, device=device)
    nonfinite = explosion = spike = false
    if loss is not None:
        lt = _as_tensor(loss, device)
        nonfinite = ~torch.isfinite(lt)
        if math.isfinite(spike_limit):
            spike = lt > spike_limit
    if grad is not None:
        gt = _as_tensor(grad, device)
        if not scaled:
            nonfinite = nonfinite | ~torch.isfinite(gt)
        if math.isfinite(explosion_limit):
            explosion = gt > explosion_limit  # NaN compares False
    return torch.stack([nonfinite, explosion, spike]).to(torch.float32)


def _host_flags(loss: Any, grad: Any, scaled: bool, explosion_limit: float, spike_limit: float) -> tuple[float, ...]:
    nonfinite = loss is not None and not math.isfinite(loss)
    nonfinite = nonfinite or (grad is not None and not scaled and not math.isfinite(grad))
    explosion = grad is not None and grad > explosion_limit
    spike = loss is not None and loss > spike_limit
    return (float(nonfinite), float(explosion), float(spike))


def _plain_step(optimizer: Any, grad_scaler: Any) -> None:
    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()


def _skip_with_scaler(optimizer: Any, scaler: Any, bad: Any) -> None:
    """Skip through the scaler's own overflow path, then put its scale back where the scaler
    itself found no overflow: a guard skip leaves the scaler as if the step never happened.
    Reads GradScaler's private ``_per_optimizer_states``, ``_scale`` and ``_growth_tracker``."""
    import torch

    state = scaler._per_optimizer_states[id(optimizer)]
    if not state["found_inf_per_device"]:
        scaler.unscale_(optimizer)  # what scaler.step would do first; records found_inf per device
    found = list(state["found_inf_per_device"].values())
    overflow = torch.stack([f.to(bad.device) for f in found]).amax() > 0
    for f in found:
        f.copy_(torch.maximum(f, bad.to(f.device, f.dtype)))  # the scaler now skips this step
    scale, growth = scaler._scale.clone(), scaler._growth_tracker.clone()
    scaler.step(optimizer)
    scaler.update()
    ours = (bad & ~overflow).to(scale.device)
    scaler._scale.copy_(torch.where(ours, scale, scaler._scale))
    scaler._growth_tracker.copy_(torch.where(ours, growth, scaler._growth_tracker))


def _strategy(optimizer: Any, device: Any) -> str:
    import torch

    defaults = getattr(optimizer, "defaults", {})
    if defaults.get("fused"):
        return "found_inf"
    if isinstance(optimizer, torch.optim.SGD):
        return "mask"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and (
        defaults.get("capturable") or device.type == "cpu"
    ):
        return "mask"  # their step counters live with the decision: restorable on the device
    return "read"


def _masked_step(optimizer: Any, bad: Any) -> None:
    """Step, then restore every parameter and state tensor where ``bad`` (no host read). State
    created by this step (a first step) is zeroed where bad: Adam's and SGD's fresh state."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    before = [(p, {k: v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}) for p in params]
    saved = [(p.detach().clone(), {k: v.clone() for k, v in st.items()}) for p, st in before]
    optimizer.step()
    for (p, _), (p_old, st_old) in zip(before, saved):
        p.data.copy_(torch.where(bad, p_old, p.data))
        for k, v in optimizer.state[p].items():
            if not isinstance(v, torch.Tensor):
                continue
            old = st_old.get(k)
            v.copy_(torch.where(bad.to(v.device), old if old is not None else torch.zeros_like(v), v))


class NoGuard:
    """``guard="off"``: ``step`` is ``optimizer.step()`` exactly (with a scaler: its step and update)."""

    host_reads = 0
    decides = False  # observe() skips decide()

    def decide(self, values: dict[Any, Any]) -> None:
        pass

    def record(self, *args: Any) -> bool:
        return False

    def step(self, optimizer: Any, grad_scaler: Any = None, scheduler: Any = None) -> None:
        _plain_step(optimizer, grad_scaler)
        if scheduler is not None:
            scheduler.step()


def make_guard(
    mode: str, spikes: bool, schedule: str, thresholds: Thresholds, history: History, state: MonitorState, defer: bool
) -> Guard | NoGuard:
    state.guard_mode = mode
    if mode == "off":
        return NoGuard()
    return Guard(mode, spikes, schedule == "hold", thresholds, history, state, defer)
