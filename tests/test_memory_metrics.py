"""On CPU the exported peak memory is the process's high-water mark: never below the current
resident memory it is exported with (``ru_maxrss`` lags the live RSS; VmHWM does not)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from lossbeat import Monitor, MonitorConfig


def _memory(port: int) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("training_memory_allocated_bytes", "training_memory_peak_bytes"):
                assert sample.labels["device"] == "cpu"
                found[sample.name] = sample.value
    return found["training_memory_allocated_bytes"], found["training_memory_peak_bytes"]


def _vm(field: str) -> float:
    with open("/proc/self/status") as fh:
        return next(float(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))


def test_cpu_peak_is_never_below_the_current_memory():
    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1"), registry=CollectorRegistry(), rank_context=None)
    held = []
    try:
        monitor.observe(0, loss=1.0)
        for _ in range(8):  # grow the resident set in touched 32 MiB steps, scraping after each
            chunk = bytearray(32 << 20)
            chunk[::4096] = b"\1" * len(chunk[::4096])
            held.append(chunk)
            current, peak = _memory(monitor.port)
            assert peak >= current > 0
        # What they read: this process's RSS and its high-water mark, in bytes.
        assert abs(current - _vm("VmRSS")) < 64 << 20
        assert abs(peak - max(_vm("VmHWM"), _vm("VmRSS"))) < 64 << 20 and peak >= 8 * (32 << 20)
        del held[:]
        current_after, peak_after = _memory(monitor.port)
        assert peak_after >= peak  # a high-water mark does not go down when memory is freed
    finally:
        monitor.close()
