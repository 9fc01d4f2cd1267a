"""Fused per-layer gradient norms against a per-parameter reference."""

import math

import pytest
import torch
from torch import nn

from lossbeat.measure.gradients import LayerGrouping, clip_with_norms, compute_grad_norms, layer_name


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(8, 8), "mlp": nn.Linear(8, 8)}) for _ in range(2))
        self.head = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block["mlp"](torch.relu(block["attn"](h)))
        return self.head(h).mean(1) * self.scale


NET_LAYERS = ["scale", "embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "head"]
"""Net's layers in model order (named_parameters() order: a module's own parameters come first)."""


def backward(model, seed=0):
    torch.manual_seed(seed)
    x = torch.randint(0, 10, (4, 5))
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def reference_layer_norms(model, grouping):
    squares = {name: 0.0 for name in grouping.layer_names}
    for name, p in model.named_parameters():
        if p.grad is not None and p.requires_grad:
            squares[layer_name(name, grouping.depth if grouping.depth else None)] += p.grad.double().norm().item() ** 2
    return {k: math.sqrt(v) for k, v in squares.items()}


def test_layer_names_follow_module_paths_in_model_order():
    grouping = LayerGrouping(Net())
    assert grouping.layer_names == NET_LAYERS


def test_wrapper_components_are_dropped_from_layer_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = Net()
    net.blocks[0] = checkpoint_wrapper(net.blocks[0])  # activation checkpointing, as FSDP jobs do
    compiled = torch.compile(net)  # wraps without compiling until called
    names = [n for n, _ in compiled.named_parameters()]
    assert "_orig_mod.blocks.0._checkpoint_wrapped_module.attn.weight" in names
    grouping = LayerGrouping(compiled)
    assert grouping.layer_names == NET_LAYERS
    assert not grouping.sharded and grouping.shard_groups == [()]  # no process group: nothing to reduce
    assert layer_name("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module._flat_param", None) == "blocks.0"


def test_coarser_grouping_by_depth_and_by_max_layers():
    assert LayerGrouping(Net(), depth=2).layer_names == ["scale", "embed", "blocks.0", "blocks.1", "head"]
    assert LayerGrouping(Net(), max_layers=5).layer_names == ["scale", "embed", "blocks.0", "blocks.1", "head"]
    with pytest.raises(ValueError, match="layer_depth"):
        LayerGrouping(Net(), depth=0)
    with pytest.raises(TypeError, match="model"):
        LayerGrouping("not a model")


def test_fused_norms_match_the_per_parameter_reference():
    model = Net()
    backward(model)
    grouping = LayerGrouping(model)
    norms = compute_grad_norms(grouping)
    reference = reference_layer_norms(model, grouping)
    assert norms.layer_norms.tolist() == pytest.approx([reference[n] for n in grouping.layer_names], rel=1e-5)
    total = math.sqrt(sum(v * v for v in reference.values()))
    assert norms.global_norm.item() == pytest.approx(total, rel=1e-5)
    assert norms.global_norm.item() == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item(), rel=1e-5
    )


def test_frozen_layers_and_missing_grads_are_handled():
    model = Net()
    model.head.requires_grad_(False)
    grouping = LayerGrouping(model)
    assert "head" not in grouping.layer_names
    assert compute_grad_norms(grouping) is None  # no gradients yet
    backward(model)
    model.blocks[1]["mlp"].weight.grad = None  # a layer unused this step
    model.blocks[1]["mlp"].bias.grad = None
    model.blocks[0]["attn"].bias.grad = None  # half a layer: the layer is still measured
    norms = compute_grad_norms(grouping)
    by_name = dict(zip(grouping.layer_names, norms.layer_norms.tolist()))
    assert by_name["blocks.1.mlp"] == -1.0  # absent, not a vanishing 0
    attn = model.blocks[0]["attn"].weight.grad.double().norm().item()
    assert by_name["blocks.0.attn"] == pytest.approx(attn, rel=1e-5)
    assert by_name["blocks.0.mlp"] > 0
    present = [p.grad for p in model.parameters() if p.grad is not None]
    assert norms.global_norm.item() == pytest.approx(torch.nn.utils.get_total_norm(present).item(), rel=1e-5)
    only_global = compute_grad_norms(grouping, per_layer=False)
    assert only_global.layer_norms is None
    assert only_global.global_norm.item() == pytest.approx(norms.global_norm.item(), rel=1e-6)


def test_the_layer_index_is_built_once_whatever_gradients_are_absent():
    """MoE experts and dropped layers change the parameters with gradients every step:
    the index stays the one built for every parameter (no rebuild, no host-to-device copy)."""
    model = Net()
    grouping = LayerGrouping(model)
    layers = [model.blocks[0]["attn"], model.blocks[0]["mlp"], model.blocks[1]["attn"], model.blocks[1]["mlp"]]
    seen = set()
    for step in range(8):
        model.zero_grad(set_to_none=True)
        backward(model, seed=step)
        dropped = layers[step % 4]
        for p in dropped.parameters():
            p.grad = None
        norms = compute_grad_norms(grouping)
        by_name = dict(zip(grouping.layer_names, norms.layer_norms.tolist()))
        assert [n for n, v in by_name.items() if v == -1.0] == [grouping.layer_names[2 + step % 4]]
        reference = reference_layer_norms(model, grouping)
        assert [v for v in by_name.values() if v >= 0] == pytest.approx(
            [reference[n] for n, v in by_name.items() if v >= 0], rel=1e-5
        )
        seen.add(id(grouping.index(norms.global_norm.device, presence=True)))
    assert len(seen) == 1 and len(grouping._index_cache) == 1


def test_non_finite_gradients_show_in_their_layer():
    model = Net()
    backward(model)
    model.blocks[1]["attn"].weight.grad[0, 0] = math.inf
    model.head.weight.grad[0, 0] = math.nan
    grouping = LayerGrouping(model)
    norms = compute_grad_norms(grouping)
    values = dict(zip(grouping.layer_names, norms.layer_norms.tolist()))
    assert math.isinf(values["blocks.1.attn"]) and math.isnan(values["head"])
    assert math.isfinite(values["blocks.0.attn"])
    assert not math.isfinite(norms.global_norm.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_measured_in_float32(dtype):
    model = Net().to(dtype)
    backward(model)
    grouping = LayerGrouping(model)
    norms = compute_grad_norms(grouping)
    assert norms.layer_norms.dtype == torch.float32
    reference = reference_layer_norms(model, grouping)
    assert norms.layer_norms.tolist() == pytest.approx([reference[n] for n in grouping.layer_names], rel=1e-2)


def test_huge_gradients_do_not_overflow_the_sum_of_squares():
    model = Net()
    backward(model)
    # Each parameter's norm fits float32, but the sum of their squares (5e38) does not.
    model.scale.grad.fill_(1.5e19)
    model.head.bias.grad.fill_(1e19)
    norms = compute_grad_norms(LayerGrouping(model))
    assert norms.global_norm.item() == pytest.approx(math.sqrt(1.5e19**2 + 3 * 1e38), rel=1e-3)


def test_clip_and_measure_matches_torch_clip_grad_norm():
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    backward(ours), backward(theirs)
    norms, coefficient = clip_with_norms(LayerGrouping(ours), 0.05)
    expected_total = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
    assert norms.global_norm.item() == pytest.approx(expected_total.item(), rel=1e-5)
    assert coefficient.item() == pytest.approx(0.05 / expected_total.item(), rel=1e-4)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class OddDtypes(nn.Module):
    """A float32 body with an fp64 scalar, a complex layer and a sparse embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8, sparse=True)
        self.body = nn.Linear(8, 8)
        self.spectral = nn.Linear(8, 8, dtype=torch.complex64)
        self.temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        h = self.body(self.embed(x))
        z = self.spectral(h.to(torch.complex64))
        return (z.abs().mean(-1).double() / self.temperature).float()


def odd_backward(model, seed=0):
    torch.manual_seed(seed)
    loss = model(torch.randint(0, 10, (4, 5))).pow(2).mean()
    loss.backward()
    return loss


def dense_reference(model):
    """Per-layer norms from dense float64 copies (complex: magnitudes; sparse: densified)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        layer = layer_name(name, None)
        out[layer] = out.get(layer, 0.0) + g.abs().double().square().sum().item()
    return {k: math.sqrt(v) for k, v in out.items()}


def test_fp64_complex_and_sparse_gradients_are_measured():
    model = OddDtypes()
    odd_backward(model)
    assert model.embed.weight.grad.is_sparse and model.temperature.grad.dtype == torch.float64
    model.embed.weight.grad = model.embed.weight.grad + model.embed.weight.grad  # uncoalesced duplicates
    assert not model.embed.weight.grad.is_coalesced()
    grouping = LayerGrouping(model)
    norms = compute_grad_norms(grouping)
    reference = dense_reference(model)
    assert dict(zip(grouping.layer_names, norms.layer_norms.tolist())) == pytest.approx(reference, rel=1e-5)
    assert norms.global_norm.item() == pytest.approx(math.sqrt(sum(v * v for v in reference.values())), rel=1e-5)


def test_clipping_odd_dtypes_matches_torch():
    """torch clips fp64 and complex gradients; ours must too, and measure them on the way.
    (torch has no norm for sparse gradients: they are checked against dense copies.)"""
    ours, theirs = OddDtypes(), OddDtypes()
    theirs.load_state_dict(ours.state_dict())
    odd_backward(ours), odd_backward(theirs)
    theirs.embed.weight.grad = theirs.embed.weight.grad.to_dense()  # the only form torch can clip
    norms, coefficient = clip_with_norms(LayerGrouping(ours), 0.05)
    expected_total = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
    assert norms.global_norm.item() == pytest.approx(expected_total.item(), rel=1e-5)
    assert coefficient.item() == pytest.approx(0.05 / expected_total.item(), rel=1e-4)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad.to_dense(), b.grad, rtol=1e-5, atol=1e-7)
        assert a.grad.dtype == b.grad.dtype
