"""What each rank exports so that the rules can compare the ranks of a job with each other.

No collective runs here: every rank exports its own numbers and Prometheus compares them,
so a rank that stops calling ``observe()`` cannot hang the others.

**Step-aligned gradient norm** (``TrainingRankGradientMismatch``). After the data-parallel
all-reduce every replica holds the same gradients, so their global norms agree to float
tolerance; one that differs has been corrupted or has desynchronised. Scrapes of different
ranks land on different steps, so each rank keeps the norm of the last step that is a
multiple of ``every`` together with that step; the rule compares the ranks whose aligned step
is the job's latest. Cost: one tuple assignment every ``every`` steps, from the float the
monitor already has on the host. Only where ranks must agree: by default (``every`` None) it
turns on (every :data:`AUTO_ALIGN_EVERY` steps) when the first model observed is a
``DistributedDataParallel`` over the whole world, and stays off for anything else (sharded or
model-parallel layouts hold per-rank norms that legitimately differ; so does a DDP over a
data-parallel subgroup next to plain-tensor tensor or expert parallelism, whose replica groups
hold different shards).

**Rank work time** (``TrainingStraggler``). Under synchronous data parallelism every rank's
step takes the same wall time (the all-reduce waits for the slowest), so the time between
``observe()`` calls cannot show a straggler. What differs is the work a rank does on its own:
the time from the end of its previous ``observe()`` to the start of the model's forward (data
loading, the optimizer step, zero_grad) plus the forward itself (hooks on the module passed
as ``observe(model=...)``; under DDP the forward of the wrapped module, which leaves out
DDP's buffer broadcast, a collective). The backward is left out: it contains the
gradient all-reduce, where the fast ranks wait for the slow one. On CUDA the forward part is
the host's launch time unless the host waits for the device. Exported as the mean over the
last ``window`` steps (a ring buffer).

What is measured is *host* time (``time.perf_counter``), not device time. On CPU that is the
work itself. Under asynchronous CUDA a throttled or failing GPU delays kernels, not their
launches: its host time looks normal and every rank then waits equally at the next sync, so
this signal cannot see a slow GPU (use DCGM's clocks and XID errors for that); it sees slow
data loading, a slow host, CPU contention and a slow optimizer step on the host. Conversely a
rank whose host waits for its device between ``observe()`` and the next forward (``loss.item()``,
``print(loss)``, a metrics sync that only rank 0 does) has that wait counted as its work: keep
rank-0-only logging after ``observe()`` off the work path, or read logged values from lossbeat.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lossbeat.diagnosis.window import Ring

if TYPE_CHECKING:
    import torch

__all__ = ["CrossRankSignals", "AUTO_ALIGN_EVERY"]

AUTO_ALIGN_EVERY = 100
"""The aligned-norm period where it turns on by itself (pure data parallelism)."""


def _pure_data_parallel(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a DistributedDataParallel over every rank whose replicas hold whole
    parameters: then, and only then, every rank's gradients must agree."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or any(hasattr(p, "_local_tensor") for p in model.parameters()):
        return False
    group = getattr(model, "process_group", None)
    # A subgroup (DDP over the data-parallel ranks of a TP/EP layout): other groups hold other shards.
    return group is None or not dist.is_initialized() or group.size() == dist.get_world_size()


class CrossRankSignals:
    """Step-aligned grad norm and rank work time of one rank (rendered by
    :class:`lossbeat.exposition.cross_rank.CrossRankCollector` at scrape time)."""

    def __init__(self, rank: str, align_every: int | None, work_time: bool, window: int = 50) -> None:
        self.rank = rank
        self.align_every = align_every
        """Aligned-norm period; 0 off; None: not decided yet (on for pure DDP, at the first model)."""
        self.work_time = work_time
        self.aligned: tuple[float, float] | None = None
        """(step, global grad norm) of the last aligned step; assigned whole."""
        self._work = Ring(window)
        self.work_mean: float | None = None
        self._hooked: int | None = None  # id() of the model the hooks are on
        self._handles: list = []
        self._step_end: float | None = None
        self._outer_start: float | None = None
        self._inner_start: float | None = None
        self._forward = 0.0

    # --- called by the monitor -------------------------------------------------------------

    def record(self, step: int, grad_norm: float | None) -> None:
        """A step's host values arrived (the training thread, possibly a step late)."""
        if self.align_every and grad_norm is not None and step % self.align_every == 0:
            self.aligned = (float(step), grad_norm)

    def step_end(self, model: torch.nn.Module | None) -> None:
        """End of ``observe()``: close this step's work time, hook the model on first sight."""
        if self.align_every is None and model is not None:
            self.align_every = AUTO_ALIGN_EVERY if _pure_data_parallel(model) else 0
        if not self.work_time:
            return
        now = time.perf_counter()
        if self._step_end is not None and self._outer_start is not None and self._outer_start >= self._step_end:
            self._work.push((self._outer_start - self._step_end) + self._forward)
            self.work_mean = sum(self._work) / len(self._work)  # <= `window` floats
        self._step_end, self._outer_start, self._forward = now, None, 0.0
        if model is not None and id(model) != self._hooked:
            self._hook(model)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = None

    # --- forward hooks (the training thread, inside the model's forward) ----------------------

    def _hook(self, model: torch.nn.Module) -> None:
        import torch  # a model: torch is loaded

        self.close()
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, torch.nn.Module) else model  # DDP/FSDP1 wrap `.module`
        self._handles = [
            model.register_forward_pre_hook(self._on_outer_start),
            inner.register_forward_pre_hook(self._on_inner_start),
            inner.register_forward_hook(self._on_inner_end),
        ]
        self._hooked = id(model)

    def _on_outer_start(self, module, args) -> None:
        if (
            self._outer_start is None
        ):  # the first forward of the step (gradient accumulation: later ones add forward time)
            self._outer_start = time.perf_counter()

    def _on_inner_start(self, module, args) -> None:
        self._inner_start = time.perf_counter()

    def _on_inner_end(self, module, args, output) -> None:
        if self._inner_start is not None:
            self._forward += time.perf_counter() - self._inner_start
            self._inner_start = None
