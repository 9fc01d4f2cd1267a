"""PyTorch Lightning CSVLogger ``metrics.csv``: sparse columns, one row per ``log_metrics`` call."""

from __future__ import annotations

import bisect
import csv
import re

from lossbeat.logs.records import RecordBuilder
from lossbeat.logs.source import Source, iter_lines, parse_number

__all__ = ["parse_lightning", "is_lightning_header", "choose_loss_column"]

_TRAIN = ("train_loss_step", "train_loss", "train/loss", "loss", "training_loss")
_EVAL = ("val_loss", "val/loss", "valid_loss", "validation_loss", "val_loss_epoch", "eval_loss", "eval/loss")
_GRAD = ("grad_norm", "train/grad_norm", "grad_2.0_norm_total", "grad_norm_total")
# LearningRateMonitor: "lr-AdamW", "lr-AdamW/pg1", "lr-SGD-momentum" (momentum and weight decay are not LRs).
_LR = re.compile(r"^(?:lr-[^,]*?|lr|learning_rate|train/learning_rate)$")
_NOT_LR = re.compile(r"-(?:momentum|beta\d?|weight_decay)$")
# Lightning's grad_norm() utility: one column per parameter or module, "grad_2.0_norm/<name>".
_LAYER = re.compile(r"^grad_(?:2(?:\.0)?)_norm/(.+)$")
_MAX_LAYERS = 64
_VITALS = {"step_time": "step_time", "memory_allocated": "memory_allocated"}
"""Columns read as the run's vitals (a step's wall time in seconds, allocated memory in bytes), by signal."""


_EVAL_PREFIX = re.compile(r"^(?:val|valid|validation|eval|evaluation|dev)(?:[_/\-. ]|$)", re.I)
_TRAIN_EXCLUDE = re.compile(r"^(?:val|valid|validation|eval|evaluation|dev|test|predict)(?:[_/\-. ]|$)|hp_metric", re.I)
_EVAL_EXCLUDE = re.compile(r"^(?:test|predict)(?:[_/\-. ]|$)", re.I)
_LOSS = re.compile(r"loss", re.I)


def _rank(name: str) -> tuple:
    """How much a loss column looks like *the* loss: a total over its parts, then a plain name
    (``loss``, ``mean_loss``, ``train_loss_step``), per step over per epoch, named train, the shortest
    name, then column order (the sort is stable)."""
    low = name.lower()
    plain = re.fullmatch(r"(?:train(?:ing)?[_/])?(?:mean_|avg_)?loss(?:_step|_epoch)?", low)
    return ("total" not in low, not plain, low.endswith("_epoch"), "train" not in low, len(name))


def choose_loss_column(
    columns: list[str], known: tuple[str, ...], exclude: re.Pattern, require: re.Pattern | None = None
) -> tuple[str | None, list[str]]:
    """The loss column by name: a known name first, else any column named ``*loss*`` (``mean_loss``,
    ``train/total_loss``, ``train_disc_loss``...) ranked by :func:`_rank`. Returns it and the other
    candidates (listed in the notes, not read)."""
    candidates = [
        c
        for c in columns
        if _LOSS.search(c) and not exclude.search(c) and (require is None or require.search(c)) and c not in _NOT_A_LOSS
    ]
    chosen = next((c for c in known if c in columns), None)
    if chosen is None and candidates:
        chosen = sorted(candidates, key=_rank)[0]
    others = [c for c in candidates if c != chosen and c not in _paired(chosen)]
    return chosen, others


_NOT_A_LOSS = frozenset({"step", "epoch"})


def _paired(chosen: str | None) -> set[str]:
    """The other aggregate of the chosen column (``train_loss_epoch`` beside ``train_loss_step``): not a rival."""
    if not chosen:
        return set()
    base = re.sub(r"_(?:step|epoch)$", "", chosen)
    return {base, f"{base}_step", f"{base}_epoch"}


def is_lightning_header(first_line: str) -> bool:
    return "step" in [c.strip() for c in first_line.split(",")]


def parse_lightning(src: Source, out: RecordBuilder) -> None:
    """Train rows, eval rows and LR rows are separate rows: the LR of a train record is the latest
    LR logged at or before its step (LearningRateMonitor writes rows of their own)."""
    reader = csv.DictReader(iter_lines(src, out))
    columns = list(reader.fieldnames or [])
    out.field_names(columns)
    out.counts.read = 0  # count rows below, not the header line
    out.counts.unit = "rows"
    train_col, train_others = choose_loss_column(columns, _TRAIN, _TRAIN_EXCLUDE)
    eval_col, eval_others = choose_loss_column(columns, _EVAL, _EVAL_EXCLUDE, _EVAL_PREFIX)
    if train_col:
        rest = f"; other loss columns, not read: {', '.join(train_others)}" if train_others else ""
        out.note(f"train loss from column {train_col!r}{rest}")
    if eval_col:
        rest = f"; other eval loss columns, not read: {', '.join(eval_others)}" if eval_others else ""
        out.note(f"eval loss from column {eval_col!r}{rest}")
    grad_col = next((c for c in _GRAD if c in columns), None)
    lr_cols = [c for c in columns if _LR.match(c) and not _NOT_LR.search(c)]
    lr_col = lr_cols[0] if lr_cols else None
    if lr_col:
        others = f"; not read: {', '.join(lr_cols[1:])}" if len(lr_cols) > 1 else ""
        out.note(f"learning rate from column {lr_col!r}{others}")
    vitals = {c: _VITALS[c] for c in columns if c in _VITALS}
    layers = {c: f"layer_grad_norm/{m.group(1)}" for c in columns if (m := _LAYER.match(c))}
    if len(layers) > _MAX_LAYERS:  # every value is kept until the replay: bounded by columns as by records
        out.note(f"per-layer grad norms: the first {_MAX_LAYERS} of {len(layers)} columns read")
        layers = dict(list(layers.items())[:_MAX_LAYERS])
    vitals.update(layers)
    if vitals:
        out.note(f"vitals from columns: {', '.join(list(vitals)[:6])}{', ...' if len(vitals) > 6 else ''}")
    unused = [
        c
        for c in columns
        if c not in {train_col, eval_col, grad_col, *lr_cols, *train_others, *eval_others, *vitals, "step", "epoch"}
    ]
    if unused:
        out.note(f"columns not read: {', '.join(unused[:12])}{', ...' if len(unused) > 12 else ''}")
    if not train_col:
        out.note(
            f"no train-loss column (looked for {', '.join(_TRAIN)}, then any column named *loss* "
            "that is not a validation, test or epoch aggregate)"
        )
    lr_steps: list[int] = []
    lr_values: list[float] = []
    rows: list[tuple] = []  # train and eval rows in file order, emitted once every LR is known
    for n, row in enumerate(reader, start=1):
        out.counts.read = n
        out.where = f"row {n}"
        step_raw = row.get("step")
        step, ok = parse_number(step_raw)
        if step is None or step != step:
            if step_raw not in (None, ""):
                out.unreadable("step", step_raw)
            out.skip("rows without a step")
            continue

        def value(col: str | None, row: dict[str, str] = row) -> float | None:
            if not col:
                return None
            v, ok = parse_number(row.get(col))
            if not ok:
                out.unreadable(col, row.get(col))
            return v

        used = False
        lr = value(lr_col)
        if lr is not None:
            used = True
            if lr_steps and int(step) < lr_steps[-1]:  # out of order: keep the list sorted
                i = bisect.bisect_right(lr_steps, int(step))
                lr_steps.insert(i, int(step))
                lr_values.insert(i, lr)
            else:
                lr_steps.append(int(step))
                lr_values.append(lr)
        for col, name in vitals.items():
            if row.get(col) not in (None, ""):
                out.signal(int(step), name, value(col))
        loss = value(train_col)
        if train_col and row.get(train_col) not in (None, ""):
            rows.append((out.where, int(step), loss, value(grad_col), value("epoch")))
            used = True
        val = value(eval_col)
        if val is not None:
            rows.append((out.where, int(step), val))
            used = True
        if not used:
            out.skip("rows with no train loss, eval loss or LR (epoch aggregates, other metrics)")
        if len(rows) >= out.max_records:
            out.stop(out.where)
            break
    for where, step, loss, *train in rows:
        out.where = where
        if not train:
            out.eval(step, loss)
            continue
        i = bisect.bisect_right(lr_steps, step)
        out.train(step, loss, train[0], lr_values[i - 1] if i else None, train[1])
