"""Text logs: what training scripts print (llm.c, nanoGPT speedrun, Megatron-LM, the HF Trainer).

Lines that are not records (banners, warnings, progress bars, tracebacks) are
counted as skipped; a value a record states but that is not a number is counted
as unreadable and left out.
"""

from __future__ import annotations

import re

from lossbeat.diagnosis.profiles import is_signal
from lossbeat.logs.records import RecordBuilder, log_interval
from lossbeat.logs.source import Source, parse_number, text_lines

__all__ = [
    "parse_llmc_main",
    "parse_llmc_stdout",
    "parse_nanogpt",
    "parse_megatron_log",
    "parse_hf_stdout",
    "hf_signals",
    "LLMC_MAIN",
    "LLMC_STDOUT",
    "NANOGPT",
    "NANOGPT_ITER",
    "NANOGPT_EVAL",
    "MEGATRON_ITER",
    "HF_DICT",
    "HF_DICT_START",
]

_NOT_RECORD = "lines that are not records (banners, progress, warnings)"
_KV = re.compile(r"(\w+):(\S+)")


def _number(out: RecordBuilder, name: str, raw: str | None) -> float | None:
    if raw is None:
        return None
    value, ok = parse_number(raw)
    if not ok:
        out.unreadable(name, raw)
    return value


# --- llm.c main.log: "s:N trl:L lr:X norm:G" and "s:N tel:V" -----------------------------

LLMC_MAIN = re.compile(r"^s:(\d+)\s+(.*)$")


def parse_llmc_main(src: Source, out: RecordBuilder) -> None:
    for line in text_lines(src, out):
        m = LLMC_MAIN.match(line.strip())
        if not m:
            out.skip(_NOT_RECORD)
            continue
        step = int(m.group(1))
        fields = dict(_KV.findall(m.group(2)))
        used = False
        if "trl" in fields:
            out.train(
                step,
                _number(out, "trl", fields["trl"]),
                _number(out, "norm", fields.get("norm")),
                _number(out, "lr", fields.get("lr")),
            )
            used = True
        if "tel" in fields:
            loss = _number(out, "tel", fields["tel"])
            if loss is not None:
                out.eval(step, loss)
            used = True
        if not used:
            out.skip("s:N lines without trl or tel")


# --- llm.c stdout: "step    1/19560 | loss 10.98 (+nanz)| norm 15.4 (+nanz)| lr 8.57e-07 | ..." ---

LLMC_STDOUT = re.compile(r"^\s*step\s+(\d+)/(\d+)\s*[|:]\s*(.*)$")
_LLMC_FIELD = {
    "loss": re.compile(r"(?:^|[|,]\s*)(?:train )?loss\s+(\S+?)(?=\s|\(|\||,|$)"),
    "norm": re.compile(r"(?:^|[|,]\s*)norm\s+(\S+?)(?=\s|\(|\||,|$)"),
    "lr": re.compile(r"(?:^|[|,]\s*)lr\s+(\S+?)(?=\s|\(|\||,|$)"),
}
_LLMC_VAL = re.compile(r"^\s*val loss\s+(\S+)")


def parse_llmc_stdout(src: Source, out: RecordBuilder) -> None:
    """The step printed is 1-based (``step + 1``); ``val loss`` lines, printed before a step's
    training, belong to the last printed step (0 before the first). ``step N/N`` is the last
    training step: it completes the run (the final validation, printed after it, is not waited for)."""
    last = 0
    for line in text_lines(src, out):
        m = LLMC_STDOUT.match(line)
        if m:
            step, total, rest = int(m.group(1)), int(m.group(2)), m.group(3)
            raw = {k: (r.group(1) if (r := rx.search(rest)) else None) for k, rx in _LLMC_FIELD.items()}
            if raw["loss"] is None:
                out.skip("step lines without a loss")
                continue
            out.train(
                step,
                _number(out, "loss", raw["loss"]),
                _number(out, "norm", raw["norm"]),
                _number(out, "lr", raw["lr"]),
            )
            last = step
            if step == total > 0:
                out.complete(f"llm.c printed its last step ({step}/{total})")
            continue
        v = _LLMC_VAL.match(line)
        if v:
            loss = _number(out, "val loss", v.group(1))
            if loss is not None:
                out.eval(last, loss)
            continue
        out.skip(_NOT_RECORD)


# --- nanoGPT: the speedrun's "step:N/M train_loss:L" / "step:N/M val_loss:V", and karpathy/nanoGPT's
# "iter N: loss L, time T ms, mfu M%" / "step N: train loss A, val loss B" ---------------------------

NANOGPT = re.compile(r"^step:(\d+)/\d+\s+(.*)$")
# a unit may follow a value ("loss 6.07 BPC,"): forks print bits per character
NANOGPT_ITER = re.compile(r"^iter (\d+): loss (\S+?)(?:\s+[A-Za-z/]+)?,")
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss (\S+?)(?:\s+[A-Za-z/]+)?, val loss (\S+)")


def parse_nanogpt(src: Source, out: RecordBuilder) -> None:
    """The "train loss" of karpathy/nanoGPT's eval line is an estimate over eval batches of the
    training split, not a training step: only its val loss is read."""
    for line in text_lines(src, out):
        text = line.strip()
        m = NANOGPT.match(text)
        if m:
            step = int(m.group(1))
            fields = dict(_KV.findall(m.group(2)))
            if "train_loss" in fields:
                out.train(step, _number(out, "train_loss", fields["train_loss"]))
            elif "val_loss" in fields:
                loss = _number(out, "val_loss", fields["val_loss"])
                if loss is not None:
                    out.eval(step, loss)
            else:
                out.skip("step lines without train_loss or val_loss")
        elif m := NANOGPT_ITER.match(text):
            out.train(int(m.group(1)), _number(out, "loss", m.group(2)))
        elif m := NANOGPT_EVAL.match(text):
            loss = _number(out, "val loss", m.group(3).rstrip(",;"))
            if loss is not None:
                out.eval(int(m.group(1)), loss)
        else:
            out.skip(_NOT_RECORD)


# --- Megatron-LM: " iteration 100/ 500000 | ... | lm loss: 4.12E+00 | ... | grad norm: 1.234 | ..." --

MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_MEGATRON_VAL = re.compile(r"validation loss at (?:iteration\s+(\d+)|([^|]*?))\s*\|(.*)$")
_FIELD = re.compile(r"\s*([^:|]+?)\s*:\s*([^|]*?)\s*(?=\||$)")


def _fields(text: str) -> dict[str, str]:
    return {k.strip().lower(): v for k, v in _FIELD.findall(text)}


def parse_megatron_log(src: Source, out: RecordBuilder) -> None:
    """``lm loss`` is the mean over the logging interval's iterations; an interval that reports
    ``number of nan iterations`` > 0 had a non-finite loss: its record's loss is NaN (the printed
    mean of the other iterations is in the notes). ``iteration N/ N`` is the last one (printed
    when ``train_iters`` is a multiple of ``log_interval``): it completes the run."""
    last = 0
    nan_steps: list[str] = []
    skipped_iters = 0
    for line in text_lines(src, out):
        m = MEGATRON_ITER.search(line)
        if m:
            step, fields = int(m.group(1)), _fields(m.group(3))
            loss = _number(out, "lm loss", fields.get("lm loss"))
            nans = _number(out, "number of nan iterations", fields.get("number of nan iterations"))
            skipped_iters += int(
                _number(out, "number of skipped iterations", fields.get("number of skipped iterations")) or 0
            )
            if nans:
                nan_steps.append(f"{step} ({int(nans)} NaN iterations, mean of the others {loss})")
                loss = float("nan")
            if loss is None and "lm loss" not in fields:
                out.skip("iteration lines without lm loss")
            else:
                out.train(
                    step,
                    loss,
                    _number(out, "grad norm", fields.get("grad norm")),
                    _number(out, "learning rate", fields.get("learning rate")),
                )
                if step == int(m.group(2)) > 0:
                    out.complete(f"Megatron-LM logged its last iteration ({step}/{step})")
            last = step
            continue
        v = _MEGATRON_VAL.search(line)
        if v:
            step = int(v.group(1)) if v.group(1) else last
            loss = _number(out, "lm loss value", _fields(v.group(3)).get("lm loss value"))
            if loss is not None:
                out.eval(step, loss, "" if v.group(1) else (v.group(2) or "").strip())
            continue
        out.skip(_NOT_RECORD)
    if nan_steps:
        out.note(
            "intervals with NaN iterations, recorded as a non-finite loss: "
            + ", ".join(nan_steps[:10])
            + (", ..." if len(nan_steps) > 10 else "")
        )
    if skipped_iters:
        out.note(f"{skipped_iters} iterations skipped by the optimizer (fp16 loss-scale overflow)")


# --- Hugging Face Trainer stdout: "{'loss': 2.34, 'grad_norm': 1.2, 'learning_rate': 1.5e-04, 'epoch': 0.5}"

HF_DICT = re.compile(r"\{'(?:loss|eval_[\w/.-]*loss|grad_norm|learning_rate|train_runtime|train_loss)'\s*:[^{}]*\}")
HF_DICT_START = re.compile(r"\{'(?:loss|eval_[\w/.-]*loss)'\s*:")
"""What detection looks for: a printed dict that starts with a train or eval loss."""
_BAR = re.compile(r"(\d+)/(\d+)\s*\[")  # tqdm: " 5%|▌   | 50/1000 [00:10<03:00,  5.2it/s]"
_WRAPPED = re.compile(r"^[\w.]+\(\s*([-+0-9.eEinfatINFAT]+)")  # tensor(1.2, device=...), np.float64(2.3)
_HF_EVAL = re.compile(r"^eval_(?:(.+)_)?loss$")


def _dict_items(body: str) -> dict[str, str]:
    """``'key': value`` pairs of a printed Python dict, split at top-level commas."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(body):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    result = {}
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip()
        if sep and len(key) >= 2 and key[0] == key[-1] and key[0] in "'\"":
            result[key[1:-1]] = value.strip()
    return result


def _py_number(out: RecordBuilder, name: str, raw: str | None) -> float | None:
    if raw is None:
        return None
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        raw = raw[1:-1]  # transformers >= 4.5x prints floats formatted as strings: '2.34'
    value, ok = parse_number(raw)
    if not ok and (w := _WRAPPED.match(raw)):
        value, ok = parse_number(w.group(1))
    if not ok:
        out.unreadable(name, raw)
        return None
    return value


def parse_hf_stdout(src: Source, out: RecordBuilder) -> None:
    """The dicts the Trainer prints (``logging_steps``): the step is not printed, so it is derived.

    With the progress bar in the log (stderr captured too), the step of a train dict is the
    position of the training bar (the bar last drawn before the first train dict) at that moment,
    snapped to a multiple of the logging interval (the bar may lag by a few steps). Without a bar,
    steps are record numbers 1, 2, 3..., starting again where the epoch goes back (a new run).
    An eval dict belongs to the step of the train dict before it. The report says which was done.
    """
    main_total: int | None = None
    last_total: int | None = None
    bar: dict[int, int] = {}  # total -> last position seen
    after_eval = False
    raw_train: list[tuple[str, int | None, dict[str, str]]] = []  # (where, bar position, items)
    raw_eval: list[tuple[str, int, dict[str, str]]] = []  # (where, train dicts before it, items)
    for line in text_lines(src, out):
        found = False
        for b in _BAR.finditer(line):
            last_total = int(b.group(2))
            bar[last_total] = int(b.group(1))
            after_eval = after_eval and last_total != main_total
        for m in HF_DICT.finditer(line):
            found = True
            items = _dict_items(m.group(0)[1:-1])
            if "loss" in items:
                # The bar drawn last is the training bar, unless an eval bar was drawn since the
                # last train dict and the training bar has not been redrawn yet.
                if not after_eval or main_total is None:
                    main_total = last_total
                after_eval = False
                raw_train.append((out.where, bar.get(main_total) if main_total else None, items))
            elif any(_HF_EVAL.match(k) for k in items):
                raw_eval.append((out.where, len(raw_train), items))
                after_eval = True
            else:
                out.skip(
                    "final summaries" if "train_runtime" in items or "train_loss" in items else "dicts without a loss"
                )
        if not found:
            out.skip(_NOT_RECORD)
        if len(raw_train) >= out.max_records:
            out.stop(out.where)
            break
    out.derived_steps = True
    steps = _derived_steps(out, raw_train)
    evals = iter(raw_eval)
    pending = next(evals, None)
    for i, (step, (where, _, items)) in enumerate(zip(steps, raw_train)):
        while pending is not None and pending[1] <= i:  # evals printed before this train dict
            _hf_eval(out, steps[i - 1] if i else 0, pending)
            pending = next(evals, None)
        out.where = where
        hf_signals(out, step, items)
        lr_key = "learning_rate" if "learning_rate" in items else ("lr" if "lr" in items else None)
        out.train(
            step,
            _py_number(out, "loss", items["loss"]),
            _py_number(out, "grad_norm", items.get("grad_norm")),
            _py_number(out, "learning_rate", items.get(lr_key)) if lr_key else None,
            _py_number(out, "epoch", items.get("epoch")),
        )
    while pending is not None:
        _hf_eval(out, steps[-1] if steps else 0, pending)
        pending = next(evals, None)


def _derived_steps(out: RecordBuilder, raw_train: list[tuple[str, int | None, dict[str, str]]]) -> list[int]:
    """Steps for the train dicts: from the progress bar when it gives every record a step of its own,
    else record numbers. A derivation never merges two printed records into one step."""
    positions = [p for _, p, _ in raw_train if p is not None]
    if positions and len(positions) == len(raw_train):
        interval = log_interval(positions)
        steps: list[int] = []
        for i, p in enumerate(positions):
            snapped = round(p / interval) * interval
            # keep the bar's own position where snapping would lose a record: step 1 of
            # logging_first_step, or two records landing on one multiple
            if snapped <= 0 or (steps and snapped == steps[-1] and p != positions[i - 1]):
                snapped = p
            steps.append(snapped)
        stale = sum(1 for a, b in zip(steps, steps[1:]) if b == a)
        if not stale:
            out.note(
                f"the Trainer prints no step: steps derived from the progress bar, snapped to the "
                f"logging interval ({interval})"
            )
            return steps
        out.note(
            f"the Trainer prints no step, and the progress bar gives {stale} of {len(steps)} records the "
            "step of the record before (the bar is drawn in blocks, not at each log): steps are record "
            "numbers (1, 2, ...), not training steps"
        )
    else:
        out.note("the Trainer prints no step and the log has no progress bar: steps are record numbers (1, 2, ...)")
    steps, k, last_epoch = [], 0, None
    for _, _, items in raw_train:
        epoch, ok = parse_number(_unquoted(items.get("epoch")))
        if ok and epoch is not None and last_epoch is not None and epoch < last_epoch:
            k = 0  # the epoch went back: a new run in the same log
        last_epoch = epoch if ok and epoch is not None else last_epoch
        k += 1
        steps.append(k)
    return steps


def _unquoted(raw: str | None) -> str | None:
    if raw is not None and len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return raw


def hf_signals(out: RecordBuilder, step: int, items: dict[str, str]) -> None:
    """The dict's names (the task profile is detected from them) and its named signals beside the
    loss (reward, reward_std, kl, entropy, rewards/margins, eval_accuracy, ...), as a
    trainer_state.json's log_history gives them: the same dict, printed."""
    out.field_names(items)
    for key, raw in items.items():
        if is_signal(key):
            value, ok = parse_number(_unquoted(raw))
            if ok:
                out.signal(step, key, value)


def _hf_eval(out: RecordBuilder, step: int, pending: tuple[str, int, dict[str, str]]) -> None:
    out.where = pending[0]
    hf_signals(out, step, pending[2])
    for key, value in pending[2].items():
        m = _HF_EVAL.match(key)
        if m and (loss := _py_number(out, key, value)) is not None:
            out.eval(step, loss, m.group(1) or "")
