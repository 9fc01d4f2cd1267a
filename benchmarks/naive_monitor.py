"""A per-parameter gradient monitor written the obvious way, as a point of comparison.

It loops over the parameters and reads each gradient norm to Python with
``.item()``: one host read (a blocking sync on an accelerator) per parameter.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NaiveGradientMonitor"]


class NaiveGradientMonitor:
    def __init__(self, model: torch.nn.Module) -> None:
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.latest: dict[str, float] = {}
        self.global_norm = 0.0
        self.steps = 0

    def observe(self, loss: torch.Tensor) -> None:
        norms = {name: p.grad.norm().item() for name, p in self.named if p.grad is not None}
        self.latest = norms
        self.global_norm = math.sqrt(sum(n * n for n in norms.values()))
        self.loss = loss.item()
        self.steps += 1
