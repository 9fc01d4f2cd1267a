"""The parsers made live: each record is handed on as soon as its line is read (``lossbeat watch``).

The line formats' parsers read a :class:`~lossbeat.logs.source.Source` whose ``lines`` come
from a followed file; a :class:`LiveBuilder` stands in for the :class:`RecordBuilder` and
passes each record to a sink at once instead of keeping it, so memory stays bounded however
long the run. A record is final when handed on: a step logged again (two ranks, a repeat) is
skipped, not revised; a step further back (a run resumed from a checkpoint, appending its redo)
is followed. The step going back to the start is a new run (the same test as the
offline split). Two formats need a live parser of their own: the HF Trainer's printed dicts,
whose steps the offline parser derives after reading the whole file, and LLaMA-Factory's
``trainer_log.jsonl``, whose ``total_steps`` says when the run ends. The others end the run
where their offline parser finds an end marker (llm.c's ``step N/N``). Torch-free.
"""

from __future__ import annotations

from typing import Callable, Protocol

from lossbeat.logs import _LINE_FORMATS, FORMATS
from lossbeat.logs.json_logs import read_llamafactory_line
from lossbeat.logs.records import _MIN_STEPS_BEFORE_RESTART, LogFormatError, RecordBuilder, _Run
from lossbeat.logs.source import Source, iter_lines, text_lines
from lossbeat.logs.text_logs import _HF_EVAL, HF_DICT, _dict_items, _py_number, hf_signals

__all__ = ["LiveSink", "LiveBuilder", "live_parser", "LIVE_FORMATS", "RESUME_INTERVALS"]

RESUME_INTERVALS = 2
"""A step further back than this many logging intervals (and not to the start) is a resume."""


class LiveSink(Protocol):
    """Where a :class:`LiveBuilder` sends the records, in file order."""

    def train(
        self, step: int, loss: float | None, grad_norm: float | None, learning_rate: float | None, epoch: float | None
    ) -> None: ...

    def eval(self, step: int, loss: float, group: str) -> None: ...

    def new_run(self, step: int) -> None:
        """The step went back to the start: the records that follow are another run's."""

    def resume(self, step: int, last: int) -> None:
        """The step went back from ``last`` to ``step``, not to the start: a run resumed from a
        checkpoint, whose records follow."""

    def complete(self, why: str) -> None:
        """The log says the run ended (the HF Trainer's final summary, the last of total_steps,
        llm.c's last step)."""


class LiveBuilder(RecordBuilder):
    """A :class:`RecordBuilder` that keeps nothing: records go to ``sink`` as they are parsed."""

    def __init__(self, path: str, fmt: str, sink: LiveSink) -> None:
        super().__init__(path, fmt, "lines")
        self.sink = sink
        self.runs = 1
        self.completed: str | None = None
        """Why the log says the run ended, once it does."""
        self._run = _Run("the start")
        # the HF printed dicts' record numbering, kept across rotations of the file
        self.hf_records = 0
        self.hf_epoch: float | None = None
        self.last_step: int | None = None
        self.resumes = 0
        """Times the step went back to resume from a checkpoint (see :meth:`_resumes`)."""

    @property
    def full(self) -> bool:
        return False  # nothing is kept: no record cap

    def _goes_back(self, step: int) -> bool:
        if not self._run.goes_back(step):
            return False
        self.runs += 1
        self._run = _Run(self.where or f"step {step}")
        self.last_step = None
        self.sink.new_run(step)
        return True

    def _resumes(self, step: int, last: int) -> bool:
        """True when ``step`` goes back by more than :data:`RESUME_INTERVALS` logging intervals
        without going back to the start: a run resumed from a checkpoint appending its redo to
        the same log (LLaMA-Factory's ``trainer_log.jsonl``, ``tee -a``). Its records are fed:
        the redo is the run's progress (its heartbeat, its faults), not a repeat. A step logged
        again or a little behind (two ranks appending to one file) is still a repeat. ``last``: the
        last step fed (``self.last_step``, not None here)."""
        interval = max(1, self._run.first_gap)
        if step >= last - RESUME_INTERVALS * interval:
            return False
        self.resumes += 1
        self.last_step = None
        resume = getattr(self.sink, "resume", None)  # a sink of its own may not follow resumes
        if resume is not None:
            resume(step, last)
        return True

    def _add(self, step: int) -> None:
        run = self._run
        if len(run.by_step) < _MIN_STEPS_BEFORE_RESTART:  # all goes_back needs: bounded
            run.by_step[step] = None  # type: ignore[assignment]
        run.add(step)
        self.last_step = step

    def train(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        learning_rate: float | None = None,
        epoch: float | None = None,
    ) -> None:
        if not self._goes_back(step) and self.last_step is not None and step <= self.last_step:
            if not self._resumes(step, self.last_step):
                self.skip("repeated or earlier steps (a live record is final: the first one kept)")
                return
        self._add(step)
        self.counts.train += 1
        self.sink.train(step, loss, grad_norm, learning_rate, epoch)

    def eval(self, step: int, loss: float, group: str = "") -> None:
        self._goes_back(step)
        self.counts.evals += 1
        self.sink.eval(step, loss, group)

    def signal(self, step: int, name: str, value: float | None) -> None:
        """Handed on with the step's record (nothing kept: bounded)."""
        if value is not None and hasattr(self.sink, "metrics"):
            self.sink.metrics(step, {name: value})

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if values and hasattr(self.sink, "metrics"):
            self.sink.metrics(step, values)

    def complete(self, why: str) -> None:
        if self.completed is None:
            self.completed = why
            self.sink.complete(why)


def parse_hf_stdout_live(src: Source, out: LiveBuilder) -> None:
    """The HF Trainer's printed dicts, one at a time. The Trainer prints no step: the step is the
    record number (1, 2, ...; again from 1 where the epoch goes back: a new run). The progress
    bar is not used live: stdout redirected to a file is block-buffered while the bar (stderr)
    is not, so the bar drawn before a dict may be hundreds of steps ahead of it (the offline
    parser checks the bar against the whole file; a live reader cannot). An eval dict belongs
    to the last train dict's step. The final ``train_runtime`` summary completes the run."""
    for line in text_lines(src, out):
        found = False
        for m in HF_DICT.finditer(line):
            found = True
            items = _dict_items(m.group(0)[1:-1])
            if "loss" in items:
                epoch = _py_number(out, "epoch", items.get("epoch"))
                if epoch is not None and out.hf_epoch is not None and epoch < out.hf_epoch:
                    out.hf_records = 0  # the epoch went back: a new run in the same log
                out.hf_epoch = epoch if epoch is not None else out.hf_epoch
                out.hf_records += 1
                hf_signals(out, out.hf_records, items)  # handed on before the record they belong to
                lr_key = "learning_rate" if "learning_rate" in items else ("lr" if "lr" in items else None)
                out.train(
                    out.hf_records,
                    _py_number(out, "loss", items["loss"]),
                    _py_number(out, "grad_norm", items.get("grad_norm")),
                    _py_number(out, "learning_rate", items.get(lr_key)) if lr_key else None,
                    epoch,
                )
            elif any(_HF_EVAL.match(k) for k in items):
                hf_signals(out, out.last_step or 0, items)
                for key, value in items.items():
                    g = _HF_EVAL.match(key)
                    if g and (loss := _py_number(out, key, value)) is not None:
                        out.eval(out.last_step or 0, loss, g.group(1) or "")
            elif "train_runtime" in items:
                out.skip("final summaries")
                out.complete("the HF Trainer printed its final summary (train_runtime)")
            else:
                out.skip("dicts without a loss")
        if not found:
            out.skip("lines that are not records (banners, progress, warnings)")


def parse_llamafactory_live(src: Source, out: LiveBuilder) -> None:
    """``trainer_log.jsonl`` a line at a time; the record whose ``current_steps`` reaches
    ``total_steps`` completes the run."""
    for line in iter_lines(src, out):
        read = read_llamafactory_line(line, out)
        if read is None:
            continue
        entry, step = read
        total = entry.get("total_steps")
        if isinstance(total, int) and not isinstance(total, bool) and 0 < total <= step:
            out.complete(f"step {step} of total_steps {total} logged")


LIVE_FORMATS: dict[str, Callable[[Source, LiveBuilder], None]] = {
    **_LINE_FORMATS,
    "hf-stdout": parse_hf_stdout_live,
    "llamafactory": parse_llamafactory_live,
}
"""The formats a live file can be read in: every line format (not whole JSON documents, not TensorBoard)."""


def live_parser(fmt: str) -> Callable[[Source, LiveBuilder], None]:
    """The live parser of ``fmt``; raises :class:`LogFormatError` for a format that is not line by line."""
    if fmt in LIVE_FORMATS:
        return LIVE_FORMATS[fmt]
    if fmt in FORMATS:
        raise LogFormatError(
            f"{fmt}: not a line-by-line log, so it cannot be followed (a JSON document "
            "rewritten whole, or event files): follow the run's printed log instead "
            f"(live formats: {', '.join(LIVE_FORMATS)})"
        )
    raise LogFormatError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
