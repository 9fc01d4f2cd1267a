"""The log parsers on the real corpus (tests/data/real-logs, see its SOURCES.md) and on small edge cases."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REAL_LOGS, require_module
from helpers.real_logs import REAL_LOGS_COUNTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossbeat.logs import FORMATS, LogFormatError, detect_format, parse_log

CORPUS = REAL_LOGS
DATA = Path(__file__).resolve().parent / "data"


def _corpus(name: str) -> Path:
    path = CORPUS / name
    if not path.exists():
        pytest.fail(f"real-log corpus missing: {path}")
    return path


@pytest.mark.parametrize("name", sorted(REAL_LOGS_COUNTS))
def test_corpus_file_parses_with_sources_md_counts(name):
    fmt, train, losses, evals, groups = REAL_LOGS_COUNTS[name]
    path = _corpus(name)
    assert detect_format(path) == fmt
    log = parse_log(path)
    assert (log.format, len(log.train), log.losses, len(log.evals), log.eval_groups) == (
        fmt,
        train,
        losses,
        evals,
        groups,
    )


def test_hf_fields_and_first_last_values():
    log = parse_log(_corpus("hf-tinyllama-1.1b-chat-lora-sft-trainer_state.json"))
    first, last = log.train[0], log.train[-1]
    assert (first.step, last.step) == (15, 2790)
    assert first.loss == pytest.approx(2.08, abs=0.01) and last.loss == pytest.approx(1.03, abs=0.01)
    assert first.grad_norm is not None and first.learning_rate is not None and first.epoch is not None
    assert log.evals[0].loss == pytest.approx(1.622, abs=1e-3) and log.evals[-1].loss == pytest.approx(1.122, abs=1e-3)


def test_hf_without_grad_norm_keeps_it_missing():
    log = parse_log(_corpus("hf-whisper-large-v2-ja-overfit-trainer_state.json"))
    assert all(r.grad_norm is None for r in log.train)
    assert [e.loss for e in log.evals] == pytest.approx([0.321, 0.359, 0.394, 0.412, 0.420], abs=1e-3)


def test_llamafactory_dedupes_ranks_and_resume_keeps_lr_key():
    log = parse_log(_corpus("llamafactory-qwen2.5-3b-full-sft-7epoch-trainer_log.jsonl"))
    steps = [r.step for r in log.train]
    assert steps == sorted(set(steps)) and steps[0] == 10 and steps[-1] == 6560
    assert all(r.learning_rate is not None for r in log.train)  # from the "lr" key
    assert log.train[0].learning_rate == pytest.approx(1e-5, rel=1e-3)
    assert log.counts.read == 1360 and log.counts.train == 656
    assert log.counts.skipped == {
        "repeated steps (the latest record of a step kept)": 702,
        "lines without a loss or eval loss (progress only)": 2,
    }
    assert "read 1360 lines: 656 train records" in log.notes[0]


def test_lightning_sparse_columns_and_resumed_counter():
    log = parse_log(_corpus("lightning-wikitext103-slm-resumed-metrics.csv"))
    assert any("starts at 140749" in n and "mid-run" in n for n in log.notes)
    assert log.train[0].step == 140749 and log.train[-1].step == 196999
    assert [e.loss for e in log.evals] == pytest.approx([3.563, 3.566, 3.570, 3.604], abs=1e-3)
    assert all(r.epoch is not None for r in log.train)


def test_llmc_train_and_val_lines():
    log = parse_log(_corpus("llmc-gpt2-124m-fineweb-main.log"))
    r0 = log.train[0]
    assert (r0.step, r0.loss, r0.learning_rate, r0.grad_norm) == (0, 11.0091, 0.000001, 15.37)
    assert log.evals[0].loss == pytest.approx(11.0092) and log.evals[-1].loss == pytest.approx(3.2722)


def test_nanogpt_train_and_val_lines():
    log = parse_log(_corpus("modded-nanogpt-muon-gpt2-124m-train.txt"))
    assert log.train[0].step == 1 and log.train[-1].step == 6200
    assert log.evals[0].loss == pytest.approx(10.9264) and log.evals[-1].loss == pytest.approx(3.2785)


def test_megatron_nan_strings_are_missing_values():
    log = parse_log(_corpus("megatron-gpt3-15b-release-sm-golden_values.json"))
    missing = [r.step for r in log.train if r.loss is None]
    assert len(missing) == 57 and missing[0] == 12720 and missing[-1] == 13000
    assert all(math.isfinite(r.loss) for r in log.train if r.loss is not None)
    assert log.train[0].loss == pytest.approx(12.95636)


def test_nan_literal_in_hf_log_stays_non_finite(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": NaN, "grad_norm": Infinity}]}')
    log = parse_log(path)
    assert math.isnan(log.train[1].loss) and math.isinf(log.train[1].grad_norm)
    assert any("1 non-finite" in n for n in log.notes)


def test_unknown_format_is_an_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\nworld\n")
    with pytest.raises(LogFormatError, match="unknown log format"):
        parse_log(path)
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"current_steps": 1, "loss": 1.0}\n{not json\n')
    log = parse_log(bad)  # a line cut short is counted, not fatal (a crash while writing)
    assert len(log.train) == 1 and log.counts.skipped == {"lines that are not JSON (a line cut short?)": 1}


def test_every_corpus_file_is_one_run_and_says_what_it_read():
    for name in REAL_LOGS_COUNTS:
        log = parse_log(_corpus(name))
        assert len(log.segments) == 1, name
        assert log.notes[0].startswith(f"read {log.counts.read} "), name
        assert log.counts.train == len(log.train) and log.counts.evals == len(log.evals), name
        assert not log.counts.unreadable and log.counts.stopped_at is None, name


# --- what used to be lost ------------------------------------------------------------------


def test_llamafactory_eval_lines_are_eval_records():
    log = parse_log(DATA / "llamafactory-with-eval-trainer_log.jsonl")
    assert [(e.step, e.loss) for e in log.evals] == [(25, 1.0805), (50, 0.9349), (75, 0.8099), (100, 0.7026)]
    assert len(log.train) == 20 and not log.counts.skipped


def test_hf_lr_key_is_the_learning_rate():
    log = parse_log(DATA / "hf-custom-lr-key-trainer_state.json")
    assert [r.learning_rate for r in log.train] == [1e-4] * 10


def test_lightning_lr_monitor_rows_of_their_own():
    log = parse_log(DATA / "lightning-lr-monitor-metrics.csv")
    assert [r.step for r in log.train][:3] == [9, 19, 29]
    assert log.train[0].learning_rate == pytest.approx(1e-3 * (1 - 9 / 200))
    assert log.train[-1].learning_rate == pytest.approx(1e-3 * (1 - 199 / 200))
    assert any("'lr-AdamW'" in n and "lr-AdamW/pg2" in n for n in log.notes)
    assert not any("mid-run" in n for n in log.notes)  # first step 9 when logging every 10: not a resumed run
    assert [e.step for e in log.evals] == [99, 199]


def test_several_runs_in_one_file_are_segments():
    log = parse_log(DATA / "llmc-three-seeds-main.log")
    assert len(log.segments) == 3
    for seg in log.segments:
        assert [r.step for r in seg.train] == list(range(60))
        assert [e.step for e in seg.evals] == [0, 60]  # each run's own evals, none merged across runs
    assert log.train is log.segments[-1].train
    assert any("3 runs in one file" in n for n in log.notes)
    assert "run 2 of 3" in log.segments[1].notes[-1]


def test_repeated_and_slightly_late_steps_are_not_runs(tmp_path):
    path = tmp_path / "trainer_log.jsonl"
    steps = [10, 10, 20, 30, 20, 40, 30, 50, 40, 60]  # two ranks, one lagging a step behind
    path.write_text("".join(f'{{"current_steps": {s}, "loss": {1 + s / 100}}}\n' for s in steps))
    log = parse_log(path)
    assert len(log.segments) == 1 and [r.step for r in log.train] == [10, 20, 30, 40, 50, 60]
    assert log.counts.skipped["repeated steps (the latest record of a step kept)"] == 4


def test_resume_from_checkpoint_is_not_a_new_run(tmp_path):
    history = [{"step": s, "loss": 2.0} for s in range(10, 110, 10)] + [
        {"step": s, "loss": 1.0} for s in range(60, 160, 10)
    ]
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": history}))
    log = parse_log(path)
    assert len(log.segments) == 1
    assert [r.step for r in log.train] == list(range(10, 160, 10))
    assert [r.loss for r in log.train if r.step >= 60] == [1.0] * 10  # the resumed attempt wins


# --- new formats ---------------------------------------------------------------------------


def test_hf_trainer_stdout_dicts_with_progress_bars():
    path = DATA / "hf-trainer-stdout.log"
    assert detect_format(path) == "hf-stdout"
    log = parse_log(path)
    assert [r.step for r in log.train] == [10, 20, 30, 40, 50, 60]
    assert log.derived_steps and any("derived from the progress bar" in n for n in log.notes)
    assert math.isnan(log.train[4].grad_norm)  # a bare nan
    assert log.train[0].learning_rate == pytest.approx(1.866e-4, rel=1e-3) and log.train[0].epoch == 0.33
    assert [e.step for e in log.evals] == [30, 60]
    assert log.counts.skipped["final summaries"] == 1


def test_hf_stdout_without_progress_bar_numbers_records_and_reads_wrapped_values(tmp_path):
    path = tmp_path / "train.out"
    path.write_text(
        "Loading checkpoint shards: done\n"
        "{'loss': 2.5, 'grad_norm': tensor(1.5, device='cuda:0'), 'learning_rate': 5e-05, 'epoch': 0.1}\n"
        "{'loss': inf, 'grad_norm': np.float64(2.0), 'learning_rate': 4e-05, 'epoch': 0.2}\n"
        "{'loss': 'oops', 'grad_norm': 1.0, 'learning_rate': 3e-05, 'epoch': 0.3}\n"
        "{'eval_loss': 2.1, 'eval_runtime': 3.2, 'epoch': 0.3}\n"
        "{'loss': 2.4, 'grad_norm': 1.0, 'learning_rate': 5e-05, 'epoch': 0.1}\n"  # epoch went back: a new run
        "{'loss': 2.3, 'grad_norm': 1.0, 'learning_rate': 4e-05, 'epoch': 0.2}\n"
        "{'loss': 2.2, 'grad_norm': 1.0, 'learning_rate': 3e-05, 'epoch': 0.3}\n"
    )
    log = parse_log(path)
    first, second = log.segments
    assert [(r.step, r.loss, r.grad_norm) for r in first.train] == [(1, 2.5, 1.5), (2, math.inf, 2.0), (3, None, 1.0)]
    assert [(e.step, e.loss) for e in first.evals] == [(3, 2.1)]
    assert [r.step for r in second.train] == [1, 2, 3]
    assert log.counts.unreadable == {"loss": 1}
    assert any("unreadable 1 loss value" in n and "'oops'" in n for n in log.notes)
    assert any("record numbers" in n for n in log.notes)


def test_llmc_stdout():
    path = DATA / "llmc-stdout.log"
    assert detect_format(path) == "llmc-stdout"
    log = parse_log(path)
    r0 = log.train[0]
    assert (r0.step, r0.loss, r0.grad_norm, r0.learning_rate) == (1, 10.98, 15.4, 6e-05)  # "(+nanz)" is not a value
    assert [r.step for r in log.train] == list(range(1, 41))
    assert [e.step for e in log.evals] == [0, 20, 40]
    assert log.counts.skipped == {"lines that are not records (banners, progress, warnings)": 10}


def test_megatron_text_log():
    path = DATA / "megatron-train.log"
    assert detect_format(path) == "megatron-log"
    log = parse_log(path)
    assert [r.step for r in log.train] == list(range(10, 310, 10))
    r100 = next(r for r in log.train if r.step == 100)
    assert r100.learning_rate == pytest.approx(1.5e-4) and r100.grad_norm is not None
    assert next(r for r in log.train if r.step == 20).grad_norm is None  # skipped iteration: no grad norm
    assert math.isnan(next(r for r in log.train if r.step == 200).loss)  # "number of nan iterations: 1"
    assert [e.step for e in log.evals] == [100, 200, 300]
    assert any("NaN iterations" in n for n in log.notes) and any("1 iterations skipped" in n for n in log.notes)


def test_tensorboard_event_file(tmp_path):
    require_module("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 31):
        writer.add_scalar("train/loss", 3.0 - step * 0.05, step)
        writer.add_scalar("train/grad_norm", 1.0, step)
        writer.add_scalar("train/learning_rate", 1e-4, step)
        if step % 10 == 0:
            writer.add_scalar("eval/loss", 2.9 - step * 0.04, step)
    writer.add_scalar("train/loss", float("nan"), 31)
    writer.add_histogram("weights", torch_tensor(), 31)
    writer.close()
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    for path in (event_file, tmp_path):  # the file, or the directory that holds it
        assert detect_format(path) == "tensorboard"
        log = parse_log(path)
        assert [r.step for r in log.train] == list(range(1, 32))
        assert log.train[0].loss == pytest.approx(2.95) and log.train[0].learning_rate == pytest.approx(1e-4)
        assert math.isnan(log.train[-1].loss)
        assert [e.step for e in log.evals] == [10, 20, 30]
        assert log.counts.skipped["values that are not scalars (histograms, images, text)"] == 1
        assert any("tags not read: weights" in n for n in log.notes)


def torch_tensor():
    import torch

    return torch.arange(10.0)


def test_every_format_has_its_row_in_the_docs_formats_table():
    """What ``--format`` accepts and detection returns is what docs/analyze.md's table describes, in its order."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "analyze.md").read_text(encoding="utf-8")
    table = text[text.index("## Formats (auto-detected)") :]
    table = table[: table.index("\n## ", 1)]
    assert tuple(re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.MULTILINE)) == FORMATS


# --- broken inputs: one line naming the file and the problem ----------------------------------


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "empty file"),
        (b'{"log_history": [{"step": 1, "loss": 2.0}, {"step": 2, "lo', "truncated JSON"),
        (bytes(range(256)) * 64, "binary data"),
        (b"\x00\x01\x02garbage\xff\xfe" * 1000, "binary data"),
        (b'{"log_history": []}', "no training or eval records"),
        (b'{"something": "else"}', "none of the known layouts"),
    ],
)
def test_broken_files_raise_one_line(tmp_path, content, problem):
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    with pytest.raises(LogFormatError) as info:
        parse_log(path)
    message = str(info.value)
    assert message.startswith(str(path)) and problem in message and "\n" not in message


def test_directory_and_fifo_are_refused_without_blocking(tmp_path):
    with pytest.raises(LogFormatError, match="is a directory"):
        parse_log(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(LogFormatError, match="FIFO"):  # opening it would wait for a writer forever
        parse_log(fifo)


def test_encodings(tmp_path):
    text = "".join(f"s:{i} trl:{3 - i / 100:.4f} lr:0.000100 norm:1.00\n" for i in range(10))
    utf16 = tmp_path / "utf16.log"
    utf16.write_bytes(text.encode("utf-16"))  # a Windows redirect, with a BOM
    assert [r.step for r in parse_log(utf16).train] == list(range(10))
    nobom = tmp_path / "utf16le.log"
    nobom.write_bytes(text.encode("utf-16-le"))
    assert len(parse_log(nobom).train) == 10
    latin = tmp_path / "latin1.log"
    latin.write_bytes(("# run by Jos\xe9\n" + text).encode("latin-1"))
    log = parse_log(latin)
    assert len(log.train) == 10 and any("not valid utf-8" in n for n in log.notes)


def test_one_step_is_read(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [{"step": 1, "loss": 2.0}]}')
    log = parse_log(path)
    assert len(log.train) == 1 and len(log.segments) == 1


def test_unreadable_values_are_counted_not_dropped(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text(
        json.dumps(
            {
                "log_history": [
                    {"step": 1, "loss": 2.0, "grad_norm": "n/a"},
                    {"step": 2, "loss": "abc"},
                    {"step": "x", "loss": 1.0},
                ]
            }
        )
    )
    log = parse_log(path)
    assert [(r.step, r.loss, r.grad_norm) for r in log.train] == [(1, 2.0, None), (2, None, None)]
    assert log.counts.unreadable == {"grad_norm": 1, "loss": 1, "step": 1}
    assert log.counts.skipped == {"entries without a step": 1}
    assert "unreadable 1 grad_norm value (first: 'n/a' at log_history[0])" in log.notes[0]


def test_overlong_lines_and_record_cap_bound_memory(tmp_path):
    """A 64 MiB line and a file past the record cap: memory stays far below the file size."""
    path = tmp_path / "big.log"
    with open(path, "w") as fh:
        fh.write("s:0 trl:3.0 lr:0.0001 norm:1.0\n")
        fh.write("x" * (64 << 20) + "\n")  # one enormous line (a binary blob dumped as text)
        for i in range(1, 300_000):
            fh.write(f"s:{i} trl:{3 - i * 1e-6:.6f} lr:0.000100 norm:1.00\n")
    script = (
        "import resource, sys\n"
        "from lossbeat.logs import parse_log\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"log = parse_log({str(path)!r}, max_records=100_000)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(len(log.train), (after - before) // 1024, log.counts.stopped_at is not None, dict(log.counts.skipped))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    records, grew_mib, stopped, skipped = out.stdout.split(maxsplit=3)
    assert int(records) == 100_000 and stopped == "True"
    assert "overlong lines" in skipped
    assert int(grew_mib) < 48, out.stdout  # the file is over 70 MiB; reading it must not hold it


# --- real outputs (tests/data/make_fixtures.py): one HF Trainer run, printed and as TensorBoard events --


def test_hf_trainer_real_stdout_matches_its_own_tensorboard_events():
    require_module("tensorboard")
    printed = parse_log(DATA / "hf-trainer-real-stdout.log")  # transformers 5 prints '3.899' (quoted)
    events = parse_log(DATA / "hf-trainer-real-tfevents")
    assert (printed.format, events.format) == ("hf-stdout", "tensorboard")
    assert [r.step for r in printed.train] == [r.step for r in events.train] == list(range(5, 45, 5))
    for p, e in zip(printed.train, events.train):
        for field in ("loss", "grad_norm", "learning_rate", "epoch"):
            assert getattr(p, field) == pytest.approx(getattr(e, field), rel=1e-3), field
    assert [e.step for e in printed.evals] == [e.step for e in events.evals] == [10, 20, 30, 40]
    assert [e.loss for e in printed.evals] == pytest.approx([e.loss for e in events.evals], rel=1e-3)
    assert not printed.counts.unreadable and printed.counts.skipped["final summaries"] == 1


def test_lightning_real_lr_monitor_two_param_groups():
    log = parse_log(DATA / "lightning-real-lr-monitor-metrics.csv")
    assert [r.step for r in log.train] == list(range(9, 100, 10))
    assert [r.learning_rate for r in log.train] == [0.01] * 3 + [0.005] * 3 + [0.0025] * 3 + [0.00125]
    assert any("'lr-AdamW/pg1'" in n for n in log.notes)
    assert not any("mid-run" in n for n in log.notes)
    assert len(log.evals) == 5


def test_karpathy_nanogpt_stdout():
    path = DATA / "nanogpt-karpathy-stdout.log"
    assert detect_format(path) == "nanogpt"
    log = parse_log(path)
    assert [r.step for r in log.train] == list(range(0, 140, 10))
    assert log.train[0].loss == 4.2654 and math.isnan(log.train[12].loss)
    assert [(e.step, e.loss) for e in log.evals] == [(0, 4.2823), (100, 2.4619)]  # val loss, not the train estimate
    assert log.counts.skipped == {"lines that are not records (banners, progress, warnings)": 11}


def test_tensorboard_cut_short_or_garbage(tmp_path):
    require_module("tensorboard")
    whole = (DATA / "hf-trainer-real-tfevents/events.out.tfevents.fixture").read_bytes()
    cut = tmp_path / "events.out.tfevents.cut"
    cut.write_bytes(whole[:6500])  # a crash while writing: the last record is incomplete
    log = parse_log(cut)
    assert [r.step for r in log.train] == [5, 10, 15, 20, 25, 30]
    assert any("not a complete event" in n for n in log.notes)
    garbage = tmp_path / "events.out.tfevents.garbage"
    garbage.write_bytes(os.urandom(3000))
    with pytest.raises(LogFormatError, match="no TensorBoard event could be read"):
        parse_log(garbage)
    with pytest.raises(LogFormatError, match="no TensorBoard event could be read"):
        parse_log(DATA / "llmc-stdout.log", "tensorboard")


def test_json_document_over_the_limit_is_refused(tmp_path, monkeypatch):
    from lossbeat.logs import json_logs

    monkeypatch.setattr(json_logs, "MAX_JSON_BYTES", 1 << 10)
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": [{"step": i, "loss": 1.0} for i in range(100)]}))
    with pytest.raises(LogFormatError, match="larger than the 1024 bytes read at once"):
        parse_log(path)


def test_hf_stdout_logging_first_step_and_a_lagging_bar(tmp_path):
    bar = lambda n: f"\r {n}/100 [00:01<00:10,  9.1it/s]"  # noqa: E731
    path = tmp_path / "out.log"
    positions = [1, 10, 20, 29, 40, 50]  # step 1 (logging_first_step), then every 10; the bar lags once
    path.write_text(
        "".join(f"{bar(p)}\n{{'loss': {3 - p / 100}, 'learning_rate': 1e-4, 'epoch': {p / 100}}}\n" for p in positions)
    )
    log = parse_log(path)
    assert [r.step for r in log.train] == [1, 10, 20, 30, 40, 50]
    assert len(log.train) == len(positions)


# --- fuzzing: any bytes, any forced format: records or a LogFormatError, never another exception ----

_FRAGMENTS = [
    '{"log_history": [',
    '{"step": 1, "loss": 2.0}',
    '"loss": "x"',
    "]}",
    '{"current_steps": 3, "loss": NaN}',
    '{"lm loss": {"values": {"1": "nan", "x": 2}}}',
    "epoch,step,train_loss,lr-AdamW",
    ",,1.5,",
    "9,9,nan,0.1",
    "s:0 trl:11.0 lr:0.0001 norm:1.5",
    "s:x tel:",
    "step 1/10 | loss 2.0 (+nanz)| norm 1.0 | lr 1e-4",
    "val loss abc",
    "step:1/10 train_loss:3.0",
    "iter 5: loss inf, time 3ms",
    "step 5: train loss 2, val loss",
    " iteration 10/ 100 | lm loss: 4.0E+00 | grad norm: x | number of nan iterations: 2 |",
    "validation loss at iteration 10 | lm loss value: 3.0 |",
    "{'loss': nan, 'grad_norm': tensor(1.0), 'epoch': 1}",
    "{'eval_loss': '2.0', 'epoch': 'x'}",
    " 10/100 [00:01<00:10]",
    "\r",
    "\x00",
    "\ufffd",
    "}",
    "{",
    ",",
    "|",
    "step     3 | loss: 3.4 | lr 6e-04 | norm: x | dt: 1ms",
    "validation loss: nan",
    "7 val 3.2",
    "7 hella 0.25",
    "step 00012/00100 (1.20%) | loss: 3.4 | lrm: 1.00",
    "Step 00012 | Validation bpb: x",
    "[step=5/10,epoch=0]",
    "    train/CE loss=inf",
    "    eval/lm/c4/CE loss=3",
    "[eval_step=1/2]",
    "step: 10  loss:  7.9  grad_norm:  inf",
    "validate step: 10  loss: x",
    "batch: 9, time: 1.0, loss: 5",
    "epoch: 0|step: 2|act_loss: nan",
    "[rank0]:",
    "0: ",
    "\x1b[31m",
    '{"name": "stdout", "text": ["iter 1: loss 2.0, time 1ms"]}',
    '"step: 1 loss: 2\\n"',
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=20), max_size=30),
    sep=st.sampled_from(["\n", "\r\n", "\r", ""]),
    fmt=st.sampled_from([None, *FORMATS]),
)
def test_fuzzed_text_never_raises_anything_but_log_format_error(tmp_path, parts, sep, fmt):
    path = tmp_path / "fuzz.log"
    path.write_text(sep.join(parts), encoding="utf-8", errors="replace")
    try:
        log = parse_log(path, fmt)
    except LogFormatError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
    else:
        assert log.segments and log.counts.train == sum(len(s.train) for s in log.segments)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=4096), fmt=st.sampled_from([None, *FORMATS]))
def test_fuzzed_bytes_never_raise_anything_but_log_format_error(tmp_path, data, fmt):
    path = tmp_path / "events.out.tfevents.fuzz" if fmt == "tensorboard" else tmp_path / "fuzz.bin"
    path.write_bytes(data)
    try:
        parse_log(path, fmt)
    except LogFormatError as exc:
        assert "\n" not in str(exc)


def test_compressed_files_and_log_directories_get_a_hint(tmp_path):
    import gzip

    packed = tmp_path / "main.log.gz"
    packed.write_bytes(gzip.compress(b"s:0 trl:11.0\n" * 100))
    with pytest.raises(LogFormatError, match="gzip-compressed: decompress it first"):
        parse_log(packed)
    (tmp_path / "checkpoint-500").mkdir()
    (tmp_path / "checkpoint-500" / "trainer_state.json").write_text('{"log_history": []}')
    with pytest.raises(LogFormatError, match="it holds trainer_state.json: pass that file"):
        parse_log(tmp_path / "checkpoint-500")


@pytest.mark.parametrize(
    "text, expected",
    [
        # llm.c's older C trainer
        (
            "step 1/74: train loss 4.677316 (acc 0.12) (1.52 ms, 336842 tok/s)\nval loss 4.3\n"
            "step 2/74: train loss 4.1 (1.4 ms, 336842 tok/s)\n",
            [(1, 4.677316, None, None), (2, 4.1, None, None)],
        ),
        # llm.c's train_gpt2.py
        (
            "step    1/5000 | train loss 10.985306 | norm 15.4521 | lr 1.00e-06 | (3200.53 ms | 163828 tok/s)\n"
            "step    2/5000 | train loss nan | norm inf | lr 2.00e-06 | (320.53 ms | 163828 tok/s)\n",
            [(1, 10.985306, 15.4521, 1e-06), (2, math.nan, math.inf, 2e-06)],
        ),
    ],
)
def test_llmc_stdout_variants(tmp_path, text, expected):
    path = tmp_path / "train.out"
    path.write_text(text)
    log = parse_log(path)
    assert log.format == "llmc-stdout"
    got = [(r.step, r.loss, r.grad_norm, r.learning_rate) for r in log.train]
    assert [[str(v) for v in row] for row in got] == [[str(v) for v in row] for row in expected]  # nan == nan


def test_tensorboard_lightning_tags_and_a_sparser_lr(tmp_path):
    require_module("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(0, 40):
        writer.add_scalar("train_loss", 2.0 - step / 100, step)
        if step % 10 == 0:
            writer.add_scalar("lr-AdamW", 1e-3 / (1 + step // 10), step)
    writer.add_scalar("val_loss", 1.9, 39)
    writer.close()
    log = parse_log(tmp_path)
    assert [r.learning_rate for r in log.train][9:12] == pytest.approx([1e-3, 5e-4, 5e-4])  # held until the next LR
    assert [(e.step, e.loss) for e in log.evals] == [(39, pytest.approx(1.9))]


def test_a_lightning_csv_gives_its_layer_norms_step_times_and_memory_to_the_replay(tmp_path):
    """Lightning's grad_norm() columns, a step time and the allocated memory are read as the run's vitals
    (at most 64 layer columns: every value is kept until the replay) and judged as live: a layer that
    vanished against its own level mid-run is a danger offline too."""
    from lossbeat.analyze import analyze_runs
    from lossbeat.logs import parse_log

    layers = [f"l{i}" for i in range(70)]
    header = "step,train_loss,step_time,memory_allocated," + ",".join(f"grad_2.0_norm/{n}" for n in layers)
    rows = []
    for step in range(200):
        norms = [0.5 if i or step < 100 else 1e-10 for i in range(len(layers))]  # l0 cut off at step 100
        rows.append(f"{step},{2.0 - step * 0.002},0.1,{1e9},{','.join(map(repr, norms))}")
    path = tmp_path / "metrics.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    log = parse_log(path, "lightning")
    assert "per-layer grad norms: the first 64 of 70 columns read" in log.notes
    names = {n for n in log.signals if n.startswith("layer_grad_norm/")}
    assert len(names) == 64 and "layer_grad_norm/l0" in names
    assert len(log.signals["step_time"]) == 200 and len(log.signals["memory_allocated"]) == 200
    (run,) = analyze_runs(path).runs
    layer = next(f for f in run.findings if f.check == "layer_grad_norm")
    assert layer.status.name == "DANGER" and "l0 " in layer.message, layer.message
    assert next(f for f in run.findings if f.check == "throughput").status.name == "GOOD"
