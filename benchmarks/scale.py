"""What the Prometheus set-up deploy/ ships pays for N ranks with lossbeat's rules, measured.

    python benchmarks/scale.py --ranks 1000                 # one Prometheus, rules.yml: ~4 minutes
    python benchmarks/scale.py --ranks 10000 --interval 15  # deploy/sharding (8 shards + global): ~6 min
    python benchmarks/scale.py --ranks 1000 --shards 2      # the sharded set-up at a small size
    python benchmarks/scale.py --report                     # docs/scale.md tables from scale_results.json

Worker processes (one per 4,000 ranks) serve the expositions of N synthetic ranks, one HTTP
target per rank on loopback ports (asyncio, keep-alive). The expositions are real: a
10M-parameter TinyLM trains a few steps under two real Monitors (global rank 0, which exports
per-layer norms, and rank 1, scalars only), and their rendered text is the template; every
scrape re-renders the changing values (step, counters, loss with per-rank noise, grad norms,
timestamps), so the TSDB compresses what a real run gives it, not constants.

The servers are the ones deploy/ ships for the size, from its files: up to 2,000 ranks one
Prometheus with ``alerting/rules.yml`` (deploy/local); above, ``deploy/sharding``: shards
that scrape their ``hashmod`` share of one file_sd list and evaluate ``rules-shard.yml``,
remote-writing to a global Prometheus that evaluates ``rules-global.yml``. After all ranks
answer and ``--warmup-cycles`` intervals, one rank turns NaN (time from the first exposition
showing it to TrainingLossNaN's activeAt on its shard), and another is killed (its port refuses:
time to TrainingRankDown firing on the global, and TrainingExporterDown on its shard).

Recorded per run: the Prometheus version, the set-up, the machine's load, every server's rule
groups (``prometheus_rule_group_last_duration_seconds``, sampled every interval: max and mean),
missed iterations, head series, RSS and CPU, series per rank, memory per 1,000 ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/scale.py` from anywhere

RESULTS = HERE / "scale_results.json"
SCRAPE_INTERVAL = 15.0
SHARDING = REPO / "deploy" / "sharding"
RULES = REPO / "alerting" / "rules.yml"
STAGE_RULES = {stage: REPO / "alerting" / f"rules-{stage}.yml" for stage in ("shard", "global")}
JOB = "scale"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


# --- real expositions -------------------------------------------------------------------------


def real_expositions(world_size: int, steps: int = 12, model: str = "10M") -> dict[str, str]:
    """The /metrics text of global rank 0 (with per-layer norms) and rank 1 (scalars only)
    after ``steps`` real training steps of a TinyLM, both in a ``world_size``-rank job."""
    import torch
    from prometheus_client import generate_latest

    from benchmarks.models import MODEL_SPECS, build_workload
    from lossbeat import Monitor, MonitorConfig
    from lossbeat.exposition.server import RankContext

    torch.set_num_threads(1)
    work = build_workload(MODEL_SPECS[model])
    monitors = {
        rank: Monitor(
            MonitorConfig(port=0, run_name="scale"), serve=False, rank_context=RankContext(rank, rank % 8, world_size)
        )
        for rank in (0, 1)
    }
    for step in range(steps):
        tokens, targets = work.batch(step)
        loss = work.model(tokens, targets)
        loss.backward()
        for monitor in monitors.values():
            monitor.observe(step, loss=loss, optimizer=work.optimizer, model=work.model, tokens=tokens.numel())
        work.optimizer.step()
        work.optimizer.zero_grad(set_to_none=True)
    texts = {}
    for rank, monitor in monitors.items():
        monitor.flush()
        texts["layers" if rank == 0 else "scalars"] = generate_latest(monitor.registry).decode()
        monitor.close()
    return texts


def series_count(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


# --- synthetic ranks --------------------------------------------------------------------------

# Gauges that change every step; counters that grow with the steps.
_MOVING = (
    "training_loss",
    "training_grad_norm",
    "training_layer_grad_norm",
    "training_loss_cv",
    "training_step_duration_seconds",
    "training_loss_trend_ratio",
    "training_memory_allocated_bytes",
    "training_learning_rate",
)
_STEP_LIKE = ("training_step", "training_steps_total")


@dataclass
class _Line:
    prefix: str
    base: float
    kind: str  # static | moving | step | tokens | timestamp | nonfinite_loss


RUN_ID = "scale-benchmark"
"""The run identity every synthetic rank exports: the ranks of one job, one run."""


class SyntheticRank:
    """One rank's exposition, re-rendered at each scrape from a real template."""

    def __init__(self, template: str, rank: int, started: float, seed: int) -> None:
        self.rank = rank
        self.started = started
        self.nan_since: float | None = None
        self.rng = random.Random(seed)
        self.offset = self.rng.uniform(-0.01, 0.01)  # this rank's data shard: +-1 % loss
        self.lines: list[tuple[str, _Line | None]] = []
        for raw in template.splitlines():
            m = _SAMPLE.match(raw)
            if raw.startswith("#") or not m:
                self.lines.append((raw, None))
                continue
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            labels = re.sub(r'\brank="\d+"', f'rank="{rank}"', labels)
            labels = re.sub(r'\blocal_rank="\d+"', f'local_rank="{rank % 8}"', labels)
            labels = re.sub(r'\brun_id="[^"]*"', f'run_id="{RUN_ID}"', labels)  # one run, as torchrun's ranks share
            base = float(value)
            if name in _STEP_LIKE:
                kind = "step"
            elif name == "training_tokens_total":
                kind = "tokens"
            elif name == "training_last_step_timestamp_seconds":
                kind = "timestamp"
            elif name == "training_nonfinite_loss_total":
                kind = "nonfinite_loss"
            elif name in _MOVING:
                kind = "moving"
            else:
                kind = "static"
            self.lines.append(("", _Line(f"{name}{labels} ", base, kind)))

    def render(self, now: float, steps_per_s: float = 2.0) -> bytes:
        steps = int((now - self.started) * steps_per_s)
        nan = self.nan_since is not None and now >= self.nan_since
        out = []
        for raw, line in self.lines:
            if line is None:
                out.append(raw)
                continue
            if line.kind == "step":
                value = line.base + steps
            elif line.kind == "tokens":
                value = line.base * (1 + steps / 12)
            elif line.kind == "timestamp":
                value = now
            elif line.kind == "nonfinite_loss":
                value = line.base + (int((now - self.nan_since) * steps_per_s) + 1 if nan else 0)
            elif line.kind == "moving":
                value = line.base * (1 + self.offset) * (1 + 0.02 * self.rng.uniform(-1, 1))
                if nan and line.prefix.startswith("training_loss{"):
                    value = math.nan
            else:
                value = line.base
            out.append(line.prefix + ("NaN" if math.isnan(value) else repr(value)))
        return ("\n".join(out) + "\n").encode()


class _FarmWorker:
    """One process of the farm: ``ranks`` synthetic ranks on loopback ports, one asyncio loop.

    Commands come on ``conn``: ("nan", rank, at), ("kill", rank), ("stats",), ("stop",)."""

    def __init__(self, templates: dict[str, str], first: int, count: int, started: float, conn) -> None:
        self.ranks = {
            r: SyntheticRank(templates["layers" if r == 0 else "scalars"], r, started, seed=r)
            for r in range(first, first + count)
        }
        self.conn = conn
        self.servers: dict[int, asyncio.AbstractServer] = {}
        self.scrapes = 0

    async def main(self) -> None:
        ports = {}
        for rank in self.ranks.values():
            server = await asyncio.start_server(self._handler(rank), "127.0.0.1", 0, backlog=64)
            self.servers[rank.rank] = server
            ports[rank.rank] = server.sockets[0].getsockname()[1]
        self.conn.send(ports)
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, self.conn.recv)
            if command[0] == "nan":
                self.ranks[command[1]].nan_since = command[2]
            elif command[0] == "kill":  # the process dies: its port refuses, its connections drop
                server = self.servers.pop(command[1])
                server.close()
                for writer in getattr(self.ranks[command[1]], "writers", ()):
                    writer.close()
            elif command[0] == "stats":
                usage = os.times()
                self.conn.send({"scrapes": self.scrapes, "cpu_s": usage.user + usage.system})
            elif command[0] == "stop":
                for server in self.servers.values():
                    server.close()
                self.conn.send("stopped")
                return

    def _handler(self, rank: SyntheticRank):
        rank.writers = set()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if rank.rank not in self.servers:
                writer.close()
                return
            rank.writers.add(writer)
            try:
                while True:  # keep-alive: Prometheus reuses its connection
                    request = await reader.readuntil(b"\r\n\r\n")
                    if not request or rank.rank not in self.servers:
                        break
                    body = rank.render(time.time())
                    self.scrapes += 1
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                    )
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                pass
            finally:
                rank.writers.discard(writer)
                writer.close()

        return handle


def _farm_process(templates: dict[str, str], first: int, count: int, started: float, conn) -> None:
    asyncio.run(_FarmWorker(templates, first, count, started, conn).main())


class RankFarm:
    """N synthetic ranks, each on its own loopback port, served by ``processes`` worker
    processes (a listening socket and a connection per rank: ~2 file descriptors each)."""

    def __init__(self, templates: dict[str, str], ranks: int, processes: int = 1) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no copy of this process's threads or torch
        started = time.time()
        per = math.ceil(ranks / processes)
        self._workers = []
        for first in range(0, ranks, per):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_farm_process, args=(templates, first, min(per, ranks - first), started, child), daemon=True
            )
            proc.start()
            self._workers.append((first, min(per, ranks - first), proc, parent))
        self.ports: list[int] = [0] * ranks
        for *_, conn in self._workers:
            if not conn.poll(300):
                raise RuntimeError("the synthetic ranks did not start")
            for rank, port in conn.recv().items():
                self.ports[rank] = port

    def _worker(self, rank: int):
        return next(conn for first, count, _, conn in self._workers if first <= rank < first + count)

    def turn_nan(self, rank: int, at: float) -> None:
        self._worker(rank).send(("nan", rank, at))

    def kill(self, rank: int) -> None:
        self._worker(rank).send(("kill", rank))

    def stats(self) -> dict:
        out = {"scrapes": 0, "cpu_s": 0.0}
        for _, _, _, conn in self._workers:
            conn.send(("stats",))
            got = conn.recv()
            out["scrapes"] += got["scrapes"]
            out["cpu_s"] += got["cpu_s"]
        return out

    def close(self) -> None:
        for _, _, proc, conn in self._workers:
            try:
                conn.send(("stop",))
                conn.poll(30) and conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(30)
            if proc.is_alive():
                proc.kill()


# --- Prometheus -----------------------------------------------------------------------------


class Server:
    """One Prometheus of the set-up, from ``config`` (a dict), on a free loopback port."""

    def __init__(
        self, workdir: Path, name: str, config: dict, flags: tuple[str, ...] = (), data: Path | None = None
    ) -> None:
        import yaml

        from lossbeat.stack.local import find_binary

        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = data or workdir / f"{name}-data"
        (workdir / f"{name}.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        self.log = open(workdir / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [
                find_binary("prometheus"),
                f"--config.file={workdir / (name + '.yml')}",
                f"--storage.tsdb.path={self.data}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not _ok(f"{self.url}/-/ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} did not start:\n{tail}")
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=60) as resp:
            return json.load(resp)["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def own_metrics(self) -> dict[str, float]:
        """Prometheus' own /metrics: {name{labels}: value}."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=60) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m and not line.startswith("#"):
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def alerts(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=60) as resp:
            return json.load(resp)["data"]["alerts"]

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@dataclass(frozen=True)
class SetupFiles:
    """The files a set-up starts from: the checkout's, or another commit's (to compare)."""

    rules: Path = RULES
    shard_rules: Path = STAGE_RULES["shard"]
    global_rules: Path = STAGE_RULES["global"]
    sharding: Path = SHARDING

    @classmethod
    def at_commit(cls, commit: str, into: Path) -> SetupFiles:
        """The rule files and deploy/sharding configs of ``commit``, written under ``into``."""
        into.mkdir(parents=True, exist_ok=True)
        (into / "sharding").mkdir(exist_ok=True)
        wanted = {
            "rules.yml": "alerting/rules.yml",
            "rules-shard.yml": "alerting/rules-shard.yml",
            "rules-global.yml": "alerting/rules-global.yml",
            "sharding/shard-0.yml": "deploy/sharding/shard-0.yml",
            "sharding/global.yml": "deploy/sharding/global.yml",
        }
        for name, path in wanted.items():
            text = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
            ).stdout
            (into / name).write_text(text, encoding="utf-8")
        return cls(into / "rules.yml", into / "rules-shard.yml", into / "rules-global.yml", into / "sharding")

    def shipped(self, name: str) -> dict:
        import yaml

        return yaml.safe_load((self.sharding / name).read_text(encoding="utf-8"))


class Setup:
    """The Prometheus servers ``deploy/`` ships for the size: ``shards`` = 0, one Prometheus with
    ``alerting/rules.yml`` (deploy/local); else ``deploy/sharding``: that many shards (hashmod on
    the address, ``rules-shard.yml``) remote-writing to a global Prometheus (``rules-global.yml``).
    The shipped files, changed only where a loopback run must: addresses, the file_sd path, the
    interval, and no Alertmanager (alerts are read from each server's API)."""

    def __init__(
        self, workdir: Path, ports: list[int], shards: int, interval: float, files: SetupFiles = SetupFiles()
    ) -> None:
        import yaml

        self.interval = interval
        sd = workdir / "file_sd"
        sd.mkdir()
        (sd / "ranks.json").write_text(
            json.dumps([{"targets": [f"127.0.0.1:{p}" for p in ports], "labels": {"job": JOB}}]), encoding="utf-8"
        )
        timing = {
            "scrape_interval": f"{interval:g}s",
            "scrape_timeout": f"{min(interval, 10):g}s",
            "evaluation_interval": f"{interval:g}s",
        }
        self.servers: list[Server] = []
        self.shards: list[Server] = []
        self.global_server: Server | None = None
        try:
            if shards == 0:
                config = {
                    "global": timing,
                    "rule_files": [str(files.rules)],
                    "scrape_configs": [
                        {"job_name": JOB, "sample_limit": 2000, "file_sd_configs": [{"files": [str(sd / "*.json")]}]}
                    ],
                }
                self.shards.append(Server(workdir, "prometheus", config))
                self.servers = list(self.shards)
                return
            central = files.shipped("global.yml")
            central["global"].update(evaluation_interval=f"{interval:g}s")
            central["rule_files"] = [str(files.global_rules)]
            central.pop("alerting", None)
            self.global_server = Server(workdir, "global", central, ("--web.enable-remote-write-receiver",))
            self.servers.append(self.global_server)
            for i in range(shards):
                config = files.shipped("shard-0.yml")
                config["global"].update(timing)
                # Each shard its own copy: Prometheus offsets a group's evaluations within the
                # interval by a hash of its name and file path, so shards that load one path on
                # one host all evaluate each group at the same instant (on a cluster, each has
                # its own cores and it does not matter).
                rules_copy = workdir / f"shard-{i}" / "rules-shard.yml"
                rules_copy.parent.mkdir()
                rules_copy.write_text(files.shard_rules.read_text(encoding="utf-8"), encoding="utf-8")
                config["rule_files"] = [str(rules_copy)]
                config.pop("alerting", None)
                job = config["scrape_configs"][0]
                job["file_sd_configs"] = [{"files": [str(sd / "*.json")]}]
                hashmod, keep = job["relabel_configs"]
                hashmod["modulus"], keep["regex"] = shards, str(i)
                for relabel in config["remote_write"][0].get("write_relabel_configs", []):
                    if relabel.get("target_label") == "shard":  # its partials carry its number
                        relabel["replacement"] = str(i)
                config["remote_write"][0]["url"] = f"{self.global_server.url}/api/v1/write"
                config["remote_write"][0]["queue_config"]["batch_send_deadline"] = (
                    f"{max(1, min(5, int(interval / 3)))}s"
                )
                server = Server(workdir, f"shard-{i}", config)
                self.shards.append(server)
                self.servers.append(server)
            (workdir / "setup.yml").write_text(yaml.safe_dump({"shards": shards}), encoding="utf-8")
        except Exception:
            self.stop()
            raise

    @property
    def evaluator(self) -> Server:
        """Where the cross-rank alerts are evaluated."""
        return self.global_server or self.shards[0]

    def up(self) -> float:
        return sum(s.scalar(f'count(up{{job="{JOB}"}} == 1)') or 0 for s in self.shards)

    def wait_up(self, ranks: int) -> None:
        """Until every rank answers its shard (discovery hands targets to the scrapers after
        ~5 s); raises after six intervals, two minutes at least."""
        wait = max(120.0, 6 * self.interval)
        deadline = time.monotonic() + wait
        while self.up() < ranks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.up():.0f} of {ranks} ranks up within {wait:.0f}s")
            time.sleep(1.0)

    def shard_of(self, port: int) -> Server:
        for server in self.shards:
            if server.query(f'up{{instance="127.0.0.1:{port}"}}'):
                return server
        raise LookupError(port)

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def _log(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values) or [math.nan]
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1], "mean": sum(ordered) / len(ordered)}


def _firing(server: Server, alert: str, **labels: str) -> list[dict]:
    return [
        a
        for a in server.alerts()
        if a["labels"].get("alertname") == alert
        and a["state"] == "firing"
        and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def _wait_firing(server: Server, alert: str, deadline: float, **labels: str) -> float | None:
    """The activeAt of ``alert`` once it fires with ``labels`` (None at the deadline)."""
    while time.time() < deadline:
        firing = _firing(server, alert, **labels)
        if firing:
            return _parse_time(firing[0]["activeAt"])
        time.sleep(0.5)
    return None


def measure(
    ranks: int,
    warmup_cycles: int,
    templates: dict[str, str],
    interval: float = SCRAPE_INTERVAL,
    shards: int = 0,
    kill: bool = True,
    farm_processes: int = 1,
    rules: Path = RULES,
) -> dict:
    """One size: serve ``ranks`` ranks to the set-up, measure every server while it scrapes and
    evaluates, then turn one rank NaN (time to TrainingLossNaN) and kill another (TrainingRankDown)."""
    load = [os.getloadavg()[0]]
    farm = RankFarm(templates, ranks, farm_processes)
    _log(f"{ranks} ranks serving on ports {min(farm.ports)}..{max(farm.ports)} ({farm_processes} process(es))")
    with tempfile.TemporaryDirectory(prefix="lossbeat-scale-") as tmp:
        setup = Setup(Path(tmp), farm.ports, shards, interval, SetupFiles(rules=rules))
        try:
            setup.wait_up(ranks)  # measured from when all answer
            _log(f"all {ranks} up on {len(setup.shards)} shard(s)")
            started = time.time()
            cpu0 = {s.name: s.cpu_seconds() for s in setup.servers}
            farm0 = farm.stats()
            durations: dict[str, dict[str, list[float]]] = {s.name: {} for s in setup.servers}
            rss: dict[str, list[int]] = {s.name: [] for s in setup.servers}

            def sample() -> dict[str, dict[str, float]]:
                owns = {}
                for server in setup.servers:
                    own = owns[server.name] = server.own_metrics()
                    for key, value in own.items():
                        if key.startswith("prometheus_rule_group_last_duration_seconds{"):
                            group = re.search(r'rule_group="[^"]*;([^"]+)"', key).group(1)
                            durations[server.name].setdefault(group, []).append(value)
                    rss[server.name].append(server.rss())
                load.append(os.getloadavg()[0])
                return owns

            for cycle in range(warmup_cycles):
                time.sleep(interval)
                owns = sample()
                heads = sum(o.get("prometheus_tsdb_head_series", 0) for o in owns.values())
                _log(
                    f"cycle {cycle + 1}/{warmup_cycles}: {setup.up():.0f}/{ranks} up, head series {heads:.0f}, "
                    f"RSS {sum(v[-1] for v in rss.values()) / 2**20:.0f} MiB, load {load[-1]:.1f}"
                )
            scrape_durations, samples = [], []
            for server in setup.shards:
                scrape_durations += [
                    float(r["value"][1]) for r in server.query(f'scrape_duration_seconds{{job="{JOB}"}}')
                ]
                samples += [float(r["value"][1]) for r in server.query(f'scrape_samples_scraped{{job="{JOB}"}}')]
            intervals = max(
                (
                    v
                    for own in owns.values()
                    for k, v in own.items()
                    if k.startswith("prometheus_target_interval_length_seconds{") and 'quantile="0.99"' in k
                ),
                default=None,
            )

            victim = ranks // 2
            owner = setup.shard_of(farm.ports[victim])
            flip = time.time() + 0.01
            farm.turn_nan(victim, flip)
            _log(f"rank {victim} turns NaN (on {owner.name})")
            fired_at = _wait_firing(owner, "TrainingLossNaN", flip + 4 * interval + 30, rank=str(victim))
            sample()
            killed = None
            if kill:
                dead = ranks // 3 if ranks >= 3 else ranks - 1
                dead_owner = setup.shard_of(farm.ports[dead])
                killed_at = time.time()
                farm.kill(dead)
                _log(
                    f"rank {dead} killed (on {dead_owner.name}); waiting for TrainingRankDown on "
                    f"{setup.evaluator.name} and TrainingExporterDown on {dead_owner.name} (both for: 2m)"
                )
                where = {"TrainingRankDown": setup.evaluator, "TrainingExporterDown": dead_owner}
                found: dict[str, float | None] = dict.fromkeys(where)
                deadline, last_sample = killed_at + 240 + 8 * interval, time.time()
                while time.time() < deadline and None in found.values():
                    for alert, server in where.items():
                        if found[alert] is None and _firing(server, alert, rank=str(dead)):
                            found[alert] = round(_firing_time(server, alert, dead) - killed_at, 1)
                    if time.time() - last_sample >= interval:
                        sample()
                        last_sample = time.time()
                    time.sleep(1.0)
                killed = {
                    "rank": dead,
                    "shard": dead_owner.name,
                    "rank_down_firing_after_s": found["TrainingRankDown"],
                    "exporter_down_firing_after_s": found["TrainingExporterDown"],
                }
                _log(f"killed rank: {killed}")
            sample()
            elapsed = time.time() - started
            cpu = {s.name: (s.cpu_seconds() - cpu0[s.name]) / elapsed for s in setup.servers}
            farm1 = farm.stats()
            owns = {s.name: s.own_metrics() for s in setup.servers}
            alerts = [
                a
                for s in setup.servers
                for a in s.alerts()
                if a["labels"].get("alertname") not in ("TrainingLossNaN", "TrainingRankDown", "TrainingExporterDown")
            ]
            per_server = {}
            for server in setup.servers:
                own = owns[server.name]
                per_server[server.name] = {
                    "rule_group_duration_s": {
                        g: {"mean": sum(v) / len(v), "max": max(v), "samples": len(v)}
                        for g, v in sorted(durations[server.name].items())
                    },
                    "rule_iterations_missed": sum(
                        v for k, v in own.items() if k.startswith("prometheus_rule_group_iterations_missed_total")
                    ),
                    "head_series": own.get("prometheus_tsdb_head_series"),
                    "rss_bytes_max": max(rss[server.name]),
                    "cpu_cores": cpu[server.name],
                }
            shard_series = sum(per_server[s.name]["head_series"] or 0 for s in setup.shards)
            all_rss = sum(v["rss_bytes_max"] for v in per_server.values())
            result = {
                "ranks": ranks,
                "interval_s": interval,
                "setup": "one Prometheus, alerting/rules.yml"
                if shards == 0
                else f"deploy/sharding: {shards} shards (hashmod, rules-shard.yml) -> 1 global (rules-global.yml)",
                "shards": shards,
                "series_per_rank": {
                    "exposed_scalars": series_count(templates["scalars"]),
                    "exposed_with_layers": series_count(templates["layers"]),
                    "shards_head": shard_series / ranks,
                    "global_head": (per_server["global"]["head_series"] or 0) / ranks if shards else None,
                },
                "up": setup.up(),
                "scrape_duration_s": _quantiles(scrape_durations),
                "samples_per_scrape": _quantiles(samples),
                "target_interval_p99_s": intervals,
                "servers": per_server,
                "slowest_rule_group": max(
                    ((n, g, d["max"]) for n, v in per_server.items() for g, d in v["rule_group_duration_s"].items()),
                    key=lambda x: x[2],
                ),
                "rule_iterations_missed": sum(v["rule_iterations_missed"] for v in per_server.values()),
                "rss_bytes_total": all_rss,
                "rss_mib_per_1000_ranks": all_rss / 2**20 / ranks * 1000,
                "prometheus_cpu_cores_total": sum(cpu.values()),
                "farm_cpu_cores": (farm1["cpu_s"] - farm0["cpu_s"]) / elapsed,
                "farm_scrapes_served": farm1["scrapes"] - farm0["scrapes"],
                "measured_for_s": elapsed,
                "nan_to_firing_s": None if fired_at is None else max(0.0, fired_at - flip),
                "nan_rank_shard": owner.name,
                "killed": killed,
                "other_alerts": sorted({a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}),
                "pending_alerts": sorted({a["labels"]["alertname"] for a in alerts if a["state"] != "firing"}),
                "load_average_1m": {"min": min(load), "median": sorted(load)[len(load) // 2], "max": max(load)},
                "cpus": os.cpu_count(),
            }
            _log(json.dumps(result))
            return result
        finally:
            setup.stop()
            farm.close()


def _firing_time(server: Server, alert: str, rank: int) -> float:
    """When ``alert`` for ``rank`` started firing: its activeAt plus its ``for``."""
    firing = _firing(server, alert, rank=str(rank))
    for group in json.load(urllib.request.urlopen(f"{server.url}/api/v1/rules", timeout=60))["data"]["groups"]:
        for rule in group["rules"]:
            if rule.get("name") == alert:
                return _parse_time(firing[0]["activeAt"]) + float(rule.get("duration", 0))
    return _parse_time(firing[0]["activeAt"])


def _parse_time(text: str) -> float:
    from datetime import datetime

    text = re.sub(r"(\.\d{6})\d*", r"\1", text.replace("Z", "+00:00"))
    return datetime.fromisoformat(text).timestamp()


# --- the report --------------------------------------------------------------------------------


def report(results: list[dict]) -> str:
    """The docs tables: one row per run, then every server's rule groups for the largest run."""
    results = sorted(results, key=lambda r: (r["ranks"], r["shards"], r.get("rules", "")))
    rows = [
        "| ranks | set-up | interval (s) | up | slowest rule group, max (ms) | missed iterations | "
        "series per rank (shards / global) | RSS per 1,000 ranks (MiB) | Prometheus CPU (cores) | "
        "NaN to TrainingLossNaN (s) | kill to TrainingRankDown / ExporterDown firing (s) | load (1m) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        server, group, slow = r["slowest_rule_group"]
        per = r["series_per_rank"]
        series = f"{per['shards_head']:.1f}" + (f" / {per['global_head']:.1f}" if per.get("global_head") else "")
        nan = "-" if r["nan_to_firing_s"] is None else f"{r['nan_to_firing_s']:.1f}"
        k = r.get("killed") or {}
        kill = (
            f"{k.get('rank_down_firing_after_s') or '-'} / {k.get('exporter_down_firing_after_s') or '-'}"
            if k
            else "not run"
        )
        load = r["load_average_1m"]
        setup = f"{r['shards']} shards + global" if r["shards"] else "one Prometheus"
        if r.get("rules"):
            setup += " (full-lookback rules)"
        if r.get("label"):
            setup += f" ({r['label']})"
        rows.append(
            f"| {r['ranks']:,} | {setup} | "
            f"{r['interval_s']:g} | {r['up']:.0f} | {1e3 * slow:.0f} ({server} {group}) | "
            f"{r['rule_iterations_missed']:.0f} | {series} | {r['rss_mib_per_1000_ranks']:.0f} | "
            f"{r['prometheus_cpu_cores_total']:.2f} | {nan} | {kill} | "
            f"{load['min']:.1f}-{load['max']:.1f} |"
        )
    largest = max(results, key=lambda r: (r["ranks"], r.get("date", "")))  # the latest of the largest
    lines = rows + [
        "",
        f"Every rule group of every server, {largest['ranks']:,} ranks (max / mean over the run, ms):",
        "",
        "| server | head series | RSS (MiB) | CPU (cores) | rule groups |",
        "|---|---|---|---|---|",
    ]
    for name, server in largest["servers"].items():
        groups = ", ".join(
            f"{g} {1e3 * d['max']:.0f} / {1e3 * d['mean']:.0f}" for g, d in server["rule_group_duration_s"].items()
        )
        lines.append(
            f"| {name} | {server['head_series']:,.0f} | {server['rss_bytes_max'] / 2**20:,.0f} | "
            f"{server['cpu_cores']:.2f} | {groups} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, action="append", help="synthetic ranks (repeatable)")
    parser.add_argument(
        "--shards",
        type=int,
        default=None,
        help="0: one Prometheus with rules.yml; N: deploy/sharding with N shards "
        "(default: 0 up to 2,000 ranks, else one shard per 1,250 ranks)",
    )
    parser.add_argument("--warmup-cycles", type=int, default=6, help="scrape intervals before the NaN (default 6)")
    parser.add_argument(
        "--interval", type=float, default=SCRAPE_INTERVAL, help="scrape and evaluation interval in seconds (default 15)"
    )
    parser.add_argument("--no-kill", action="store_true", help="skip the killed rank (TrainingRankDown, ~3 min)")
    parser.add_argument(
        "--farm-processes",
        type=int,
        default=None,
        help="processes serving the ranks (default: one per 4,000 ranks; each holds two file descriptors a rank)",
    )
    parser.add_argument(
        "--rules",
        type=Path,
        default=RULES,
        help="the rules of the one-Prometheus set-up (default alerting/rules.yml; another commit's, to compare)",
    )
    parser.add_argument("--results", default=str(RESULTS), help="JSON file the results are merged into")
    parser.add_argument(
        "--label",
        help="a name for this run in the tables (a run replaces the stored one of the "
        "same ranks, shards, interval and label)",
    )
    parser.add_argument("--report", action="store_true", help="print the markdown tables of the stored results")
    args = parser.parse_args(argv)
    path = Path(args.results)
    stored = json.loads(path.read_text()) if path.exists() else {"runs": []}
    stored.setdefault("runs", [])
    if args.report:
        print(report(stored["runs"]), end="")
        return 0
    if not args.ranks:
        parser.error("--ranks N (or --report)")
    _log("rendering real expositions (TinyLM 10M, 12 steps)")
    templates = real_expositions(world_size=max(args.ranks))
    versions = subprocess.run([_prometheus(), "--version"], capture_output=True, text=True).stdout.splitlines()
    for ranks in args.ranks:
        shards = args.shards if args.shards is not None else (0 if ranks <= 2000 else math.ceil(ranks / 1250))
        processes = args.farm_processes or max(1, math.ceil(ranks / 4000))
        # world_size in training_run_info is the size of this run's job.
        sized = {k: v.replace(f'world_size="{max(args.ranks)}"', f'world_size="{ranks}"') for k, v in templates.items()}
        result = measure(
            ranks,
            args.warmup_cycles,
            sized,
            args.interval,
            shards,
            kill=not args.no_kill,
            farm_processes=processes,
            rules=args.rules,
        )
        if args.rules != RULES:
            result["rules"] = str(args.rules)
        result["prometheus_version"] = versions[0] if versions else "unknown"
        result["date"] = time.strftime("%Y-%m-%d %H:%M")
        result["commit"] = _commit()
        if args.label:
            result["label"] = args.label
        key = lambda r: (r["ranks"], r.get("shards"), r["interval_s"], r.get("label"))  # noqa: E731
        stored["runs"] = [r for r in stored["runs"] if key(r) != key(result)] + [result]
        path.write_text(json.dumps(stored, indent=2) + "\n")
    print(report(stored["runs"]), end="")
    return 0


def _commit() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes): which rules a run measured."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def _prometheus() -> str:
    from lossbeat.stack.local import find_binary

    return find_binary("prometheus")


if __name__ == "__main__":
    sys.exit(main())
