"""Tables of named values: rows of ``name -> value`` read into step records, columns chosen by name.

The formats (see docs/analyze.md):

* ``csv``: any CSV (or tab / semicolon separated) file whose header names a loss;
* ``jsonl``: JSON lines (or one JSON list of objects) whose keys name a loss (nested objects
  are flattened with ``/``);
* ``printout``: printed ``key value`` records (``epoch 1 | step 12 | train_loss 2.31 | lr 1.0e-04``,
  ``Epoch [1/10], Step [100/600], Loss: 0.2345``, ``step=12 loss=2.31``);
* ``sb3``: stable-baselines3's ``progress.csv`` (``train/loss``, ``time/total_timesteps``,
  ``rollout/ep_rew_mean``, ``train/entropy_loss``);
* ``detectron2``: detectron2's ``metrics.json`` (JSON lines with ``iteration``, ``total_loss``, ``lr``).

MLflow runs and W&B runs are tables too: their readers hand rows to the same :class:`TableReader`.
The columns are chosen by :func:`lossbeat.logs.columns.choose_columns` (or a ``--map``) and the
choice is written in the notes. Torch-free.
"""

from __future__ import annotations

import csv
import json
import math
import re
from typing import Any, Callable, Iterator, Mapping

from lossbeat.diagnosis.profiles import is_signal
from lossbeat.logs.columns import Columns, choose_columns, names_a_loss
from lossbeat.logs.json_logs import load_json
from lossbeat.logs.records import LogFormatError, RecordBuilder
from lossbeat.logs.source import Source, iter_lines, parse_number, text_lines

__all__ = [
    "TableReader",
    "parse_csv_table",
    "parse_jsonl_table",
    "parse_printout",
    "parse_sb3",
    "parse_detectron2",
    "table_kind",
    "printout_pairs",
    "is_printout",
    "SB3_STEP",
]

SB3_STEP = "time/total_timesteps"
_SB3_TRAIN = ("train/loss",)
_SB3_STEP = (SB3_STEP, "time/iterations", "train/n_updates")
_D2_TRAIN = ("total_loss",)
_D2_STEP = ("iteration",)
_RL_NAMESPACES = ("train/", "rollout/")
_MAX_METRICS = 64


class TableReader:
    """Rows in file order into ``out``: each row with a loss value is a train record, each row with
    an eval-loss value an eval record, named signals (reward, kl, ...) go beside them.

    The loss column is fixed at the first row whose names hold one; the other roles are taken
    when first seen. Steps: the step column; none: the row number (noted). A step counter that
    starts again while the epoch column rises (``Epoch [2/10], Step [100/600]``) is counted on
    from the last epoch's highest step (noted)."""

    def __init__(
        self,
        out: RecordBuilder,
        *,
        train: tuple[str, ...] | None = None,
        step: tuple[str, ...] | None = None,
        extra: Callable[[Mapping[str, Any], int, RecordBuilder], None] | None = None,
        strict: bool = False,
    ) -> None:
        self.out = out
        self.mapping = dict(getattr(out, "column_map", None) or {})
        self._kw = {k: v for k, v in (("train", train), ("step", step)) if v is not None}
        self.extra = extra
        self.strict = strict
        self.live = hasattr(out, "sink")
        """A live reader (``lossbeat watch``): the row's other values go to the Monitor as metrics."""
        self.cols: Columns | None = None
        self.names: dict[str, None] = {}
        self.signals: set[str] = set()
        self.rows = 0
        self._offset: float = 0  # grows by an epoch's largest step (a float, -inf before any)
        self._epoch_max = -math.inf
        self._last_raw: float | None = None
        self._last_step: int | None = None  # the step of the last row read
        self._last_epoch: float | None = None
        self._per_epoch = False

    def header(self, names: list[str]) -> None:
        """All the columns at once (a CSV header, an MLflow run's metric files): the choice is made now."""
        self._add_names(names)
        self._choose()

    def _add_names(self, names) -> bool:
        new = [n for n in names if n not in self.names]
        for n in new:
            self.names[n] = None
        if new:
            self.out.field_names(new)
            self.out.field_names(n.split("/", 1)[1] for n in new if n.startswith(_RL_NAMESPACES))
        return bool(new)

    def _choose(self) -> None:
        names = list(self.names)
        if self.cols is None or self.cols.loss is None:
            if self.cols is None or names_a_loss(names) or self.mapping:
                self.cols = choose_columns(names, self.mapping, path=self.out.path, strict=self.strict, **self._kw)
            return
        fresh = choose_columns(names, self.mapping, path=self.out.path, strict=False, **self._kw)
        for role in ("step", "lr", "grad_norm", "eval", "epoch"):
            if getattr(self.cols, role) is None:
                setattr(self.cols, role, getattr(fresh, role))
        self.cols.other_losses = [c for c in fresh.other_losses if c != self.cols.loss and c != self.cols.eval]

    def _value(self, row: Mapping[str, Any], col: str | None) -> float | None:
        if col is None or col not in row:
            return None
        value, ok = parse_number(row[col])
        if not ok:
            self.out.unreadable(col, row[col])
        return value

    def _step(self, row: Mapping[str, Any], cols: Columns) -> int | None:
        if cols.step is None:
            return self.rows
        raw = self._value(row, cols.step)
        if raw is None or not math.isfinite(raw):
            return None
        epoch = self._value(row, cols.epoch)
        if (
            self._last_raw is not None
            and raw < self._last_raw
            and epoch is not None
            and self._last_epoch is not None
            and epoch > self._last_epoch
        ):
            self._offset += self._epoch_max  # the step counts batches within an epoch
            self._epoch_max = -math.inf
            self._per_epoch = True
        self._epoch_max = max(self._epoch_max, raw)
        self._last_raw = raw
        self._last_epoch = epoch if epoch is not None else self._last_epoch
        return int(raw + self._offset)

    def row(self, row: Mapping[str, Any], where: str) -> None:
        out = self.out
        out.where = where
        self.rows += 1
        if self._add_names(row) or self.cols is None:
            self._choose()
        cols = self.cols
        if cols is None or (cols.loss is None and cols.eval is None):
            out.skip("rows before any loss column")
            return
        step = self._step(row, cols)
        if step is None and self._last_step is not None and cols.step not in row and _eval_alone(row, cols):
            step = self._last_step  # an eval line that prints no step ("Val | loss 2.3"): the step before it
        if step is None:
            out.skip("rows without a step")
            return
        self._last_step = step
        for name, raw in row.items():
            if is_signal(name) and name not in (cols.loss, cols.eval):
                value, ok = parse_number(raw)
                if ok and value is not None:
                    self.signals.add(name)
                    out.signal(step, name, value)
        if self.extra is not None:
            self.extra(row, step, out)
        if self.live:
            values = {}
            for name, raw in list(row.items())[:_MAX_METRICS]:
                value, ok = parse_number(raw)
                if ok and value is not None and name not in (cols.loss, cols.eval, cols.step):
                    values[name] = value
                    if name.startswith(_RL_NAMESPACES):
                        values[name.split("/", 1)[1]] = value
            out.metrics(step, values)
        used = False
        if cols.loss is not None and row.get(cols.loss) not in (None, ""):
            out.train(
                step,
                self._value(row, cols.loss),
                self._value(row, cols.grad_norm),
                self._value(row, cols.lr),
                self._value(row, cols.epoch),
            )
            used = True
        if cols.eval is not None and (val := self._value(row, cols.eval)) is not None:
            out.eval(step, val)
            used = True
        if not used:
            out.skip("rows without a loss or eval loss (other metrics)")

    def finish(self) -> None:
        """The notes: the columns read and not read; a refusal when nothing names a loss."""
        out = self.out
        if self.live:
            return  # a followed file ends in a reset or a stop: its notes are not printed
        if self.cols is None or (self.cols.loss is None and self.cols.eval is None):
            names = list(self.names)
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise LogFormatError(
                f"{out.path}: no column names a loss (columns: {shown or 'none'}); name one with --map loss=COLUMN"
            )
        for note in self.cols.describe(self.names, self.signals):
            out.note(note)
        if self.cols.step is None:
            out.derived_steps = True
        if self._per_epoch:
            out.note(f"the step column {self.cols.step!r} starts again each epoch: steps are counted on across epochs")


# --- CSV ------------------------------------------------------------------------------------------


def _delimiter(header: str) -> str:
    return max((",", "\t", ";"), key=header.count)


def _csv_rows(src: Source, out: RecordBuilder, reader: TableReader) -> None:
    header: list[str] | None = None
    delim = ","
    state = out.table_state
    n = 0
    for line in iter_lines(src, out):
        if not line.strip():
            out.skip("blank lines")
            continue
        if header is None:
            delim = _delimiter(line)
            header = [c.strip() for c in next(csv.reader([line], delimiter=delim))]
            reader.header(header)
            out.counts.unit = "rows"
            continue
        cells = next(csv.reader([line], delimiter=delim), [])
        if cells == header:  # a header again (files appended to): not a row
            out.skip("repeated header lines")
            continue
        n += 1
        row = {name: cell for name, cell in zip(header, cells) if cell != ""}
        if len(cells) > len(header):
            out.skip("rows with more cells than the header (extra cells left out)")
        if n == 1:
            # A file rewritten whole with a wider header (stable-baselines3 adds a column when a new
            # key is logged) holds the same rows again: a live reader skips those it handed on.
            key = tuple(sorted(row.items()))
            rewritten = state.get("first") == key
            state["skip_to"] = state.get("last_row", 0) if rewritten else 0
            if not rewritten:
                state["first"], state["last_row"] = key, 0
            elif state["skip_to"]:
                out.note("the file was rewritten with new columns: the rows read before were not read again")
        if n <= state.get("skip_to", 0):
            continue
        state["last_row"] = n
        reader.row(row, f"row {n}")
    if header is not None:
        out.counts.read = max(0, out.counts.read - 1)


def parse_csv_table(src: Source, out: RecordBuilder) -> None:
    """Any CSV whose header names a loss: each role's column chosen by name (or ``--map``)."""
    reader = TableReader(out, strict=True)
    _csv_rows(src, out, reader)
    reader.finish()


def _sb3_extra(row: Mapping[str, Any], step: int, out: RecordBuilder) -> None:
    """stable-baselines3 logs the entropy *loss* (minus the policy's entropy): the entropy is its negation."""
    value, ok = parse_number(row.get("train/entropy_loss"))
    if ok and value is not None:
        out.signal(step, "entropy", -value)


def parse_sb3(src: Source, out: RecordBuilder) -> None:
    """stable-baselines3's ``progress.csv``: ``train/loss`` at ``time/total_timesteps``; ``rollout/ep_rew_mean``
    is the reward, ``train/entropy_loss`` the policy's entropy (negated). A row of the first rollout holds
    no ``train/*`` value yet: its reward is read, it is not a train record."""
    reader = TableReader(out, train=_SB3_TRAIN, step=_SB3_STEP, extra=_sb3_extra, strict=True)
    _csv_rows(src, out, reader)
    reader.finish()
    out.note("stable-baselines3 progress.csv: the step is the environment step count (time/total_timesteps)")


# --- JSON lines -----------------------------------------------------------------------------------


def _flat(entry: Mapping, prefix: str = "", into: dict | None = None, depth: int = 0) -> dict[str, Any]:
    into = {} if into is None else into
    for key, value in entry.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and depth < 4:
            _flat(value, f"{name}/", into, depth + 1)
        elif not isinstance(value, (list, Mapping)):
            into[name] = value
    return into


def _json_rows(src: Source, out: RecordBuilder, reader: TableReader) -> None:
    out.counts.unit = "lines"
    if src.lines is None and src.head.lstrip().startswith("["):
        doc = load_json(src)
        if not isinstance(doc, list):
            raise LogFormatError(f"{src.path}: a JSON list was expected")
        out.counts.unit = "entries"
        for i, entry in enumerate(doc):
            out.counts.read += 1
            if isinstance(entry, Mapping):
                reader.row(_flat(entry), f"entry {i}")
            else:
                out.skip("entries that are not objects")
        return
    for line in iter_lines(src, out):
        text = line.strip()
        if not text:
            out.skip("blank lines")
            continue
        try:
            entry = json.loads(text)
        except (ValueError, RecursionError):
            out.skip("lines that are not JSON (a line cut short?)")
            continue
        if not isinstance(entry, Mapping):
            out.skip("lines that are not JSON objects")
            continue
        reader.row(_flat(entry), out.where)


def parse_jsonl_table(src: Source, out: RecordBuilder) -> None:
    """JSON lines (or a JSON list of objects) whose keys name a loss: columns chosen by name."""
    reader = TableReader(out)
    _json_rows(src, out, reader)
    reader.finish()


def parse_detectron2(src: Source, out: RecordBuilder) -> None:
    """detectron2's ``metrics.json``: one object per logging period, ``total_loss`` at ``iteration``
    (the sum of ``loss_*`` terms, each listed), ``lr``; evaluation results (``bbox/AP``...) are lines of
    their own and not losses: listed as not read."""
    reader = TableReader(out, train=_D2_TRAIN, step=_D2_STEP)
    _json_rows(src, out, reader)
    reader.finish()


# --- printed key value records --------------------------------------------------------------------

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|NAN|inf|Inf|INF)"
_VALUE = r"\[?\s*(" + _NUM + r")(?:\s*/\s*\d+)?\s*\]?"
# one word, then ":", "=" or a space, then the number (``[100/600]`` is 100)
_PAIR = re.compile(r"(?<![\w/.\-])([A-Za-z][\w/.\-]*)\s*(?:[:=]\s*|\s+)" + _VALUE + r"(?=$|[\s|,;)\]%])")
# two words, alone between separators: "| train loss 2.31 |"
_SEGMENT = re.compile(r"^\s*([A-Za-z][\w/.\-]* [A-Za-z][\w/.\-]*)\s*[:=]?\s*" + _VALUE + r"\s*$")
_SEPARATORS = re.compile(r"\s*(?:\||,|;|\t| - )\s*")
_NOT_PRINTED = re.compile(r"^\s*(?:[-*#>`]|\|.*\|\s*$)")


def printout_pairs(line: str) -> dict[str, str]:
    """The ``key value`` pairs of a printed line (keys lower-cased), e.g. ``epoch 1 | step 12 | loss 2.31``."""
    if not any(c.isdigit() for c in line):
        return {}
    pairs: dict[str, str] = {}
    for segment in _SEPARATORS.split(line):
        if m := _SEGMENT.match(segment):
            pairs[m.group(1).lower()] = m.group(2)
            continue
        for k, v in _PAIR.findall(segment):
            pairs.setdefault(k.lower(), v)
    return pairs


def _signature(line: str) -> tuple[str, ...] | None:
    """A printed record's keys, in order: a log prints the same ones on its records, prose does not."""
    if _NOT_PRINTED.match(line):
        return None  # markdown: lists, headings, tables, quotes, code
    pairs = printout_pairs(line)
    if len(pairs) < 2:
        return None
    return tuple(pairs) if names_a_loss(pairs) else None


def is_printout(lines: list[str]) -> bool:
    """Three printed records at least with the same keys in the same order, one of them naming a loss."""
    seen: dict[tuple[str, ...], int] = {}
    for line in lines:
        if (sig := _signature(line)) is not None:
            seen[sig] = seen.get(sig, 0) + 1
            if seen[sig] >= 3:
                return True
    return False


def _eval_alone(row: Mapping[str, Any], cols: Columns) -> bool:
    """The row holds an eval loss and no train loss."""
    return (
        cols.eval is not None
        and row.get(cols.eval) not in (None, "")
        and (cols.loss is None or row.get(cols.loss) in (None, ""))
    )


# A line headed by its phase ("Test: [48/48]  Loss: 4.1", timm's validation; "Val | loss 2.3"): its
# losses are that phase's, never the train loss.
_PHASE_NAMES = {"valid": "val", "validation": "val", "evaluation": "eval", "testing": "test"}
_PHASE = re.compile(r"^\s*(val|valid|validation|eval|evaluation|dev|test|testing)(?=[\s:|\-\[(]|$)", re.I)


def parse_printout(src: Source, out: RecordBuilder) -> None:
    """Printed ``key value`` records (``|``, ``,`` or spaces between pairs; ``:`` or ``=`` or a space
    between key and value; ``[100/600]`` read as 100). Lines without a pair are not records. The
    losses of a line headed by a phase (``Test:``, ``Val |``) are named for it (``test_loss``)."""
    reader = TableReader(out)
    for line in text_lines(src, out):
        pairs = printout_pairs(line)
        if not pairs:
            out.skip("lines that are not records (banners, progress, warnings)")
            continue
        if phase := _PHASE.match(line):
            name = _PHASE_NAMES.get(phase.group(1).lower(), phase.group(1).lower())
            pairs = {(f"{name}_{k}" if "loss" in k and not k.startswith(name) else k): v for k, v in pairs.items()}
        reader.row(pairs, out.where)
    reader.finish()


# --- detection ------------------------------------------------------------------------------------


def _first_lines(head: str, n: int = 50) -> Iterator[str]:
    k = 0
    for line in head.splitlines():
        if line.strip():
            yield line
            k += 1
            if k >= n:
                return


_PRINTED = re.compile(r"[\s\[:=]\s*[-+]?\.?\d")


def table_kind(head: str) -> str | None:
    """``sb3``, ``detectron2``, ``csv`` or ``jsonl`` for a head that is one of them (and names a loss), else None."""
    lines = list(_first_lines(head))
    if not lines:
        return None
    first = lines[0].strip()
    if first.startswith("{"):
        keys: dict[str, None] = {}
        for line in lines[:20]:
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(entry, Mapping):
                keys.update(dict.fromkeys(_flat(entry)))
        if "iteration" in keys and "total_loss" in keys:
            return "detectron2"
        return "jsonl" if names_a_loss(keys) else None
    if first.startswith("[{"):
        return "jsonl" if re.search(r'"[^"]*loss[^"]*"\s*:', head, re.I) else None
    delim = _delimiter(first)
    if first.count(delim) < 1 or len(lines) < 2:
        return None
    header = [c.strip() for c in next(csv.reader([first], delimiter=delim))]
    if any((parse_number(c)[1] and parse_number(c)[0] is not None) or _PRINTED.search(c) for c in header):
        return None  # a data row or a printed record ("Step [100/600]", "loss: 2.3"), not a header
    if SB3_STEP in header or ("train/loss" in header and any(c.startswith("rollout/") for c in header)):
        return "sb3"
    second = next(csv.reader([lines[1]], delimiter=delim), [])
    if len(second) != len(header) or not names_a_loss(header):
        return None
    return "csv"
