"""The benchmark's transformers (lossbeat's demo TinyLM, 1M to 1.3B parameters) and their data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lossbeat.demo import ModelSize, SyntheticCorpus, TinyLM

__all__ = ["ModelSpec", "MODEL_SPECS", "TINY_SPEC", "Workload", "build_workload", "make_optimizer"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    size: ModelSize
    batch: int
    """Sequences per step: sized so a CPU step takes 0.1 to 1.5 s on the reference machine."""
    dtype: torch.dtype = torch.float32
    """Parameters, gradients and optimizer state (bf16 for the GPU-sized model)."""


MODEL_SPECS = {
    "1M": ModelSpec("1M", ModelSize(vocab=256, context=64, width=128, layers=5, heads=4), batch=16),
    "10M": ModelSpec("10M", ModelSize(vocab=256, context=64, width=256, layers=12, heads=8), batch=8),
    "50M": ModelSpec("50M", ModelSize(vocab=256, context=64, width=512, layers=16, heads=8), batch=4),
    # GPU only: 1.34e9 parameters in 293 tensors, about 11 GB with grads and AdamW state in bf16.
    "1.3B": ModelSpec(
        "1.3B", ModelSize(vocab=32768, context=1024, width=2048, layers=24, heads=16), batch=8, dtype=torch.bfloat16
    ),
    # The smoke plan's models: milliseconds a step on CPU (tiny-bf16 stands in for the GPU plan's dtype).
    "tiny": ModelSpec("tiny", ModelSize(vocab=32, context=8, width=16, layers=2, heads=2), batch=2),
    "tiny-bf16": ModelSpec(
        "tiny-bf16", ModelSize(vocab=32, context=8, width=16, layers=2, heads=2), batch=2, dtype=torch.bfloat16
    ),
}
TINY_SPEC = MODEL_SPECS["tiny"]
"""For the smoke test: milliseconds a step."""

_BATCH_POOL = 4  # batches made up front and cycled, so data generation is not in the timings


@dataclass
class Workload:
    spec: ModelSpec
    model: TinyLM
    optimizer: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def tensors(self) -> int:
        return sum(1 for _ in self.model.parameters())

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[step % len(self.batches)]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def build_workload(spec: ModelSpec, device: torch.device | str = "cpu", seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    device = torch.device(device)
    with device:  # built in place: initialising 1.3e9 parameters on the CPU first takes a minute
        model = TinyLM(spec.size).to(dtype=spec.dtype)
    optimizer = make_optimizer(model)
    corpus = SyntheticCorpus(spec.size.vocab, spec.size.context, seed=seed)
    batches = [tuple(t.to(device) for t in corpus.batch(spec.batch)) for _ in range(_BATCH_POOL)]
    return Workload(spec, model, optimizer, batches, device)
