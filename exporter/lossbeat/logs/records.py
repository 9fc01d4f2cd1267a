"""What every parser produces: step records, read counts, and the runs found in one file.

A parser reads its format and feeds a :class:`RecordBuilder` in file order; the
builder keeps the latest record of a repeated step, splits the file into runs
where the step counter goes back to the start, and counts everything it read,
skipped or could not read, so that nothing is dropped without a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

__all__ = [
    "TrainRecord",
    "EvalRecord",
    "ReadCounts",
    "ParsedLog",
    "LogFormatError",
    "RecordBuilder",
    "DEFAULT_MAX_RECORDS",
]

DEFAULT_MAX_RECORDS = 1_000_000
"""Train records read per file before parsing stops (bounded memory; the report says where it stopped)."""

_MIN_STEPS_BEFORE_RESTART = 3
"""Distinct steps a run must hold before a step at or below its first one starts a new run
(a step logged twice by two ranks at the start is a repeat, not a restart)."""


_SINGULAR = {"lines": "line", "entries": "entry", "rows": "row", "events": "event", "records": "record"}


class LogFormatError(ValueError):
    """The file cannot be read as a log: unknown format, broken content, not a regular file."""


@dataclass(frozen=True, slots=True)
class TrainRecord:
    """One logged training step. A log records every k-th step: records are not steps."""

    step: int
    loss: float | None
    """None when the log has the step but no loss value (a missing value, not a NaN)."""
    grad_norm: float | None = None
    learning_rate: float | None = None
    epoch: float | None = None


@dataclass(frozen=True, slots=True)
class EvalRecord:
    """One evaluation loss; ``group`` names the eval set ('' = the only or unnamed one)."""

    step: int
    loss: float
    group: str = ""


@dataclass
class ReadCounts:
    """What a parse read, kept, skipped on purpose, and could not read."""

    unit: str = "lines"
    """What ``read`` counts: lines, entries (JSON), rows (CSV) or events (TensorBoard)."""
    read: int = 0
    train: int = 0
    """Train records kept (after repeated steps were merged)."""
    evals: int = 0
    """Eval records kept."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> units skipped on purpose (not a log record, a final summary, a repeated step...)."""
    unreadable: dict[str, int] = field(default_factory=dict)
    """Field -> values present in the log that could not be read as numbers (left out, never guessed)."""
    unreadable_examples: dict[str, str] = field(default_factory=dict)
    """Field -> the first unreadable value and where it was."""
    stopped_at: str | None = None
    """Where reading stopped early (record cap), or None when the whole file was read."""

    def summary(self) -> str:
        """One line: read N units: kept ..., skipped ..., unreadable ..."""
        unit = self.unit if self.read != 1 else _SINGULAR.get(self.unit, self.unit)
        text = f"read {self.read} {unit}: {self.train} train records, {self.evals} eval records"
        if self.skipped:
            text += "; skipped " + ", ".join(f"{n} {why}" for why, n in self.skipped.items())
        if self.unreadable:
            text += (
                "; unreadable "
                + ", ".join(
                    f"{n} {name} value{'s' if n > 1 else ''} (first: {self.unreadable_examples[name]})"
                    for name, n in self.unreadable.items()
                )
                + " (left out)"
            )
        if self.stopped_at:
            text += f"; STOPPED EARLY {self.stopped_at}"
        return text

    def to_dict(self) -> dict:
        return {
            "unit": self.unit,
            "read": self.read,
            "train": self.train,
            "evals": self.evals,
            "skipped": dict(self.skipped),
            "unreadable": dict(self.unreadable),
            "stopped_at": self.stopped_at,
        }


@dataclass
class ParsedLog:
    """One run's records (a file holds one run or several, see :attr:`segments`).

    ``parse_log`` returns the file: its ``train``/``evals`` are those of the
    **last** run in the file (all of them for the usual one-run file), and
    ``segments`` lists every run, each a ``ParsedLog`` of its own, in file order.
    Analyse each segment (``for run in log.segments: replay(run, t)``), never
    the records of several runs as one series.
    """

    path: str
    format: str
    train: list[TrainRecord] = field(default_factory=list)
    """Train records in step order (one per step: a step logged again keeps its latest record)."""
    evals: list[EvalRecord] = field(default_factory=list)
    """Eval records in step order."""
    notes: list[str] = field(default_factory=list)
    """What the reader did that a user must know: read counts, skipped and unreadable values, runs."""
    counts: ReadCounts = field(default_factory=ReadCounts)
    """For the whole file."""
    segment: int = 0
    """Index of this run in the file."""
    segments: list[ParsedLog] = field(default_factory=list)
    """Every run in the file, in order (one element for a one-run file); empty on a segment itself."""
    derived_steps: bool = False
    """True when the log prints no step and the steps were derived (see the notes)."""
    fields: tuple[str, ...] = ()
    """The field (key, column, tag) names the file holds, read or not: what the run is
    (``lossbeat.diagnosis.profiles.detect_profile`` names the task from them)."""
    signals: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Named signals beside the loss (``lossbeat.diagnosis.profiles.SIGNALS``: reward,
    reward_std, rewards/accuracies, eval_accuracy, ...), as (step, value) in step order."""

    @property
    def losses(self) -> int:
        """Train records that have a loss value."""
        return sum(1 for r in self.train if r.loss is not None)

    @property
    def eval_groups(self) -> list[str]:
        return sorted({e.group for e in self.evals})

    @property
    def runs(self) -> list[ParsedLog]:
        """The runs to analyse: ``segments``, or this log itself when it is a segment."""
        return self.segments or [self]


class _Run:
    __slots__ = ("by_step", "evals", "first_step", "first_gap", "last_step", "start", "signals")

    def __init__(self, start: str) -> None:
        self.signals: dict[str, dict[int, float]] = {}
        self.by_step: dict[int, TrainRecord] = {}
        self.evals: dict[tuple[int, str], EvalRecord] = {}
        self.first_step: int | None = None
        self.first_gap = 0
        """The distance from the first logged step to the next one (the run's first logging interval)."""
        self.last_step: int | None = None
        self.start = start

    def goes_back(self, step: int) -> bool:
        """True when ``step`` starts the count again: at or below the first step, or back within the
        first logging interval of it from well past it (a run logging 9, 19, ... 69 restarted at 10)."""
        if self.first_step is None or len(self.by_step) < _MIN_STEPS_BEFORE_RESTART:
            return False
        if step <= self.first_step:
            return True
        last = self.last_step if self.last_step is not None else step
        return self.first_gap > 0 and step <= self.first_step + self.first_gap and step < last - 2 * self.first_gap

    def add(self, step: int) -> None:
        if self.first_step is not None and not self.first_gap and step > self.first_step:
            self.first_gap = step - self.first_step
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step


def log_interval(steps: list[int]) -> int:
    """The usual distance between logged steps (median of the positive gaps; 1 when unknown)."""
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return max(1, int(median(gaps))) if gaps else 1


class RecordBuilder:
    """Collects a parser's records in file order; :meth:`finish` returns the :class:`ParsedLog`."""

    def __init__(self, path: str, fmt: str, unit: str = "lines", max_records: int = DEFAULT_MAX_RECORDS) -> None:
        self.path = path
        self.format = fmt
        self.counts = ReadCounts(unit=unit)
        self.notes: list[str] = []
        self.max_records = max_records
        self.derived_steps = False
        self._runs: list[_Run] = []
        self._records = 0
        self.fields: dict[str, None] = {}
        self.where = ""
        """Where the parser is (e.g. 'line 12'), for notes and examples; set by the parser."""
        self.column_map: dict[str, str] = {}
        """``--map``: role -> column, for the readers that choose columns by name (:mod:`lossbeat.logs.columns`)."""
        self.table_state: dict = {}
        """What a table reader keeps across re-reads of a followed file (a CSV rewritten with a wider header)."""

    # --- counting ---------------------------------------------------------------------------

    def skip(self, reason: str, n: int = 1) -> None:
        self.counts.skipped[reason] = self.counts.skipped.get(reason, 0) + n

    def unreadable(self, name: str, raw: object) -> None:
        """A value the log states for ``name`` that is not a number: counted, shown, left out."""
        self.counts.unreadable[name] = self.counts.unreadable.get(name, 0) + 1
        if name not in self.counts.unreadable_examples:
            text = repr(raw) if not isinstance(raw, str) else repr(raw[:40])
            self.counts.unreadable_examples[name] = f"{text} at {self.where}" if self.where else text

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @property
    def full(self) -> bool:
        """True once the record cap is reached: the parser stops and says where."""
        return self._records >= self.max_records

    def stop(self, where: str) -> None:
        self.counts.stopped_at = f"at {where}: the record cap ({self.max_records}) was reached; the rest was not read"

    # --- records ----------------------------------------------------------------------------

    def _current(self) -> _Run:
        if not self._runs:
            self._runs.append(_Run(self.where or "the start"))
        return self._runs[-1]

    def new_run(self, start: str) -> None:
        """The records that follow are another run's (a reader of several runs: MLflow's, W&B's)."""
        if self._runs and (self._runs[-1].by_step or self._runs[-1].evals):
            self._runs.append(_Run(start))

    def _maybe_restart(self, step: int) -> _Run:
        run = self._current()
        if run.goes_back(step):
            run = _Run(self.where or f"step {step}")
            self._runs.append(run)
        return run

    def train(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        learning_rate: float | None = None,
        epoch: float | None = None,
    ) -> None:
        run = self._maybe_restart(step)
        if step in run.by_step:
            self.skip("repeated steps (the latest record of a step kept)")
        else:
            self._records += 1
        run.by_step[step] = TrainRecord(step, loss, grad_norm, learning_rate, epoch)
        run.add(step)

    def eval(self, step: int, loss: float, group: str = "") -> None:
        run = self._current()
        if run.goes_back(step):
            run = self._maybe_restart(step)  # an eval before the first train record of the next run
        if (step, group) in run.evals:
            self.skip("repeated evals (the latest kept)")
        run.evals[(step, group)] = EvalRecord(step, loss, group)

    def complete(self, why: str) -> None:
        """The log says the run ended here (an end marker). Offline the file's end says as much;
        the live builder (:mod:`lossbeat.logs.live`) ends the watch on it."""

    def field_names(self, names) -> None:
        """Names of fields the file holds (bounded: the first 256)."""
        for name in names:
            if len(self.fields) >= 256:
                return
            if isinstance(name, str):
                self.fields.setdefault(name)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """A record's other named values (a table's columns): offline their names are in :attr:`fields`;
        the live builder hands them to the Monitor, whose profile detection reads their names."""

    def signal(self, step: int, name: str, value: float | None) -> None:
        """A named signal beside the loss at ``step`` (the latest of a step kept)."""
        if value is None:
            return
        self._current().signals.setdefault(name, {})[step] = value

    # --- result -----------------------------------------------------------------------------

    def finish(self) -> ParsedLog:
        runs = [r for r in self._runs if r.by_step or r.evals]
        segments: list[ParsedLog] = []
        for i, run in enumerate(runs):
            train = [run.by_step[s] for s in sorted(run.by_step)]
            evals = sorted(run.evals.values(), key=lambda e: e.step)
            seg = ParsedLog(
                self.path,
                self.format,
                train,
                evals,
                [],
                self.counts,
                i,
                [],
                self.derived_steps,
                tuple(self.fields),
                {k: sorted(v.items()) for k, v in run.signals.items()},
            )
            if len(runs) > 1:
                span = f"steps {train[0].step}-{train[-1].step}" if train else "no train records"
                seg.notes.append(f"run {i + 1} of {len(runs)} in this file ({span}, from {run.start})")
            seg.notes.extend(_start_note(train))
            segments.append(seg)
        self.counts.train = sum(len(s.train) for s in segments)
        self.counts.evals = sum(len(s.evals) for s in segments)
        notes = [self.counts.summary(), *self.notes]
        nonfinite = sum(1 for s in segments for r in s.train if r.loss is not None and not math.isfinite(r.loss))
        if nonfinite:
            notes.append(f"{nonfinite} non-finite loss values (NaN/Inf as the log states them)")
        if len(segments) > 1:
            starts = ", ".join(runs[i].start for i in range(1, len(runs)))
            notes.append(
                f"{len(segments)} runs in one file: the step goes back to the start at {starts} "
                "(a restart, or runs appended to one file); each run is analysed on its own"
            )
        for seg in segments:
            seg.notes[:0] = notes
        last = segments[-1] if segments else ParsedLog(self.path, self.format, notes=notes, counts=self.counts)
        # The file's notes: for a one-run file its run's notes, else the notes shared by every run.
        file_notes = list(last.notes) if len(segments) == 1 else notes
        return ParsedLog(
            self.path,
            self.format,
            last.train,
            last.evals,
            file_notes,
            self.counts,
            last.segment,
            segments,
            self.derived_steps,
            tuple(self.fields),
            dict(last.signals),
        )


def _start_note(train: list[TrainRecord]) -> list[str]:
    """A run whose first logged step lies well past one log interval starts mid-way (resumed or trimmed)."""
    if len(train) < 2:
        return []
    interval = log_interval([r.step for r in train])
    first = train[0].step
    if first > 2 * interval + 1:
        return [
            f"the step counter starts at {first} (logged every {interval} steps): "
            "the log begins mid-run (a resumed run, or a trimmed log)"
        ]
    return []
