"""PyTorch Lightning CSVLogger ``metrics.csv``: sparse columns, one row per ``log_metrics`` call."""

from __future__ import annotations

import bisect
import csv
import re

from lossbeat.logs.records import RecordBuilder
from lossbeat.logs.source import Source, iter_lines, parse_number

__all__ = ["parse_lightning", "is_lightning_header"]

_TRAIN = ("train_loss_step", "train_loss", "train/loss", "loss", "training_loss")
_EVAL = ("val_loss", "val/loss", "valid_loss", "validation_loss", "val_loss_epoch", "eval_loss", "eval/loss")
_GRAD = ("grad_norm", "train/grad_norm", "grad_2.0_norm_total", "grad_norm_total")
# LearningRateMonitor: "lr-AdamW", "lr-AdamW/pg1", "lr-SGD-momentum" (momentum and weight decay are not LRs).
_LR = re.compile(r"^(?:lr-[^,]*?|lr|learning_rate|train/learning_rate)$")
_NOT_LR = re.compile(r"-(?:momentum|beta\d?|weight_decay)$")


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
    train_col = next((c for c in _TRAIN if c in columns), None)
    eval_cols = [c for c in _EVAL if c in columns]
    eval_col = eval_cols[0] if eval_cols else None
    grad_col = next((c for c in _GRAD if c in columns), None)
    lr_cols = [c for c in columns if _LR.match(c) and not _NOT_LR.search(c)]
    lr_col = lr_cols[0] if lr_cols else None
    if lr_col:
        others = f"; not read: {', '.join(lr_cols[1:])}" if len(lr_cols) > 1 else ""
        out.note(f"learning rate from column {lr_col!r}{others}")
    unused = [c for c in columns if c not in {train_col, eval_col, grad_col, *lr_cols, "step", "epoch"}]
    if unused:
        out.note(f"columns not read: {', '.join(unused[:12])}{', ...' if len(unused) > 12 else ''}")
    if not train_col:
        out.note(f"no train-loss column (looked for {', '.join(_TRAIN)})")
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

        def value(col: str | None) -> float | None:
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
