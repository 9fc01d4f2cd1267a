"""The log parsers on the real corpus (../shared/data/real-logs, see its SOURCES.md) and on small edge cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lossbeat.logs import LogFormatError, detect_format, parse_log

CORPUS = Path(__file__).resolve().parents[1].parent / "shared/data/real-logs"

# file: (format, train records, train records with a loss, eval records, eval groups) per SOURCES.md
EXPECTED = {
    "hf-tinyllama-1.1b-chat-lora-sft-trainer_state.json": ("hf", 186, 186, 14, [""]),
    "hf-tinyllama-1.1b-chat-v1.0-dpo-trainer_state.json": ("hf", 291, 291, 29, [""]),
    "hf-qwen3-8b-lora-tcm-9epoch-perstep-trainer_state.json": ("hf", 6687, 6687, 0, []),
    "hf-qwen3-8b-cpt-nsllm-llamafactory-trainer_state.json": ("hf", 435, 435, 0, []),
    "hf-mistral-7b-lora-translator-ckpt8500-trainer_state.json": ("hf", 850, 850, 0, []),
    "hf-qwen2.5-3b-lora-law-hugeloss-trainer_state.json": ("hf", 6, 6, 6, [""]),
    "hf-llama3.1-8b-lora-token-compressor-plateau-trainer_state.json": ("hf", 100, 100, 0, []),
    "hf-whisper-large-v3-tr-lora-earlystop-trainer_state.json": ("hf", 60, 60, 6, [""]),
    "hf-whisper-large-v2-ja-overfit-trainer_state.json": ("hf", 200, 200, 5, [""]),
    "hf-t5-small-summarization-gradspike-trainer_state.json": ("hf", 430, 430, 0, []),
    "hf-classifier-multi-eval-overfit-trainer_state.json": ("hf", 30, 30, 186, ["g0", "g1", "g2", "g3", "g4", "g5"]),
    "llamafactory-qwen2.5-3b-full-sft-7epoch-trainer_log.jsonl": ("llamafactory", 656, 656, 0, []),
    "lightning-wikitext103-slm-resumed-metrics.csv": ("lightning", 1126, 1126, 4, [""]),
    "llmc-gpt2-124m-fineweb-main.log": ("llmc", 19560, 19560, 80, [""]),
    "modded-nanogpt-muon-gpt2-124m-train.txt": ("nanogpt", 6200, 6200, 51, [""]),
    "megatron-gpt3-15b-release-sm-golden_values.json": ("megatron", 2601, 2544, 0, []),
}


def _corpus(name: str) -> Path:
    path = CORPUS / name
    if not path.exists():
        pytest.fail(f"real-log corpus missing: {path}")
    return path


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_parses_with_sources_md_counts(name):
    fmt, train, losses, evals, groups = EXPECTED[name]
    path = _corpus(name)
    assert detect_format(path) == fmt
    log = parse_log(path)
    assert (log.format, len(log.train), log.losses, len(log.evals), log.eval_groups) == (fmt, train, losses, evals, groups)


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
    assert any("2 lines without a loss" in n for n in log.notes)


def test_lightning_sparse_columns_and_resumed_counter():
    log = parse_log(_corpus("lightning-wikitext103-slm-resumed-metrics.csv"))
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
    with pytest.raises(LogFormatError, match="not a valid llamafactory log"):
        parse_log(bad)
