"""The optimizer guard: skip (or stop) a bad step before the optimizer applies it.

``observe`` decides on the device: a step is bad when its loss or grad norm is non-finite,
when its grad norm departs from the run's baseline as an explosion event does, or (opt-in)
when its loss spikes. The three flags, and a fourth that says whether the loss went bad (above
its spike limit), are MAX-reduced over the world, so every rank skips the same steps, and travel
to the host with the step's one transfer. Whether an explosion may be a new level, or leads to
a stop, is then the same judgement on every rank, whose losses differ. ``Monitor.step(optimizer)``
applies that decision to every optimizer stepped before the next ``observe``
(:mod:`~lossbeat.monitor.skipping` withholds the update):

- flags already on the host (CPU runs, float inputs): a Python branch, no extra read;
- with a GradScaler: the flag joins the scaler's own ``found_inf`` (on the device), so the
  scaler skips the step as an overflow; its scale and growth tracker are put back afterwards;
- fused optimizers: ``found_inf`` (the fused kernels skip the update and the step count);
- SGD, and Adam/AdamW whose step counters live on the device (capturable, or CPU): the update
  is masked, parameters and optimizer state restored with ``torch.where``;
- any other optimizer on CUDA: one host read of the decision (documented, counted).

A ``Monitor.step`` with no decision for it (``observe`` not called for the step, or failed) is
decided from the gradients (non-finite values, MAX-reduced over the ranks, one host read).

A skip is counted once both are known, in whichever order they come: the flags on the host
(``record``, from the step's applier) and a ``Monitor.step`` that withheld the update. On CPU
the flags come first: a bad step's record waits in the guard (untouched) for its
``Monitor.step``, or for the next decision, which records it as a step the model took in.

A run of explosion skips with a healthy loss is a new level, not a fault: after
``guard.accept_level_after`` of them their norms become the baseline. A stop (``guard="stop"``
on a bad step, or more than ``guard.max_consecutive`` skips in a row) raises
:class:`TrainingHalted` from ``Monitor.step`` on every rank at the same step: at once when the
flags are on the host, else ``MAX_PENDING`` steps after the bad one, when every rank has its
flags on the host without waiting for the device (a stop among the last steps: at ``flush``
or ``close``).

Floats without a process group decide in Python: torch is used only where a tensor, a process
group or a GradScaler is, so torch is loaded (:mod:`~lossbeat.monitor.loaded`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import TYPE_CHECKING, Any, Callable

from lossbeat.diagnosis import History
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.exposition.metrics import SKIP_REASONS
from lossbeat.exposition.state import MonitorState
from lossbeat.monitor import loaded, skipping
from lossbeat.monitor.record import DeviceStep
from lossbeat.monitor.transfer import MAX_PENDING

if TYPE_CHECKING:
    import torch

__all__ = ["Guard", "NoGuard", "TrainingHalted", "GUARD_MODES", "REASONS", "make_guard"]

GUARD_MODES = ("off", "skip", "stop")
REASONS = SKIP_REASONS
"""The reasons a step is skipped, in the order of the flags (the first set one is counted)."""
_BAD = len(REASONS)  # flags[:_BAD] decide a skip; the one after them (the loss went bad) only judges an explosion


class TrainingHalted(RuntimeError):
    """Raised by ``Monitor.step`` on every rank when the guard stops the run."""

    def __init__(self, step: int, reason: str, values: dict[str, float], consecutive: int) -> None:
        self.step, self.reason, self.values, self.consecutive = step, reason, values, consecutive
        shown = ", ".join(f"{k} {v:.6g}" for k, v in values.items())
        super().__init__(
            f"lossbeat guard stopped the run at step {step}: {reason} ({shown}); "
            f"{consecutive} bad step(s) in a row, none applied"
        )


APPLIED, SKIPPED, PARKED = "applied", "skipped", "parked"
"""What :meth:`Guard.record` says of a step whose flags reached the host: the model took it in
(or nothing withheld it), ``Monitor.step`` withheld it, or it is bad and its ``Monitor.step``
may still come (the record waits in the guard until it does, or the next decision)."""
_UNDECIDED = -1  # the index of a decision taken in Monitor.step from the gradients themselves
_log = logging.getLogger("lossbeat")


class Guard:
    """The decision per step (``decide``, from ``observe``), its application to every optimizer
    stepped before the next decision (``step``), and the host-side count of what it withheld
    (``record``, from the step's applier). A skip is counted only once both are known: the
    flags on the host, and a ``Monitor.step`` that withheld the update."""

    decides = True

    def __init__(
        self,
        *,
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
        self.accept_level_after = thresholds.guard.accept_level_after
        self.history, self.state = history, state
        self.defer = defer
        """Device values read a step late (``defer_device_reads``): on CUDA, a halt waits MAX_PENDING steps."""
        self.decisions = 0
        self.host_reads = 0
        """Host reads of a decision (an optimizer the device cannot skip for, a step observe() did
        not decide): 0 on CPU for observed steps."""
        self._lock: Any = contextlib.nullcontext()  # the transfer's lock, once attached
        self._apply: Callable[[Any], None] | None = None  # the step applier, once attached
        self._current: tuple[int, Any] | None = None  # (decision index, flags) of the training step
        self._stepped: set[int] = set()  # the optimizers Monitor.step applied the current decision to
        # every optimizer stepped through the guard, not kept alive by it (a sweep's finished runs)
        self._optimizers: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._used: set[int] = set()  # decisions Monitor.step applied (withheld or not)
        self._host: tuple[int, tuple[float, ...]] | None = None  # the latest flags that reached the host
        self._parked: tuple[int, Any] | None = None  # a bad step's record awaiting its Monitor.step
        self._halt: tuple[int, TrainingHalted] | None = None  # (decision index to raise at, error)
        self._consecutive = 0
        self._level: list[tuple[int, float]] = []  # explosions in a row with a healthy loss: (step, norm)
        self._strategies: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # by optimizer

    def attach(self, lock: Any, apply: Callable[[Any], None]) -> None:
        """The transfer's lock and the step applier: a parked record is applied under the lock."""
        self._lock, self._apply = lock, apply

    # --- observe(): the decision, on the device -------------------------------------------

    def decide(self, values: DeviceStep) -> None:
        """Sets ``values.guard`` (4 flags) and ``values.guard_index`` for the step's transfer."""
        self.settle()
        loss, grad = values.loss, values.grad_norm
        scaled = values.grad_scale is not None  # overflowing grads are the scaler's to skip
        explosion_limit = self.history.grad.event_limit()
        loss_limit = self.history.loss.spike_limit()  # a loss above it is no healthy new level
        spike_limit = loss_limit if self.spikes else math.inf
        tensors = [x for x in (loss, grad) if isinstance(x, loaded.Tensor)]
        dist = loaded.distributed()  # None without torch: no process group
        distributed = dist is not None and dist.is_initialized() and dist.get_world_size() > 1
        if tensors or distributed:
            device = tensors[0].device if tensors else _collective_device()
            flags = _device_flags(loss, grad, scaled, explosion_limit, spike_limit, loss_limit, device)
            if distributed:
                # Every rank skips the same steps: a MAX of four flags, enqueued like any kernel.
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        else:
            flags = _host_flags(loss, grad, scaled, explosion_limit, spike_limit, loss_limit)
        self._current, self._stepped = (self.decisions, flags), set()
        if len(self._used) > 4 * MAX_PENDING:  # only the decisions whose flags may still be in flight
            self._used = {i for i in self._used if i >= self.decisions - 2 * MAX_PENDING}
        values.guard = flags
        values.guard_index = float(self.decisions)
        self.decisions += 1

    def settle(self) -> None:
        """The training step is over (the next is being observed, or the run ends): a bad step
        that no ``Monitor.step`` withheld is recorded as what it was, a step the model took in."""
        with self._lock:
            self._current = None
            parked, self._parked = self._parked, None
            if parked is not None and self._apply is not None:
                self._apply(parked[1])

    # --- the applier: the flags on the host -------------------------------------------------

    def record(
        self,
        flags: list[float] | tuple[float, ...],
        index: float,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        pending: Any = None,
    ) -> str:
        """One step's flags on the host (the transfer's lock held): ``APPLIED``, ``SKIPPED`` (counted
        now), or ``PARKED`` (``pending``, the record, waits for its Monitor.step or the next decision)."""
        index = int(index)
        self._host = (index, tuple(flags))
        bad = next((reason for reason, f in zip(REASONS, flags) if f > 0), None)
        if bad is not None and index in self._used:  # Monitor.step withheld it already, on the device
            self._count(index, bad, step, loss, grad_norm, loss_bad=flags[_BAD] > 0)
            return SKIPPED
        current = self._current
        if bad is not None and pending is not None and current is not None and current[0] == index:
            self._parked = (index, pending)
            return PARKED
        self._consecutive = 0  # applied, or never stepped through the guard: the model took it in
        self.state.clear_consecutive_skips()
        self._level.clear()
        return APPLIED

    def _count(
        self, at: int, reason: str, step: int, loss: float | None, grad_norm: float | None, *, loss_bad: bool
    ) -> None:
        """One withheld step: counted, and judged for a new level or a halt. ``loss_bad``: the loss
        went bad with the step on some rank (the reduced flag), so it is no new level."""
        self._consecutive += 1
        self.state.count_skip(reason, self._consecutive)
        # An explosion whose loss stays finite and below the spike limit on every rank may be a
        # new level (layers unfrozen, a summed loss, a new data mix): after accept_level_after of
        # them in a row it becomes the baseline. Only a non-finite value or a bad loss leads to a
        # stop. Judged from the reduced flags, not this rank's loss: a loss gone bad on one rank
        # only would otherwise stop that rank alone, and leave the others waiting in a collective.
        healthy = reason == "explosion" and grad_norm is not None and math.isfinite(grad_norm) and not loss_bad
        if not healthy:
            self._level.clear()
        else:
            self._level.append((step, grad_norm))  # type: ignore[arg-type]
            if len(self._level) >= self.accept_level_after:
                self._accept_level(step)
                return
        if self._halt is None and not healthy and (self.mode == "stop" or self._consecutive > self.max_consecutive):
            values = {k: v for k, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None}
            self._halt = (at + self.lag(), TrainingHalted(step, reason, values, self._consecutive))

    def _accept_level(self, step: int) -> None:
        """The skipped norms become the baseline: explosions are judged again against the new level
        once ``windows.baseline_min_records`` norms of it are in."""
        steps, norms = zip(*self._level)
        self.history.rebase_grad(steps, norms)
        self._level.clear()
        self._consecutive = 0
        self.state.count_level_change()
        _log.warning(
            "lossbeat: the gradient norm stayed at a new level (%.4g) with a healthy loss for %d steps "
            "up to step %d: accepted as the run's baseline",
            sorted(norms)[len(norms) // 2],
            len(norms),
            step,
        )

    def lag(self) -> int:
        """Decisions between a bad step and its halt: every rank has its flags on the host by then
        (on CUDA with deferred reads, ``MAX_PENDING``; else none)."""
        torch = loaded.refresh()
        return MAX_PENDING if self.defer and torch is not None and torch.cuda.is_available() else 0

    # --- Monitor.step(): apply the decision ---------------------------------------------------

    def step(self, optimizers: list[Any], grad_scaler: Any = None, scheduler: Any = None, closure: Any = None) -> Any:
        """Apply the training step's decision to ``optimizers`` (every optimizer stepped before the
        next ``observe`` shares it); a step without one is decided from its gradients."""
        grad_scaler = skipping.active_scaler(grad_scaler)
        for optimizer in optimizers:
            if id(optimizer) not in self._optimizers:  # refused at its first step, before anything is applied
                skipping.refuse_optimizer(optimizer)
                if grad_scaler is not None and not skipping.scaler_skippable(grad_scaler):
                    raise ValueError("grad_scaler: expected a torch.amp.GradScaler, whose skip the guard goes through")
                self._optimizers[id(optimizer)] = optimizer
        out = None
        if closure is not None:  # what the optimizer would do first: forward and backward (and observe)
            import torch  # an optimizer: torch is loaded

            with torch.enable_grad():
                out = closure()
        if grad_scaler is not None and skipping.unscaled_elsewhere(grad_scaler, optimizers):
            raise ValueError(
                "grad_scaler: another optimizer unscaled by this GradScaler waits for its step, and the "
                "update after this one would unscale it twice: step them together, "
                "monitor.step([optimizer_a, optimizer_b], grad_scaler=scaler)"
            )
        current = self._current
        if current is None or any(id(o) in self._stepped for o in optimizers):
            current = self._undecided(grad_scaler)
        self._stepped.update(id(o) for o in optimizers)
        index, flags = current
        applied = self._apply_decision(optimizers, grad_scaler, index, flags)
        if index != _UNDECIDED and index not in self._used:
            self._mark_used(index)
        if scheduler is not None:
            if applied is None and self.hold_schedule:
                self.host_reads += 1
                applied = not bool(flags[:_BAD].amax() > 0)  # host sync: guard_schedule="hold" on the device path
            if applied or not self.hold_schedule:
                scheduler.step()
        self._raise_if_halted()
        return out

    def _apply_decision(self, optimizers: list[Any], grad_scaler: Any, index: int, flags: Any) -> bool | None:
        host = self._host
        if index == _UNDECIDED or (host is not None and host[0] == index):  # on the host: a Python branch
            bad = flags if index == _UNDECIDED else any(f > 0 for f in host[1][:_BAD])  # type: ignore[index]
            if not bad:
                skipping.plain_step(optimizers, grad_scaler)
            elif grad_scaler is not None:
                import torch  # a GradScaler: torch is loaded

                skipping.skip_with_scaler(optimizers, grad_scaler, torch.ones((), dtype=torch.bool))
            return not bad
        bad = flags[:_BAD].amax() > 0
        if grad_scaler is not None:
            skipping.skip_with_scaler(optimizers, grad_scaler, bad)
            return None
        applied: bool | None = None
        for optimizer in optimizers:
            applied = self._device_step(optimizer, bad)
        return applied

    def _mark_used(self, index: int) -> None:
        """The first Monitor.step of decision ``index``: a bad record parked for it is now a skip."""
        with self._lock:
            self._used.add(index)
            parked = self._parked
            if parked is not None and parked[0] == index and self._apply is not None:
                self._parked = None
                self._apply(parked[1])

    def _undecided(self, grad_scaler: Any) -> tuple[int, Any]:
        """A training step observe() did not decide (not called for it, or it failed): decided now
        from the gradients of every optimizer the guard has seen, non-finite values only, and shared
        by the optimizers stepped after it. Under a GradScaler its own overflow check skips them."""
        if self.state.count_undecided_step() == 1:
            _log.warning(
                "lossbeat: Monitor.step() without a decision from observe() for this step (observe "
                "not called, or it failed): the guard decides it from the gradients (non-finite only)"
            )
        self._stepped = set()
        bad = False
        if grad_scaler is None:
            self.host_reads += 1
            bad = skipping.nonfinite_gradients(list(self._optimizers.values()))  # host sync: counted above
        self._current = (_UNDECIDED, bad)
        if bad:  # on the host on every rank already: a halt is raised at once
            step = -1 if self.state.step is None else int(self.state.step) + 1
            self._count(self.decisions - 1 - self.lag(), "nonfinite", step, None, None, loss_bad=True)
        else:
            self._consecutive = 0
            self.state.clear_consecutive_skips()
        return self._current

    def _device_step(self, optimizer: Any, bad: torch.Tensor) -> bool | None:
        """Skip on the device where the optimizer allows it; returns None when it did (unknown here)."""
        strategy = self._strategies.get(optimizer)  # not by id: a later optimizer may reuse a freed one's
        if strategy is None:
            strategy = self._strategies[optimizer] = skipping.strategy(optimizer, bad.device)
        if strategy == "found_inf":
            skipping.found_inf_step(optimizer, bad)
            return None
        if strategy == "mask":
            skipping.masked_step(optimizer, bad)
            return None
        self.host_reads += 1
        if bool(bad):  # host sync: an optimizer the device cannot skip for (documented)
            return False
        optimizer.step()
        return True

    def _raise_if_halted(self) -> None:
        halt = self._halt
        if halt is not None and self.decisions - 1 >= halt[0]:
            self.state.halt()
            raise halt[1]

    def pending_halt(self) -> TrainingHalted | None:
        """A halt decided but not raised yet (a bad step among the last ones of a deferred run)."""
        halt = self._halt
        return halt[1] if halt is not None and not self.state.halted else None


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


def _device_flags(
    loss: Any, grad: Any, scaled: bool, explosion_limit: float, spike_limit: float, loss_limit: float, device: Any
) -> Any:
    """(non-finite, explosion, spike, the loss above its spike limit) as a float32 tensor."""
    import torch

    false = torch.zeros((), dtype=torch.bool, device=device)
    nonfinite = explosion = spike = loss_bad = false
    if loss is not None:
        lt = _as_tensor(loss, device)
        nonfinite = ~torch.isfinite(lt)
        if math.isfinite(spike_limit):
            spike = lt > spike_limit
        if spike_limit == loss_limit:
            loss_bad = spike
        elif math.isfinite(loss_limit):
            loss_bad = lt > loss_limit
    if grad is not None:
        gt = _as_tensor(grad, device)
        if not scaled:
            nonfinite = nonfinite | ~torch.isfinite(gt)
        if math.isfinite(explosion_limit):
            explosion = gt > explosion_limit  # NaN compares False
    return torch.stack([nonfinite, explosion, spike, loss_bad]).to(torch.float32)


def _host_flags(
    loss: Any, grad: Any, scaled: bool, explosion_limit: float, spike_limit: float, loss_limit: float
) -> list[float]:
    """:func:`_device_flags` on floats."""
    nonfinite = loss is not None and not math.isfinite(loss)
    nonfinite = nonfinite or (grad is not None and not scaled and not math.isfinite(grad))
    explosion = grad is not None and grad > explosion_limit
    spike = loss is not None and loss > spike_limit
    loss_bad = loss is not None and loss > loss_limit
    return [float(nonfinite), float(explosion), float(spike), float(loss_bad)]


class NoGuard:
    """``guard="off"``: ``step`` is ``optimizer.step()`` exactly (with a scaler: its step and update)."""

    host_reads = 0
    decides = False  # observe() skips decide()

    def decide(self, values: DeviceStep) -> None:
        pass

    def record(self, *args: Any) -> str:
        return APPLIED

    def settle(self) -> None:
        pass

    def attach(self, lock: Any, apply: Any) -> None:
        pass

    def pending_halt(self) -> None:
        return None

    def step(self, optimizers: list[Any], grad_scaler: Any = None, scheduler: Any = None, closure: Any = None) -> Any:
        out = skipping.plain_step(optimizers, grad_scaler, closure)
        if scheduler is not None:
            scheduler.step()
        return out


def make_guard(
    *,
    mode: str,
    spikes: bool,
    schedule: str,
    thresholds: Thresholds,
    history: History,
    state: MonitorState,
    defer: bool,
) -> Guard | NoGuard:
    state.set_guard_mode(mode)
    if mode == "off":
        return NoGuard()
    return Guard(
        mode=mode,
        spikes=spikes,
        hold_schedule=schedule == "hold",
        thresholds=thresholds,
        history=history,
        state=state,
        defer=defer,
    )
