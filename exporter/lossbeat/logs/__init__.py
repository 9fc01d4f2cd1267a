"""Parsers for finished runs' logs: each turns one file into step records, one list per run.

Formats (auto-detected by :func:`detect_format`, see docs/analyze.md):

* ``hf``: Hugging Face ``trainer_state.json`` (``log_history``)
* ``hf-stdout``: the dicts the HF Trainer prints (``{'loss': 2.34, 'grad_norm': 1.2, ...}``)
* ``llamafactory``: LLaMA-Factory ``trainer_log.jsonl``
* ``lightning``: PyTorch Lightning CSVLogger ``metrics.csv``
* ``llmc``: llm.c ``main.log`` (``s:N trl:L lr:X norm:G`` and ``s:N tel:V``)
* ``llmc-stdout``: llm.c's printed lines (``step 1/19560 | loss 10.98 (+nanz)| norm 15.4 ...``)
* ``nanogpt``: karpathy/nanoGPT (``iter N: loss L, ...`` / ``step N: train loss A, val loss B``) and
  modded-nanogpt speedrun logs (``step:N/M train_loss:L`` / ``val_loss:V``)
* ``megatron``: Megatron-LM golden values JSON (``{metric: {values: {step: v}}}``)
* ``megatron-log``: Megatron-LM's printed log (``iteration 100/ 500000 | ... | lm loss: ...``)
* ``build-nanogpt``: karpathy/build-nanogpt stdout (``step  123 | loss: 3.45 | lr ... | norm: ...``) and log.txt
* ``nanochat``: karpathy/nanochat base / mid / SFT prints (``step 00123/05000 (2.46%) | loss: ...``)
* ``olmo``: OLMo / OLMo-core console metrics (``[step=123/1000,epoch=0]`` then ``    train/CE loss=3.45``)
* ``torchtitan``: torchtitan stdout (``step: 10  loss:  7.93  grad_norm:  1.23  memory: ...``)
* ``composer``: MosaicML Composer / llm-foundry console metrics (``[batch=10/100]:`` then ``Train loss/train/total: 2.3``)
* ``openrlhf``: OpenRLHF's PPO / GRPO status lines (``✨ Global step 12: {'policy_loss': ..., 'kl': ...}``)
* ``verl``: verl's console logger (``step:12 - actor/entropy:np.float64(0.32) - actor/pg_loss:... - ...``)
* ``kv-stdout``: other printed ``key: value`` records with a step counter and a loss
  (DeepSpeed-Chat's ``epoch: 0|step: 3|...|act_loss: ...``, ``batch: 9, ..., loss: 55.8``)
* ``tensorboard``: TensorBoard event files, or a directory of them (the ``tensorboard`` extra)
* ``mlflow``: an MLflow file store run (``mlruns/<experiment>/<run>/``, its ``metrics/`` files)
* ``wandb``: a W&B run folder (``wandb/run-*/``, ``offline-run-*/``) or its ``.wandb`` file
* ``sb3``: stable-baselines3's ``progress.csv``
* ``detectron2``: detectron2's ``metrics.json`` (JSON lines)
* ``csv``, ``jsonl``, ``printout``: any CSV, JSON lines or printed ``key value`` records whose
  names hold a loss, columns chosen by name (:mod:`lossbeat.logs.columns`) or by ``column_map``

Public API::

    log = parse_log(path)            # ParsedLog for the file; raises LogFormatError
    log.counts                       # ReadCounts: what was read, kept, skipped, unreadable
    log.notes                        # the same in words, plus what the parser did
    for run in log.segments:         # one ParsedLog per run in the file (restarts, appended seeds)
        run.train, run.evals         # TrainRecord / EvalRecord lists in step order

``log.train`` / ``log.evals`` are the last run's records. Missing values are
``None``; NaN and Inf that a log states as numbers stay floats (the analysis
counts them as non-finite). Torch-free.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from lossbeat.logs.columns import parse_column_map
from lossbeat.logs.csv_logs import is_lightning_header, parse_lightning
from lossbeat.logs.json_logs import load_json, parse_hf_state, parse_llamafactory, parse_megatron_golden
from lossbeat.logs.mlflow_store import is_mlflow, parse_mlflow
from lossbeat.logs.records import (
    DEFAULT_MAX_RECORDS,
    EvalRecord,
    LogFormatError,
    ParsedLog,
    ReadCounts,
    RecordBuilder,
    TrainRecord,
)
from lossbeat.logs.rl_logs import OPENRLHF_STEP, VERL_STEP, parse_openrlhf, parse_verl
from lossbeat.logs.source import Source, compressed, head_lines, open_source
from lossbeat.logs.stdout_logs import (
    BUILD_NANOGPT,
    BUILD_NANOGPT_LOGTXT,
    COMPOSER_HEADER,
    NANOCHAT,
    OLMO_STEP,
    TORCHTITAN,
    is_kv_record,
    parse_build_nanogpt,
    parse_composer,
    parse_kv_stdout,
    parse_nanochat,
    parse_olmo,
    parse_torchtitan,
)
from lossbeat.logs.tables import (
    is_printout,
    parse_csv_table,
    parse_detectron2,
    parse_jsonl_table,
    parse_printout,
    parse_sb3,
    table_kind,
)
from lossbeat.logs.tensorboard import event_files, is_event_file, parse_tensorboard
from lossbeat.logs.text_logs import (
    HF_DICT_START,
    LLMC_STDOUT,
    MEGATRON_ITER,
    NANOGPT_EVAL,
    NANOGPT_ITER,
    parse_hf_stdout,
    parse_llmc_main,
    parse_llmc_stdout,
    parse_megatron_log,
    parse_nanogpt,
)
from lossbeat.logs.wandb_run import is_wandb, parse_wandb

__all__ = [
    "TrainRecord",
    "EvalRecord",
    "ReadCounts",
    "ParsedLog",
    "LogFormatError",
    "FORMATS",
    "COLUMN_FORMATS",
    "DEFAULT_MAX_RECORDS",
    "detect_format",
    "parse_log",
]

FORMATS: tuple[str, ...] = (
    "hf",
    "hf-stdout",
    "llamafactory",
    "lightning",
    "llmc",
    "llmc-stdout",
    "nanogpt",
    "megatron",
    "megatron-log",
    "build-nanogpt",
    "nanochat",
    "olmo",
    "torchtitan",
    "composer",
    "openrlhf",
    "verl",
    "kv-stdout",
    "tensorboard",
    "mlflow",
    "wandb",
    "sb3",
    "detectron2",
    "csv",
    "jsonl",
    "printout",
)
COLUMN_FORMATS: tuple[str, ...] = ("mlflow", "wandb", "sb3", "detectron2", "csv", "jsonl", "printout")
"""The formats whose columns are chosen by name, and that ``column_map`` (``--map``) overrides."""

_JSON_FORMATS = {"hf": parse_hf_state, "megatron": parse_megatron_golden}
_LINE_FORMATS: dict[str, Callable[[Source, RecordBuilder], None]] = {
    "hf-stdout": parse_hf_stdout,
    "llamafactory": parse_llamafactory,
    "lightning": parse_lightning,
    "llmc": parse_llmc_main,
    "llmc-stdout": parse_llmc_stdout,
    "nanogpt": parse_nanogpt,
    "megatron-log": parse_megatron_log,
    "build-nanogpt": parse_build_nanogpt,
    "nanochat": parse_nanochat,
    "olmo": parse_olmo,
    "torchtitan": parse_torchtitan,
    "composer": parse_composer,
    "openrlhf": parse_openrlhf,
    "verl": parse_verl,
    "kv-stdout": parse_kv_stdout,
    "sb3": parse_sb3,
    "detectron2": parse_detectron2,
    "csv": parse_csv_table,
    "jsonl": parse_jsonl_table,
    "printout": parse_printout,
}
_DIR_FORMATS = {"mlflow": parse_mlflow, "wandb": parse_wandb}


def _detect(src: Source) -> str:
    if is_event_file(src.path, src.head_bytes):
        return "tensorboard"
    if is_wandb(src.path, src.head_bytes):
        return "wandb"
    if src.encoding is None:
        if kind := compressed(src.head_bytes):
            raise LogFormatError(
                f"{src.path}: {kind}-compressed: decompress it first "
                f"(e.g. {'zcat' if kind == 'gzip' else kind + ' -dc'} FILE > log)"
            )
        raise LogFormatError(f"{src.path}: binary data, not a text log (and not a TensorBoard event file)")
    head = src.head
    stripped = head.lstrip()
    lines = stripped.splitlines()
    first = lines[0] if lines else ""
    if stripped.startswith("{") and not stripped.startswith("{'"):
        if '"log_history"' in head:
            return "hf"
        if '"current_steps"' in first:
            return "llamafactory"
        if re.search(r'"lm loss"\s*:\s*\{', head) or re.search(r'"step_interval"|"values"\s*:', head):
            return "megatron"
        if (kind := table_kind(head)) == "detectron2":
            return kind
    if HF_DICT_START.search(head):
        return "hf-stdout"
    table = table_kind(head)
    if table == "sb3":
        return table
    if is_lightning_header(first):
        return "lightning"
    # printed logs: lines unwrapped from JSON streams, without colour codes and launcher/logger prefixes
    text = head_lines(src)
    if any(OPENRLHF_STEP.search(line) for line in text):
        return "openrlhf"
    if any(re.match(r"^s:\d+\s+(trl|tel):", line) for line in text):
        return "llmc"
    if any(LLMC_STDOUT.match(line) and "loss" in line for line in text):
        return "llmc-stdout"
    if any(
        re.match(r"^step:\d+/\d+\s+(train_loss|val_loss):", line)
        or NANOGPT_ITER.match(line)
        or NANOGPT_EVAL.match(line)
        for line in text
    ):
        return "nanogpt"
    if any(MEGATRON_ITER.search(line) for line in text):
        return "megatron-log"
    if any(BUILD_NANOGPT.match(line) for line in text) or _count(BUILD_NANOGPT_LOGTXT.match, text) >= 2:
        return "build-nanogpt"
    if any(NANOCHAT.match(line) for line in text):
        return "nanochat"
    if any(OLMO_STEP.search(line) for line in text) and any(re.match(r"^(?:train|eval)/[^=]*=", line) for line in text):
        return "olmo"
    if any(TORCHTITAN.match(line) for line in text):
        return "torchtitan"
    if any(COMPOSER_HEADER.match(line) for line in text) and any(line.startswith("Train loss/") for line in text):
        return "composer"
    if any(VERL_STEP.search(line) and "actor/" in line for line in text):
        return "verl"
    if _count(is_kv_record, text) >= 2:
        return "kv-stdout"
    # what no one named: a table or printout whose names hold a loss
    if table is not None:
        return table
    if not stripped.startswith(("{", "[")) and is_printout(text):
        return "printout"
    if stripped.startswith(("{", "[{")):
        raise LogFormatError(
            f"{src.path}: JSON, but none of the known layouts (trainer_state.json "
            "log_history, trainer_log.jsonl, Megatron golden values) and no key names a loss: "
            "name the loss with --map loss=KEY"
        )
    raise LogFormatError(
        f"{src.path}: unknown log format: no record of a known format in the first "
        f"{len(head) >> 10 or 1} KiB, and no column or printed key names a loss "
        f"(known: {', '.join(FORMATS)}; name the loss with --map loss=COLUMN)"
    )


def _map_format(src: Source) -> str:
    """The generic reader for a file whose columns ``--map`` names: JSON lines, a CSV, else a printout."""
    first = next((line.strip() for line in src.head.splitlines() if line.strip()), "")
    if first.startswith(("{", "[{")):
        return "jsonl"
    if first.count(",") or first.count("\t") or first.count(";"):
        return "csv"
    return "printout"


def _count(test: Callable[[str], object], lines: list[str]) -> int:
    n = 0
    for line in lines:
        if test(line):
            n += 1
            if n >= 2:
                break
    return n


def detect_format(path: str | os.PathLike, column_map: str | dict[str, str] | None = None) -> str:
    """The format of a log file (or a directory of TensorBoard event files, an MLflow or W&B run);
    raises :class:`LogFormatError`. With a ``column_map``, a text file of no known format is a table
    (CSV, JSON lines or a printout) whose columns the map names."""
    path = os.fspath(path)
    if parse_column_map(column_map) and os.path.isfile(path):
        src = open_source(path)
        try:
            return _detect(src)
        except LogFormatError:
            if src.encoding is None:
                raise
            return _map_format(src)
    if os.path.isdir(path):
        if event_files(path):
            return "tensorboard"
        if is_mlflow(path):
            return "mlflow"
        if is_wandb(path):
            return "wandb"
        open_source(path)  # raises the directory error
    if is_mlflow(path):
        return "mlflow"
    return _detect(open_source(path))


def parse_log(
    path: str | os.PathLike,
    fmt: str | None = None,
    *,
    max_records: int = DEFAULT_MAX_RECORDS,
    column_map: str | dict[str, str] | None = None,
) -> ParsedLog:
    """Parse one log file (or a directory of TensorBoard event files).

    Returns the file's :class:`ParsedLog`: ``segments`` holds each run in the file,
    ``train``/``evals`` are the last run's, ``counts`` and ``notes`` say what was read,
    skipped and unreadable. Reading stops after ``max_records`` train records (noted).
    Raises :class:`LogFormatError` (one line naming the file and the problem) for anything
    that cannot be read: missing, a directory or FIFO, empty, binary, broken JSON, no records.
    ``column_map`` (``--map``: ``"loss=COL,step=COL"`` or a dict) names the columns of a table
    (:data:`COLUMN_FORMATS`); given for a file of another format, the file is read as a table.
    """
    path = os.fspath(path)
    if fmt is not None and fmt not in FORMATS:
        raise LogFormatError(f"{path}: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    mapping = parse_column_map(column_map)
    if mapping and fmt is not None and fmt not in COLUMN_FORMATS:
        raise ValueError(
            f"--map: the {fmt} reader chooses its own columns (--map applies to {', '.join(COLUMN_FORMATS)})"
        )
    if fmt is None and os.path.isdir(path) and not event_files(path) and (is_mlflow(path) or is_wandb(path)):
        fmt = "mlflow" if is_mlflow(path) else "wandb"
    elif fmt is None and os.path.isfile(path) and is_mlflow(path):
        fmt = "mlflow"
    if os.path.isdir(path) and (files := event_files(path)):
        out = RecordBuilder(path, "tensorboard", "events", max_records)
        parse_tensorboard(files, out)
        if len(files) > 1:
            out.note(f"{len(files)} event files read in name order")
        return _finished(out)
    if fmt in _DIR_FORMATS:
        out = RecordBuilder(path, fmt, "rows", max_records)
        out.column_map = mapping
        try:
            _DIR_FORMATS[fmt](path, out)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            if isinstance(exc, LogFormatError):
                raise
            raise LogFormatError(f"{path}: not a valid {fmt} run ({type(exc).__name__}: {exc})") from None
        return _finished(out)
    src = open_source(path)
    if fmt is None and mapping:
        try:
            fmt = _detect(src)
        except LogFormatError:
            if src.encoding is None:
                raise
            fmt = _map_format(src)  # --map names the loss the names did not
    fmt = fmt or _detect(src)
    if fmt in _DIR_FORMATS:
        return parse_log(path, fmt, max_records=max_records, column_map=mapping)
    if mapping and fmt not in COLUMN_FORMATS:
        fmt = _map_format(src)
    out = RecordBuilder(path, fmt, "entries" if fmt in _JSON_FORMATS else "lines", max_records)
    out.column_map = mapping
    try:
        if fmt == "tensorboard":
            parse_tensorboard([path], out)
        elif fmt in _JSON_FORMATS:
            _JSON_FORMATS[fmt](load_json(src), out)
        else:
            if src.encoding is None:
                raise LogFormatError(f"{path}: binary data, not a text log")
            _LINE_FORMATS[fmt](src, out)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        if isinstance(exc, LogFormatError):
            raise
        raise LogFormatError(f"{path}: not a valid {fmt} log ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise LogFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return _finished(out)


def _finished(out: RecordBuilder) -> ParsedLog:
    log = out.finish()
    if not log.segments:
        raise LogFormatError(f"{out.path}: no training or eval records ({out.counts.summary()})")
    return log
