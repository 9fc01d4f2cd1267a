"""The status page at request time: the render of ``/status.json`` (and the static ``/``) with
1,000 layers in the heatmap's history, and the memory that history holds.

    PYTHONPATH=exporter python3 -m benchmarks.status_render [--layers 1000] [--repeats 20]

Measured on a real monitor: the layer history is filled by ``observe(model=...)`` for
``LAYER_HISTORY_STEPS`` steps, as in training, then rendered as the server thread does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from lossbeat.exposition.state import LAYER_HISTORY_STEPS, RECENT_STEPS
from lossbeat.exposition.status import StatusSource, page_html
from lossbeat.monitor import Monitor, MonitorConfig

from .render import layered_model


def history_bytes(state) -> int:
    """What the heatmap's history keeps alive: its dicts and their floats (the names are shared)."""
    total = 0
    for _, norms in state.layer_history.snapshot():
        total += sys.getsizeof(norms) + sum(sys.getsizeof(v) for v in norms.values())
    return total


def measure(layers: int, repeats: int) -> dict:
    model = layered_model(layers)
    monitor = Monitor(MonitorConfig(port=0, max_layers=max(1000, layers), log_status_changes=False), serve=False)
    steps = max(LAYER_HISTORY_STEPS, RECENT_STEPS)
    for step in range(steps):
        monitor.observe(step, loss=1.0 / (step + 1), learning_rate=1e-3, model=model)
    monitor.flush()
    source = StatusSource(monitor.state)
    start = time.perf_counter()
    body = source.json()  # cold: every column of the window encoded (the first request)
    cold = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        source.json()
        times.append(time.perf_counter() - start)
    page = []
    for _ in range(repeats):
        start = time.perf_counter()
        page_html()
        page.append(time.perf_counter() - start)
    doc = json.loads(body)
    result = {
        "layers": len(doc["layers"]["names"]),
        "heatmap_steps": len(doc["layers"]["steps"]),
        "curve_steps": len(doc["series"]["step"]),
        "status_json_ms": statistics.median(times) * 1e3,
        "status_json_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        "status_json_cold_ms": cold * 1e3,
        "status_json_bytes": len(body),
        "page_ms": statistics.median(page) * 1e3,
        "page_bytes": len(page_html()),
        "layer_history_bytes": history_bytes(monitor.state),
    }
    monitor.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[64, 1000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print(
        "| layers | heatmap steps | /status.json ms (median) | p90 ms | first request ms | bytes | / ms | layer history MB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        r = measure(layers, args.repeats)
        print(
            f"| {r['layers']} | {r['heatmap_steps']} | {r['status_json_ms']:.2f} | {r['status_json_ms_p90']:.2f} | {r['status_json_cold_ms']:.1f} "
            f"| {r['status_json_bytes']:,} | {r['page_ms']:.4f} | {r['layer_history_bytes'] / 2**20:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
