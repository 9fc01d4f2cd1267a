"""The record counts of the real-log corpus (tests/data/real-logs/real-logs): one table the parsers'
tests check the files against, from SOURCES.md's "logged steps" and its eval counts."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Counts", "REAL_LOGS_COUNTS"]


class Counts(NamedTuple):
    """What a file of the corpus holds."""

    format: str
    train: int
    """Train records (SOURCES.md's logged steps)."""
    losses: int
    """Train records with a loss value (Megatron's "nan" strings are records without one)."""
    evals: int
    groups: list[str]
    """The eval groups (``""``: the plain eval loss; one per eval set)."""


REAL_LOGS_COUNTS = {
    "hf-tinyllama-1.1b-chat-lora-sft-trainer_state.json": Counts("hf", 186, 186, 14, [""]),
    "hf-tinyllama-1.1b-chat-v1.0-dpo-trainer_state.json": Counts("hf", 291, 291, 29, [""]),
    "hf-qwen3-8b-lora-tcm-9epoch-perstep-trainer_state.json": Counts("hf", 6687, 6687, 0, []),
    "hf-qwen3-8b-cpt-nsllm-llamafactory-trainer_state.json": Counts("hf", 435, 435, 0, []),
    "hf-mistral-7b-lora-translator-ckpt8500-trainer_state.json": Counts("hf", 850, 850, 0, []),
    "hf-qwen2.5-3b-lora-law-hugeloss-trainer_state.json": Counts("hf", 6, 6, 6, [""]),
    "hf-llama3.1-8b-lora-token-compressor-plateau-trainer_state.json": Counts("hf", 100, 100, 0, []),
    "hf-whisper-large-v3-tr-lora-earlystop-trainer_state.json": Counts("hf", 60, 60, 6, [""]),
    "hf-whisper-large-v2-ja-overfit-trainer_state.json": Counts("hf", 200, 200, 5, [""]),
    "hf-t5-small-summarization-gradspike-trainer_state.json": Counts("hf", 430, 430, 0, []),
    "hf-classifier-multi-eval-overfit-trainer_state.json": Counts(
        "hf", 30, 30, 186, ["g0", "g1", "g2", "g3", "g4", "g5"]
    ),
    "llamafactory-qwen2.5-3b-full-sft-7epoch-trainer_log.jsonl": Counts("llamafactory", 656, 656, 0, []),
    "lightning-wikitext103-slm-resumed-metrics.csv": Counts("lightning", 1126, 1126, 4, [""]),
    "llmc-gpt2-124m-fineweb-main.log": Counts("llmc", 19560, 19560, 80, [""]),
    "modded-nanogpt-muon-gpt2-124m-train.txt": Counts("nanogpt", 6200, 6200, 51, [""]),
    "megatron-gpt3-15b-release-sm-golden_values.json": Counts("megatron", 2601, 2544, 0, []),
}
