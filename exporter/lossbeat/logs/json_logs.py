"""JSON logs: Hugging Face ``trainer_state.json``, LLaMA-Factory ``trainer_log.jsonl``, Megatron golden values."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from lossbeat.diagnosis.profiles import is_signal
from lossbeat.logs.records import LogFormatError, RecordBuilder
from lossbeat.logs.source import MAX_JSON_BYTES, Source, iter_lines, parse_number

__all__ = ["parse_hf_state", "parse_llamafactory", "parse_megatron_golden", "load_json", "HF_EVAL_KEY"]

HF_EVAL_KEY = re.compile(r"^eval_(?:(.+)_)?loss$")
"""``eval_loss`` (group '') and ``eval_<set>_loss`` (group '<set>'), as the HF Trainer names them."""
_LR_KEYS = ("learning_rate", "lr")
_SUMMARY_KEYS = ("train_loss", "train_runtime", "total_flos")
_READ_KEYS = {"step", "current_steps", "loss", "grad_norm", "epoch", *_LR_KEYS}


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 1 << 20 else f"{n} bytes"


def load_json(src: Source) -> Any:
    """The whole document (bounded: :data:`MAX_JSON_BYTES`); a broken one is a one-line error."""
    if src.size > MAX_JSON_BYTES:
        raise LogFormatError(
            f"{src.path}: a {_size(src.size)} JSON document is larger than the {_size(MAX_JSON_BYTES)} read at once"
        )
    try:
        with open(src.path, encoding=src.encoding or "utf-8", errors="replace") as fh:
            text = fh.read()
        return json.loads(text)  # Python's json reads NaN/Infinity literals as floats
    except json.JSONDecodeError as exc:
        # A document that stops before its closing bracket was cut short (a crash while saving).
        ends = text.rstrip()[-1:]
        what = "truncated JSON (the document ends early)" if ends not in ("}", "]") else "invalid JSON"
        raise LogFormatError(f"{src.path}: {what}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (RecursionError, MemoryError) as exc:
        raise LogFormatError(f"{src.path}: JSON too deeply nested or too large ({type(exc).__name__})") from None


def _value(out: RecordBuilder, entry: Mapping, key: str) -> float | None:
    """The number under ``key`` (None when absent or null); an unreadable value is counted."""
    value, ok = parse_number(entry.get(key))
    if not ok:
        out.unreadable(key, entry.get(key))
    return value


def _step(out: RecordBuilder, entry: Mapping, key: str) -> int | None:
    raw = entry.get(key)
    value, ok = parse_number(raw)
    if value is None or value != value or value in (float("inf"), float("-inf")):
        if raw is not None:
            out.unreadable(key, raw)
        return None
    return int(value)


def _train_and_evals(out: RecordBuilder, entry: Mapping, step: int) -> bool:
    """One HF-style entry: a train record if it has ``loss``, eval records for its ``eval_*loss`` keys,
    and the named signals beside them (reward, rewards/accuracies, eval_accuracy, ...)."""
    used = False
    out.field_names(entry)
    for key in entry:
        if isinstance(key, str) and is_signal(key):
            value, ok = parse_number(entry.get(key))
            if ok:
                out.signal(step, key, value)
    if "loss" in entry:
        lr_key = next((k for k in _LR_KEYS if k in entry), None)
        out.train(
            step,
            _value(out, entry, "loss"),
            _value(out, entry, "grad_norm"),
            _value(out, entry, lr_key) if lr_key else None,
            _value(out, entry, "epoch"),
        )
        used = True
    for key in entry:
        m = HF_EVAL_KEY.match(key)
        if m:
            loss = _value(out, entry, key)
            if loss is not None:
                out.eval(step, loss, m.group(1) or "")
                used = True
    return used


def _note_unread_keys(out: RecordBuilder, keys: set[str]) -> None:
    unread = sorted(
        k
        for k in keys
        if k not in _READ_KEYS
        and not HF_EVAL_KEY.match(k)
        and k not in _SUMMARY_KEYS
        and not (isinstance(k, str) and is_signal(k))
    )
    if unread:
        out.note(f"fields not read: {', '.join(unread[:12])}{', ...' if len(unread) > 12 else ''}")


def parse_hf_state(doc: Any, out: RecordBuilder) -> None:
    """``log_history``: entries with ``loss`` are train records, ``eval_*loss`` keys eval records."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("log_history"), list):
        raise LogFormatError(f"{out.path}: no 'log_history' list (not a trainer_state.json)")
    keys: set[str] = set()
    for i, entry in enumerate(doc["log_history"]):
        if isinstance(entry, Mapping) and len(keys) < 256:
            keys.update(k for k in entry if isinstance(k, str))
        out.counts.read += 1
        out.where = f"log_history[{i}]"
        if not isinstance(entry, Mapping):
            out.skip("entries that are not objects")
            continue
        step = _step(out, entry, "step")
        if step is None:
            out.skip("entries without a step")
            continue
        if not _train_and_evals(out, entry, step):
            out.skip("final summaries" if any(k in entry for k in _SUMMARY_KEYS) else "entries without a loss")
        if out.full:
            out.stop(out.where)
            break
    _note_unread_keys(out, keys)


def parse_llamafactory(src: Source, out: RecordBuilder) -> None:
    """One JSON object per line; ``current_steps`` is the step, ``loss`` / ``eval_loss`` the values.

    Several ranks append the same step (slightly out of order): the latest record of a step wins.
    A line cut short (a crash while writing) is counted, not fatal.
    """
    for line in iter_lines(src, out):
        read_llamafactory_line(line, out)


def read_llamafactory_line(line: str, out: Any) -> tuple[Mapping, int] | None:
    """One ``trainer_log.jsonl`` line into ``out`` (a RecordBuilder or the live one); returns the
    entry and its step, or None for a line that is not a record (counted in ``out``'s notes)."""
    line = line.strip()
    if not line:
        out.skip("blank lines")
        return None
    try:
        entry = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        out.skip("lines that are not JSON (a line cut short?)")
        return None
    if not isinstance(entry, Mapping):
        out.skip("lines that are not JSON objects")
        return None
    step = _step(out, entry, "current_steps")
    if step is None:
        out.skip("lines without current_steps")
        return None
    if not _train_and_evals(out, entry, step):
        out.skip("lines without a loss or eval loss (progress only)")
    return entry, step


def _missing_or_number(out: RecordBuilder, raw: object, name: str, missing: list[int]) -> float | None:
    # The golden files store the *string* "nan" for steps that were not measured: missing, not NaN.
    if isinstance(raw, str) and raw.strip().lower() == "nan":
        missing[0] += 1
        return None
    value, ok = parse_number(raw)
    if not ok:
        out.unreadable(name, raw)
    return value


def parse_megatron_golden(doc: Any, out: RecordBuilder) -> None:
    """Megatron-LM functional-test golden values: ``{"lm loss": {"values": {step: value}}, ...}``."""
    series = doc.get("lm loss") if isinstance(doc, Mapping) else None
    if not isinstance(series, Mapping) or not isinstance(series.get("values"), Mapping):
        raise LogFormatError(f"{out.path}: no 'lm loss' series with 'values' (not a Megatron golden-values file)")
    values = series["values"]
    pairs = []
    for key in values:
        try:
            pairs.append((int(key), key))
        except (TypeError, ValueError):
            out.unreadable("step", key)
    keys = sorted(pairs)
    missing = [0]
    for step, key in keys:
        out.counts.read += 1
        out.where = f'"lm loss" step {key}'
        out.train(step, _missing_or_number(out, values[key], "lm loss", missing))
        if out.full:
            out.stop(out.where)
            break
    others = sorted(k for k in doc if k != "lm loss")
    if others:
        out.note(f"series not read (no check uses them): {', '.join(others)}")
    out.note(f'{missing[0]} of {len(keys)} "lm loss" values are the string "nan": treated as missing')
