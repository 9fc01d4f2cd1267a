"""Mixture-of-experts router health with a real tiny MoE model trained on CPU: a balanced router
is silent, a router forced to collapse is named (the layer) and paged (promtool over the
monitor's own scrape), in the step's one host transfer; the helpers that fill ``expert_load``
from a Hugging Face MoE model's ``router_logits`` and from hooks on its routers count what it routed."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import require_binary, require_module
from helpers.paging import pages, scrape_series
from prometheus_client import generate_latest

from lossbeat import Monitor, MonitorConfig, load_thresholds
from lossbeat.exposition.status import status_document
from lossbeat.integrations.moe import RouterHooks, expert_load_from_router_logits

VOCAB, DIM, EXPERTS, TOP_K, LAYERS = 32, 16, 8, 2, 2
STEPS = 120
WINDOW = 20  # moe.dead_window_steps for these short runs


class MoELayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(DIM, EXPERTS)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(x)
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):  # the model's own loop (not the monitor's)
            hit = (chosen == e).any(-1)
            w = (weights * (chosen == e)).sum(-1, keepdim=True)
            out = out + torch.where(hit[:, None], w * expert(x), 0.0)
        # Switch Transformer's balance loss: E * sum_i f_i * P_i (1 at a uniform load).
        f = F.one_hot(chosen, EXPERTS).float().sum(1).mean(0) / TOP_K
        aux = EXPERTS * (f * probs.mean(0)).sum()
        return x + torch.tanh(out), aux


class TinyMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(MoELayer() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, a = layer(x)
            aux = aux + a
        return self.head(x), aux / LAYERS


def _collapse(model: TinyMoE, layer: int) -> None:
    """Force one layer's router onto experts 0 and 1 (its weights frozen at it): a collapsed router."""
    router = model.layers[layer].router
    with torch.no_grad():
        router.weight.zero_()
        router.bias.copy_(torch.tensor([8.0, 7.0] + [-8.0] * (EXPERTS - 2)))
    router.requires_grad_(False)


def _train(collapse_layer: int | None = None, monitor: Monitor | None = None) -> tuple[Monitor, RouterHooks]:
    torch.manual_seed(0)
    model = TinyMoE()
    if collapse_layer is not None:
        _collapse(model, collapse_layer)
    hooks = RouterHooks(model, r"\.router$", top_k=TOP_K)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    t = load_thresholds()
    t = dataclasses.replace(t, moe=dataclasses.replace(t.moe, dead_window_steps=WINDOW))
    monitor = monitor or Monitor(MonitorConfig(thresholds=t), serve=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (256,), generator=gen)
        logits, aux = model(tokens)
        lm = F.cross_entropy(logits, (tokens * 3 + 1) % VOCAB)
        loss = lm + 0.1 * aux  # a balance loss strong enough for 20-step windows of 256 tokens
        opt.zero_grad()
        loss.backward()
        monitor.observe(
            step,
            loss=loss.detach(),
            losses={"router_aux_loss": aux.detach()},
            expert_load=hooks.expert_load(),
        )
        opt.step()
    monitor.flush()
    return monitor, hooks


def _series(monitor: Monitor, name: str) -> dict[str, float]:
    body = generate_latest(monitor.registry).decode()
    return {labels["layer"]: value for metric, labels, value in scrape_series(body, (name,)) if metric == name}


def _finding(monitor: Monitor, check: str):
    return next(f for f in monitor.findings if f.check == check)


def test_a_balanced_router_is_silent_and_costs_no_extra_host_read(tmp_path):
    monitor, _ = _train()
    assert monitor.host_transfers == STEPS  # expert_load adds no read: one per step, as before
    imbalance = _series(monitor, "training_moe_load_imbalance")
    assert set(imbalance) == {"layers.0.router", "layers.1.router"}
    assert all(1.0 <= v < load_thresholds().moe.imbalance_max for v in imbalance.values()), imbalance
    assert set(_series(monitor, "training_moe_dead_experts").values()) == {0.0}
    assert set(_series(monitor, "training_moe_experts").values()) == {float(EXPERTS)}
    finding = _finding(monitor, "moe_router")
    assert finding.status.name == "GOOD" and finding.known, finding
    # The router's aux loss is exported as a component and not judged as a loss (no range finding on it).
    body = generate_latest(monitor.registry).decode()
    assert 'training_loss_component{component="router_aux_loss"' in body
    assert not any(f.component == "router_aux_loss" for f in monitor.findings)
    # Held for the alert's for through the checked-in rules, the scrape pages nothing.
    pages(tmp_path, body, "TrainingMoERouterCollapse", load_thresholds().moe.for_, ("training_moe_",), [])


def test_a_collapsed_router_is_named_and_paged_for_its_layer_only(tmp_path):
    monitor, _ = _train(collapse_layer=1)
    assert monitor.host_transfers == STEPS
    imbalance = _series(monitor, "training_moe_load_imbalance")
    # Every token on experts 0 and 1: the busiest gets all 256 of 512 routings, the mean is 64.
    assert imbalance["layers.1.router"] == EXPERTS / TOP_K
    assert imbalance["layers.0.router"] < load_thresholds().moe.imbalance_max
    assert _series(monitor, "training_moe_dead_experts") == {"layers.0.router": 0.0, "layers.1.router": 6.0}
    finding = _finding(monitor, "moe_router")
    assert finding.status.name == "DANGER", finding
    assert "layer layers.1.router collapsed" in finding.message and "6 of 8 experts dead" in finding.message
    body = generate_latest(monitor.registry).decode()
    assert 'training_health_status{check="moe_router",component="",rank="0"' in body
    checked = subprocess.run(
        [require_binary("promtool"), "check", "metrics"], input=body, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr  # names, units, help: clean
    # The status page lists the collapsed layer first.
    routers = status_document(monitor.state)["routers"]
    assert routers["layers"] == 2 and routers["worst"][0] == {
        "layer": "layers.1.router",
        "imbalance": 4.0,
        "dead": 6,
        "experts": EXPERTS,
    }
    labels = {"rank": "0", "run_id": monitor.state.run_id, "layer": "layers.1.router"}
    pages(tmp_path, body, "TrainingMoERouterCollapse", load_thresholds().moe.for_, ("training_moe_",), [(labels, 4.0)])


def test_expert_load_from_hf_router_logits_and_router_hooks_count_the_routing():
    transformers = require_module("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    model.train()
    hooks = RouterHooks(model, r"mlp\.gate$", top_k=cfg.num_experts_per_tok)
    tokens = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0  # two padding tokens
    out = model(input_ids=tokens, attention_mask=mask, labels=tokens, output_router_logits=True)
    load = expert_load_from_router_logits(out.router_logits, cfg.num_experts_per_tok, attention_mask=mask)
    assert list(load) == ["moe.0", "moe.1"]
    for i, counts in enumerate(load.values()):
        chosen = out.router_logits[i].topk(2, dim=-1).indices[mask.reshape(-1).bool()]
        assert counts.tolist() == torch.bincount(chosen.reshape(-1), minlength=4).float().tolist()
        assert counts.sum().item() == 14 * 2  # 14 real tokens, top-2
    hooked = hooks.expert_load()
    assert list(hooked) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert all(c.sum().item() == 16 * 2 for c in hooked.values())  # every token the router saw
    assert hooks.expert_load() == {}  # taken: counts start again
    monitor = Monitor(MonitorConfig(), serve=False)
    out.loss.backward()
    monitor.observe(0, loss=out.loss.detach(), losses={"aux_loss": out.aux_loss.detach()}, expert_load=load)
    monitor.flush()
    assert set(_series(monitor, "training_moe_experts")) == {"moe.0", "moe.1"}
    assert monitor.host_transfers == 1


def test_expert_load_takes_sequences_and_refuses_what_is_not_counts():
    monitor = Monitor(MonitorConfig(), serve=False)
    monitor.observe(0, loss=1.0, expert_load={"l0": [30, 10, 0, 0], "l1": torch.tensor([5.0, 5.0])})
    monitor.flush()
    assert _series(monitor, "training_moe_load_imbalance") == {"l0": 3.0, "l1": 1.0}
    assert _series(monitor, "training_moe_experts") == {"l0": 4.0, "l1": 2.0}
    with pytest.raises(TypeError, match="expert_load"):
        monitor.observe(1, loss=1.0, expert_load=[1, 2])
    with pytest.raises(TypeError, match=r"expert_load\['l0'\]"):
        monitor.observe(1, loss=1.0, expert_load={"l0": torch.ones(2, 2)})


def _counted_steps(layers: int, experts: int, dtype: torch.dtype, steps: int = 10):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.counting import StepCounts, count_host_reads

    monitor = Monitor(MonitorConfig(log_status_changes=False), serve=False)
    gen = torch.Generator().manual_seed(0)
    loads = [
        {f"layers.{i}.mlp": torch.randint(0, 50, (experts,), generator=gen).to(dtype) for i in range(layers)}
        for _ in range(steps + 2)
    ]
    loss = torch.tensor(2.0)
    monitor.observe(0, loss=loss, expert_load=loads[0])  # the first step checks each layer and sets up the window
    counts = StepCounts()
    with count_host_reads(counts):
        for step in range(1, steps + 1):
            monitor.observe(step, loss=loss, expert_load=loads[step])
        monitor.flush()
    return counts, monitor


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_64_layers_of_128_experts_read_the_host_once_per_step_in_a_fixed_number_of_ops(dtype):
    counts, monitor = _counted_steps(64, 128, dtype)
    assert counts.host_reads == 10 and counts.device_waits == 0
    assert len(_series(monitor, "training_moe_load_imbalance")) == 64  # per layer, never per expert
    few, _ = _counted_steps(4, 128, dtype)
    assert counts.ops - counts.view_ops == few.ops - few.view_ops  # no kernel per layer or per expert


def test_a_failed_expert_load_measurement_is_counted_and_the_step_goes_on(monkeypatch):
    from lossbeat.measure.experts import ExpertLoadMeter

    monitor = Monitor(MonitorConfig(), serve=False)
    monitor.observe(0, loss=1.0, expert_load={"l0": [1, 2]})

    def broken(self, step, expert_load):
        raise RuntimeError("device lost")

    monkeypatch.setattr(ExpertLoadMeter, "measure", broken)
    monitor.observe(1, loss=1.0, expert_load={"l0": [1, 2]})
    monitor.flush()
    assert monitor.state.steps_total == 2 and monitor.state.errors["observe"] == 1
