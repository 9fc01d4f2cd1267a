"""More printed logs, each read from its project's own print statements.

* ``build-nanogpt``: karpathy/build-nanogpt ``train_gpt2.py`` stdout
  (``step {step:5d} | loss: {loss:.6f} | lr {lr:.4e} | norm: {norm:.4f} | dt: ...ms | tok/sec: ...``,
  ``validation loss: {val:.4f}``) and its ``log.txt`` (``{step} train {loss:.6f}``, ``{step} val {val:.4f}``);
* ``nanochat``: karpathy/nanochat's base / mid training (``step {step:05d}/{num_iterations:05d} (..%) |
  loss: ... | lrm: ...``, mid without the total), SFT (``Step {step:05d}/{num_iterations:05d} |
  Training loss: ...| lrm: ...``) and their evals (``Step {step:05d} | Validation bpb: ...`` /
  ``Validation loss: ...``);
* ``olmo``: OLMo / OLMo-core console metrics, a ``[step=N/M,epoch=E]`` line followed by indented
  ``    name=value`` lines (``train/CrossEntropyLoss``, ``train/CE loss``, ``optim/total_grad_norm``,
  ``optim/total grad norm``, ``eval/<set>/CrossEntropyLoss``...);
* ``torchtitan``: ``step: {step:2}  loss: {loss:7.4f}  grad_norm: {norm:7.4f}  memory: ...  tps: ...``
  (colour codes and ``[rank0]:[titan] ... - INFO -`` prefixes are removed by :func:`text_lines`),
  ``validate step: ...  loss: ...``;
* ``composer``: MosaicML Composer / llm-foundry's ConsoleLogger, a ``[batch=N/M]:`` header then
  tab-indented ``Train loss/train/total: ...`` lines, and ``Eval metrics/<label>/LanguageCrossEntropy``;
* ``kv-stdout``: any other printed ``key: value`` records with a step counter (``step``, ``iter``,
  ``iteration``, ``batch``) and a loss (``loss``, or the first ``*_loss``: DeepSpeed-Chat's
  ``epoch: 0|step: 3|ppo_ep: 1|act_loss: ...``, ``batch: 9, time: ..., loss: 55.8``). The loss key read
  is named in the notes, with the other loss keys.
"""

from __future__ import annotations

import re

from lossbeat.diagnosis.profiles import is_signal
from lossbeat.logs.records import RecordBuilder
from lossbeat.logs.source import Source, parse_number, text_lines

__all__ = [
    "parse_build_nanogpt",
    "parse_nanochat",
    "parse_olmo",
    "parse_torchtitan",
    "parse_composer",
    "parse_kv_stdout",
    "BUILD_NANOGPT",
    "BUILD_NANOGPT_LOGTXT",
    "NANOCHAT",
    "OLMO_STEP",
    "TORCHTITAN",
    "COMPOSER_HEADER",
    "is_kv_record",
]

_NOT_RECORD = "lines that are not records (banners, progress, warnings)"
_NUM = r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf)"


def _number(out: RecordBuilder, name: str, raw: str | None) -> float | None:
    if raw is None:
        return None
    value, ok = parse_number(raw.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?", raw) else raw)
    if not ok:
        out.unreadable(name, raw)
    return value


# --- build-nanogpt --------------------------------------------------------------------------------

BUILD_NANOGPT = re.compile(r"^step\s+(\d+)\s*\|\s*loss:\s*(\S+)\s*\|\s*lr\s+(\S+)\s*\|\s*norm:\s*(\S+)")
BUILD_NANOGPT_LOGTXT = re.compile(r"^(\d+) (train|val|hella) (\S+)\s*$")
_BN_VAL = re.compile(r"^validation loss:\s*(\S+)")


def parse_build_nanogpt(src: Source, out: RecordBuilder) -> None:
    """``validation loss`` lines carry no step: the script evaluates before training the step it
    prints next, so an eval belongs to the step after the last printed one (0 before the first).
    HellaSwag accuracies and generated samples are skipped."""
    last = -1
    for line in text_lines(src, out):
        if m := BUILD_NANOGPT.match(line):
            last = int(m.group(1))
            out.train(
                last, _number(out, "loss", m.group(2)), _number(out, "norm", m.group(4)), _number(out, "lr", m.group(3))
            )
        elif m := _BN_VAL.match(line):
            if (loss := _number(out, "validation loss", m.group(1))) is not None:
                out.eval(last + 1, loss)
        elif m := BUILD_NANOGPT_LOGTXT.match(line):  # log.txt
            step, kind = int(m.group(1)), m.group(2)
            if kind == "train":
                out.train(step, _number(out, "train", m.group(3)))
            elif kind == "val":
                if (loss := _number(out, "val", m.group(3))) is not None:
                    out.eval(step, loss)
            else:
                out.skip("HellaSwag accuracies (not a loss)")
        else:
            out.skip(_NOT_RECORD)


# --- nanochat -------------------------------------------------------------------------------------

NANOCHAT = re.compile(r"^step\s+(\d+)(?:/(\d+))?\s+\([\d.]+%\)\s*\|\s*loss:\s*(\S+)")
_NANOCHAT_SFT = re.compile(r"^Step\s+(\d+)/(\d+)\s*\|\s*Training loss:\s*([^|\s]+)")
_NANOCHAT_VAL = re.compile(r"^Step\s+(\d+)\s*\|\s*Validation (bpb|loss):\s*(\S+)")


def parse_nanochat(src: Source, out: RecordBuilder) -> None:
    """Base, mid and SFT training print their own step counters: each stage is a run of its own
    (the step goes back to 0 or 1). ``lrm`` is an LR multiplier, not an LR: not read as one.
    A stage's step-0 validation is printed before its first training line and belongs to it."""
    lrm = False
    for line in text_lines(src, out):
        if m := NANOCHAT.match(line):
            out.train(int(m.group(1)), _number(out, "loss", m.group(3)))
            lrm = lrm or "lrm:" in line
        elif m := _NANOCHAT_SFT.match(line):
            out.train(int(m.group(1)), _number(out, "Training loss", m.group(3)))
            lrm = lrm or "lrm:" in line
        elif m := _NANOCHAT_VAL.match(line):
            if (loss := _number(out, f"Validation {m.group(2)}", m.group(3))) is not None:
                out.eval(int(m.group(1)), loss, "bpb" if m.group(2) == "bpb" else "")
        else:
            out.skip(_NOT_RECORD)
    if lrm:
        out.note("'lrm' is nanochat's LR multiplier (a schedule factor, not an LR): not read as the learning rate")


# --- OLMo / OLMo-core -----------------------------------------------------------------------------

OLMO_STEP = re.compile(r"\[step=(\d+)(?:/[^,\]]*)?(?:,[^\]]*)?\]")
_OLMO_EVAL_STEP = re.compile(r"\[eval_step=\d+")
_OLMO_METRIC = re.compile(r"^\s*([\w./ ()-]+?)=(\S+)\s*$")
_OLMO_TRAIN = re.compile(r"^train/(?:CE ?loss|CrossEntropyLoss|loss)$", re.I)
_OLMO_EVAL = re.compile(r"^eval/(?:(.+)/)?(?:CE ?loss|CrossEntropyLoss|loss)$", re.I)
_OLMO_GRAD = re.compile(r"^optim/total[ _]grad[ _]norm$", re.I)
_OLMO_LR = re.compile(r"^optim/(?:LR|learning_rate)(?:[ _]?\(?group ?0\)?|_group0)?$", re.I)


def parse_olmo(src: Source, out: RecordBuilder) -> None:
    """A ``[step=N/M,...]`` header opens a block of ``name=value`` lines; the block is one record.
    OLMo prints an evaluation's results under a header of its own (the evaluator's label, after
    ``[eval_step=k/n]`` progress lines): eval losses belong to the step of the last train block."""
    block: dict[str, str] | None = None
    train_block = False
    step = 0
    where = ""

    def flush() -> None:
        if not block:
            return
        out.where = where
        used = False
        train = next((v for k, v in block.items() if _OLMO_TRAIN.match(k)), None) if train_block else None
        if train is not None:
            grad = next((v for k, v in block.items() if _OLMO_GRAD.match(k)), None)
            lr = next((v for k, v in block.items() if _OLMO_LR.match(k)), None)
            out.train(
                step,
                _number(out, "train loss", train),
                _number(out, "grad norm", grad),
                _number(out, "learning rate", lr),
            )
            used = True
        for key, value in block.items():
            if (e := _OLMO_EVAL.match(key)) and (loss := _number(out, key, value)) is not None:
                out.eval(step, loss, e.group(1) or "")
                used = True
        if not used:
            out.skip("metric blocks without a train or eval loss")

    for line in text_lines(src, out):
        if m := OLMO_STEP.search(line):
            flush()
            step, block, train_block, where = int(m.group(1)), {}, True, out.where
            continue
        if block is not None and (m := _OLMO_METRIC.match(line)):
            block[m.group(1).strip()] = m.group(2)
            continue
        flush()
        # any other line may head an evaluator's results ("c4_en-validation" then "    eval/...=...")
        block, train_block, where = {}, False, out.where
        out.skip("eval progress lines ([eval_step=...])" if _OLMO_EVAL_STEP.search(line) else _NOT_RECORD)
    flush()


# --- torchtitan -----------------------------------------------------------------------------------

TORCHTITAN = re.compile(r"^(validate )?step:\s*(\d+)\s+loss:\s*(\S+)")
_TT_GRAD = re.compile(r"\bgrad_norm:\s*(\S+)")
_TT_LR = re.compile(r"\blr:\s*(\S+)")


def parse_torchtitan(src: Source, out: RecordBuilder) -> None:
    """Every rank that logs prints each step: the latest line of a step is kept (counted)."""
    for line in text_lines(src, out):
        if m := TORCHTITAN.match(line):
            step = int(m.group(2))
            loss = _number(out, "loss", m.group(3))
            if m.group(1):
                if loss is not None:
                    out.eval(step, loss)
                continue
            grad = _TT_GRAD.search(line)
            lr = _TT_LR.search(line)
            out.train(
                step,
                loss,
                _number(out, "grad_norm", grad.group(1) if grad else None),
                _number(out, "lr", lr.group(1) if lr else None),
            )
        else:
            out.skip(_NOT_RECORD)


# --- composer -------------------------------------------------------------------------------------

COMPOSER_HEADER = re.compile(
    r"^(?:\[epoch=(\d+)\])?\[(batch|token|sample|iteration)=(\d+)(?:/(\d+))?\]:?\s*$"
    r"|^\[Eval batch=\d+(?:/\d+)?\] Eval on (.+?) data:?\s*$"
)
_COMPOSER_METRIC = re.compile(r"^\s*(Train|Eval) (\S.*?): (\S+)\s*$")
_COMPOSER_LOSS = re.compile(r"^loss/train(?:/total)?$")
_COMPOSER_EVAL = re.compile(r"^metrics/(.+)/(?:LanguageCrossEntropy|CrossEntropy|loss)$")
_COMPOSER_LR = re.compile(r"^lr-[^/]+/group0$")


def parse_composer(src: Source, out: RecordBuilder) -> None:
    """MosaicML Composer's (and llm-foundry's) ConsoleLogger: a progress header, ``[batch=N/M]:``
    (``[epoch=E][batch=B/T]:`` for a duration in epochs, B counted within the epoch; ``[token=...]``),
    then one tab-indented ``Train name: value`` line per metric: ``loss/train/total``,
    ``l2_norm/grad/global`` (OptimizerMonitor), ``lr-<Optimizer>/group0`` (LRMonitor). An eval
    prints ``[Eval batch=n/n] Eval on <label> data:`` then ``Eval metrics/<label>/LanguageCrossEntropy:
    ...``: it belongs to the last train step. The step is the global batch (``time/batch`` + 1 where
    the header counts tokens or samples)."""
    block: dict[str, str] = {}
    header: re.Match[str] | None = None
    step = 0
    where = ""

    def flush() -> None:
        nonlocal step
        if header is None or not block:
            return
        out.where = where
        if header.group(5) is not None:  # an eval block
            used = False
            for key, value in block.items():
                if (e := _COMPOSER_EVAL.match(key)) and (loss := _number(out, key, value)) is not None:
                    out.eval(step, loss, "" if e.group(1) == "eval" else e.group(1))
                    used = True
            if not used:
                out.skip("eval blocks without an eval loss")
            return
        epoch, unit, count, total = header.group(1), header.group(2), int(header.group(3)), header.group(4)
        if unit == "batch":
            step = count if epoch is None or total is None else (int(epoch) - 1) * int(total) + count
        else:  # a token or sample count: the batch is in the block
            batch, ok = parse_number(block.get("time/batch"))
            step = int(batch) + 1 if ok and batch is not None else step + 1
        train_loss = next((v for k, v in block.items() if _COMPOSER_LOSS.match(k)), None)
        if train_loss is None:
            out.skip("metric blocks without a train loss")
            return
        out.field_names(block)
        for key, value in block.items():
            if is_signal(key):
                out.signal(step, key, _number(out, key, value))
        out.train(
            step,
            _number(out, "loss/train/total", train_loss),
            _number(out, "l2_norm/grad/global", block.get("l2_norm/grad/global")),
            _number(out, "lr", next((v for k, v in block.items() if _COMPOSER_LR.match(k)), None)),
        )

    for line in text_lines(src, out):
        if m := COMPOSER_HEADER.match(line):
            flush()
            header, block, where = m, {}, out.where
        elif header is not None and (m := _COMPOSER_METRIC.match(line)):
            block[m.group(2)] = m.group(3)
        else:
            out.skip(_NOT_RECORD)
    flush()


# --- key: value records ---------------------------------------------------------------------------

_KV_PAIR = re.compile(r"(?:^|(?<=[\s|,;]))([A-Za-z][\w/.-]*(?: [a-z]+)?)\s*[:=]\s*(" + _NUM + r")(?=$|[\s|,;/(%])")
_STEP_KEYS = ("step", "global_step", "iter", "iteration", "batch", "it")
_EVAL_KEY = re.compile(r"^(?:val|valid|validation|eval|test)[ _/-]?loss$", re.I)
_GRAD_KEYS = ("grad_norm", "gnorm", "norm", "grad norm", "gradient_norm")
_LR_KEYS = ("lr", "learning_rate", "learning rate")


def _kv(line: str) -> dict[str, str]:
    return {k.lower(): v for k, v in _KV_PAIR.findall(line)}


def _step_key(pairs: dict[str, str]) -> str | None:
    return next((k for k in _STEP_KEYS if k in pairs and re.fullmatch(r"\d+", pairs[k])), None)


def _loss_key(pairs: dict[str, str]) -> str | None:
    if "loss" in pairs:
        return "loss"
    for k in ("train_loss", "train loss", "training_loss", "total_loss"):
        if k in pairs:
            return k
    return next((k for k in pairs if k.endswith("loss") and not _EVAL_KEY.match(k)), None)


def is_kv_record(line: str) -> bool:
    """A printed record with a step counter and a loss (``step: 3 | loss: 2.1``, ``batch: 9, loss: 55.8``)."""
    if ":" not in line and "=" not in line:
        return False
    pairs = _kv(line)
    return _step_key(pairs) is not None and (_loss_key(pairs) is not None or any(_EVAL_KEY.match(k) for k in pairs))


def parse_kv_stdout(src: Source, out: RecordBuilder) -> None:
    chosen: dict[str, int] = {}
    others: set[str] = set()
    for line in text_lines(src, out):
        pairs = _kv(line) if (":" in line or "=" in line) else {}
        key = _step_key(pairs)
        if key is None:
            out.skip(_NOT_RECORD)
            continue
        step = int(pairs[key])
        out.field_names(pairs)  # the task profile is detected from them (reward, kl, ...)
        for name, text in pairs.items():
            if is_signal(name) and (value := _number(out, name, text)) is not None:
                out.signal(step, name, value)
        loss_key = _loss_key(pairs)
        evals = [k for k in pairs if _EVAL_KEY.match(k)]
        if loss_key is None and not evals:
            out.skip("step lines without a loss")
            continue
        if loss_key is not None:
            chosen[loss_key] = chosen.get(loss_key, 0) + 1
            others.update(k for k in pairs if k.endswith("loss") and k != loss_key and not _EVAL_KEY.match(k))
            grad = next((pairs[k] for k in _GRAD_KEYS if k in pairs), None)
            lr = next((pairs[k] for k in _LR_KEYS if k in pairs), None)
            out.train(
                step, _number(out, loss_key, pairs[loss_key]), _number(out, "grad norm", grad), _number(out, "lr", lr)
            )
        for k in evals:
            if (loss := _number(out, k, pairs[k])) is not None:
                out.eval(step, loss)
    if chosen:
        rest = f"; other loss keys, not read: {', '.join(sorted(others))}" if others else ""
        out.note(
            "printed key: value records: train loss from "
            + ", ".join(f"{k!r} ({n} records)" for k, n in chosen.items())
            + rest
        )
