"""Latency of ``lossbeat watch``, measured: from a line written to a log to (1) the value changing
in ``/metrics`` and (2) the alert firing in a real Prometheus.

(1) A real watcher (default poll interval) follows a real file; this process appends one HF
Trainer dict at a time, flushes it, and scrapes ``/metrics`` over HTTP back to back until
``training_step`` shows the new record. The figure includes one scrape's own time.

(2) A real Prometheus (Debian's, through :class:`lossbeat.stack.local.Stack`) on the shipped
rules, scraping and evaluating every ``--scrape-interval`` seconds, scrapes ``--alert-rounds``
watchers, each following its own healthy log under its own job.
One at a time (spread over the scrape cycle), a NaN line is written to one log; the figure is
the time from the write to the ``activeAt`` Prometheus reports for that job's
``TrainingLossNaN`` (no ``for``: it fires at the evaluation that first sees the NaN), against
the bound of one scrape plus one evaluation interval.

Writes ``benchmarks/watch_latency.json`` and prints a markdown table.

    PYTHONPATH=exporter python benchmarks/watch_latency.py [--rounds 30] [--alert-rounds 10]
        [--scrape-interval 1 5] [--poll-interval 0.05]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from lossbeat.exposition.server import RankContext
from lossbeat.monitor import MonitorConfig
from lossbeat.watch import Watcher

OUT = Path(__file__).resolve().parent / "watch_latency.json"


def _hf_line(i: int, loss: str | None = None) -> str:
    loss = loss or f"{2.0 - i / 1000:.4f}"
    return f"{{'loss': {loss}, 'grad_norm': 1.0, 'learning_rate': 1e-4, 'epoch': {i / 100}}}\n"


def _step(port: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("training_step{") or line.startswith("training_step "):
                return float(line.rsplit(" ", 1)[1])
    return None


def _summary(seconds: list[float]) -> dict:
    ms = sorted(x * 1000 for x in seconds)
    return {
        "median_ms": round(statistics.median(ms), 1),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1),
        "max_ms": round(ms[-1], 1),
        "min_ms": round(ms[0], 1),
    }


class _Watch:
    """A Watcher following ``log`` in a thread of this process, serving on a free port."""

    def __init__(self, log: Path, poll_interval: float, job: str = "latency") -> None:
        config = MonitorConfig(port=0, addr="127.0.0.1", run_name=job, linger_seconds=0)
        self.watcher = Watcher(
            log, config, fmt="hf-stdout", poll_interval=poll_interval, rank_context=RankContext(0, 0, 1, "log")
        )
        self.thread = threading.Thread(target=self.watcher.run, daemon=True)
        self.thread.start()
        self.port = self.watcher.monitor.port

    def stop(self) -> None:
        self.watcher.stop()
        self.thread.join(30)


def measure_metrics(rounds: int, poll_interval: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "train.log"
        with open(log, "w", encoding="utf-8") as fh:
            watch = _Watch(log, poll_interval)
            latencies = []
            for i in range(1, rounds + 1):
                time.sleep(poll_interval * 1.37)  # spread the writes over the poll cycle
                written = time.perf_counter()
                fh.write(_hf_line(i))
                fh.flush()
                while _step(watch.port) != i:
                    pass
                latencies.append(time.perf_counter() - written)
            watch.stop()
    return {
        "what": "line written (flushed) to the value changing in /metrics, scraped over HTTP back to back",
        "rounds": rounds,
        "poll_interval_s": poll_interval,
        **_summary(latencies),
        "target_ms": 1000,
        "meets_target": _summary(latencies)["p90_ms"] < 1000,
    }


def _active_at(prometheus: str, job: str) -> float | None:
    """When Prometheus's TrainingLossNaN for ``job`` became active (and, without ``for``, fired)."""
    with urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=5) as resp:
        alerts = json.load(resp)["data"]["alerts"]
    for alert in alerts:
        if (
            alert["labels"].get("alertname") == "TrainingLossNaN"
            and alert["labels"].get("job") == job
            and alert["state"] == "firing"
        ):
            stamp = alert["activeAt"].rstrip("Z")
            whole, _, frac = stamp.partition(".")
            parsed = datetime.datetime.fromisoformat(f"{whole}.{(frac + '000000')[:6]}+00:00")
            return parsed.timestamp()
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _query(prometheus: str, expr: str) -> list:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)["data"]["result"]


def measure_alert(rounds: int, scrape_interval: float, poll_interval: float) -> dict:
    from lossbeat.stack.local import Stack, write_target_groups

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        interval = f"{scrape_interval:g}s"
        stack = Stack(
            workdir=tmp / "stack",
            prometheus_port=_free_port(),
            alertmanager_port=_free_port(),
            targets=(),
            scrape_interval=interval,
        )
        stack.start()
        logs, watches = [], []
        try:
            for i in range(rounds):
                logs.append(open(tmp / f"train-{i}.log", "w", encoding="utf-8"))
                watches.append(_Watch(tmp / f"train-{i}.log", poll_interval, job=f"latency-{i}"))
            write_target_groups(
                stack.targets_file,
                [
                    {"targets": [f"127.0.0.1:{w.port}"], "labels": {"job": f"latency-{i}"}}
                    for i, w in enumerate(watches)
                ],
            )
            for step in range(1, 4):  # a few healthy records each, scraped before any NaN
                for fh in logs:
                    fh.write(_hf_line(step))
                    fh.flush()
            deadline = time.monotonic() + 120
            while len(_query(stack.prometheus_url, 'training_step{job=~"latency-.*"} == 3')) < rounds:
                if time.monotonic() > deadline:
                    raise RuntimeError("Prometheus did not scrape every watcher within 120 s")
                time.sleep(0.2)
            latencies, seen = [], []
            for i, fh in enumerate(logs):
                time.sleep(scrape_interval * 0.37)  # each write at another point of the scrape cycle
                written = time.time()
                fh.write(_hf_line(4, "nan"))
                fh.flush()
                while (active := _active_at(stack.prometheus_url, f"latency-{i}")) is None:
                    if time.time() - written > 60:
                        raise RuntimeError(f"TrainingLossNaN for latency-{i} not firing 60 s after the NaN")
                    time.sleep(0.05)
                latencies.append(active - written)
                seen.append(time.time() - written)
        finally:
            for w in watches:
                w.stop()
            for fh in logs:
                fh.close()
            stack.stop()
    bound = 2 * scrape_interval  # one scrape interval plus one evaluation interval (equal here)
    return {
        "what": "line written (flushed) to TrainingLossNaN firing in a real Prometheus (its activeAt), shipped rules",
        "rounds": rounds,
        "scrape_interval_s": scrape_interval,
        "evaluation_interval_s": scrape_interval,
        **_summary(latencies),
        "seen_by_api_poll_median_ms": round(statistics.median(seen) * 1000, 1),
        "target_ms": round(bound * 1000),
        "meets_target": max(latencies) < bound,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--alert-rounds", type=int, default=10, help="0: skip the Prometheus measurement")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        nargs="+",
        default=[1.0, 5.0],
        help="Prometheus scrape and evaluation intervals to measure, seconds (default 1 5)",
    )
    parser.add_argument("--poll-interval", type=float, default=0.05)
    args = parser.parse_args()
    result = {"metrics": measure_metrics(args.rounds, args.poll_interval)}
    if args.alert_rounds:
        result["alert"] = [
            measure_alert(args.alert_rounds, interval, args.poll_interval) for interval in args.scrape_interval
        ]
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print("| from a line written to | rounds | median | p90 | max | target |\n|---|---|---|---|---|---|")
    rows = [("the value in /metrics", result["metrics"])]
    rows += [
        (f"TrainingLossNaN firing in Prometheus (scrape and evaluation every {r['scrape_interval_s']:g} s)", r)
        for r in result.get("alert", [])
    ]
    for what, r in rows:
        print(
            f"| {what} | {r['rounds']} | {r['median_ms']} ms | {r['p90_ms']} ms | {r['max_ms']} ms | "
            f"< {r['target_ms']} ms: {'pass' if r['meets_target'] else 'MISS'} |"
        )


if __name__ == "__main__":
    main()
