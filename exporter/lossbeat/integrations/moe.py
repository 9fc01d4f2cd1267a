"""Fill ``observe(expert_load=...)`` from a mixture-of-experts model's own routers.

Two ways, both on the device, without a host read (the counts travel with the step's values):

* :func:`expert_load_from_router_logits`: the ``router_logits`` a Hugging Face MoE model returns
  with ``output_router_logits=True`` (Mixtral, Qwen2-MoE / Qwen3-MoE, OLMoE: one ``[tokens,
  experts]`` tensor per MoE layer), routed on the top-k the model uses (``config.num_experts_per_tok``)::

      out = model(**batch, output_router_logits=True)
      load = expert_load_from_router_logits(out.router_logits, model.config.num_experts_per_tok,
                                            attention_mask=batch["attention_mask"])
      monitor.observe(step, loss=out.loss, losses={"router_aux_loss": out.aux_loss}, expert_load=load)

* :class:`RouterHooks`: a forward hook on each router module whose name matches a pattern
  (``r"mlp\\.gate$"`` for HF's MoE models, ``r"router$"`` for your own), counting the experts
  each training forward chose (its indices when the router returns them, as HF's routers do;
  else the top-k of its logits), summed over the micro-batches until :meth:`RouterHooks.expert_load`
  takes them::

      hooks = RouterHooks(model, r"mlp\\.gate$", top_k=2)
      ...
      monitor.observe(step, loss=loss, expert_load=hooks.expert_load())
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from lossbeat.measure.experts import counts_from_indices

__all__ = ["expert_load_from_router_logits", "RouterHooks"]


def expert_load_from_router_logits(
    router_logits: Sequence[torch.Tensor | None],
    top_k: int,
    *,
    attention_mask: torch.Tensor | None = None,
    names: Sequence[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Tokens per expert of each MoE layer from a HF model's ``router_logits``: ``{"moe.0": counts, ...}``
    (``names``: your own layer names, in the same order). ``attention_mask``: padding tokens are not
    counted (``[batch, seq]``, as the model was given). One top-k and one ``scatter_add_`` for all layers."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k: expected a positive int (the model's num_experts_per_tok), got {top_k!r}")
    layers = [x for x in router_logits if x is not None]
    if not layers:
        return {}
    experts = layers[0].shape[-1]
    logits = torch.stack([x.detach().reshape(-1, experts) for x in layers])  # [layers, tokens, experts]
    chosen = logits.topk(top_k, dim=-1).indices  # [layers, tokens, k]
    weight = torch.ones_like(chosen, dtype=torch.float32)
    if attention_mask is not None:
        keep = attention_mask.reshape(-1).to(device=chosen.device, dtype=torch.float32)
        if keep.numel() == chosen.shape[1]:
            weight = weight * keep[None, :, None]
    counts = torch.zeros(len(layers), experts, dtype=torch.float32, device=chosen.device)
    counts.scatter_add_(1, chosen.reshape(len(layers), -1), weight.reshape(len(layers), -1))
    labels = list(names) if names is not None else [f"moe.{i}" for i in range(len(layers))]
    if len(labels) != len(layers):
        raise ValueError(f"names: expected {len(layers)} names (one per MoE layer), got {len(labels)}")
    return dict(zip(labels, counts.unbind(0)))


class RouterHooks:
    """Forward hooks on the router modules of ``model`` whose qualified name matches ``pattern``
    (``re.search``): the tokens each expert got in training forwards, per router, on the device."""

    def __init__(self, model: torch.nn.Module, pattern: str, top_k: int, num_experts: int | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        regex = re.compile(pattern)
        self.top_k, self.num_experts = top_k, num_experts
        self.counts: dict[str, torch.Tensor | None] = {}
        self._handles = []
        for name, module in model.named_modules():
            if name and regex.search(name):
                self.counts[name] = None
                self._handles.append(module.register_forward_hook(self._hook(name)))
        if not self._handles:
            raise ValueError(f"pattern: no module of the model matches {pattern!r}")

    def _hook(self, name: str):
        def count(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if not module.training:  # evaluation and generation forwards are not the step's routing
                return
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
            logits = next((t for t in tensors if t.is_floating_point() and t.dim() >= 2), None)
            experts = self.num_experts or (logits.shape[-1] if logits is not None else None)
            indices = next((t for t in tensors if not t.is_floating_point() and t.dim() >= 1), None)
            if indices is None and logits is not None:
                indices = logits.detach().topk(self.top_k, dim=-1).indices
            if indices is None or experts is None:
                return
            counts = counts_from_indices(indices.detach(), experts)
            before = self.counts[name]
            self.counts[name] = counts if before is None else before + counts

        return count

    def expert_load(self) -> dict[str, torch.Tensor]:
        """The counts since the last call (every router that ran in training), and start again."""
        out = {name: c for name, c in self.counts.items() if c is not None}
        self.counts = dict.fromkeys(self.counts)
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
