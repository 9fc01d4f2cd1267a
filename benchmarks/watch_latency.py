"""Latency of ``lossbeat watch``: from a line written to a log to the value changing in ``/metrics``.

A real watcher (default poll interval) follows a real file; this process appends one HF
Trainer dict at a time, flushes it, and scrapes ``/metrics`` over HTTP back to back until
``training_step`` shows the new record. The figure includes one scrape's own time (the
first scrape that sees the value). Writes ``benchmarks/watch_latency.json`` and prints a
markdown table.

    PYTHONPATH=exporter python benchmarks/watch_latency.py [--rounds 30] [--poll-interval 0.05]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from lossbeat.monitor import MonitorConfig
from lossbeat.watch import Watcher

OUT = Path(__file__).resolve().parent / "watch_latency.json"


def _step(port: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("training_step{") or line.startswith("training_step "):
                return float(line.rsplit(" ", 1)[1])
    return None


def measure(rounds: int, poll_interval: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "train.log"
        fh = open(log, "w", encoding="utf-8")
        cfg = MonitorConfig(port=0, addr="127.0.0.1", run_name="latency", linger_seconds=0)
        watcher = Watcher(log, cfg, fmt="hf-stdout", poll_interval=poll_interval)
        thread = threading.Thread(target=watcher.run, daemon=True)
        thread.start()
        while watcher.monitor.port is None:
            time.sleep(0.01)
        port = watcher.monitor.port
        latencies = []
        for i in range(1, rounds + 1):
            time.sleep(poll_interval * 1.37)  # spread the writes over the poll cycle
            written = time.perf_counter()
            fh.write(f"{{'loss': {2.0 - i / 1000:.4f}, 'grad_norm': 1.0, 'learning_rate': 1e-4, 'epoch': {i / 100}}}\n")
            fh.flush()
            while _step(port) != i:
                pass
            latencies.append(time.perf_counter() - written)
        watcher.stop()
        thread.join(30)
        fh.close()
    ms = sorted(x * 1000 for x in latencies)
    return {
        "what": "line written (flushed) to the value changing in /metrics, scraped over HTTP back to back",
        "rounds": rounds, "poll_interval_s": poll_interval,
        "median_ms": round(statistics.median(ms), 1), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1),
        "max_ms": round(ms[-1], 1), "min_ms": round(ms[0], 1),
        "target_ms": 1000, "meets_target": ms[int(0.9 * (len(ms) - 1))] < 1000,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--poll-interval", type=float, default=0.05)
    args = parser.parse_args()
    result = measure(args.rounds, args.poll_interval)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print("| rounds | poll interval | median | p90 | max | target |\n|---|---|---|---|---|---|")
    print(f"| {result['rounds']} | {result['poll_interval_s'] * 1000:.0f} ms | {result['median_ms']} ms | "
          f"{result['p90_ms']} ms | {result['max_ms']} ms | < 1000 ms: "
          f"{'pass' if result['meets_target'] else 'MISS'} |")


if __name__ == "__main__":
    main()
