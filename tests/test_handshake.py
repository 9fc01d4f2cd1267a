"""The shard handshake (lossbeat.measure.handshake) through a real TCPStore, ranks simulated as
threads with a client each: one decision for early, late and absent ranks, the components the
groups link, O(1) store requests per rank, and a store that never answers."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lossbeat.measure.handshake import ABSENT, LATE, REDUCE, decode_ranks, encode_ranks, meet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.handshake import CountingStore


@pytest.fixture(scope="module")
def server():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def client(server):
    return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))


def run_ranks(server, prefix, groups, timeout=30.0, grace=30.0, start=None, counting=False):
    """{rank: outcome} for the ranks in ``groups`` ({rank: its groups' ranks}); ``start[rank]``:
    a callable it waits on before arriving. With ``counting``, also {rank: CountingStore}."""
    out, stores = {}, {}

    def one(rank):
        store = client(server)
        if counting:
            store = stores[rank] = CountingStore(store)
        if start and rank in start:
            start[rank]()
        wait = timeout[rank] if isinstance(timeout, dict) else timeout
        out[rank] = meet(store, prefix, rank, groups[rank], wait, grace)

    threads = [threading.Thread(target=one, args=(r,)) for r in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return (out, stores) if counting else out


def test_ranks_encode_as_arithmetic_runs():
    for ranks in ([0], [0, 1], list(range(4096)), list(range(3, 4096, 8)), [0, 1, 2, 5, 9, 13, 14]):
        assert decode_ranks(encode_ranks(ranks)) == set(ranks)
    assert encode_ranks(range(4096)) == "0-4095" and encode_ranks(range(3, 64, 8)) == "3-59/8"


def test_early_and_late_ranks_agree_on_one_decision(server):
    """All arrive -> every rank reduces; one missing -> the waiting one gives up after timeout +
    grace, and the missing one, coming later, reads that instead of entering a collective alone;
    a straggler past the timeout but within the grace -> every rank still reduces (LATE)."""
    group = {0: [[0, 1, 2]], 1: [[0, 1, 2]], 2: [[0, 1, 2]]}
    delays = {r: (lambda d=0.2 * r: time.sleep(d)) for r in group}
    assert run_ranks(server, "all", group, start=delays) == {0: REDUCE, 1: REDUCE, 2: REDUCE}

    pair = {0: [[0, 1]], 1: [[0, 1]]}
    started = time.monotonic()
    assert run_ranks(server, "missing", {0: pair[0]}, timeout=0.3, grace=0.3) == {0: ABSENT}  # no hang
    assert 0.6 <= time.monotonic() - started < 10
    started = time.monotonic()
    assert run_ranks(server, "missing", {1: pair[1]}) == {1: ABSENT}  # it comes late: it skips too, at once
    assert time.monotonic() - started < 5

    # Rank 1 arrives past rank 0's timeout (0.3 s after rank 0's entry is there; its own timeout
    # is 0: it is the one late).
    waiter = client(server)

    def after_rank_0():
        waiter.wait(["straggler/e/0"], timedelta(seconds=60))
        time.sleep(0.3)

    assert run_ranks(server, "straggler", pair, timeout={0: 0.2, 1: 0.0}, grace=60.0, start={1: after_rank_0}) == {
        0: LATE,
        1: LATE,
    }
    # ... and once rank 0 gave up altogether (ordered by the store): absent for both.
    gone = {1: lambda: waiter.wait(["gone/l/0"], timedelta(seconds=60))}
    assert run_ranks(server, "gone", pair, timeout=0.2, grace=0.2, start=gone) == {0: ABSENT, 1: ABSENT}


def test_ranks_whose_groups_differ_meet_every_rank_they_are_linked_to(server):
    """PP x FSDP on 4 ranks: stages {0, 1}, {2, 3}, shards {0, 2}, {1, 3}. Each rank's own groups
    hold 3 ranks, a different 3 on each; the component is all 4. One that never comes: all give up.
    Disjoint components (HSDP's shard groups) decide apart: a missing rank in one spares the other."""
    groups = {0: [[0, 1], [0, 2]], 1: [[0, 1], [1, 3]], 2: [[2, 3], [0, 2]], 3: [[2, 3], [1, 3]]}
    assert run_ranks(server, "pp", groups) == {r: REDUCE for r in range(4)}
    three = {r: groups[r] for r in (0, 1, 2)}
    assert run_ranks(server, "pp3", three, timeout=0.3, grace=0.3) == {0: ABSENT, 1: ABSENT, 2: ABSENT}

    hsdp = {r: [[0, 1, 2, 3]] if r < 4 else [[4, 5, 6, 7]] for r in range(8)}
    del hsdp[6]
    assert run_ranks(server, "hsdp", hsdp, timeout=0.3, grace=0.3) == {
        0: REDUCE,
        1: REDUCE,
        2: REDUCE,
        3: REDUCE,
        4: ABSENT,
        5: ABSENT,
        7: ABSENT,
    }


def test_64_ranks_make_a_constant_number_of_store_requests_each(server):
    """One FSDP group over 64 ranks, and an 8 x 8 mesh (FSDP x TP): a handful of requests per rank,
    independent of N (the old protocol made each rank get every other's member list: 63 gets;
    benchmarks/handshake.py compares them)."""
    n = 64
    world = {r: [list(range(n))] for r in range(n)}
    out, stores = run_ranks(server, "o1", world, counting=True)
    assert set(out.values()) == {REDUCE}
    requests = [stores[r].requests for r in range(n)]
    assert max(requests) <= 8, requests
    assert max(stores[r].keys_read for r in range(1, n)) <= 3  # rank 0, the leader, reads the 63 entries ...
    assert stores[0].keys_read <= n + 2 and stores[0].requests <= 8  # ... in one multi_get
    assert sum(s.received for s in stores.values()) < 16 * 1024

    mesh = {r: [[r // 8 * 8 + k for k in range(8)], [k * 8 + r % 8 for k in range(8)]] for r in range(n)}
    out, stores = run_ranks(server, "o1-2d", mesh, counting=True)
    assert set(out.values()) == {REDUCE}
    assert max(stores[r].requests for r in range(n)) <= 12


@pytest.fixture
def frozen_store():
    """A TCPStore client whose server (another process) is stopped: every request times out."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, 1, True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\ntime.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=1))
        os.kill(proc.pid, signal.SIGSTOP)
        yield store
    finally:
        proc.kill()
        proc.wait()


class _TwoStages:
    """A process group of 2 (a pipeline group: the grouping measures with a collective)."""

    def size(self) -> int:
        return 2


def test_a_store_that_never_answers_is_an_exporter_error_and_clip_grad_norm_still_clips(frozen_store, monkeypatch):
    from lossbeat import Monitor, MonitorConfig
    from lossbeat.measure import gradients

    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: frozen_store)
    started = time.monotonic()
    outcome, detail = gradients._all_ranks_arrive([_TwoStages()], 0.3)
    assert outcome == gradients.HANDSHAKE_FAILED and "did not answer" in detail  # no raise, no hang
    assert 0.9 <= time.monotonic() - started < 5  # 2 x timeout + 1 s
    monkeypatch.setattr(gradients, "SHARD_HANDSHAKE_TIMEOUT_S", 0.3)

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("lossbeat").addHandler(handler)
    try:
        monitor = Monitor(MonitorConfig(port=0), serve=False)
        monitor._meter.pipeline_group = _TwoStages()
        torch.manual_seed(0)
        model, reference = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        reference.load_state_dict(model.state_dict())
        for m in (model, reference):
            m(torch.ones(2, 4)).pow(2).sum().backward()
        total = monitor.clip_grad_norm_(model, 0.01)  # step 1: the handshake fails; torch's clip, no raise
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        assert total.item() == pytest.approx(expected.item(), rel=1e-6)
        torch.testing.assert_close(model.weight.grad, reference.weight.grad)
        monitor.observe(1, loss=1.0, model=model)
        monitor.flush()
        assert monitor.state.steps_total == 1 and monitor.state.loss == 1.0  # the step is recorded
        assert monitor.state.grad_norm is None and monitor.state.errors["gradients"] == 2
        messages = [r.getMessage() for r in records]
        assert len(messages) == 1 and "shard handshake" in messages[0] and "failed" in messages[0]
        monitor.close(completed=False)
    finally:
        logging.getLogger("lossbeat").removeHandler(handler)
