"""The sharded set-up, end to end with real servers on loopback: two Prometheus shards (the
shipped deploy/sharding configs, hashmod relabelling) each scrape half of the ranks, judge them
with rules-shard.yml and remote-write into a global Prometheus that evaluates rules-global.yml;
both notify one real Alertmanager. A NaN on a rank of either shard pages once, from its shard;
a rank killed on one shard fires TrainingRankDown on the global, a rule that counts ranks
across both shards."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lossbeat.stack.local import write_target_groups

from .e2e_harness import AlertmanagerProcess, free_port, terminate, wait_until
from .prometheus_process import PrometheusProcess
from .stack_config import E2E_THRESHOLDS, REPO, SHIPPED_ALERTMANAGER, retimed_alertmanager_config

SHARDING = REPO / "deploy" / "sharding"
SHARDS = 2


@pytest.fixture(scope="module")
def e2e_overrides() -> dict:
    return {"alerts": {**E2E_THRESHOLDS["alerts"], "rank_down_for": "5s"}}


def hashmod_shard(address: str, modulus: int = SHARDS) -> int:
    """Prometheus' `hashmod` relabel action: the low 64 bits of the MD5, big-endian, mod N."""
    return int.from_bytes(hashlib.md5(address.encode()).digest()[8:], "big") % modulus


def port_for_shard(shard: int, taken: set[int]) -> int:
    while True:
        port = free_port()
        if port not in taken and hashmod_shard(f"127.0.0.1:{port}") == shard:
            taken.add(port)
            return port


def shipped(name: str) -> dict:
    return yaml.safe_load((SHARDING / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def sharded(servers, e2e_rules, receiver, tmp_path_factory):
    """Alertmanager, the global Prometheus and two shards, from the shipped configs with
    loopback addresses, 1 s intervals, the test thresholds' stage rules and a test file_sd folder."""
    work = tmp_path_factory.mktemp("sharded")
    sd = work / "file_sd"
    sd.mkdir()
    am_config = work / "alertmanager.yml"
    am_config.write_text(yaml.safe_dump(retimed_alertmanager_config(SHIPPED_ALERTMANAGER, receiver.url)))
    alertmanager = AlertmanagerProcess(am_config, work)
    processes: list = [alertmanager]
    try:
        alertmanager.wait_ready()
        central_config = shipped("global.yml")
        central_config["global"]["evaluation_interval"] = "1s"
        central_config["rule_files"] = [str(e2e_rules.parent / "rules-global.yml")]
        central_config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager.address]
        central = PrometheusProcess(
            work, central_config, name="global", extra_flags=("--web.enable-remote-write-receiver",)
        )
        processes.append(central)
        central.wait_ready()
        shards = []
        for shard in range(SHARDS):
            config = shipped(f"shard-{shard}.yml")
            config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
            config["rule_files"] = [str(e2e_rules.parent / "rules-shard.yml")]
            config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager.address]
            job = config["scrape_configs"][0]
            job["file_sd_configs"] = [{"files": [str(sd / "*.json")], "refresh_interval": "1s"}]
            config["remote_write"][0]["url"] = f"{central.url}/api/v1/write"
            config["remote_write"][0]["queue_config"]["batch_send_deadline"] = "1s"
            process = PrometheusProcess(work, config, name=f"shard-{shard}")
            processes.append(process)
            shards.append(process.wait_ready())
        yield {"central": central, "shards": shards, "sd": sd, "work": work}
    finally:
        for process in reversed(processes):
            process.stop()


def start_rank(work: Path, job: str, rank: int, world: int, port: int, thresholds: Path, *fault: str):
    """A real `lossbeat demo` training process as global rank `rank` of a `world`-rank job."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
    log = open(work / f"{job}-rank{rank}.log", "wb")
    with log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lossbeat",
                "demo",
                "--port",
                str(port),
                "--no-progress",
                "--steps",
                "100000",
                "--step-delay",
                "0.2",
                "--batch-size",
                "8",
                "--run-name",
                job,
                "--thresholds",
                str(thresholds),
                *fault,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )


def test_a_fault_on_either_shard_pages_once_and_rank_down_counts_across_shards(sharded, receiver, e2e_thresholds):
    central, sd, work = sharded["central"], sharded["sd"], sharded["work"]
    taken: set[int] = set()
    # Two 2-rank jobs, each with one rank on each shard; job nan-s<K> goes NaN on shard K.
    layout = {}  # (job, rank) -> (port, shard)
    for shard in range(SHARDS):
        job = f"sharded-nan-s{shard}"
        for rank in range(2):
            rank_shard = shard if rank == 0 else 1 - shard
            layout[(job, rank)] = (port_for_shard(rank_shard, taken), rank_shard)
    procs = {}
    try:
        for (job, rank), (port, _) in layout.items():
            fault = ("--fault", "nan", "--fault-step", "40") if rank == 0 else ()
            procs[(job, rank)] = start_rank(work, job, rank, 2, port, e2e_thresholds, *fault)
        write_target_groups(
            sd / "training.json",
            [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": job}} for (job, _), (port, _) in layout.items()],
        )

        # Each shard scrapes exactly its half, and forwards each rank's 5m mean loss (what the
        # global compares across ranks) and its partials, not the raw series.
        def all_up():
            up = sum(len(p.api.query('up{job=~"sharded-.*"} == 1')) for p in sharded["shards"])
            means = central.api.query('job_run_id_instance_rank:training_loss:avg_over_time5m{job=~"sharded-.*"}')
            return up == len(layout) and len(means) == len(layout) and means

        wait_until(all_up, 120, "every rank scraped by its shard and its mean loss remote-written to the global")
        assert not central.api.query('training_loss{job=~"sharded-.*"}')  # the raw series stay on the shards
        # Each shard's count of its ranks present, per job, labelled with the shard's number.
        expected = [(f"sharded-nan-s{job}", str(shard), 1.0) for job in range(SHARDS) for shard in range(SHARDS)]

        def partials():
            got = central.api.query('job_world_size_shard:training_run:count_present{job=~"sharded-.*"}')
            return sorted((p["metric"]["job"], p["metric"]["shard"], float(p["value"][1])) for p in got) == expected

        wait_until(partials, 60, "each shard's count of ranks present, per job, on the global")
        for shard, process in enumerate(sharded["shards"]):
            scraped = {t["labels"]["instance"] for t in process.api._get("/api/v1/targets")["activeTargets"]}
            expected = {f"127.0.0.1:{port}" for port, s in layout.values() if s == shard}
            assert scraped == expected, f"shard-{shard} scrapes {scraped}, expected {expected}"

        for shard in range(SHARDS):
            job = f"sharded-nan-s{shard}"
            wait_until(
                lambda job=job: [
                    d for d in receiver.received(alertname="TrainingLossNaN", job=job) if d.path == "/page"
                ],
                120,
                f"TrainingLossNaN of {job} (shard {shard}) paged",
            )
        time.sleep(5)  # further evaluations and notification cycles must not page again
        for shard in range(SHARDS):
            job = f"sharded-nan-s{shard}"
            pages = [d for d in receiver.received(alertname="TrainingLossNaN", job=job) if d.path == "/page"]
            assert len(pages) == 1, f"{job}: paged {len(pages)} times"
            assert pages[0].labels["rank"] == "0"
            port, rank_shard = layout[(job, 0)]
            assert pages[0].labels["instance"] == f"127.0.0.1:{port}" and rank_shard == shard
            # Judged by the rank's own shard; the global holds no per-rank alert.
            assert sharded["shards"][shard].api.firing("TrainingLossNaN", job=job)
            assert not central.api.alerts(alertname="TrainingLossNaN", job=job)

        # Kill the healthy rank of job s0 (it lives on shard 1): its job still has rank 0 on
        # shard 0, so only a rule that sees both shards can tell a rank is missing.
        job = "sharded-nan-s0"
        victim = procs[(job, 1)]
        victim.kill()
        victim.wait(10)
        down = wait_until(lambda: central.api.firing("TrainingRankDown", job=job), 120, f"TrainingRankDown for {job}")
        assert [(a["labels"]["rank"], a["labels"]["world_size"]) for a in down] == [("1", "2")]
        assert float(down[0]["value"]) == 1
        assert not central.api.alerts(alertname="TrainingRankDown", job="sharded-nan-s1")
    finally:
        write_target_groups(sd / "training.json", [])
        for proc in procs.values():
            terminate(proc)
