"""The cross-rank signals each rank exports: the step-aligned grad norm and the rank's own work time."""

from __future__ import annotations

import re

import pytest
import torch
from prometheus_client import generate_latest

from lossbeat import Monitor, MonitorConfig
from lossbeat.exposition.server import RankContext


def _samples(monitor: Monitor) -> dict[str, float]:
    out = {}
    for line in generate_latest(monitor.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r',?run_id="[^"]*"', "", name)] = float(value)  # the run identity: tested on its own
    return out


def test_the_grad_norm_of_every_kth_step_is_exported_with_its_step():
    m = Monitor(MonitorConfig(port=0, grad_norm_align_every=10), serve=False, rank_context=RankContext(3, 3, 4))
    for step in range(1, 26):
        m.observe(step, loss=1.0, grad_norm=float(step) / 10)
    m.flush()
    s = _samples(m)
    assert s['training_grad_norm_aligned{rank="3"}'] == 2.0
    assert s['training_grad_norm_aligned_step{rank="3"}'] == 20
    m.close()


def test_aligned_norms_can_be_turned_off_and_work_time_is_opt_in():
    m = Monitor(MonitorConfig(port=0, grad_norm_align_every=0), serve=False)
    model = torch.nn.Linear(2, 1)
    for step in range(0, 300, 100):
        model(torch.ones(1, 2)).sum().backward()
        m.observe(step, loss=1.0, model=model)
    m.flush()
    assert not [k for k in _samples(m) if k.startswith(("training_grad_norm_aligned", "training_rank_work"))]
    assert not model._forward_hooks and not model._forward_pre_hooks  # no hooks unless asked
    m.close()


class _Clock:
    """The work-time clock of lossbeat.measure.cross_rank, advanced by the test: waits take
    exactly the seconds they say, whatever else runs on the machine."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Wrapper(torch.nn.Module):
    """Like DDP: `.module` is the model; its forward first runs a collective (here: a wait)."""

    def __init__(self, module: torch.nn.Module, collective_s: float, clock: _Clock) -> None:
        super().__init__()
        self.module = module
        self.collective_s = collective_s
        self.clock = clock

    def forward(self, x):
        self.clock.sleep(self.collective_s)  # waiting for the other ranks: not this rank's work
        return self.module(x)


class _SlowForward(torch.nn.Module):
    def __init__(self, forward_s: float, clock: _Clock) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.forward_s = forward_s
        self.clock = clock

    def forward(self, x):
        self.clock.sleep(self.forward_s)
        return self.linear(x)


def test_work_time_counts_data_wait_and_forward_but_not_the_collective(monkeypatch):
    import lossbeat.measure.cross_rank as cross_rank

    clock = _Clock()
    monkeypatch.setattr(cross_rank, "time", clock)  # the only clock work time reads
    data_s, forward_s, collective_s, backward_s = 0.03, 0.02, 0.3, 0.3
    model = _Wrapper(_SlowForward(forward_s, clock), collective_s, clock)
    m = Monitor(MonitorConfig(port=0, work_time=True), serve=False)
    for step in range(6):
        clock.sleep(data_s)  # data loading
        loss = model(torch.ones(2, 4)).sum()
        clock.sleep(backward_s)  # the backward (its all-reduce waits): not counted either
        loss.backward()
        m.observe(step, loss=loss.detach(), model=model)
    work = _samples(m)['training_rank_work_seconds{rank="0"}']
    assert work == pytest.approx(data_s + forward_s), work  # none of the collective's or the backward's 0.6 s
    m.close()
    assert not model._forward_pre_hooks and not model.module._forward_hooks  # close() removes the hooks


def test_work_time_is_host_time_and_the_straggler_alert_says_so(monkeypatch):
    """What TrainingStraggler measures: the host's time. A host-side wait that only
    this rank does after observe() (rank 0 reading ``loss.item()`` to log, which under CUDA
    waits for the device) is charged to its work; the alert, its action and the metric's help
    say it is host time and that a slow GPU does not show (before, they sent on-call to look
    for a throttled GPU, which host time cannot see)."""
    import lossbeat.measure.cross_rank as cross_rank
    from lossbeat.diagnosis.thresholds import load_thresholds
    from lossbeat.exposition.metrics import METRICS
    from lossbeat.mixin.alert_rules import alert_rules

    clock = _Clock()
    monkeypatch.setattr(cross_rank, "time", clock)
    data_s, forward_s, logging_sync_s = 0.03, 0.02, 0.05
    model = _SlowForward(forward_s, clock)
    m = Monitor(MonitorConfig(port=0, work_time=True), serve=False)
    for step in range(6):
        clock.sleep(data_s)
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        m.observe(step, loss=loss.detach(), model=model)
        clock.sleep(logging_sync_s)  # rank 0's own logging: the host waits after observe()
    work = _samples(m)['training_rank_work_seconds{rank="0"}']
    assert work == pytest.approx(data_s + forward_s + logging_sync_s), work
    m.close()

    rule = next(r for r in alert_rules(load_thresholds()) if r.name == "TrainingStraggler")
    assert "timed on the host" in rule.description and "slow GPU does not show" in rule.description
    assert "loss.item()" in rule.description  # the host-device sync that makes rank 0 look slow
    assert "throttled GPU" not in rule.action and "DCGM" in rule.action
    assert "host time" in METRICS["training_rank_work_seconds"].help


def test_settings_are_validated():
    with pytest.raises(ValueError, match="grad_norm_align_every"):
        MonitorConfig(grad_norm_align_every=-1)
    with pytest.raises(TypeError, match="work_time"):
        MonitorConfig(work_time=1)


_ALIGN = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from lossbeat import Monitor, MonitorConfig
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
alone = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank creates every group, in order
for name, wrap, reduce, group in (("plain", False, True, None), ("ddp", True, True, None),
                                  ("ddp-noreduce", True, False, None), ("ddp-subgroup", True, True, alone)):
    model = torch.nn.Linear(2, 1)
    # A DDP over a subgroup: the data-parallel ranks of a TP/EP layout, next to other groups' shards.
    observed = DistributedDataParallel(model, process_group=group) if wrap else model
    m = Monitor(MonitorConfig(port=0, reduce_shards=reduce), serve=False)  # grad_norm_align_every left alone
    for step in range(1, 201):
        model.zero_grad()
        observed(torch.ones(1, 2)).sum().backward()
        m.observe(step, loss=1.0, model=observed)
    m.flush()
    print(name, m._cross_rank.aligned is not None)
    m.close()
dist.destroy_process_group()
"""


def test_aligned_norms_are_on_by_default_only_for_pure_ddp(tmp_path):
    """TrainingRankGradientMismatch compares ranks that must agree: pure DDP replicas over every
    rank. Elsewhere (a plain module: FSDP/TP/EP/pipeline layouts, or a callback's unwrapped
    model; reduce_shards=False; a DDP over a data-parallel subgroup, whose other groups hold other
    shards) the ranks' norms legitimately differ, so nothing is exported. Before, a DDP over a
    subgroup turned it on."""
    import subprocess
    import sys

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ALIGN, str(tmp_path / "store"), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        assert dict(line.split() for line in out.splitlines()) == {
            "plain": "False",
            "ddp": "True",
            "ddp-noreduce": "False",
            "ddp-subgroup": "False",
        }
