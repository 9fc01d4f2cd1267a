"""Replay a parsed log through the live monitor's judgment: same Judge, same History, same checks.

Each train record is one ``History.add_step``; windows that judge a trend are
measured in steps, so a log written every step or every 500 steps gets the
same verdict. The judgment runs every ``windows.diagnose_every`` records or
steps, whichever comes first, and after each eval record, like the live monitor; the worst status each check
reached is kept with the step where it first did, next to the final findings
and every status change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lossbeat.diagnosis import Finding, Judge, Status, StatusChange
from lossbeat.diagnosis.history import History
from lossbeat.diagnosis.patterns import Pattern, PatternTracker
from lossbeat.diagnosis.resources import ThroughputTracker, check_memory
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.diagnosis.window import Ring
from lossbeat.logs import EvalRecord, ParsedLog, TrainRecord

__all__ = ["Analysis", "WorstFinding", "replay", "EVENT_KINDS"]

EVENT_KINDS = ("nonfinite_loss", "nonfinite_grad", "loss_spikes", "grad_explosions")
_MAX_EVENT_STEPS = 1000  # steps remembered per event kind (the counters go on)
_MAX_CHANGES = 1000  # status changes remembered (the count goes on)


@dataclass(frozen=True)
class WorstFinding:
    finding: Finding
    step: int
    """The step at which the check first reached this status."""


@dataclass
class Analysis:
    path: str
    format: str
    train_records: int = 0
    missing_losses: int = 0
    eval_records: int = 0
    eval_groups: tuple[str, ...] = ()
    first_step: int | None = None
    last_step: int | None = None
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_KINDS, 0))
    event_steps: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in EVENT_KINDS})
    findings: list[Finding] = field(default_factory=list)
    """The final diagnosis, at the end of the log."""
    worst: dict[tuple[str, str], WorstFinding] = field(default_factory=dict)
    """Per (check, component): the worst status reached during the run."""
    changes: list[StatusChange] = field(default_factory=list)
    """Status changes in order (the first ``_MAX_CHANGES``); ``status_changes`` counts them all."""
    status_changes: int = 0
    pattern: Pattern | None = None
    """The loss curve's pattern at the end (article section 1.3), as the live monitor names it."""
    pattern_since: int | None = None
    """The step at which that pattern began."""
    profile: str = ""
    """The task profile the run was judged with, and why (:meth:`Detection.describe`)."""
    profile_reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> Status:
        """The worst status of the final findings."""
        return max((f.status for f in self.findings), default=Status.GOOD)

    @property
    def worst_status(self) -> Status:
        """The worst status any check reached at any point of the run."""
        return max((w.finding.status for w in self.worst.values()), default=Status.GOOD)

    def reached(self, check: str, status: Status = Status.WARNING, component: str | None = None) -> bool:
        """Whether ``check`` (for ``component``, or any) reached ``status`` or worse during the run."""
        return any(
            key[0] == check and (component is None or key[1] == component) and w.finding.status >= status
            for key, w in self.worst.items()
        )


def _merged(train: list[TrainRecord], evals: list[EvalRecord]):
    """Both lists in file order, interleaved by step; at equal steps the train record first."""
    i = j = 0
    while i < len(train) or j < len(evals):
        if j < len(evals) and (i >= len(train) or evals[j].step < train[i].step):
            yield evals[j]
            j += 1
        else:
            yield train[i]
            i += 1


_LAYER = "layer_grad_norm/"


class _Vitals:
    """What a log may carry of the run's vitals, judged as the live monitor judges them: step times
    (``step_time``, seconds) in throughput blocks, allocated memory (``memory_allocated``, bytes)
    sampled at each diagnosis after the same warm-up, per-layer grad norms (``layer_grad_norm/<name>``)
    into the History the Judge reads. Bounded as live: a block, a ring of samples, one float a layer."""

    def __init__(self, t: Thresholds, history: History) -> None:
        self.t, self.history = t, history
        self.throughput = ThroughputTracker(t.throughput)
        self.times = False
        self.memory = Ring(t.memory.samples)
        self.memory_now = math.nan
        self.memory_seen = 0
        self.layers: dict[str, float] = {}

    def take(self, name: str, value: float) -> bool:
        """Take a vital signal; False for any other signal (the History's)."""
        if name == "step_time":
            self.times = True
            self.throughput.add(value)
        elif name == "memory_allocated":
            if math.isfinite(value):
                self.memory_now = value
        elif name.startswith(_LAYER):
            self.layers[name[len(_LAYER) :]] = value
            self.history.set_layer_norms(self.layers)
        else:
            return False
        return True

    def findings(self) -> list[Finding]:
        """At each diagnosis: sample the memory, judge memory and throughput (only what the log carries)."""
        out = []
        if math.isfinite(self.memory_now):
            self.memory_seen += 1
            if self.memory_seen > self.t.memory.warmup_samples:
                self.memory.push(self.memory_now)
            samples = self.memory.last(len(self.memory))
            if samples:  # no limit in a log: the leak is judged by its trend alone
                out.append(check_memory(samples, None, None, self.t.memory, self.t.windows.diagnose_every))
        if self.times:
            out.append(self.throughput.finding())
        return out


class _Replay:
    def __init__(self, log: ParsedLog, thresholds: Thresholds) -> None:
        self.t = thresholds
        self.judge = Judge(thresholds)
        self.history = self.judge.history
        self.vitals = _Vitals(thresholds, self.history)
        self.patterns = PatternTracker()
        self.a = Analysis(
            log.path, log.format, notes=list(log.notes), eval_groups=tuple(log.eval_groups), eval_records=len(log.evals)
        )

    def train(self, r: TrainRecord) -> None:
        a = self.a
        a.train_records += 1
        a.first_step = r.step if a.first_step is None else a.first_step
        a.last_step = r.step
        if r.loss is None:  # a missing value is not an observation: nothing to count or window
            a.missing_losses += 1
            return
        events = self.history.add_step(r.step, r.loss, r.grad_norm, r.learning_rate)
        for kind, hit in zip(
            EVENT_KINDS, (events.nonfinite_loss, events.nonfinite_grad, events.spike, events.explosion)
        ):
            if hit:
                a.counters[kind] += 1
                if len(a.event_steps[kind]) < _MAX_EVENT_STEPS:
                    a.event_steps[kind].append(r.step)
        if self.judge.due(r.step):
            self.diagnose(r.step)

    def eval(self, r: EvalRecord) -> None:
        self.history.add_eval(r.loss, r.group, r.step)
        self.diagnose(r.step)

    def diagnose(self, step: int) -> list[Finding]:
        findings, changes = self.judge.judge(step)
        findings = findings + self.vitals.findings()  # as the live monitor adds its vitals to the Judge's
        a = self.a
        a.status_changes += len(changes)
        a.changes.extend(changes[: max(0, _MAX_CHANGES - len(a.changes))])
        for f in findings:
            key = (f.check, f.component)
            seen = a.worst.get(key)
            if f.known and (seen is None or f.status > seen.finding.status):
                a.worst[key] = WorstFinding(f, step)
        a.pattern = self.patterns.update(findings, step)
        a.pattern_since = self.patterns.since_step
        return findings


def replay(log: ParsedLog, thresholds: Thresholds) -> Analysis:
    """Feed every record of ``log`` to a fresh Judge and judge as the live monitor does."""
    r = _Replay(log, thresholds)
    r.a.profile = thresholds.profile.name
    signals: dict[int, list[tuple[str, float]]] = {}
    for name, points in getattr(log, "signals", {}).items():
        for step, value in points:
            signals.setdefault(step, []).append((name, value))
    for record in _merged(log.train, log.evals):
        for name, value in signals.pop(record.step, ()):  # the signals of a step, before its judgment
            if not r.vitals.take(name, value):
                r.history.add_signal(name, value, record.step)
        if isinstance(record, TrainRecord):
            r.train(record)
        else:
            r.eval(record)
    last = r.a.last_step if r.a.last_step is not None else 0
    r.a.findings = r.diagnose(last)
    if r.a.missing_losses:
        r.a.notes.append(f"{r.a.missing_losses} records without a loss value were skipped (missing, not non-finite)")
    if r.a.train_records and not math.isfinite(r.history.first_loss):
        r.a.notes.append("no finite loss in the log")
    return r.a
