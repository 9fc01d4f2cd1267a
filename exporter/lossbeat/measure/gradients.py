"""Gradient statistics from one fused reduction: per-layer norms, global norm, clipping.

Parameters are grouped into layers by module path (``blocks.3.attn.qkv.weight``
belongs to layer ``blocks.3.attn.qkv``); ``depth`` keeps only the first
components for coarser grouping (``depth=3`` -> ``blocks.3.attn``). Everything
here stays on the device: no ``.item()``, no host synchronisation.

Every trainable parameter gets a fixed slot once; a parameter without a
gradient this step (an unrouted MoE expert, a dropped layer, an unused head)
fills its slot with a marker, so the index never changes from step to step and
a layer none of whose parameters has a gradient is reported as absent (-1),
not as a zero norm.

Sharded parameters (``DTensor``: FSDP2's ``fully_shard``, HSDP, tensor and
sequence parallelism; FSDP1's flat parameters) hold a shard of their gradient
on each rank. The placements that count are the *gradient's*: under sequence
parallelism a replicated norm weight has a ``Partial(sum)`` gradient, each
rank holding a summand. Partial gradients are summed over their groups first
(one all-reduce of a flat buffer per group, small: norm weights and biases);
then the squared norms are reduced locally and summed over the groups the
gradients are sharded on, with one small all-reduce per sharding layout (a
vector of two floats per layer), so every rank gets the model's norms. Those
all-reduces are collectives: every rank must measure at the same steps, as
training loops do. The first time, the ranks check through the process
group's store, with a short timeout and O(1) requests per rank
(:mod:`lossbeat.measure.handshake`), that they all came (``if rank == 0:
monitor.observe(...)`` would otherwise wait in the collective forever); if
not, :class:`ShardedMeasurementError` says so.

Pipeline parallelism (``pipeline_group``: one rank per stage) holds other
layers on each stage. A stage's squared total (after its shard reductions) is
summed over the pipeline group: one all-reduce of one float64 scalar per
measurement, so the global norm, and the clip coefficient, are the whole
model's on every stage (NaN/Inf in one stage reaches all); per-layer norms stay
the stage's own layers. A collective too: a stage without gradients still
joins it, and the first measurement's handshake includes the stages. Wrapper components of
parameter names (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``,
``_orig_mod``) are dropped, and so is the leading ``module`` of the model given when it is a
``DistributedDataParallel``, ``DataParallel`` or DeepSpeed engine wrapper, so layers keep the
model's own names (the same under DDP as on one GPU; ``layer_depth`` counts the model's levels).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from lossbeat.measure import handshake
from lossbeat.measure.errors import ShardedMeasurementError, ShardHandshakeError

__all__ = [
    "LayerGrouping",
    "GradientNorms",
    "ShardedMeasurementError",
    "ShardHandshakeError",
    "compute_grad_norms",
    "clip_with_norms",
    "deepspeed_zero_stage",
]

SHARD_HANDSHAKE_TIMEOUT_S = 30.0
"""How long the first sharded measurement waits for every rank of its groups to arrive; a rank
arriving within as long again is a straggler (all still measure), one later is absent.
Ranks leave backward within moments of each other (its collectives align them)."""
HANDSHAKE_FAILED = "failed"  # the store failed: no collective, the clip falls back to torch's

# Modules that wrappers insert into parameter names; never a user's own module name.
_WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# Measured by the fused kernel in float32 (bf16/fp16 norms lose precision; fp32 is exact).
_FLOAT32_NORM = frozenset({torch.float32, torch.float16, torch.bfloat16})
_handshakes = itertools.count()  # the same sequence on every rank: keys the store handshakes


def _placement_groups(param: torch.Tensor, placements: Any) -> tuple[tuple[Any, ...], tuple[tuple[Any, str], ...]]:
    """(groups the gradient is sharded over, (group, reduce op) it is partial over) for a DTensor.

    ``Shard``/``_StridedShard`` on a mesh dimension: a slice there (its squares add
    up over that dimension's group). ``Partial``: a summand (the gradient itself
    must be reduced before it is squared). ``Replicate``: the whole.
    """
    mesh = getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        return (), ()
    shards, partials = [], []
    for dim, placement in enumerate(placements):
        if mesh.size(dim) < 2 or placement.is_replicate():
            continue
        if placement.is_partial():
            partials.append((mesh.get_group(dim), getattr(placement, "reduce_op", "sum")))
        else:
            shards.append(mesh.get_group(dim))
    return tuple(shards), tuple(partials)


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
        if flat is None or module.sharding_strategy == ShardingStrategy.NO_SHARD:
            continue
        if group.size() < 2:  # type: ignore[union-attr]  # typed Optional; a wrapped module always has one
            continue
        for param in getattr(flat, "_params", None) or [flat]:
            out[id(param)] = (group,)
    return out


def deepspeed_zero_stage(model: torch.nn.Module) -> int | None:
    """The ZeRO stage (2 or 3) when DeepSpeed keeps ``model``'s gradients out of ``p.grad``, else None.

    ZeRO-2 reduces gradients into its own partitioned buffers and ZeRO-3 also
    partitions the parameters (they carry ``ds_id``): ``p.grad`` stays None.
    """
    stage_of = getattr(model, "zero_optimization_stage", None)
    if callable(stage_of) and type(model).__name__ == "DeepSpeedEngine":
        try:
            stage = int(stage_of())
        except Exception:
            stage = 0
        if stage >= 2:
            return stage
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return 3
    return None


def _wrapper_levels(model: torch.nn.Module) -> int:
    """How many leading ``module`` components of ``model``'s parameter names are wrappers'
    (DDP, DataParallel, a DeepSpeed engine, possibly under ``torch.compile``), not the model's."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    levels = 0
    while True:
        if isinstance(orig := getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile (dropped anyway)
            model = orig
        elif (
            isinstance(model, (DistributedDataParallel, DataParallel)) or type(model).__name__ == "DeepSpeedEngine"
        ) and isinstance(inner := getattr(model, "module", None), torch.nn.Module):
            levels += 1
            model = inner
        else:
            return levels


def layer_name(param_name: str, depth: int | None, wrapper_levels: int = 0) -> str:
    parts = [part for part in param_name.split(".") if part not in _WRAPPER_NAMES]
    for _ in range(wrapper_levels):
        if len(parts) > 1 and parts[0] == "module":
            parts = parts[1:]
    module = parts[:-1] or parts  # a top-level parameter is its own layer
    if depth is not None:
        module = module[:depth]
    return ".".join(module)


@dataclass
class _Present:
    """One step's gradients: the local tensors that exist and their parameters' positions."""

    grads: list[torch.Tensor]
    positions: list[int]


class LayerGrouping:
    """The trainable parameters of a model, in model order, mapped to layer indices.

    ``max_layers`` bounds label cardinality: when the module paths give more
    layers, the grouping gets coarser (smaller depth) until they fit.

    Each parameter gets two fixed slots in a vector of ``2 * len(layers)`` per
    sharding layout (0 for whole tensors; one per distinct set of process
    groups for shards): its squared norm goes to its layer's slot, its
    presence (1 if it has a gradient) to ``len(layers)`` past it, so one
    ``index_add_`` sorts squares and presence by layer and layout.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        depth: int | None = None,
        max_layers: int = 1000,
        reduce_shards: bool = True,
        pipeline_group: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if depth is not None and (not isinstance(depth, int) or depth < 1):
            raise ValueError(f"layer_depth: expected a positive int or None, got {depth!r}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        levels = _wrapper_levels(model)
        names = [layer_name(n, depth, levels) for n, _ in named]
        if depth is None:
            depth = max((len(n.split(".")) for n in names), default=1)
        while len(dict.fromkeys(names)) > max_layers and depth > 1:
            depth -= 1
            names = [layer_name(n, depth, levels) for n, _ in named]
        self.depth = depth
        self.model_ref = model
        self.params: list[torch.nn.Parameter] = [p for _, p in named]
        self.layer_names: list[str] = list(dict.fromkeys(names))
        position = {name: i for i, name in enumerate(self.layer_names)}
        self.param_layer: list[int] = [position[n] for n in names]
        # reduce_shards=False: each rank measures its own shards, with no collective.
        self._distributed = reduce_shards and dist.is_available() and dist.is_initialized()
        self._fsdp1 = _fsdp1_groups(model) if self._distributed else {}
        self.pipeline_group = pipeline_group if pipeline_group is not None and pipeline_group.size() > 1 else None
        """The group of this rank's pipeline stages (one rank per stage), whose stage norms add up to the
        model's; None without pipeline parallelism (or a single stage)."""
        self._dtensors = any(hasattr(p, "_local_tensor") for p in self.params)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.uniform = True
        """Whether the gradients are all strided fp32/fp16/bf16 (one fused float32 norm kernel);
        False once a step showed otherwise (fp64, complex, sparse): dtypes do not change."""
        self.handshake: str | None = None
        """The first sharded measurement's handshake: REDUCE, LATE, ABSENT or HANDSHAKE_FAILED; None before."""
        self._handshake_detail = ""
        self.on_late: Callable[[Exception], None] | None = None
        """Told once when every rank arrived, but after the first timeout (an exporter error to count)."""
        self._layout([getattr(p.grad, "placements", None) for p in self.params])

    def _layout(self, grad_placements: list[Any]) -> None:
        """Slots, sharding layouts and partial-gradient sets, from the gradients' placements
        (the parameter's own where a gradient has none yet)."""
        self._grad_placements = grad_placements
        layouts: dict[tuple[Any, ...], int] = {(): 0}
        partial_sets: dict[tuple[tuple[Any, str], ...], list[int]] = {}
        param_layouts = []
        for i, p in enumerate(self.params):
            if not self._distributed:
                param_layouts.append(0)
                continue
            shards, partials = _placement_groups(p, grad_placements[i] or getattr(p, "placements", None))
            shards = self._fsdp1.get(id(p)) or shards
            param_layouts.append(layouts.setdefault(shards, len(layouts)))
            if partials:
                partial_sets.setdefault(partials, []).append(i)
        self.shard_groups: list[tuple[Any, ...]] = list(layouts)
        """Per sharding layout, the process groups its squares are summed over (layout 0: none)."""
        self.partial_sets = partial_sets
        """{((group, reduce op), ...): positions of the parameters whose gradients are partial there}."""
        self.sharded = len(self.shard_groups) > 1 or bool(partial_sets)
        """Whether the gradients are sharded or partial (reduced over their groups)."""
        self.collective = self.sharded or self.pipeline_group is not None
        """Whether measuring takes collectives (every rank must measure at the same steps)."""
        width = 2 * len(self.layer_names)
        self._square_slots = [layer + width * layout for layer, layout in zip(self.param_layer, param_layouts)]
        self._slots = self._square_slots + [s + len(self.layer_names) for s in self._square_slots]
        self._index_cache: dict[tuple[torch.device, bool], torch.Tensor] = {}
        self._absent: dict[torch.device, torch.Tensor] = {}

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

    def present_grads(self) -> _Present:
        """Gradients that exist this step (the local tensor of a DTensor's) and their positions.

        A Python loop over parameters, but it only reads attributes: no device work.
        Frozen parameters are excluded at construction; unused ones have no grad.
        """
        grads, positions = [], []
        dtensors = self._dtensors
        expected = self._grad_placements
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if dtensors:
                local = getattr(g, "_local_tensor", None)  # by attribute: to_local() is a dispatch
                if local is not None:
                    # the placements first seen before its gradient, or changed:
                    if g._spec.placements != expected[i]:  # type: ignore[attr-defined]  # a DTensor (by attribute)
                        self._layout([getattr(q.grad, "placements", None) for q in self.params])
                        expected = self._grad_placements
                    g = local
            # A grad only requires grad after backward(create_graph=True); detach is a dispatch.
            grads.append(g.detach() if g.requires_grad else g)
            positions.append(i)
        return _Present(grads, positions)

    def index(self, device: torch.device, presence: bool) -> torch.Tensor:
        """The parameters' slots on ``device`` (squares, then presence when asked); built once."""
        key = (device, presence)
        index = self._index_cache.get(key)
        if index is None:
            slots = self._slots if presence else self._square_slots
            index = self._index_cache[key] = torch.tensor(slots, dtype=torch.long).to(device)
        return index

    def absent(self, device: torch.device) -> torch.Tensor:
        """The marker norm of a parameter without a gradient: -1 (a norm is >= 0 or NaN)."""
        marker = self._absent.get(device)
        if marker is None:
            marker = self._absent[device] = torch.full((), -1.0, dtype=torch.float64, device=device)
        return marker

    def check_all_ranks_measure(self) -> None:
        """Before the first collective: every rank of the groups must be measuring too.

        Raises :class:`ShardedMeasurementError` (at once after the first time) when some
        never arrived (within ``SHARD_HANDSHAKE_TIMEOUT_S`` twice over), and
        :class:`ShardHandshakeError` when the store failed: no collective either way. All
        arriving late (a straggler past the first timeout) still measures; ``on_late`` hears it.
        """
        if self.handshake is None:
            groups = [g for layout in self.shard_groups[1:] for g in layout]
            groups += [g for key in self.partial_sets for g, _ in key]
            if self.pipeline_group is not None:
                groups.append(self.pipeline_group)
            self.handshake, detail = _all_ranks_arrive(groups, SHARD_HANDSHAKE_TIMEOUT_S)
            self._handshake_detail = detail
            if self.handshake == handshake.LATE and self.on_late is not None:
                self.on_late(
                    ShardHandshakeError(
                        f"the shard handshake missed its {SHARD_HANDSHAKE_TIMEOUT_S:g}s deadline (every rank arrived, "
                        f"after {detail}): gradient norms are measured as usual"
                    )
                )
        if self.handshake == handshake.ABSENT:
            raise ShardedMeasurementError(
                "the gradients of a sharded or pipelined model (FSDP, HSDP, tensor/sequence/pipeline parallel) are "
                "measured with a collective, but not every rank measured them (e.g. `if rank == 0: "
                "monitor.observe(model=...)`). Call observe(model=...), clip_grad_norm_ and measure_gradients on "
                "every rank at the same steps (rank 0 alone exports the layers), or set reduce_shards=False to "
                "measure each rank's own shards (pipeline_group=None: each stage's own layers); gradient norms are "
                "not exported meanwhile"
            )
        if self.handshake == HANDSHAKE_FAILED:
            raise ShardHandshakeError(
                f"the shard handshake through the process group's store failed ({self._handshake_detail}): "
                "the sharded gradient norms are not exported, clip_grad_norm_ clips as torch does"
            )


def _all_ranks_arrive(groups: Sequence[Any], timeout: float) -> tuple[str, str]:
    """(outcome, detail) of the handshake of the ranks linked to this one by ``groups``, through
    the default process group's store (:mod:`lossbeat.measure.handshake`): REDUCE, LATE, ABSENT,
    or FAILED when the store failed (never raises: the training loop goes on)."""
    try:
        members = [dist.get_process_group_ranks(group) for group in groups]
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
    except Exception:  # no store to meet at (a private API): measure as before
        return handshake.REDUCE, ""
    prefix = f"lossbeat/shard-handshake/{next(_handshakes)}"
    started = time.monotonic()
    done: list[tuple[str, str]] = []

    def run() -> None:
        try:
            done.append((handshake.meet(store, prefix, rank, members, timeout, timeout), ""))
        except Exception as e:  # a dead store: an exporter failure, not the user's
            done.append((HANDSHAKE_FAILED, f"{type(e).__name__}: {e}"))

    # In a thread: a store that stops answering blocks its client past the store's timeout (a
    # frozen server), while every wait of the handshake itself ends within 2 x timeout. So the
    # training loop waits (host-side only, once) for at most that and a margin.
    worker = threading.Thread(target=run, name="lossbeat-shard-handshake", daemon=True)
    worker.start()
    worker.join(2 * timeout + max(timeout, 1.0))
    if not done:
        return HANDSHAKE_FAILED, f"the process group's store did not answer within {time.monotonic() - started:.1f}s"
    outcome, detail = done[0]
    return outcome, detail or f"{time.monotonic() - started:.1f}s"


@dataclass
class GradientNorms:
    """Device tensors; read them through the monitor's single host transfer."""

    global_norm: torch.Tensor
    """0-d float32 tensor: the L2 norm over all gradients (NaN/Inf if any is)."""
    layer_norms: torch.Tensor | None
    """1-d float32 tensor, one norm per layer of the grouping; -1 for a layer none of whose
    parameters has a gradient this step (on any rank, for a sharded model)."""


def _norms(grouping: LayerGrouping, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-d norms of ``grads``, in order: one fused kernel per kind of gradient.

    fp32/fp16/bf16 in float32; fp64 and complex in their own precision (a complex
    gradient's norm is the norm of its magnitudes); sparse ones from their
    coalesced values (duplicates summed first).
    """
    if grouping.uniform:
        # Tried as one float32 kernel, without a per-gradient dtype check on the hot path: the
        # kernel refuses fp64 (narrowing), complex and sparse inputs before computing.
        try:
            return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
        except (RuntimeError, NotImplementedError):
            if all(g.dtype in _FLOAT32_NORM and g.layout == torch.strided for g in grads):
                raise  # not a matter of dtypes
            grouping.uniform = False
    by_kind: dict[Any, list[int]] = {}
    for i, g in enumerate(grads):
        kind = "sparse" if g.layout != torch.strided else ("float32" if g.dtype in _FLOAT32_NORM else g.dtype)
        by_kind.setdefault(kind, []).append(i)
    out: list[Any] = [None] * len(grads)
    norms: Sequence[torch.Tensor]
    for kind, positions in by_kind.items():
        if kind == "sparse":
            norms = [_sparse_norm(grads[i]) for i in positions]
        elif kind == "float32":
            norms = torch._foreach_norm([grads[i] for i in positions], 2, dtype=torch.float32)
        else:  # fp64, complex: the kernel's own precision (real norms)
            norms = torch._foreach_norm([grads[i] for i in positions], 2)
        for i, n in zip(positions, norms):
            out[i] = n
    return out


def _sparse_norm(g: torch.Tensor) -> torch.Tensor:
    values = g.coalesce().values() if g.layout == torch.sparse_coo else g.values()
    return torch.linalg.vector_norm(values, dtype=torch.float32 if values.dtype in _FLOAT32_NORM else None)


def _reduce_partial_grads(grouping: LayerGrouping, present: _Present) -> _Present:
    """The present gradients with every partial one summed over its groups (a new list).

    One flat buffer per set of groups, all-reduced once per group: the norm of a
    sum is not the sum of the summands' norms. The gradients are not changed.
    """
    grads = list(present.grads)
    where = {pos: i for i, pos in enumerate(present.positions)}
    for groups, members in grouping.partial_sets.items():
        parts = []
        for pos in members:  # a fixed layout: absent gradients are zeros, so every rank sends the same sizes
            i = where.get(pos)
            local = grouping.params[pos]
            local = getattr(local, "_local_tensor", local)
            parts.append(grads[i].reshape(-1) if i is not None else local.new_zeros(local.numel()))
        buffer = torch.cat(parts)
        if buffer.dtype in (torch.float16, torch.bfloat16):
            buffer = buffer.float()
        for group, op in groups:
            # Enqueued on the device like any kernel (NCCL: no host sync); gloo on CPU completes it here.
            dist.all_reduce(buffer, op=_REDUCE_OPS.get(op, dist.ReduceOp.SUM), group=group)
            if op == "avg":
                buffer /= group.size()
        for pos, part in zip(members, buffer.split([p.numel() for p in parts])):
            i = where.get(pos)
            if i is not None:
                grads[i] = part
    return _Present(grads, present.positions)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def compute_grad_norms(
    grouping: LayerGrouping, per_layer: bool = True, present: _Present | None = None
) -> GradientNorms | None:
    """Fused norms of every gradient; None when no parameter has one
    (a sharded or pipelined model's ranks always join the collectives: zeros where none has).

    ``present``: ``grouping.present_grads()`` when the caller already has it.
    Raises :class:`ShardedMeasurementError` when a sharded or pipelined model's ranks do not all measure.
    """
    present = present if present is not None else grouping.present_grads()
    sharded = grouping.sharded
    if not present.grads and not grouping.collective:
        return None
    if grouping.collective:
        grouping.check_all_ranks_measure()
    if grouping.partial_sets:
        present = _reduce_partial_grads(grouping, present)
    device = grouping.device
    if present.grads:
        norms = _norms(grouping, present.grads)
        device = norms[0].device
        if any(n.device != device for n in norms):  # model split over devices
            norms = [n.to(device, non_blocking=True) for n in norms]
    else:
        norms = []
    n_params, n_layers = len(grouping.params), len(grouping)
    if norms and len(norms) == n_params and not sharded:  # every parameter has a gradient: no markers, no presence
        # Squares in float64: each norm fits float32 (an fp32 norm is computed in float32 and is
        # inf past ~1.8e19), but the sum of many squares of large norms would not.
        squares = torch.stack(norms).double().square()
        if not per_layer:
            return GradientNorms(_model_norm(grouping, squares.sum()), None)
        layer_squares = torch.zeros(n_layers, dtype=torch.float64, device=device)
        layer_squares.index_add_(0, grouping.index(device, presence=False), squares)
        return GradientNorms(_model_norm(grouping, layer_squares.sum()), layer_squares.sqrt().float())
    if norms and not per_layer and not sharded:
        return GradientNorms(_model_norm(grouping, torch.stack(norms).double().square().sum()), None)
    # Some parameters have no gradient: fixed slots, absent ones marked -1 (never rebuilds the index).
    marker = grouping.absent(device)
    full = [marker] * n_params
    for pos, n in zip(present.positions, norms):
        full[pos] = n
    # mixed float32/float64 norms promote to float64; a stage without trainable parameters has none
    values = torch.stack(full).double() if full else torch.zeros(0, dtype=torch.float64, device=device)
    present_mask = values.ne(-1.0).double()  # NaN != -1: a NaN gradient is present
    squares = values.clamp_min(0.0).square()  # the marker counts 0; NaN stays NaN
    n_layouts = len(grouping.shard_groups)
    buckets = torch.zeros(n_layouts * 2 * n_layers, dtype=torch.float64, device=device)
    buckets.index_add_(0, grouping.index(device, presence=True), torch.cat((squares, present_mask)))
    by_layout = buckets.view(n_layouts, 2 * n_layers)
    for layout, groups in enumerate(grouping.shard_groups[1:], start=1):
        for group in groups:
            # Shards' squares (and presence) add up over the group. Enqueued on the device like any
            # kernel (NCCL: no host sync); gloo on CPU completes it here.
            dist.all_reduce(by_layout[layout], group=group)
    totals = by_layout.sum(0)
    layer_squares, layer_present = totals[:n_layers], totals[n_layers:]
    global_norm = _model_norm(grouping, layer_squares.sum())
    if not per_layer:
        return GradientNorms(global_norm, None)
    layer_norms = torch.where(layer_present > 0, layer_squares.sqrt(), -1.0).float()
    return GradientNorms(global_norm, layer_norms)


def _model_norm(grouping: LayerGrouping, stage_squares: torch.Tensor) -> torch.Tensor:
    """The model's norm from this stage's sum of squares (0-d float64): summed over the pipeline
    stages when there are several (NaN/Inf in any stage reaches every stage), else its root."""
    if grouping.pipeline_group is not None:
        # One float64 scalar over the stages. Enqueued on the device like any kernel (NCCL: no host
        # sync); gloo on CPU completes it here.
        dist.all_reduce(stage_squares, group=grouping.pipeline_group)
    return stage_squares.sqrt().float()


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
    coefficient = torch.clamp(max_norm / (norms.global_norm + eps), max=1.0)
    _scale(present.grads, coefficient)  # local tensors: a partial gradient's summands scale alike
    return norms, coefficient


def _scale(grads: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
    by_key: dict[tuple[torch.device, torch.dtype, torch.layout], list[torch.Tensor]] = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype, g.layout), []).append(g)
    for (device, _, _), group in by_key.items():
        torch._foreach_mul_(group, coefficient.to(device, non_blocking=True))
