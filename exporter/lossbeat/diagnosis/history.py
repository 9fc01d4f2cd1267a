"""Bounded training history: what the checks read, fed one record at a time (or the usual
records in batches of at most ``windows.diagnose_every``, :meth:`History.defer`).

Torch-free, so the live monitor and offline analysis of log files share it.
Memory is fixed by the thresholds' window sizes, whatever the run length.
Windows that judge a trend are measured in steps (a :class:`StepSummary`);
noise is measured per record, where it lives.
"""

from __future__ import annotations

import math
from typing import Mapping

from lossbeat.diagnosis.events import EVENT_CHECKS, EventTrack
from lossbeat.diagnosis.gradients import LayerLevels
from lossbeat.diagnosis.moe import MoETrack
from lossbeat.diagnosis.profiles import MAX_SIGNALS, SIGNALS, SignalTrack, signal_kind
from lossbeat.diagnosis.run_memory import RunMemory
from lossbeat.diagnosis.series import GradBaseline, LearningRateSchedule, LossSeries
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.diagnosis.window import Ring, median, robust_noise

__all__ = ["History", "StepEvents", "NO_EVENTS", "LossSeries", "GradBaseline", "LearningRateSchedule", "EvalTrack"]

_MAX_COMPONENTS = 32  # bounded label cardinality for multi-task losses
_MAX_EVAL_GROUPS = 32
_CANONICAL = frozenset(SIGNALS)
_isfinite = math.isfinite


class StepEvents:
    """What one step counted (each flag is a counter increment)."""

    __slots__ = ("nonfinite_loss", "nonfinite_grad", "spike", "explosion")

    def __init__(self) -> None:
        self.nonfinite_loss = False
        self.nonfinite_grad = False
        self.spike = False
        self.explosion = False


NO_EVENTS = StepEvents()
"""What :meth:`History.defer` returns for every record it takes: nothing counted (shared: never written)."""


class EvalTrack:
    """One eval set: its best loss and how many evaluations in a row sit above it by ``eval_rise``."""

    def __init__(self, t: Thresholds) -> None:
        self.t = t
        self.best = math.inf
        self.best_step: int | None = None
        self.latest = math.nan
        self.count = 0
        self.above = 0
        """Evaluations in a row above the best by ``eval_rise`` and beyond the evaluations' noise."""
        self.still_above = 0
        """Evaluations in a row above the best by ``eval_rise`` x ``hysteresis.release`` (to leave overfitting)."""
        self.recent = Ring(10)
        self.first = math.nan

    def push(self, step: int | None, loss: float) -> None:
        """``step`` None: an evaluation before any training step (its ``best_step`` stays unknown)."""
        if not math.isfinite(loss):
            return
        if not self.count:
            self.first = loss
        self.recent.push(loss)
        self.count += 1
        self.latest = loss
        if loss < self.best:
            self.best, self.best_step = loss, step
        rise = (loss - self.best) / self.best if self.best > 0 else (math.inf if loss > self.best else 0.0)
        # Above the best by eval_rise, and by more than the evaluations' own noise: the best of many
        # noisy evaluations is their luckiest one, so a noisy eval loss sits above it most of the time
        # (a small or shifting validation set: real-logs-2's TFT forecaster's val loss jumps 25-60 %
        # and back between epochs while trending down). The noise is the robust evaluation-to-evaluation
        # noise of the last evaluations (second differences: a steady rise, real overfitting, is not
        # noise; see overfitting.noise_z).
        noise = robust_noise(self.recent.last(len(self.recent)))
        beyond = not math.isfinite(noise) or loss - self.best > self.t.overfitting.noise_z * noise
        self.above = self.above + 1 if rise > self.t.overfitting.eval_rise and beyond else 0
        # Once overfitting is judged, it is left only when the eval loss comes back near its best
        # (value hysteresis, as for volatility and plateaus): one lucky evaluation of a noisy eval set
        # that rises steadily is within its noise of the best, not back at it.
        self.still_above = (
            self.still_above + 1 if rise > self.t.overfitting.eval_rise * self.t.hysteresis.release else 0
        )

    @property
    def rise(self) -> float:
        if not self.count:
            return math.nan
        return (
            (self.latest - self.best) / self.best if self.best > 0 else (math.inf if self.latest > self.best else 0.0)
        )


class History:
    def __init__(self, thresholds: Thresholds) -> None:
        t = thresholds
        self.thresholds = t
        w = t.windows
        self.loss = LossSeries(t, history=max(t.learning_rate.too_small_window, w.noise_records))
        self.components: dict[str, LossSeries] = {}
        self.grad = GradBaseline(t)
        self.grad_norms = Ring(w.grad_steps)
        self.lr = LearningRateSchedule(t)
        self.evals: dict[str, EvalTrack] = {}
        self.last_step: int | None = None
        self.steps_seen = 0
        self.nonfinite_seen = 0
        self.last_nonfinite_at: int | None = None  # steps_seen at the last non-finite value
        self.layer_norms: Mapping[str, float] = {}
        self.layer_levels = LayerLevels()
        """Each layer's own earlier level and how long it has vanished below it (per diagnosis)."""
        self.grad_scale: float | None = None  # fp16 GradScaler's loss scale, when one is observed
        self.moe: MoETrack | None = None
        """The routers' latest per-layer statistics (``observe(expert_load=...)``), once a step has them."""
        self.signals: dict[str, SignalTrack] = {}
        """Named signals beside the loss (:data:`lossbeat.diagnosis.profiles.SIGNALS`), by canonical name."""
        self.grad_level_peak = math.nan
        """The highest grad-norm baseline median a diagnosis has seen (the RL collapse check's earlier level)."""
        self.grad_records = 0
        self.grad_zero_run = 0
        """Grad norms in a row that are exactly 0."""
        self.grad_nonfinite_run = 0
        """Grad norms in a row that are not finite."""
        self.nonfinite_recent = Ring(w.cv_steps)
        """1.0 for each of the last records that had a non-finite loss or gradient, else 0.0."""
        self.events = {check: EventTrack() for check in EVENT_CHECKS}
        """The loss spikes and explosions counted, with their steps (:mod:`lossbeat.diagnosis.events`)."""
        self.memory = RunMemory()
        """The run's best levels and the earliest event it has not recovered from."""
        self.resets = 0
        """Times the windows were reset (the step went backwards)."""
        self._held: list[tuple[int, float, float | None, float | None]] = []
        """The records :meth:`defer` took, not yet in the windows (at most ``windows.diagnose_every``)."""
        self._held_grads = 0
        self._every, self._early = w.diagnose_every, t.loss.spike_min_steps  # the windows' refresh cadence

    # Older names, kept for callers that read them.
    @property
    def lrs(self) -> Ring:
        return self.lr.recent

    @property
    def first_loss(self) -> float:
        return self.loss.initial

    @property
    def finite_losses_seen(self) -> int:
        return len(self.loss.summary)

    @property
    def eval_losses(self) -> list[float]:
        track = self.evals.get("")
        return [] if track is None else [track.latest]

    def retarget(self, thresholds: Thresholds) -> None:
        """Judge with ``thresholds`` (another profile) from now on; every window is kept."""
        self.flush()  # the records before were taken under the thresholds before
        self.thresholds = thresholds
        self._every, self._early = thresholds.windows.diagnose_every, thresholds.loss.spike_min_steps
        for part in (self.loss, self.grad, self.lr, *self.components.values(), *self.evals.values()):
            if hasattr(part, "retarget"):
                part.retarget(thresholds)  # and what it derived from them (the event limits)
            elif hasattr(part, "t"):
                part.t = thresholds

    def reset_windows(self, resumed_at: int | None = None) -> None:
        """The step went backwards (a restart, or another run appended): old windows no longer apply.
        ``resumed_at``: the step a resume from a checkpoint went back to; the run memory is kept, less
        what the abandoned steps after it opened (:meth:`RunMemory.resume`)."""
        self.flush()
        self.resets += 1
        self.loss.clear()
        for series in self.components.values():
            series.clear()
        self.grad.clear()
        self.grad_norms.clear()
        self.lr.clear()
        self.evals.clear()
        self.signals.clear()
        self.grad_records = self.grad_zero_run = self.grad_nonfinite_run = 0
        self.grad_level_peak = math.nan
        self.nonfinite_recent.clear()
        for track in self.events.values():
            track.clear()
        if resumed_at is None:
            self.memory.clear()
        else:
            self.memory.resume(resumed_at)

    def _level_before(self, pushed: bool) -> tuple[float, int]:
        """The loss level before this record's event: the median of the ``windows.cv_steps``
        finite records before it, and how many there were (read only when an event is counted)."""
        n = self.thresholds.windows.cv_steps
        values = self.loss.ring.last(n + 1)[:-1] if pushed else self.loss.ring.last(n)
        return (median(values) if values else math.nan), len(values)

    def add_step(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        learning_rate: float | None = None,
        components: Mapping[str, float] | None = None,
    ) -> StepEvents:
        """Record one step; returns the events it counts. Never raises on data.

        ``loss`` None: the step had no loss (a pipeline stage before the last): the loss
        series get no record, the other values count as usual."""
        if self._held:
            self.flush()
        events = StepEvents()
        self.steps_seen += 1
        if self.last_step is not None and step < self.last_step:
            # Back past the run's first step: a restart or another run. Back to a step after it: a
            # resume from a checkpoint, whose run memory (first loss, best levels) still holds.
            first = self.loss.first_step
            self.reset_windows(resumed_at=step if first is not None and step > first else None)
        self.last_step = step

        pushed = False  # this record's loss is in the loss ring (an event's level before excludes it)
        if loss is not None:
            events.nonfinite_loss = not math.isfinite(loss)
            events.spike = self.loss.push(step, loss)
            pushed = not events.nonfinite_loss
            if events.spike:
                before, n_before = self._level_before(pushed)
                self.events["loss_spikes"].push(
                    self.steps_seen, step, before, n_before, self.loss.noise, self.loss.records
                )
                self.memory.note_event("loss spike", step, before, self.loss.noise, self.loss.records - pushed)

        if grad_norm is not None:
            self.grad_records += 1
            self.grad_zero_run = self.grad_zero_run + 1 if grad_norm == 0.0 else 0
            self.grad_nonfinite_run = 0 if math.isfinite(grad_norm) else self.grad_nonfinite_run + 1
            if math.isfinite(grad_norm):
                self.grad_norms.push(grad_norm)
                if grad_norm != 0.0:  # no gradient (an RL step without advantage) is not a level
                    events.explosion = self.grad.push(step, grad_norm)
                    if events.explosion:
                        before, n_before = self._level_before(pushed)
                        self.events["grad_explosions"].push(
                            self.steps_seen, step, before, n_before, self.loss.noise, self.loss.records
                        )
                        self.memory.note_event(
                            "gradient-norm explosion", step, before, self.loss.noise, self.loss.records - pushed
                        )
            else:
                events.nonfinite_grad = True

        if learning_rate is not None:
            self.lr.push(step, learning_rate)

        if events.nonfinite_loss or events.nonfinite_grad:
            if self.memory.event_step is None:
                self.memory.note_event(
                    "non-finite loss" if events.nonfinite_loss else "non-finite gradient",
                    step,
                    self._level_before(pushed)[0],
                    self.loss.noise,
                    self.loss.records - pushed,
                )
            self.nonfinite_seen += 1
            self.last_nonfinite_at = self.steps_seen
        self.nonfinite_recent.push(1.0 if events.nonfinite_loss or events.nonfinite_grad else 0.0)

        if components:
            for name, value in components.items():
                series = self.components.get(name)
                if series is None:
                    if len(self.components) >= _MAX_COMPONENTS:
                        continue
                    series = self.components[name] = LossSeries(self.thresholds, self.thresholds.windows.noise_records)
                series.push(step, value)
        return events

    def defer(
        self, step: int, loss: float | None, grad_norm: float | None = None, learning_rate: float | None = None
    ) -> StepEvents | None:
        """``add_step`` for the usual record, its windows written in a batch: a finite loss that is
        no spike, a grad norm that is None or finite, non-zero and no explosion, no components, a
        step that does not go back. Such a record counts no event, judged now against the limits
        ``add_step`` would use: they move only when the windows are refreshed (every
        ``windows.diagnose_every`` records), and the batch is written into the windows at each
        refresh. Until then the windows lack it: whatever reads them calls :meth:`flush` first (the
        Judge, ``add_step``, a scrape's gauges). Returns :data:`NO_EVENTS`, or None for any other
        record, holding nothing back for it (``add_step`` it)."""
        last = self.last_step
        if loss is None or (last is not None and step < last) or not _isfinite(loss) or loss > self.loss._spike_limit:
            return None
        grad = self.grad
        if grad_norm is not None and not (_isfinite(grad_norm) and grad_norm != 0.0 and grad_norm <= grad._limit):
            return None
        held = self._held
        held.append((step, loss, grad_norm, learning_rate))
        self.last_step = step
        # Written now if this record is one whose push refreshes a window (as add_step's would).
        every = self._every
        pushes = self.loss._pushes + len(held)
        due = pushes % every == 0 or pushes <= self._early
        if grad_norm is not None:
            self._held_grads += 1
            due = due or not grad._established or (grad._pushes + self._held_grads) % every == 0
        if due:
            self.flush()
        return NO_EVENTS

    def flush(self) -> None:
        """Write the records :meth:`defer` held back into the windows, as ``add_step`` would have
        one by one (the same state, float for float)."""
        held = self._held
        if not held:
            return
        with_grads = self._held_grads
        self._held, self._held_grads = [], 0
        n = len(held)
        self.steps_seen += n
        steps, losses, grads, lrs = zip(*held)
        self.loss.extend(steps, losses)
        if with_grads != n:  # some records without a grad norm
            steps_grads = [(s, g) for s, g in zip(steps, grads) if g is not None]
            grad_steps, grads = (tuple(x) for x in zip(*steps_grads)) if steps_grads else ((), ())
        else:
            grad_steps = steps
        if grads:
            self.grad_records += len(grads)
            self.grad_zero_run = self.grad_nonfinite_run = 0
            self.grad_norms.extend(grads)
            self.grad.extend(grad_steps, grads)
        if None in lrs:
            steps_lrs = [(s, x) for s, x in zip(steps, lrs) if x is not None]
            lr_steps, lrs = (tuple(x) for x in zip(*steps_lrs)) if steps_lrs else ((), ())
        else:
            lr_steps = steps
        if lrs:
            self.lr.extend(lr_steps, lrs)
        self.nonfinite_recent.extend((0.0,) * n)

    def set_grad_scale(self, scale: float) -> None:
        """The fp16 GradScaler's loss scale at the latest step that carried one."""
        self.grad_scale = scale

    def set_layer_norms(self, norms: Mapping[str, float]) -> None:
        """The per-layer gradient norms of the latest step that measured them (kept, not copied)."""
        self.layer_norms = norms

    def add_router_stats(
        self, step: int, names: tuple[str, ...], imbalance: list[float], dead: list[float], experts: list[int]
    ) -> None:
        """One step's per-layer router statistics, into the router check's track (made at the first)."""
        track = self.moe
        if track is None:
            track = self.moe = MoETrack(self.thresholds.moe.dead_window_steps)
        track.push(step, names, imbalance, dead, experts)

    def rebase_grad(self, steps: tuple[int, ...], norms: tuple[float, ...]) -> None:
        """The gradient-norm baseline starts again from ``norms`` (a new level the guard accepted),
        after the records held back for a batch, which came before it."""
        self.flush()
        self.grad.clear()
        self.grad.extend(steps, norms)

    def note_grad_level(self, level: float) -> None:
        """A diagnosis's grad-norm baseline median: kept as :attr:`grad_level_peak` when finite and higher."""
        if math.isfinite(level) and not level <= self.grad_level_peak:
            self.grad_level_peak = level

    def update_layer_levels(self) -> None:
        """At a diagnosis: each layer's own level and how long it has vanished, from the latest norms."""
        self.layer_levels.update(self.layer_norms, self.thresholds.gradients)

    def add_signal(self, name: str, value: float, step: int | None = None) -> None:
        """Record a named signal (``reward_std``, ``rewards/accuracies``, ...); names outside
        :data:`~lossbeat.diagnosis.profiles.SIGNALS` and non-numbers are ignored (bounded)."""
        kind = signal_kind(name) or (name if name in _CANONICAL else None)
        if kind is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if step is None:
            step = self.last_step
            if step is None:  # before any step: a summary by steps has nowhere to put it (it raised)
                return
        track = self.signals.get(kind)
        if track is None:
            if len(self.signals) >= MAX_SIGNALS:
                return
            track = self.signals[kind] = SignalTrack()
        track.push(step, float(value))

    def add_eval(self, eval_loss: float, group: str = "", step: int | None = None) -> None:
        """Record an evaluation loss of eval set ``group`` ('' = the only or unnamed one)."""
        track = self.evals.get(group)
        if track is None:
            if len(self.evals) >= _MAX_EVAL_GROUPS:
                return
            track = self.evals[group] = EvalTrack(self.thresholds)
        track.push(self.last_step if step is None else step, eval_loss)
