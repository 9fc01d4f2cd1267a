"""Parsers for finished runs' log files: each turns one file into step records.

Formats (auto-detected by :func:`detect_format`, see docs/analyze.md):

* ``hf``: Hugging Face ``trainer_state.json`` (``log_history``)
* ``llamafactory``: LLaMA-Factory ``trainer_log.jsonl``
* ``lightning``: PyTorch Lightning CSVLogger ``metrics.csv``
* ``llmc``: llm.c ``main.log`` (``s:N trl:L lr:X norm:G`` and ``s:N tel:V``)
* ``nanogpt``: modded-nanogpt speedrun logs (``step:N/M train_loss:L`` / ``val_loss:V``)
* ``megatron``: Megatron-LM golden values JSON (``{metric: {values: {step: v}}}``)

Missing values are ``None``; NaN and Inf that a log states as numbers stay
floats (the analysis counts them as non-finite). Torch-free.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

__all__ = [
    "TrainRecord",
    "EvalRecord",
    "ParsedLog",
    "LogFormatError",
    "FORMATS",
    "detect_format",
    "parse_log",
]


class LogFormatError(ValueError):
    """The file is not in a known format, or not readable as the one named."""


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
class ParsedLog:
    path: str
    format: str
    train: list[TrainRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the parser did that changes the records (duplicates dropped, missing values)."""

    @property
    def losses(self) -> int:
        """Train records that have a loss value."""
        return sum(1 for r in self.train if r.loss is not None)

    @property
    def eval_groups(self) -> list[str]:
        return sorted({e.group for e in self.evals})


def _num(value: Any) -> float | None:
    """A float, or None for a missing value (None, '', 'nan' strings are missing)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if not text or text.lower() in ("nan", "none", "null"):
            return None
        try:
            return float(text)
        except ValueError:
            return None
    return None


# --- Hugging Face trainer_state.json ---------------------------------------------------

_HF_EVAL = re.compile(r"^eval_(?:(.+)_)?loss$")


def _parse_hf(doc: Mapping, out: ParsedLog) -> None:
    for entry in doc.get("log_history") or []:
        if not isinstance(entry, Mapping) or "step" not in entry:
            continue
        step = int(entry["step"])
        epoch = _num(entry.get("epoch"))
        if "loss" in entry:  # the final summary has train_loss, not loss: not a step record
            out.train.append(TrainRecord(
                step, _num(entry["loss"]) if entry["loss"] is not None else None,
                _num(entry.get("grad_norm")), _num(entry.get("learning_rate")), epoch,
            ))
        for key, value in entry.items():
            m = _HF_EVAL.match(key)
            loss = _num(value)
            if m and loss is not None:
                out.evals.append(EvalRecord(step, loss, m.group(1) or ""))


# --- LLaMA-Factory trainer_log.jsonl ---------------------------------------------------

def _parse_llamafactory(lines: Iterable[str], out: ParsedLog) -> None:
    # Several ranks append to one file (each step twice, slightly out of order), and a
    # resumed run logs its steps again: the latest record of a step wins.
    by_step: dict[int, TrainRecord] = {}
    lines_read = without_loss = 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        entry = json.loads(line)
        lines_read += 1
        if "loss" not in entry:
            without_loss += 1
            continue
        step = int(entry["current_steps"])
        by_step[step] = TrainRecord(
            step, _num(entry["loss"]), _num(entry.get("grad_norm")),
            _num(entry.get("lr", entry.get("learning_rate"))), _num(entry.get("epoch")),
        )
        for key in ("eval_loss",):
            if _num(entry.get(key)) is not None:
                out.evals.append(EvalRecord(step, _num(entry[key])))
    out.train.extend(by_step[s] for s in sorted(by_step))
    out.notes.append(
        f"{lines_read} lines: {len(by_step)} distinct steps with a loss (the latest record of a step wins), "
        f"{without_loss} lines without a loss"
    )


# --- Lightning CSVLogger metrics.csv ---------------------------------------------------

_LIGHTNING_TRAIN = ("train_loss_step", "train_loss", "loss")
_LIGHTNING_EVAL = ("val_loss", "val_loss_epoch", "valid_loss")


def _parse_lightning(lines: Iterable[str], out: ParsedLog) -> None:
    reader = csv.DictReader(lines)
    columns = reader.fieldnames or []
    train_col = next((c for c in _LIGHTNING_TRAIN if c in columns), None)
    eval_col = next((c for c in _LIGHTNING_EVAL if c in columns), None)
    grad_col = next((c for c in columns if c in ("grad_norm", "grad_2.0_norm_total")), None)
    lr_col = next((c for c in columns if c.startswith("lr")), None)
    for row in reader:  # sparse: each row fills only the columns logged at that moment
        step = _num(row.get("step"))
        if step is None:
            continue
        loss = _num(row.get(train_col)) if train_col else None
        if loss is not None:
            out.train.append(TrainRecord(
                int(step), loss, _num(row.get(grad_col)) if grad_col else None,
                _num(row.get(lr_col)) if lr_col else None, _num(row.get("epoch")),
            ))
        val = _num(row.get(eval_col)) if eval_col else None
        if val is not None:
            out.evals.append(EvalRecord(int(step), val))
    if out.train and out.train[0].step > 0:
        out.notes.append(f"step counter starts at {out.train[0].step} (a resumed run)")


# --- llm.c main.log ------------------------------------------------------------------

_LLMC = re.compile(r"^s:(\d+)\s+(.*)$")
_KV = re.compile(r"(\w+):(\S+)")


def _parse_llmc(lines: Iterable[str], out: ParsedLog) -> None:
    for line in lines:
        m = _LLMC.match(line.strip())
        if not m:
            continue
        step = int(m.group(1))
        fields = dict(_KV.findall(m.group(2)))
        if "trl" in fields:
            out.train.append(TrainRecord(step, _num(fields["trl"]), _num(fields.get("norm")), _num(fields.get("lr"))))
        if "tel" in fields and _num(fields["tel"]) is not None:
            out.evals.append(EvalRecord(step, _num(fields["tel"])))


# --- modded-nanogpt speedrun logs ------------------------------------------------------

_NANOGPT = re.compile(r"^step:(\d+)/\d+\s+(.*)$")


def _parse_nanogpt(lines: Iterable[str], out: ParsedLog) -> None:
    for line in lines:
        m = _NANOGPT.match(line.strip())
        if not m:
            continue
        step = int(m.group(1))
        fields = dict(_KV.findall(m.group(2)))
        if "train_loss" in fields:
            out.train.append(TrainRecord(step, _num(fields["train_loss"])))
        if "val_loss" in fields and _num(fields["val_loss"]) is not None:
            out.evals.append(EvalRecord(step, _num(fields["val_loss"])))


# --- Megatron-LM golden values -------------------------------------------------------

def _parse_megatron(doc: Mapping, out: ParsedLog) -> None:
    series = doc.get("lm loss")
    if not isinstance(series, Mapping):
        raise LogFormatError(f"{out.path}: no 'lm loss' series")
    values = series.get("values") or {}
    missing = 0
    for key in sorted(values, key=int):
        loss = _num(values[key])  # the string "nan" is how the file marks a missing value
        missing += loss is None
        out.train.append(TrainRecord(int(key), loss))
    out.notes.append(f'{missing} of {len(values)} "lm loss" values are the string "nan": treated as missing')


# --- detection and entry point -------------------------------------------------------

FORMATS: tuple[str, ...] = ("hf", "llamafactory", "lightning", "llmc", "nanogpt", "megatron")
_JSON_FORMATS = {"hf": _parse_hf, "megatron": _parse_megatron}
_LINE_FORMATS: dict[str, Callable[[Iterable[str], ParsedLog], None]] = {
    "llamafactory": _parse_llamafactory,
    "lightning": _parse_lightning,
    "llmc": _parse_llmc,
    "nanogpt": _parse_nanogpt,
}
_HEAD_BYTES = 1 << 16


def detect_format(path: str | os.PathLike) -> str:
    """The format of a log file, from its first 64 KiB; raises :class:`LogFormatError`."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        head = fh.read(_HEAD_BYTES)
    stripped = head.lstrip()
    if stripped.startswith("{"):
        if '"log_history"' in head:
            return "hf"
        if '"current_steps"' in stripped.splitlines()[0]:
            return "llamafactory"
        if re.search(r'"step_interval"|"values"\s*:', head):
            return "megatron"
    first = stripped.splitlines()[0] if stripped else ""
    if "," in first and "step" in [c.strip() for c in first.split(",")]:
        return "lightning"
    if re.search(r"^s:\d+\s+(trl|tel):", head, re.M):
        return "llmc"
    if re.search(r"^step:\d+/\d+\s+(train_loss|val_loss):", head, re.M):
        return "nanogpt"
    raise LogFormatError(f"{os.fspath(path)}: unknown log format (known: {', '.join(FORMATS)})")


def _lines(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        yield from fh


def parse_log(path: str | os.PathLike, fmt: str | None = None) -> ParsedLog:
    """Parse one log file into train and eval records, each in the file's step order."""
    path = os.fspath(path)
    fmt = fmt or detect_format(path)
    out = ParsedLog(path, fmt)
    try:
        if fmt in _JSON_FORMATS:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)  # Python's json reads NaN/Infinity literals as floats
            if not isinstance(doc, Mapping):
                raise LogFormatError(f"{path}: expected a JSON object")
            _JSON_FORMATS[fmt](doc, out)
        elif fmt in _LINE_FORMATS:
            _LINE_FORMATS[fmt](_lines(path), out)
        else:
            raise LogFormatError(f"{path}: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    except (json.JSONDecodeError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, LogFormatError):
            raise
        raise LogFormatError(f"{path}: not a valid {fmt} log: {exc}") from exc
    nonfinite = sum(1 for r in out.train if r.loss is not None and not math.isfinite(r.loss))
    if nonfinite:
        out.notes.append(f"{nonfinite} non-finite loss values")
    return out
