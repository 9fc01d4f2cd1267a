"""Soak: memory, threads and open file descriptors stay flat over a long run with scrapes.

The suite runs a bounded soak (LOSSBEAT_SOAK_SECONDS, default 25 s); docs/reliability.md
quotes a long one (LOSSBEAT_SOAK_SECONDS=600 LOSSBEAT_SOAK_REPORT=soak.json).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from lossbeat import Monitor, MonitorConfig

SCRAPERS = Path(__file__).resolve().parent / "workers" / "scrapers.py"
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resources() -> dict[str, float]:
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * _PAGE
    threads = [t.name for t in threading.enumerate()]
    return {
        "rss_mb": rss / 2**20,
        "fds": len(os.listdir("/proc/self/fd")),
        # Connection threads come and go with scrapes; the monitor's own threads must not grow.
        "threads": sum("process_request_thread" not in name for name in threads),
        "connection_threads": sum("process_request_thread" in name for name in threads),
    }


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


def test_soak_resources_stay_flat():
    seconds = float(os.environ.get("LOSSBEAT_SOAK_SECONDS", "25"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    samples: list[tuple[float, dict]] = []
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", run_name="soak")) as monitor:
        scrapers = subprocess.Popen(
            [sys.executable, str(SCRAPERS), str(monitor.port), "4", str(seconds), "0.2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        start = time.monotonic()
        next_sample, step = start, 0
        while time.monotonic() - start < seconds:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            # Every kind of step: NaN losses, evaluations, changing learning rates.
            monitor.observe(
                step,
                loss=math.nan if step % 97 == 0 else loss,
                optimizer=optimizer,
                model=model,
                tokens=32,
                losses={"mse": loss},
                epoch=step / 1000,
            )
            if step % 50 == 0:
                monitor.observe_eval(step, float(loss) * 1.1)
            optimizer.step()
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * (1 + math.cos(step / 100)) / 2
            step += 1
            if time.monotonic() >= next_sample:
                samples.append((time.monotonic() - start, resources()))
                next_sample += max(seconds / 50, 0.5)
        out, err = scrapers.communicate(timeout=120)
        errors = dict(monitor.state.errors)
    scrape = json.loads(out)

    warm = [s for t, s in samples if t >= seconds * 0.3]  # after warm-up: allocator pools, first regroup
    first, last = warm[0], warm[-1]
    report = {
        "seconds": seconds,
        "steps": step,
        "scrapes": scrape["scrapes"],
        "rss_mb": [round(first["rss_mb"], 1), round(last["rss_mb"], 1)],
        "rss_slope_mb_per_min": slope_per_minute([(t, s["rss_mb"]) for t, s in samples if t >= seconds * 0.3]),
        "threads": [first["threads"], last["threads"]],
        "fds": [min(s["fds"] for s in warm[:5]), min(s["fds"] for s in warm[-5:])],
        "max_connection_threads": max(s["connection_threads"] for _, s in samples),
        "exporter_errors": errors,
    }
    if os.environ.get("LOSSBEAT_SOAK_REPORT"):
        Path(os.environ["LOSSBEAT_SOAK_REPORT"]).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))

    assert scrape["failure_count"] == 0 and scrape["backwards"] == [], scrape
    assert sum(errors.values()) == 0, errors
    assert last["threads"] == first["threads"], report
    assert report["fds"][1] <= report["fds"][0] + 2, report
    assert report["max_connection_threads"] <= 8, report
    assert last["rss_mb"] - first["rss_mb"] < 8.0, report
