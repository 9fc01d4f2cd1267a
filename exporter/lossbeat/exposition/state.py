"""What one monitor's scrape renders: the state the training thread writes and the scrape
thread reads (``observe`` -> :class:`MonitorState` -> :mod:`lossbeat.exposition.collector`).

On its own so that the monitor writes it and the collector reads it with neither importing
the other.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Mapping, Sequence

from lossbeat.exposition.metrics import HEALTH_CHECKS

__all__ = [
    "MonitorState",
    "EVENTS",
    "Ring",
    "RECENT_STEPS",
    "LAYER_HISTORY_STEPS",
    "LAYER_FIRST_EVENT_STEPS",
    "EVALS_KEPT",
]

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


EVENTS = ("nonfinite_loss", "nonfinite_grad", "grad_scaler_overflows", "loss_spikes", "grad_explosions")
"""The step events with a counter (``training_<event>_total``) and a last step (``event_steps``)."""


class MonitorState:
    """What a scrape renders. Written by the training thread, read by the scrape thread:
    scalars are assigned and dicts are swapped whole, never mutated in place.

    Every field is written here, through the methods below, and only read elsewhere
    (``tests/test_architecture.py`` fails on an assignment from another module): what a
    scrape may see half-written, and in which order the fields move, is decided in one place."""

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

    # The step (the transfer's applier, its lock held).

    def record_step(
        self,
        step: int,
        wall_time: float,
        epoch: float | None,
        duration: float | None,
        loss: float | None,
        grad_norm: float | None,
        lr_max: float | None,
        learning_rates: dict[str, float] | None,
        components: dict[str, float] | None,
        layer_norms: dict[str, float] | None,
        layers_without_grad: int | None,
        layer_event: bool,
        clip: float | None,
        grad_scale: float | None,
        baseline: float | None,
        tokens: float | None,
        /,
    ) -> None:
        """One applied step's values (None: not given this step, the last value stays). A
        non-finite loss, norm or component is exported as NaN. ``layer_event``: the step's
        per-layer norms hold the run's first non-finite or exploding step unless one came before.
        The step counter moves last: a scrape that sees it sees the step's values."""
        if grad_scale is not None:
            self.grad_scale = grad_scale
        if loss is not None:
            self.loss = loss if math.isfinite(loss) else math.nan
        if grad_norm is not None:
            self.grad_norm = grad_norm if math.isfinite(grad_norm) else math.nan
        self.step = float(step)
        if epoch is not None:
            self.epoch = float(epoch)
        self.last_step_time = wall_time
        if duration is not None:
            self.step_duration = duration
        if learning_rates:
            self.learning_rates = learning_rates
        if components:
            self.components = {k: (x if math.isfinite(x) else math.nan) for k, x in components.items()}
        if layer_norms is not None:
            self.layer_norms = layer_norms
            self.layers_without_grad = layers_without_grad
        if clip is not None:
            self.clip_coefficient = clip
        self.grad_norm_baseline = baseline
        # The status page's windows: one tuple of floats already at hand, one dict reference.
        self.recent.append((step, loss, grad_norm, baseline, lr_max))
        if layer_norms is not None:
            self.layer_history.append((step, layer_norms))
            if self.layer_first_event_left:
                self.layer_first_event = (*self.layer_first_event, (step, layer_norms))
                self.layer_first_event_left -= 1
            elif layer_event and self.layer_first_event_step is None:
                self._keep_first_event(step)
        self.steps_total += 1
        if tokens is not None and math.isfinite(tokens):
            self.tokens_total += max(tokens, 0.0)

    def _keep_first_event(self, step: int) -> None:
        """Freeze the per-layer window around the run's first non-finite or exploding step: the steps
        before it now, the ones after it as they come (the latest window soon moves past it)."""
        self.layer_first_event_step = step
        self.layer_first_event = tuple(self.layer_history.snapshot()[-(LAYER_FIRST_EVENT_STEPS + 1) :])
        self.layer_first_event_left = LAYER_FIRST_EVENT_STEPS

    def count_event(self, event: str, step: int, *, origin: str | None = None) -> None:
        """One ``event`` (a name in :data:`EVENTS`) at ``step``. ``origin``: the layer a non-finite
        gradient starts at (None: unknown), set before the counter moves so that a scrape in
        between sees the new count with its layer."""
        if event == "nonfinite_grad":
            self.first_nonfinite_layer = origin
            self.nonfinite_grad_total += 1
        elif event == "nonfinite_loss":
            self.nonfinite_loss_total += 1
        elif event == "grad_scaler_overflows":
            self.grad_scaler_overflows_total += 1
        elif event == "loss_spikes":
            self.loss_spikes_total += 1
        elif event == "grad_explosions":
            self.grad_explosions_total += 1
        else:
            raise ValueError(f"event: expected one of {', '.join(EVENTS)}, got {event!r}")
        self.event_steps = {**self.event_steps, event: step}

    def merge_signals(self, signals: Mapping[str, float]) -> None:
        """Named signals (``observe(metrics=...)``, ``observe_eval(metrics=...)``) over the last ones."""
        self.signals = {**self.signals, **signals}

    def set_moe(
        self, names: Sequence[str], imbalance: Sequence[float], dead: Sequence[float], sizes: Sequence[int]
    ) -> None:
        """The last expert load's router statistics, per MoE layer: swapped whole."""
        self.moe = (names, imbalance, dead, sizes)

    def set_cuda_device(self, device: int | None) -> None:
        """The device whose memory the diagnosis and a scrape read."""
        self.cuda_device = device

    def set_loss_gauges(self, cv: float | None, trend_ratio: float | None) -> None:
        """The gauges a scrape derives from the loss window (``derive_gauges``)."""
        self.loss_cv, self.loss_trend_ratio = cv, trend_ratio

    # Besides the step: evaluations, phases, the run's end.

    def mark_activity(self) -> None:
        """A sign of progress other than a step (an evaluation, a phase, a heartbeat)."""
        self.last_activity_time = time.time()

    def record_eval(self, eval_loss: float) -> None:
        """One evaluation's loss (NaN when it is not finite)."""
        self.eval_loss = eval_loss if math.isfinite(eval_loss) else math.nan
        self.evals_total += 1

    def keep_eval(self, step: int | None, eval_loss: float) -> None:
        """An evaluation, judged at ``step``, into the status page's eval-loss curve."""
        self.evals.append((step, eval_loss))

    def enter_phase(self, name: str, now: float) -> bool:
        """The run does ``name`` from ``now`` (monotonic) on; returns whether the phase changed.
        The finished span is added to its phase's seconds in the same swap."""
        current, since, totals = self.phase
        if name == current:
            return False
        totals = {**totals, current: totals.get(current, 0.0) + now - since}
        self.phase = (name, now, totals)  # one swap: a scrape sees all or nothing
        return True

    def backdate(self, latest: float) -> None:
        """No step or activity later than ``latest`` (wall time): a replayed log's records are as
        old as the log's last write, not as the replay."""
        if self.last_step_time is not None:
            self.last_step_time = min(self.last_step_time, latest)
        if self.last_activity_time is not None:
            self.last_activity_time = min(self.last_activity_time, latest)

    def halt(self) -> None:
        """The guard stopped the run (TrainingHalted raised, or about to be)."""
        self.halted = True

    def finish(self, *, completed: bool) -> None:
        """The run ended: completed (the marker) unless it failed or the guard halted it."""
        self.completed = completed and not self.halted

    # The optimizer guard.

    def set_guard_mode(self, mode: str) -> None:
        """The optimizer guard's mode ("off": its series are not exported)."""
        self.guard_mode = mode

    def count_skip(self, reason: str, consecutive: int) -> None:
        """One step the guard kept from the optimizer for ``reason``; ``consecutive`` in a row now."""
        skipped = dict(self.skipped_steps)
        skipped[reason] = skipped.get(reason, 0) + 1
        self.skipped_steps = skipped  # swapped whole: a scrape sees all or nothing
        self.guard_consecutive_skips = consecutive

    def clear_consecutive_skips(self) -> None:
        """The model took a step in: no skip in a row."""
        self.guard_consecutive_skips = 0

    def count_level_change(self) -> None:
        """A lasting new gradient-norm level with a healthy loss became the baseline."""
        self.guard_consecutive_skips = 0
        self.guard_level_changes += 1

    def count_undecided_step(self) -> int:
        """One optimizer step Monitor.step took with no decision from observe(); returns how many."""
        self.guard_undecided_steps += 1
        return self.guard_undecided_steps

    # The judgment.

    def set_grad_norm_ceiling(self, ceiling: float) -> None:
        """The profile's absolute gradient-norm ceiling, for the status page."""
        self.grad_norm_ceiling = ceiling

    def set_pattern(self, name: str | None, since: int | None) -> None:
        """The loss-curve pattern and the step it began at: swapped whole."""
        self.pattern = (name, since)

    def set_health(self, health: dict[tuple[str, str], int]) -> None:
        """Each (check, component)'s status, a new dict (never the one a scrape may be reading)."""
        self.health = health

    def set_findings(self, findings: tuple[Any, ...]) -> None:
        """The last diagnosis's findings: :attr:`findings` reads them as plain tuples when asked."""
        self.findings_source = findings

    def set_profile(self, name: str, source: str, fields: str) -> None:
        """The task profile the run is judged by, how it was chosen, and the names that chose it;
        also the run's ``profile`` info label."""
        self.profile_info = {"profile": name, "source": source, "fields": fields}
        if self.run_info.get("profile") != name:
            self.run_info = {**self.run_info, "profile": name}

    def count_error(self, where: str) -> int:
        """Count one error at ``where``; returns how many there have been there (log the first)."""
        with self._error_lock:  # both threads count errors
            errors = dict(self.errors)
            errors[where] = errors.get(where, 0) + 1
            self.errors = errors
            return errors[where]
