"""Rank and port under every launcher: real processes started with srun's, mpirun's, MPICH's,
Lightning's and torchrun's variables, and a real torch.multiprocessing.spawn job whose only
rank information is its gloo process group; each rank is scraped over HTTP."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_ports, require_module
from helpers.processes import kill_tree
from test_distributed import scrape

from lossbeat.exposition.server import MetricsServer, RankContext

WORKER = str(Path(__file__).resolve().parent / "workers" / "launch_worker.py")
LIGHTNING_WORKER = str(Path(__file__).resolve().parent / "workers" / "lightning_launch_worker.py")
LIGHTNING_HALT_WORKER = str(Path(__file__).resolve().parent / "workers" / "lightning_halt_worker.py")
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def clean_env(**variables: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update({k: str(v) for k, v in variables.items()})
    return env


def run_ranks(tmp_path: Path, launches: list[tuple[list[str], dict[str, str]]], ranks: list[int]) -> dict[int, dict]:
    """Starts each (script and arguments, environment) worker, waits for ``ready.<rank>`` of every
    rank, scrapes each rank's port; returns {rank: {"ready": ..., "metrics": ...}}."""
    jobs = [
        subprocess.Popen(
            [sys.executable, *argv, "--dir", str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv, env in launches
    ]
    out: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 400  # a hang guard: several ranks import torch at once
        while not all((tmp_path / f"ready.{r}").exists() for r in ranks):
            ended = [j for j in jobs if j.poll() is not None]
            if ended or time.monotonic() > deadline:
                logs = "\n".join(j.stdout.read() for j in ended)
                pytest.fail(f"a rank ended or the job timed out before every rank was ready:\n{logs}")
            time.sleep(0.2)
        for r in ranks:
            ready = json.loads((tmp_path / f"ready.{r}").read_text())
            out[r] = {"ready": ready, "metrics": scrape(ready["port"])}
    finally:
        (tmp_path / "done").write_text("")
        for job in jobs:
            try:
                job.wait(timeout=60)
            finally:
                if job.poll() is None:
                    kill_tree(job)
    assert [j.returncode for j in jobs] == [0] * len(jobs), "\n".join(j.stdout.read() for j in jobs)
    return out


def assert_served(results: dict[int, dict], base: int, expected: dict[int, tuple[int, int]], source: str) -> None:
    """Each global rank r serves on base + local rank with rank label r; expected: {r: (local, world)}."""
    assert sorted(results) == sorted(expected)
    for rank, (local_rank, world_size) in expected.items():
        ready, metrics = results[rank]["ready"], results[rank]["metrics"]
        assert ready["port"] == base + local_rank
        assert ready["source"] == source
        assert metrics["training_steps_total"] == [({"rank": str(rank)}, 5.0)]
        info = metrics["training_run_info"][0][0]
        assert info["rank"] == str(rank) and info["local_rank"] == str(local_rank)
        assert info["world_size"] == str(world_size)


# (launcher, variables of the process at local rank i, global ranks, world size, source)
NODE_OF_TWO = [
    # srun --ntasks 4 --ntasks-per-node 2: this node runs tasks 2 and 3.
    ("srun", lambda i: {"SLURM_PROCID": 2 + i, "SLURM_LOCALID": i, "SLURM_NTASKS": 4}, [2, 3], 4, "slurm"),
    # mpirun -np 4 inside an sbatch script: the batch step's SLURM_PROCID=0 is inherited by every rank.
    (
        "mpirun (Open MPI) in sbatch",
        lambda i: {
            "OMPI_COMM_WORLD_RANK": 2 + i,
            "OMPI_COMM_WORLD_LOCAL_RANK": i,
            "OMPI_COMM_WORLD_SIZE": 4,
            "SLURM_PROCID": 0,
            "SLURM_LOCALID": 0,
            "SLURM_NTASKS": 1,
        },
        [2, 3],
        4,
        "openmpi",
    ),
    ("mpiexec (MPICH, Intel MPI)", lambda i: {"PMI_RANK": i, "PMI_SIZE": 2, "MPI_LOCALRANKID": i}, [0, 1], 2, "mpich"),
    # Lightning's subprocess launcher: LOCAL_RANK, NODE_RANK, WORLD_SIZE and no RANK.
    ("Lightning launcher", lambda i: {"LOCAL_RANK": i, "NODE_RANK": 0, "WORLD_SIZE": 2}, [0, 1], 2, "lightning"),
    (
        "Lightning launcher, node 1 of 2",
        lambda i: {"LOCAL_RANK": i, "NODE_RANK": 1, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2},
        [2, 3],
        4,
        "lightning",
    ),
    # torchrun started by srun --ntasks-per-node 1: torchrun's variables win over the step's.
    (
        "torchrun under srun",
        lambda i: {
            "RANK": 2 + i,
            "LOCAL_RANK": i,
            "WORLD_SIZE": 4,
            "SLURM_PROCID": 1,
            "SLURM_LOCALID": 0,
            "SLURM_NTASKS": 2,
        },
        [2, 3],
        4,
        "torchrun",
    ),
]


@pytest.mark.parametrize("launcher, variables, ranks, world, source", NODE_OF_TWO, ids=[c[0] for c in NODE_OF_TWO])
def test_each_launcher_gives_each_rank_its_port_and_rank_label(tmp_path, launcher, variables, ranks, world, source):
    base = free_ports(2)
    launches = [([WORKER, "env", "--port", str(base)], clean_env(**variables(i))) for i in range(2)]
    results = run_ranks(tmp_path, launches, ranks)
    assert_served(results, base, {r: (i, world) for i, r in enumerate(ranks)}, source)


def test_srun_ranks_that_start_a_process_group_keep_slurms_local_rank(tmp_path):
    base = free_ports(2)
    launches = [
        (
            [WORKER, "group", "--port", str(base), "--rank", str(i), "--world", "2"],
            clean_env(SLURM_PROCID=i, SLURM_LOCALID=i, SLURM_NTASKS=2),
        )
        for i in range(2)
    ]
    assert_served(run_ranks(tmp_path, launches, [0, 1]), base, {0: (0, 2), 1: (1, 2)}, "slurm")


@pytest.mark.parametrize(
    "inherited",
    [{}, {"SLURM_PROCID": 0, "SLURM_LOCALID": 0, "SLURM_NTASKS": 1}],
    ids=["no launcher variables", "spawned by one srun task"],
)
def test_multiprocessing_spawn_ranks_come_from_the_process_group(tmp_path, inherited):
    """mp.spawn + init_process_group(rank=i): no variable names the rank (or only the one srun
    task's, the same in every process); the group and its store give rank and local rank."""
    base = free_ports(2)
    results = run_ranks(
        tmp_path, [([WORKER, "spawn", "--port", str(base), "--world", "2"], clean_env(**inherited))], [0, 1]
    )
    assert_served(results, base, {0: (0, 2), 1: (1, 2)}, "process group")


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_lightning_ranks_in_spawned_or_forked_children_serve_their_steps(tmp_path, strategy):
    """The callback is built in the launching process; each rank's process starts its own
    exporter in setup(), labelled with the trainer's ranks, and /metrics shows its steps."""
    require_module("lightning")
    base = free_ports(2)
    argv = [LIGHTNING_WORKER, "--strategy", strategy, "--port", str(base), "--steps", "4"]
    results = run_ranks(tmp_path, [(argv, clean_env())], [0, 1])
    for rank in (0, 1):
        ready, metrics = results[rank]["ready"], results[rank]["metrics"]
        assert ready["port"] == base + rank and ready["global_step"] == 4 and ready["observed"] == 4
        assert metrics["training_steps_total"] == [({"rank": str(rank)}, 4.0)]
        assert metrics["training_step"] == [({"rank": str(rank)}, 4.0)]
        info = metrics["training_run_info"][0][0]
        assert (info["local_rank"], info["world_size"], info["run"]) == (str(rank), "2", "lightning-launch")
    assert results[0]["ready"]["pid"] != results[1]["ready"]["pid"]
    # Per-layer norms from rank 0 only, as under torchrun.
    assert "training_layer_grad_norm" in results[0]["metrics"]
    assert "training_layer_grad_norm" not in results[1]["metrics"]


def test_a_monitor_built_in_the_launching_process_cannot_go_to_spawned_ranks():
    require_module("lightning")
    from lossbeat import Monitor, MonitorConfig
    from lossbeat.integrations.lightning import LossbeatCallback

    with pytest.raises(TypeError, match="pass exporter settings instead"):
        pickle.dumps(LossbeatCallback(Monitor(MonitorConfig(port=0), serve=False)))  # what ddp_spawn does
    restored = pickle.loads(pickle.dumps(LossbeatCallback(port=9999, run_name="r")))
    assert restored.monitor is None and restored._settings == {"port": 9999, "run_name": "r"}
    with pytest.raises(TypeError, match="unknown exporter setting 'prot'"):
        LossbeatCallback(prot=9000)
    with pytest.raises(ValueError, match="port"):
        LossbeatCallback(port=-1)
    with pytest.raises(TypeError, match="not both"):
        LossbeatCallback(Monitor(MonitorConfig(port=0), serve=False), port=9000)


# --- in-process: the variables' precedence and errors -----------------------------------------


def test_rank_context_precedence_and_bad_values(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert RankContext.from_env() == RankContext(0, 0, 1)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert RankContext.from_env() == RankContext(5, 5, 8)  # no SLURM_LOCALID: one task per node
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    ctx = RankContext.from_env()
    assert ctx == RankContext(3, 3, 4) and ctx.source == "mpich"  # PMI wins over the inherited Slurm step
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "x")
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK: expected an integer"):
        RankContext.from_env()
    with pytest.raises(ValueError, match="local_rank"):
        RankContext(0, -1, 1)
    with pytest.raises(ValueError, match="world_size"):
        RankContext(0, 0, 0)


def test_lightning_launched_ranks_stop_together_and_the_documented_save_keeps_the_last_good_state(tmp_path):
    """Lightning's own ddp launcher (it runs the script again for rank 1), guard="stop" and a NaN
    loss on rank 1 only: both ranks leave fit() with TrainingHalted at that step, and docs/guard.md's
    Lightning example, run as written on each rank, checkpoints the weights and AdamW state from
    just before it."""
    require_module("lightning")
    job = subprocess.run(
        [sys.executable, LIGHTNING_HALT_WORKER, "--dir", str(tmp_path)],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    files = [tmp_path / f"halted.{rank}.json" for rank in (0, 1)]
    deadline = time.monotonic() + 60  # rank 1 is Lightning's child: it may end after rank 0
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.returncode == 0 and all(f.exists() for f in files), job.stdout[-4000:]
    results = [json.loads(f.read_text()) for f in files]
    for r in results:
        assert (r["step"], r["reason"], r["global_step"]) == (3, "nonfinite", 2), r
    assert results[0]["saved_global_step"] == 2, results[0]
    assert results[0]["saved_weights_equal"] and results[0]["saved_adam_equal"], results[0]


def test_lightning_node_rank_without_the_node_size_falls_back_to_the_local_rank(monkeypatch, caplog):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level("WARNING", logger="lossbeat"):
        assert RankContext.from_env() == RankContext(1, 1, 4)
    assert "LOCAL_WORLD_SIZE" in caplog.text


# --- a forked child (DataLoader worker) and the listening socket ----------------------------


def test_a_forked_child_does_not_keep_the_port(tmp_path):
    """After the parent's close(), the port can be bound again while a forked child lives,
    and the child's close() of its copy neither hangs nor touches the parent's server."""
    from prometheus_client import CollectorRegistry

    server = MetricsServer(CollectorRegistry(), 0, "127.0.0.1")
    port = server.port
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold on until the parent says so, then close the copy
        os.close(write)
        os.read(read, 1)
        server.close()
        os._exit(0)
    os.close(read)
    try:
        scrape(port)  # the parent still serves
        server.close()
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, not past a listener
            again.bind(("127.0.0.1", port))  # EADDRINUSE while the child held the socket
            again.listen()
    finally:
        os.write(write, b"x")
        os.close(write)
        status = wait_or_kill(pid, 30)
    assert status == 0, "the child's close() of its inherited server hung or failed"


def wait_or_kill(pid: int, seconds: float) -> int | None:
    """The child's exit code, or None after killing it once ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None
