"""What a real Prometheus pays for N ranks with lossbeat's shipped rules, measured.

    python benchmarks/scale.py --ranks 1000              # one size: about 3 minutes on 2 cores
    python benchmarks/scale.py --ranks 250 --ranks 500   # several sizes, one after the other
    python benchmarks/scale.py --report                  # docs tables from benchmarks/scale_results.json

One process (this one) serves the expositions of N synthetic ranks, one HTTP target per rank
on loopback ports (asyncio, keep-alive). The expositions are real: a 10M-parameter TinyLM
trains a few steps under two real Monitors (global rank 0, which exports per-layer norms, and
rank 1, scalars only), and their rendered text is the template; every scrape re-renders the
changing values (step, counters, loss with per-rank noise, grad norms, timestamps), so the
TSDB compresses what a real run gives it, not constants. A real Prometheus scrapes every
target at 15 s with alerting/rules.yml loaded (evaluated every 15 s). After a warm-up, one rank
turns NaN and the time until TrainingLossNaN fires is measured from the first exposition
that shows it to the alert's activeAt.

Reported per size: scrape duration (quantiles over targets), rule-group evaluation time
(prometheus_rule_group_last_duration_seconds, sampled every scrape interval), missed rule
iterations, head series, Prometheus RSS, and the NaN-to-firing time. ``--report`` fits
every measure linearly in N over the measured sizes (least squares) and extrapolates to
10,000 ranks; docs/scale.md quotes it.
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
import threading
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
    monitors = {rank: Monitor(MonitorConfig(port=0, run_name="scale"), serve=False,
                              rank_context=RankContext(rank, rank % 8, world_size)) for rank in (0, 1)}
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
_MOVING = ("training_loss", "training_grad_norm", "training_layer_grad_norm", "training_loss_cv",
           "training_step_duration_seconds", "training_loss_trend_ratio", "training_memory_allocated_bytes",
           "training_learning_rate")
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


class RankFarm:
    """N synthetic ranks, each on its own loopback port, served by one asyncio loop on a thread."""

    def __init__(self, templates: dict[str, str], ranks: int) -> None:
        started = time.time()
        self.ranks = [SyntheticRank(templates["layers" if r == 0 else "scalars"], r, started, seed=r)
                      for r in range(ranks)]
        self.ports: list[int] = []
        self.scrapes = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("the synthetic ranks did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self._servers = []
        for rank in self.ranks:
            server = await asyncio.start_server(self._handler(rank), "127.0.0.1", 0, backlog=16)
            self._servers.append(server)
            self.ports.append(server.sockets[0].getsockname()[1])

    def _handler(self, rank: SyntheticRank):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:  # keep-alive: Prometheus reuses its connection
                    request = await reader.readuntil(b"\r\n\r\n")
                    if not request:
                        break
                    body = rank.render(time.time())
                    self.scrapes += 1
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                pass
            finally:
                writer.close()
        return handle

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


# --- Prometheus -----------------------------------------------------------------------------


class Server:
    def __init__(self, workdir: Path, ports: list[int], rules: Path, interval: float) -> None:
        from lossbeat.stack.local import find_binary
        import yaml

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{interval:g}s", "scrape_timeout": f"{min(interval, 10):g}s",
                       "evaluation_interval": f"{interval:g}s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{
                "job_name": "scale",
                "sample_limit": 5000,
                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}],
            }],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [find_binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not _ok(f"{self.url}/-/ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not start; see " + str(workdir / "prometheus.log"))
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            return json.load(resp)["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def own_metrics(self) -> dict[str, float]:
        """Prometheus' own /metrics: {name{labels}: value}."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m and not line.startswith("#"):
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def alerts(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=30) as resp:
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
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


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


def measure(ranks: int, warmup_cycles: int, rules: Path, templates: dict[str, str],
            interval: float = SCRAPE_INTERVAL) -> dict:
    """One size: serve ``ranks`` ranks, let Prometheus scrape and evaluate, measure, turn one NaN."""
    farm = RankFarm(templates, ranks)
    _log(f"{ranks} ranks serving on ports {farm.ports[0]}..{farm.ports[-1]}")
    with tempfile.TemporaryDirectory(prefix="lossbeat-scale-") as tmp:
        server = Server(Path(tmp), farm.ports, rules, interval)
        try:
            # Discovery hands targets to the scrapers after ~5 s; measure from when all answer.
            deadline = time.monotonic() + max(60.0, 4 * interval)
            while (server.scalar('count(up{job="scale"} == 1)') or 0) < ranks:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not every rank was scraped within {max(60.0, 4 * interval):.0f}s")
                time.sleep(0.5)
            started = time.time()
            cpu0 = server.cpu_seconds()
            group_durations: dict[str, list[float]] = {}
            rss: list[int] = []
            for cycle in range(warmup_cycles):
                time.sleep(interval)
                own = server.own_metrics()
                for key, value in own.items():
                    if key.startswith("prometheus_rule_group_last_duration_seconds{"):
                        group = re.search(r'rule_group="[^"]*;([^"]+)"', key).group(1)
                        group_durations.setdefault(group, []).append(value)
                rss.append(server.rss())
                up = server.scalar('count(up{job="scale"} == 1)') or 0
                _log(f"cycle {cycle + 1}/{warmup_cycles}: {up:.0f}/{ranks} up, head series "
                     f"{own.get('prometheus_tsdb_head_series', 0):.0f}, RSS {rss[-1] / 2**20:.0f} MiB")
            elapsed = time.time() - started
            cpu = server.cpu_seconds() - cpu0
            own = server.own_metrics()
            durations = [float(r["value"][1]) for r in server.query('scrape_duration_seconds{job="scale"}')]
            samples = [float(r["value"][1]) for r in server.query('scrape_samples_scraped{job="scale"}')]
            up = server.scalar('count(up{job="scale"} == 1)') or 0
            missed = sum(v for k, v in own.items() if k.startswith("prometheus_rule_group_iterations_missed_total"))
            intervals = max((v for k, v in own.items() if k.startswith("prometheus_target_interval_length_seconds{")
                             and 'quantile="0.99"' in k), default=None)

            victim = ranks // 2
            flip = time.time() + 0.01
            farm.ranks[victim].nan_since = flip
            _log(f"rank {victim} turns NaN")
            fired_at = None
            deadline = flip + 4 * interval
            while time.time() < deadline:
                firing = [a for a in server.alerts() if a["labels"].get("alertname") == "TrainingLossNaN"
                          and a["labels"].get("rank") == str(victim) and a["state"] == "firing"]
                if firing:
                    fired_at = _parse_time(firing[0]["activeAt"])
                    break
                time.sleep(0.25)
            alerts = [a for a in server.alerts() if a["labels"].get("alertname") != "TrainingLossNaN"]
            others = sorted({a["labels"]["alertname"] for a in alerts if a["state"] == "firing"})
            pending = sorted({a["labels"]["alertname"] for a in alerts if a["state"] != "firing"})
            result = {
                "ranks": ranks,
                "interval_s": interval,
                "series_per_rank": {"scalars": series_count(templates["scalars"]),
                                    "with_layers": series_count(templates["layers"])},
                "up": up,
                "scrape_duration_s": _quantiles(durations),
                "samples_per_scrape": _quantiles(samples),
                "target_interval_p99_s": intervals,
                "rule_group_duration_s": {g: {"mean": sum(v) / len(v), "max": max(v)}
                                          for g, v in sorted(group_durations.items())},
                "rule_groups_total_s": sum(max(v) for v in group_durations.values()),
                "rule_iterations_missed": missed,
                "head_series": own.get("prometheus_tsdb_head_series"),
                "rss_bytes": max(rss),
                "prometheus_cpu_cores": cpu / elapsed,
                "measured_for_s": elapsed,
                "nan_to_firing_s": None if fired_at is None else max(0.0, fired_at - flip),
                "other_alerts": others,
                "pending_alerts": pending,
                "farm_scrapes_served": farm.scrapes,
                "load_average_1m": os.getloadavg()[0],
            }
            _log(json.dumps(result))
            return result
        finally:
            server.stop()
            farm.close()


def _parse_time(text: str) -> float:
    from datetime import datetime
    text = re.sub(r"(\.\d{6})\d*", r"\1", text.replace("Z", "+00:00"))
    return datetime.fromisoformat(text).timestamp()


# --- the report --------------------------------------------------------------------------------


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    n = len(xs)
    if n == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _mean_total(result: dict) -> float:
    return sum(g["mean"] for g in result["rule_group_duration_s"].values())


def report(results: list[dict]) -> str:
    results = sorted(results, key=lambda r: r["ranks"])
    rows = ["| ranks | up | scrape p50 / p99 / max (ms) | rule groups, sum of mean / max (ms) | slowest group (ms) | "
            "missed iterations | head series | RSS (MiB) | Prometheus CPU (cores) | NaN to firing (s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["scrape_duration_s"]
        slow_group, slow = max(r["rule_group_duration_s"].items(), key=lambda kv: kv[1]["max"])
        nan = "-" if r["nan_to_firing_s"] is None else f"{r['nan_to_firing_s']:.1f}"
        rows.append(f"| {r['ranks']:,} | {r['up']:.0f} | {1e3 * s['p50']:.1f} / {1e3 * s['p99']:.1f} / "
                    f"{1e3 * s['max']:.1f} | {1e3 * _mean_total(r):.0f} / {1e3 * r['rule_groups_total_s']:.0f} | "
                    f"{1e3 * slow['max']:.0f} "
                    f"({slow_group}) | {r['rule_iterations_missed']:.0f} | {r['head_series']:,.0f} | "
                    f"{r['rss_bytes'] / 2**20:.0f} | {r['prometheus_cpu_cores']:.2f} | {nan} |")
    lines = rows + [""]
    xs = [r["ranks"] for r in results]
    measures = {
        "head series": ([r["head_series"] for r in results], "{:,.0f}"),
        "RSS (MiB)": ([r["rss_bytes"] / 2**20 for r in results], "{:,.0f}"),
        "rule groups, sum of mean (ms)": ([1e3 * _mean_total(r) for r in results], "{:,.0f}"),
        "Prometheus CPU (cores)": ([r["prometheus_cpu_cores"] for r in results], "{:.2f}"),
    }
    lines += ["| measure | fit a + b x N | at 10,000 ranks |", "|---|---|---|"]
    for name, (ys, fmt) in measures.items():
        a, b = _fit(xs, ys)
        lines.append(f"| {name} | {a:.4g} + {b:.4g} x N | {fmt.format(a + b * 10_000)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, action="append", help="synthetic ranks (repeatable)")
    parser.add_argument("--warmup-cycles", type=int, default=6, help="scrape intervals before the NaN (default 6)")
    parser.add_argument("--rules", default=str(REPO / "alerting" / "rules.yml"))
    parser.add_argument("--interval", type=float, default=SCRAPE_INTERVAL,
                        help="scrape and evaluation interval in seconds (default 15)")
    parser.add_argument("--results", default=str(RESULTS), help="JSON file the results are merged into")
    parser.add_argument("--report", action="store_true", help="print the markdown tables of the stored results")
    args = parser.parse_args(argv)
    path = Path(args.results)
    stored = json.loads(path.read_text()) if path.exists() else {"runs": []}
    if args.report:
        print(report(stored["runs"]), end="")
        return 0
    if not args.ranks:
        parser.error("--ranks N (or --report)")
    _log("rendering real expositions (TinyLM 10M, 12 steps)")
    templates = real_expositions(world_size=max(args.ranks))
    for ranks in args.ranks:
        # world_size in training_run_info is the size of this run's job.
        sized = {k: v.replace(f'world_size="{max(args.ranks)}"', f'world_size="{ranks}"') for k, v in templates.items()}
        result = measure(ranks, args.warmup_cycles, Path(args.rules), sized, args.interval)
        stored["runs"] = [r for r in stored["runs"] if r["ranks"] != ranks] + [result]
        path.write_text(json.dumps(stored, indent=2) + "\n")
    print(report(stored["runs"]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
