"""Gradient statistics from one fused reduction: per-layer norms, global norm, clipping.

Parameters are grouped into layers by module path (``blocks.3.attn.qkv.weight``
belongs to layer ``blocks.3.attn.qkv``); ``depth`` keeps only the first
components for coarser grouping (``depth=3`` -> ``blocks.3.attn``). Everything
here stays on the device: no ``.item()``, no host synchronisation.

Sharded parameters (``DTensor``: FSDP2's ``fully_shard``, HSDP, tensor
parallelism; FSDP1's flat parameters) hold a shard of their gradient on each
rank. Their squared norms are reduced locally, then summed over the process
groups they are sharded on with one small all-reduce per sharding layout (a
vector of one float per layer), so every rank gets the model's norms. That
all-reduce is a collective: every rank must measure at the same steps, as
training loops do. Wrapper components of parameter names
(``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``, ``_orig_mod``) are
dropped, so layers keep the model's own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["LayerGrouping", "GradientNorms", "compute_grad_norms", "clip_with_norms"]

_INDEX_CACHE_SIZE = 8


# Modules that wrappers insert into parameter names; never a user's own module name.
_WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def _dtensor_groups(param: torch.Tensor) -> tuple[Any, ...]:
    """Process groups over which a DTensor's gradient is sharded: () for a whole tensor.

    Placed ``Shard``/``_StridedShard`` on a mesh dimension, it holds a slice there
    (its squares add up over that dimension's group); ``Replicate`` holds the
    whole (nothing to add).
    """
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        return ()
    return tuple(
        mesh.get_group(dim) for dim, placement in enumerate(placements)
        if not (placement.is_replicate() or placement.is_partial()) and mesh.size(dim) > 1
    )


def _fsdp1_groups(model: torch.nn.Module) -> dict[int, tuple[Any, ...]]:
    """{id(parameter): (shard process group,)} for the parameters FSDP1 shards.

    A ``FullyShardedDataParallel`` unit flattens its parameters into one
    ``FlatParameter`` and keeps a 1-D chunk on each rank of its process group
    (with ``use_orig_params=True`` the original parameters are views into that
    chunk). Hybrid sharding's process group is the shard group; ``NO_SHARD``
    holds whole tensors.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    out: dict[int, tuple[Any, ...]] = {}
    for module in model.modules():
        if not isinstance(module, FullyShardedDataParallel):
            continue
        flat = getattr(getattr(module, "_handle", None), "flat_param", None)
        group = module.process_group
        if flat is None or module.sharding_strategy == ShardingStrategy.NO_SHARD or group.size() < 2:
            continue
        for param in getattr(flat, "_params", None) or [flat]:
            out[id(param)] = (group,)
    return out


def layer_name(param_name: str, depth: int | None) -> str:
    parts = [part for part in param_name.split(".") if part not in _WRAPPER_NAMES]
    module = parts[:-1] or parts  # a top-level parameter is its own layer
    if depth is not None:
        module = module[:depth]
    return ".".join(module)


class LayerGrouping:
    """The trainable parameters of a model, in model order, mapped to layer indices.

    ``max_layers`` bounds label cardinality: when the module paths give more
    layers, the grouping gets coarser (smaller depth) until they fit.

    Each parameter gets a slot: its layer index, plus ``len(layers)`` times its
    sharding layout (0 for whole tensors; one per distinct set of process groups
    for shards), so one ``index_add_`` sorts squares by layer and layout.
    """

    def __init__(
        self, model: torch.nn.Module, depth: int | None = None, max_layers: int = 1000, reduce_shards: bool = True
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if depth is not None and (not isinstance(depth, int) or depth < 1):
            raise ValueError(f"layer_depth: expected a positive int or None, got {depth!r}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = [layer_name(n, depth) for n, _ in named]
        if depth is None:
            depth = max((len(n.split(".")) for n in names), default=1)
        while len(dict.fromkeys(names)) > max_layers and depth > 1:
            depth -= 1
            names = [layer_name(n, depth) for n, _ in named]
        self.depth = depth
        self.model_ref = model
        self.params: list[torch.nn.Parameter] = [p for _, p in named]
        self.layer_names: list[str] = list(dict.fromkeys(names))
        position = {name: i for i, name in enumerate(self.layer_names)}
        self.param_layer: list[int] = [position[n] for n in names]
        layouts: dict[tuple[Any, ...], int] = {(): 0}
        # reduce_shards=False: each rank measures its own shards, with no collective.
        distributed = reduce_shards and dist.is_available() and dist.is_initialized()
        fsdp1 = _fsdp1_groups(model) if distributed else {}
        param_layouts = [
            layouts.setdefault(fsdp1.get(id(p)) or _dtensor_groups(p), len(layouts)) if distributed else 0
            for p in self.params
        ]
        self.shard_groups: list[tuple[Any, ...]] = list(layouts)
        """Per sharding layout, the process groups its squares are summed over (layout 0: none)."""
        self.param_slot: list[int] = [
            layer + len(self.layer_names) * layout for layer, layout in zip(self.param_layer, param_layouts)
        ]
        self.sharded = len(self.shard_groups) > 1
        """Whether measuring takes an all-reduce (every rank must measure at the same steps)."""
        self._dtensors = any(hasattr(p, "_local_tensor") for p in self.params)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.layer_names)

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether ``model``'s trainable parameters are still the ones grouped (one pass over them)."""
        params = self.params
        i = 0
        for p in model.parameters():
            if p.requires_grad:
                if i == len(params) or params[i] is not p:
                    return False
                i += 1
        return i == len(params)

    def present_grads(self) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        """Gradients that exist this step (the local shard of a DTensor's) and their slots.

        A Python loop over parameters, but it only reads ``.grad``: no device work.
        Frozen parameters are excluded at construction; unused ones have no grad.
        """
        grads, slots = [], []
        dtensors = self._dtensors
        for p, slot in zip(self.params, self.param_slot):
            g = p.grad
            if g is not None:
                if dtensors:  # a DTensor's local shard, by attribute: to_local() is a dispatch
                    g = getattr(g, "_local_tensor", g)
                # A grad only requires grad after backward(create_graph=True); detach is a dispatch.
                grads.append(g.detach() if g.requires_grad else g)
                slots.append(slot)
        return grads, tuple(slots)

    def layer_index(self, layers: tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = layers
        index = self._index_cache.get(key)
        if index is None or index.device != device:
            if len(self._index_cache) >= _INDEX_CACHE_SIZE:
                self._index_cache.clear()
            index = torch.tensor(layers, dtype=torch.long).to(device, non_blocking=True)
            self._index_cache[key] = index
        return index


@dataclass
class GradientNorms:
    """Device tensors; read them through the monitor's single host transfer."""

    global_norm: torch.Tensor
    """0-d float32 tensor: the L2 norm over all gradients (NaN/Inf if any is)."""
    layer_norms: torch.Tensor | None
    """1-d float32 tensor, one norm per layer of the grouping (0 where no grad)."""


def compute_grad_norms(
    grouping: LayerGrouping, per_layer: bool = True, present: tuple[list[torch.Tensor], tuple[int, ...]] | None = None
) -> GradientNorms | None:
    """One fused ``_foreach_norm`` over every gradient; None when no parameter has one
    (a sharded model's ranks always join the all-reduce: zeros where none has).

    ``present``: ``grouping.present_grads()`` when the caller already has it.
    """
    grads, layers = present if present is not None else grouping.present_grads()
    if grads:
        # Norms in float32 whatever the gradient dtype (bf16/fp16 norms lose precision).
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        device = norms[0].device
        if any(n.device != device for n in norms):  # model split over devices
            norms = [n.to(device, non_blocking=True) for n in norms]
        # Squares in float64: a per-parameter norm of 1e20 must not overflow to inf.
        squares = torch.stack(norms).double().square()
    elif grouping.sharded:  # no local shard has a gradient, others may: join the all-reduce
        device = grouping.device
        squares = torch.zeros(0, dtype=torch.float64, device=device)
    else:
        return None
    if not per_layer and not grouping.sharded:
        return GradientNorms(squares.sum().sqrt().float(), None)
    index = grouping.layer_index(layers, device)
    n_layers, n_layouts = len(grouping), len(grouping.shard_groups)
    layer_squares = torch.zeros(n_layers * n_layouts, dtype=torch.float64, device=device).index_add_(0, index, squares)
    if grouping.sharded:
        by_layout = layer_squares.view(n_layouts, n_layers)
        for layout, groups in enumerate(grouping.shard_groups[1:], start=1):
            for group in groups:
                # Shards' squares add up over the group. Enqueued on the device like any kernel
                # (NCCL: no host sync); gloo on CPU completes it here.
                dist.all_reduce(by_layout[layout], group=group)
        layer_squares = by_layout.sum(0)
    layer_norms = layer_squares.sqrt().float() if per_layer else None
    return GradientNorms(layer_squares.sum().sqrt().float(), layer_norms)


def clip_with_norms(
    grouping: LayerGrouping, max_norm: float, per_layer: bool = True, eps: float = 1e-6
) -> tuple[GradientNorms | None, torch.Tensor | None]:
    """Clip like ``torch.nn.utils.clip_grad_norm_`` and return the norms it measured.

    One reduction pass gives the per-layer norms, the global norm and the clip
    coefficient; the scaling is the only other pass over gradient memory.
    Returns (norms, clip coefficient as a 0-d tensor); non-finite norms clip to NaN
    like torch does, so the loss of that step is visible, not hidden.
    """
    present = grouping.present_grads()
    norms = compute_grad_norms(grouping, per_layer, present)
    if norms is None:
        return None, None
    grads = present[0]
    coefficient = torch.clamp(max_norm / (norms.global_norm + eps), max=1.0)
    _scale(grads, coefficient)
    return norms, coefficient


def _scale(grads: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in by_key.items():
        torch._foreach_mul_(group, coefficient.to(device, non_blocking=True))
