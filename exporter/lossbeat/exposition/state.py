"""What one monitor's scrape renders: the state the training thread writes and the scrape
thread reads (``observe`` -> :class:`MonitorState` -> :mod:`lossbeat.exposition.collector`).

On its own so that the monitor writes it and the collector reads it with neither importing
the other.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Sequence

from lossbeat.exposition.metrics import HEALTH_CHECKS

__all__ = ["MonitorState", "Ring", "RECENT_STEPS", "LAYER_HISTORY_STEPS", "LAYER_FIRST_EVENT_STEPS", "EVALS_KEPT"]

RECENT_STEPS = 500
"""Steps kept for the status page's curves: (step, loss, grad norm, baseline, LR), ~100 B each (50 KB)."""
LAYER_HISTORY_STEPS = 100
LAYER_FIRST_EVENT_STEPS = 25
"""Steps kept on each side of the first non-finite or exploding step (the heatmap's moment that matters)."""
"""Measured steps kept for the status page's per-layer heatmap: references to the per-step layer
dicts the state swaps in anyway (no copy): ~60 KB a step at 1,000 layers (6 MB), 4 KB at 64."""
EVALS_KEPT = 200
"""Evaluations kept for the status page's eval-loss curve: (step, eval loss)."""


class Ring:
    """A bounded window the training thread appends to and a request thread copies.

    The lock is held only for one append or one copy (a copy of a few hundred references:
    microseconds), so a status request never stalls a step for longer than that."""

    def __init__(self, maxlen: int) -> None:
        self._items: collections.deque[Any] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def append(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)

    def snapshot(self) -> tuple[Any, ...]:
        with self._lock:
            return tuple(self._items)


class MonitorState:
    """What a scrape renders. Written by the training thread, read by the scrape thread:
    scalars are assigned and dicts are swapped whole, never mutated in place."""

    def __init__(self, rank: str, run_info: dict[str, str], run_id: str = "") -> None:
        self.rank = rank
        self.run_id = run_id
        """The run identity, a label of every series this monitor exports."""
        self.run_info = run_info
        self.cuda_device: int | None = None
        self.measures_memory = run_info.get("feed", "process") == "process"
        """Whether this process's memory is the training's (not when a log feeds it: lossbeat watch)."""
        self.loss: float | None = None
        self.eval_loss: float | None = None
        self.grad_norm: float | None = None
        self.step: float | None = None
        self.epoch: float | None = None
        self.last_step_time: float | None = None
        self.step_duration: float | None = None
        self.last_activity_time: float | None = None
        """Wall time of the last sign of progress other than a step (evaluation, phase, heartbeat)."""
        self.phase: tuple[str, float, dict[str, float]] = ("train", time.monotonic(), {})
        """(current phase, its monotonic start, seconds of the finished spans per phase): swapped whole."""
        self.completed = False
        self.pattern: tuple[str | None, int | None] = (None, None)
        """(loss-curve pattern name, the step it began at): swapped whole."""
        self.loss_cv: float | None = None
        self.loss_trend_ratio: float | None = None
        self.grad_norm_baseline: float | None = None
        self.clip_coefficient: float | None = None
        self.grad_scale: float | None = None
        self.components: dict[str, float] = {}
        self.signals: dict[str, float] = {}
        """Named signals (``observe(metrics=...)``) by canonical name: swapped whole."""
        self.profile_info: dict[str, str] = {}
        """The training_profile info labels (profile, source, fields): swapped whole."""
        self.learning_rates: dict[str, float] = {}
        self.layer_norms: dict[str, float] = {}
        self.moe: tuple[Sequence[str], Sequence[float], Sequence[float], Sequence[int]] | None = None
        """(MoE layer names, imbalances, dead experts, experts per layer) of the last expert load: swapped whole."""
        self.health: dict[tuple[str, str], int] = {(check, ""): 0 for check in HEALTH_CHECKS}
        self.first_nonfinite_layer: str | None = None
        self.layers_without_grad: int | None = None
        self.steps_total = 0
        self.tokens_total = 0.0
        self.evals_total = 0
        self.nonfinite_loss_total = 0
        self.nonfinite_grad_total = 0
        self.loss_spikes_total = 0
        self.grad_explosions_total = 0
        self.grad_scaler_overflows_total = 0
        self.guard_mode = "off"
        """The optimizer guard's mode; its series are exported unless it is off."""
        self.skipped_steps: dict[str, int] = {}
        """Steps the guard kept from the optimizer, by reason: swapped whole."""
        self.guard_consecutive_skips = 0
        self.guard_undecided_steps = 0
        """Optimizer steps Monitor.step took with no decision from observe(): decided from their gradients."""
        self.guard_level_changes = 0
        """Times a lasting new gradient-norm level with a healthy loss was accepted as the baseline."""
        self.halted = False
        """The guard stopped the run (TrainingHalted raised)."""
        self.errors: dict[str, int] = {"observe": 0, "gradients": 0, "collect": 0, "diagnose": 0}
        self._error_lock = threading.Lock()
        # The status page's data (lossbeat.exposition.status), plain values like the rest.
        self.started = time.time()
        self.findings_source: tuple[Any, ...] = ()
        """The last diagnosis's findings (objects with check, component, status, message, fix,
        known): swapped whole; :attr:`findings` reads them as plain tuples."""
        self._findings: tuple[tuple[str, str, int, str, str, bool], ...] = ()
        self._findings_of: tuple[Any, ...] = ()
        self.grad_norm_ceiling: float | None = None
        """The profile's absolute gradient-norm ceiling (gradients.explosion)."""
        self.event_steps: dict[str, int] = {}
        """The step of each event counter's last event (name without _total): swapped whole."""
        self.recent = Ring(RECENT_STEPS)
        """(step, loss, grad norm, grad-norm baseline, max LR) per applied step; None where absent."""
        self.evals = Ring(EVALS_KEPT)
        """(step, eval loss) per evaluation."""
        self.layer_history = Ring(LAYER_HISTORY_STEPS)
        """(step, {layer: norm}) per step with per-layer norms: the dict the state already holds."""
        self.layer_first_event: tuple[tuple[int, Any], ...] = ()
        """The per-layer norms around the run's first non-finite or exploding step (LAYER_FIRST_EVENT_STEPS
        before it, it, and as many after): kept while the latest window moves on; swapped whole."""
        self.layer_first_event_step: int | None = None
        self.layer_first_event_left = 0
        """Steps after the first event still to be added to ``layer_first_event``."""

    @property
    def findings(self) -> tuple[tuple[str, str, int, str, str, bool], ...]:
        """The last diagnosis as (check, component, status, message, fix, known), built when read
        (a status request), not at every diagnosis."""
        source = self.findings_source
        if source is not self._findings_of:
            self._findings = tuple(
                (f.check, f.component, int(f.status), f.message, f.fix if f.status else "", f.known) for f in source
            )
            self._findings_of = source
        return self._findings

    def count_error(self, where: str) -> int:
        """Count one error at ``where``; returns how many there have been there (log the first)."""
        with self._error_lock:  # both threads count errors
            errors = dict(self.errors)
            errors[where] = errors.get(where, 0) + 1
            self.errors = errors
            return errors[where]
