"""/metrics at scrape time: render cost by layer count, and training while being scraped."""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request

import torch
from prometheus_client import generate_latest

from lossbeat.exposition.render import bake
from lossbeat.monitor import Monitor, MonitorConfig

from .models import Workload
from .overhead import train_step
from .variants import LossbeatVariant

__all__ = ["layered_model", "measure_render", "measure_scrape_overhead"]


def layered_model(layers: int) -> torch.nn.Module:
    """N tiny Linear layers in a row, with gradients: N per-layer series, little else."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(layers)))
    model(torch.randn(2, 4)).square().mean().backward()
    return model


OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
"""What Prometheus asks for (prometheus_client answers it with OpenMetrics)."""


def measure_render(layer_counts: tuple[int, ...], repeats: int) -> list[dict]:
    """Median time and body size of what /metrics serves (``lossbeat.exposition.render.bake``,
    the text format; OpenMetrics, what Prometheus asks for, beside it) with each layer count's
    series present, and ``generate_latest``'s, which formats every sample, for comparison."""
    results = []
    for layers in layer_counts:
        model = layered_model(layers)
        monitor = Monitor(MonitorConfig(port=0, max_layers=max(1000, layers), log_status_changes=False), serve=False)
        observe_s = []
        for step in range(5):
            start = time.perf_counter()
            monitor.observe(step, loss=1.0, learning_rate=1e-3, model=model)
            observe_s.append(time.perf_counter() - start)
        series = len(monitor.state.layer_norms)
        body = bake(monitor.registry, None, None)[2]
        render_s, openmetrics_s, generic_s = [], [], []
        for _ in range(repeats):  # interleaved: the three see the same machine
            for accept, times in ((None, render_s), (OPENMETRICS, openmetrics_s)):
                start = time.perf_counter()
                bake(monitor.registry, accept, None)
                times.append(time.perf_counter() - start)
            start = time.perf_counter()
            generate_latest(monitor.registry)
            generic_s.append(time.perf_counter() - start)
        monitor.close()
        results.append(
            {
                "layers": layers,
                "layer_series": series,
                "render_ms": statistics.median(render_s) * 1e3,
                "render_ms_p90": sorted(render_s)[int(0.9 * (len(render_s) - 1))] * 1e3,
                "render_ms_openmetrics": statistics.median(openmetrics_s) * 1e3,
                "generate_latest_ms": statistics.median(generic_s) * 1e3,
                "bytes": len(body),
                "observe_model_ms": statistics.median(observe_s[1:]) * 1e3,
            }
        )
    return results


class _Scraper(threading.Thread):
    """GETs /metrics every ``interval`` seconds while ``enabled`` is set."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.enabled, self.stopped = threading.Event(), threading.Event()
        self.latencies: list[float] = []
        self.failures = 0

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.enabled.wait(0.05) and not self.stopped.is_set():
                start = time.perf_counter()
                try:
                    with urllib.request.urlopen(self.url, timeout=5) as response:
                        response.read()
                    self.latencies.append(time.perf_counter() - start)
                except OSError:
                    self.failures += 1
                self.stopped.wait(self.interval)


def measure_scrape_overhead(workload: Workload, rounds: int, block_seconds: float, interval: float = 1.0) -> dict:
    """lossbeat per-layer every step, served on 127.0.0.1, scraped or not, in alternating blocks."""
    variant = LossbeatVariant("lossbeat_layers_every_step", "", per_layer=True)
    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1", log_status_changes=False))
    variant.monitor = monitor
    scraper = _Scraper(f"http://127.0.0.1:{monitor.port}/metrics", interval)
    scraper.start()
    step = 0
    for _ in range(3):  # warm-up: builds the layer grouping
        train_step(workload, variant, step)
        step += 1
    per_block: dict[bool, list[float]] = {False: [], True: []}
    try:
        for round_index in range(rounds):
            for scraped in (False, True) if round_index % 2 == 0 else (True, False):
                scraper.enabled.set() if scraped else scraper.enabled.clear()
                start, steps = time.perf_counter(), 0
                while time.perf_counter() - start < block_seconds or steps < 3:
                    train_step(workload, variant, step)
                    step, steps = step + 1, steps + 1
                per_block[scraped].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        scraper.stopped.set()
        scraper.enabled.set()
        scraper.join(timeout=10)
        monitor.close()
    ratios = [s / u for s, u in zip(per_block[True], per_block[False])]
    return {
        "interval_s": interval,
        "scrapes": len(scraper.latencies),
        "scrape_failures": scraper.failures,
        "scrape_latency_ms": statistics.median(scraper.latencies) * 1e3 if scraper.latencies else None,
        "step_ms_unscraped": statistics.median(per_block[False]),
        "step_ms_scraped": statistics.median(per_block[True]),
        "paired_ratio": statistics.median(ratios),
        "paired_ratio_min": min(ratios),
        "paired_ratio_max": max(ratios),
        "layer_series": len(monitor.state.layer_norms),
    }
