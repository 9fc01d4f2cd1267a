"""How the guard keeps one optimizer step from the parameters: the optimizer-side mechanics.

Each function applies, or withholds, one ``optimizer.step()`` given a decision that is a host
bool or a 0-d device flag. Nothing here counts or decides: :mod:`~lossbeat.monitor.guard` does.
torch is loaded whenever these run (an optimizer is a torch object).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "plain_step",
    "skip_with_scaler",
    "scaler_skippable",
    "strategy",
    "masked_step",
    "found_inf_step",
    "nonfinite_gradients",
    "refuse_optimizer",
    "active_scaler",
    "unscaled_elsewhere",
]


def active_scaler(grad_scaler: Any) -> Any:
    """The GradScaler that scales this run's gradients, or None: a disabled scaler
    (``GradScaler(enabled=False)``, nanoGPT's bf16/fp32 default) scales nothing and is no scaler."""
    if grad_scaler is None:
        return None
    is_enabled = getattr(grad_scaler, "is_enabled", None)
    return grad_scaler if is_enabled is None or is_enabled() else None


def refuse_optimizer(optimizer: Any) -> None:
    """Refuse, at the first guarded step, an optimizer whose step the guard cannot withhold."""
    import torch

    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "optimizer: LBFGS evaluates its closure many times inside one step, so no decision made "
            "before the step holds for what it applies; use guard='off' with LBFGS"
        )


def plain_step(optimizers: list[Any], grad_scaler: Any, closure: Any = None) -> Any:
    """``optimizer.step()`` of each (with a scaler: ``scaler.step`` of each, then one ``update``)."""
    out = None
    for optimizer in optimizers:
        if grad_scaler is not None:
            out = grad_scaler.step(optimizer) if closure is None else grad_scaler.step(optimizer, closure)
        else:
            out = optimizer.step() if closure is None else optimizer.step(closure)
    if grad_scaler is not None:
        grad_scaler.update()
    return out


def scaler_skippable(scaler: Any) -> bool:
    """Whether this GradScaler exposes the private state a device-side guard skip goes through."""
    return all(hasattr(scaler, name) for name in ("_per_optimizer_states", "_scale", "_growth_tracker"))


def unscaled_elsewhere(scaler: Any, optimizers: list[Any]) -> bool:
    """Whether an optimizer other than ``optimizers`` was unscaled by ``scaler`` and not stepped yet
    (GradScaler's private per-optimizer stage): an update now would forget it was unscaled."""
    ours = {id(o) for o in optimizers}
    states = getattr(scaler, "_per_optimizer_states", {})
    return any(
        key not in ours and getattr(state.get("stage"), "name", "") == "UNSCALED" for key, state in states.items()
    )


def skip_with_scaler(optimizers: list[Any], scaler: Any, bad: Any) -> None:
    """Skip through the scaler's own overflow path, then put its scale back where the scaler
    itself found no overflow: a guard skip leaves the scaler as if the step never happened.
    Reads GradScaler's private ``_per_optimizer_states``, ``_scale`` and ``_growth_tracker``."""
    import torch

    overflows = []
    for optimizer in optimizers:
        state = scaler._per_optimizer_states[id(optimizer)]
        if not state["found_inf_per_device"]:
            scaler.unscale_(optimizer)  # what scaler.step would do first; records found_inf per device
        found = list(state["found_inf_per_device"].values())
        if found:  # stacked (a copy) before the flags below are written
            overflows.append(torch.stack([f.to(bad.device) for f in found]).amax())
        for f in found:
            f.copy_(torch.maximum(f, bad.to(f.device, f.dtype)))  # the scaler now skips this step
    overflow = torch.stack(overflows).amax() > 0 if overflows else torch.zeros((), dtype=torch.bool, device=bad.device)
    scale, growth = scaler._scale.clone(), scaler._growth_tracker.clone()
    for optimizer in optimizers:
        scaler.step(optimizer)
    scaler.update()
    ours = (bad & ~overflow.to(bad.device)).to(scale.device)
    scaler._scale.copy_(torch.where(ours, scale, scaler._scale))
    scaler._growth_tracker.copy_(torch.where(ours, growth, scaler._growth_tracker))


def strategy(optimizer: Any, device: Any) -> str:
    """How a device flag withholds this optimizer's step: ``found_inf`` (fused kernels),
    ``mask`` (restore what the step wrote, on the device), or ``read`` (one host read)."""
    import torch

    defaults = getattr(optimizer, "defaults", {})
    if defaults.get("fused"):
        return "found_inf"
    if isinstance(optimizer, torch.optim.SGD):
        return "mask"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and (
        defaults.get("capturable") or device.type == "cpu"
    ):
        return "mask"  # their step counters live with the decision: restorable on the device
    return "read"


def found_inf_step(optimizer: Any, bad: Any) -> None:
    import torch

    optimizer.grad_scale, optimizer.found_inf = None, bad.to(torch.float32)
    try:
        optimizer.step()  # the fused kernels skip the update and the step count where found_inf
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def masked_step(optimizer: Any, bad: Any) -> None:
    """Step, then restore every parameter and state tensor where ``bad`` (no host read). State
    created by this step (a first step) is zeroed where bad: Adam's and SGD's fresh state."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    before = [(p, {k: v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}) for p in params]
    saved = [(p.detach().clone(), {k: v.clone() for k, v in st.items()}) for p, st in before]
    optimizer.step()
    for (p, _), (p_old, st_old) in zip(before, saved):
        p.data.copy_(torch.where(bad, p_old, p.data))
        for k, v in optimizer.state[p].items():
            if not isinstance(v, torch.Tensor):
                continue
            old = st_old.get(k)
            v.copy_(torch.where(bad.to(v.device), old if old is not None else torch.zeros_like(v), v))


def nonfinite_gradients(optimizers: Any) -> bool:
    """Whether any gradient of these optimizers' parameters holds a NaN or an Inf: the decision
    for a step that ``observe()`` did not decide, taken from the gradients themselves."""
    import torch

    grads = [
        p.grad
        for optimizer in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    device = grads[0].device if grads else torch.device("cpu")
    if distributed and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    bad = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        local = _to_local(grads)
        norms = [n.to(device).float() for n in torch._foreach_norm(local)]
        bad = (~torch.isfinite(torch.stack(norms))).any().to(torch.float32)
    if distributed:  # every rank decides the same: a MAX of one flag (sharded gradients differ by rank)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad > 0)  # host sync: the one read of a step observe() did not decide (its only transfer)


def _to_local(grads: list[Any]) -> list[Any]:
    """Each gradient as a plain tensor: a DTensor's local shard (FSDP2, tensor parallel)."""
    return [g.to_local().detach() if hasattr(g, "to_local") else g.detach() for g in grads]
