"""Which column is what: the loss, step, LR, grad-norm, eval and epoch columns of a table of named values.

Every reader of named values (a CSV, JSON lines, a ``key value`` printout, an MLflow run's
metric files, a W&B run's history, stable-baselines3's ``progress.csv``, detectron2's
``metrics.json``) hands the names it found to :func:`choose_columns`, which picks each role by
name (a known name first, else a pattern; the rules are in docs/analyze.md) or takes it from a
``--map`` given by the user (:func:`parse_column_map`). :meth:`Columns.describe` says, for the
notes, what was chosen and what was not read. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from lossbeat.logs.csv_logs import choose_loss_column
from lossbeat.logs.records import LogFormatError

__all__ = ["Columns", "ROLES", "choose_columns", "parse_column_map", "names_a_loss"]

ROLES = ("loss", "step", "lr", "grad_norm", "eval", "epoch")
"""What ``--map`` can name: ``loss=COL,step=COL,lr=COL,grad_norm=COL,eval=COL,epoch=COL``."""
_ROLE_ALIASES = {"learning_rate": "lr", "grad": "grad_norm", "gnorm": "grad_norm", "eval_loss": "eval", "val": "eval"}

_TRAIN = (
    "loss",
    "train_loss",
    "train/loss",
    "training_loss",
    "train/total_loss",
    "total_loss",
    "train_loss_step",
    "trl",
)
_EVAL = ("eval_loss", "val_loss", "eval/loss", "val/loss", "valid_loss", "validation_loss", "validation/loss")
_STEP = (
    "step",
    "global_step",
    "train/global_step",
    "trainer/global_step",
    "iteration",
    "iter",
    "it",
    "_step",
    "time/total_timesteps",
    "num_updates",
    "updates",
    "batch",
    "steps",
    "total_steps",
)
_EPOCH = ("epoch", "train/epoch", "epochs")
_LR = re.compile(r"^(?:(?:train|optim|optimizer|trainer)[/_])?(?:lr|learning[_ ]rate)(?:[-_/].*)?$|^lr-", re.I)
_NOT_LR = re.compile(r"(?:momentum|beta\d?|weight_decay|scale|mult|multiplier|lrm)$|^lr_?decay", re.I)
_GRAD = re.compile(r"(?:^|[/_ ])(?:grad(?:ient)?[_ ]?norm|gnorm|total_norm|grad_norm_total)$", re.I)
_TRAIN_EXCLUDE = re.compile(
    r"(?:^|[/_ ])(?:val|valid|validation|eval|evaluation|dev|test|predict)(?:[_/\-. ]|$)|hp_metric|_epoch$", re.I
)
_EVAL_PREFIX = re.compile(r"^(?:val|valid|validation|eval|evaluation|dev)(?:[_/\-. ]|$)", re.I)
_EVAL_EXCLUDE = re.compile(r"^(?:test|predict)(?:[_/\-. ]|$)", re.I)
_LOSS = re.compile(r"loss", re.I)


def names_a_loss(names: Iterable[str]) -> bool:
    """Whether any name could be a training loss (what the generic reader needs to read a file)."""
    return any(isinstance(n, str) and _LOSS.search(n) and not _TRAIN_EXCLUDE.search(n) for n in names)


@dataclass
class Columns:
    """The column of each role (None: the file has none), the loss columns not read, and where the choice came from."""

    loss: str | None = None
    step: str | None = None
    lr: str | None = None
    grad_norm: str | None = None
    eval: str | None = None
    epoch: str | None = None
    other_losses: list[str] = field(default_factory=list)
    mapped: tuple[str, ...] = ()
    """The roles given by ``--map``."""

    def describe(self, names: Iterable[str], signals: Iterable[str] = ()) -> list[str]:
        """The notes: each role's column (chosen by name, or mapped), then what was not read."""
        chosen = []
        for role in ROLES:
            col = getattr(self, role)
            if col is not None:
                chosen.append(f"{role} {col!r}" + (" (--map)" if role in self.mapped else ""))
        notes = [
            "columns read: " + ", ".join(chosen) + ("" if self.step else "; no step column: steps are row numbers")
        ]
        if self.other_losses:
            notes.append(f"other loss columns, not read (--map loss=COL to read one): {', '.join(self.other_losses)}")
        used = {getattr(self, r) for r in ROLES} | set(self.other_losses) | set(signals)
        unused = [n for n in names if n not in used]
        if unused:
            notes.append(f"columns not read: {', '.join(unused[:12])}{', ...' if len(unused) > 12 else ''}")
        return notes


def parse_column_map(text: str | Mapping[str, str] | None) -> dict[str, str]:
    """``loss=COL,step=COL,...`` (or a mapping) as {role: column}; raises ValueError naming ``--map``."""
    if text is None:
        return {}
    if isinstance(text, Mapping):
        items = list(text.items())
    elif isinstance(text, str):
        items = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            role, sep, col = part.partition("=")
            if not sep or not col.strip():
                raise ValueError(f"--map: expected ROLE=COLUMN, got {part!r} (roles: {', '.join(ROLES)})")
            items.append((role, col))
    else:
        raise TypeError(f"--map: expected 'role=COLUMN,...' or a mapping, got {type(text).__name__}")
    out: dict[str, str] = {}
    for role, col in items:
        role = _ROLE_ALIASES.get(role.strip().lower(), role.strip().lower())
        if role not in ROLES:
            raise ValueError(f"--map: unknown role {role!r} (roles: {', '.join(ROLES)})")
        if not isinstance(col, str) or not col.strip():
            raise ValueError(f"--map: {role}: expected a column name, got {col!r}")
        out[role] = col.strip()
    return out


def choose_columns(
    names: list[str],
    mapping: Mapping[str, str] | None = None,
    *,
    path: str = "",
    train: tuple[str, ...] = _TRAIN,
    step: tuple[str, ...] = _STEP,
    strict: bool = True,
) -> Columns:
    """Each role's column among ``names`` (by name, or as ``mapping`` says). A mapped column the
    file lacks raises :class:`LogFormatError` naming ``--map`` when ``strict`` (every column is
    known up front); otherwise it is taken as named (a live file's columns come row by row)."""
    mapping = dict(mapping or {})
    if strict:
        missing = [f"{r}={c}" for r, c in mapping.items() if c not in names]
        if missing:
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise LogFormatError(f"{path}: --map names columns the file does not have: {', '.join(missing)} ({shown})")
    cols = Columns(mapped=tuple(mapping))
    usable = [n for n in names if n not in mapping.values()]
    if "loss" in mapping:
        cols.loss = mapping["loss"]
        _, cols.other_losses = choose_loss_column(usable, train, _TRAIN_EXCLUDE)
    else:
        cols.loss, cols.other_losses = choose_loss_column(usable, train, _TRAIN_EXCLUDE)
    cols.step = mapping.get("step") or next((n for n in step if n in usable), None)
    cols.epoch = mapping.get("epoch") or next((n for n in _EPOCH if n in usable), None)
    cols.lr = mapping.get("lr") or next((n for n in usable if _LR.match(n) and not _NOT_LR.search(n)), None)
    cols.grad_norm = mapping.get("grad_norm") or next((n for n in usable if _GRAD.search(n)), None)
    if "eval" in mapping:
        cols.eval = mapping["eval"]
    else:
        cols.eval = next((n for n in _EVAL if n in usable), None)
        if cols.eval is None:
            cols.eval, _ = choose_loss_column(usable, (), _EVAL_EXCLUDE, _EVAL_PREFIX)
    taken = {cols.loss, cols.eval, cols.step, cols.epoch}
    cols.other_losses = [c for c in cols.other_losses if c not in taken]
    return cols
