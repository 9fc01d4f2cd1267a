"""On CPU the exported peak memory is the process's high-water mark since the previous scrape:
never below the current resident memory it is exported with (``ru_maxrss`` lags the live RSS;
VmHWM does not), and windowed: a freed spike ages out after one scrape instead of holding
TrainingMemoryNearLimit for the rest of the run."""

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
        # What they read: this process's anonymous resident memory and its high-water mark less
        # the mapped files, in bytes.
        mapped = _vm("RssFile") + _vm("RssShmem")
        assert abs(current - _vm("RssAnon")) < 64 << 20
        assert abs(peak - max(_vm("VmHWM") - mapped, _vm("RssAnon"))) < 64 << 20 and peak >= 8 * (32 << 20)
        del held[:]
        current_after, peak_after = _memory(monitor.port)
        assert peak_after >= peak - (64 << 20)  # the scrape after the spike still sees it
        current_later, peak_later = _memory(monitor.port)
        assert peak_later < peak - (128 << 20)  # the next one no longer does: the peak is windowed
        assert peak_later >= current_later
    finally:
        monitor.close()


def test_a_memory_mapped_dataset_read_through_is_not_memory_the_process_allocated(tmp_path):
    """nanoGPT's np.memmap and HF datasets' Arrow files put every page an epoch reads in the
    resident set: page cache, not a leak. Memory the process allocates itself still counts."""
    import hashlib
    import mmap

    from lossbeat.measure.memory import read_memory

    data = tmp_path / "train.bin"
    with open(data, "wb") as fh:
        for _ in range(8):
            fh.write(b"\1" * (16 << 20))  # written pages, not a sparse file's holes
    files_before = _vm("RssFile")
    before = read_memory(None, "scrape")
    with open(data, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        hashlib.md5(mapped).hexdigest()  # reads every page through the mapping, copying none
        files_resident = _vm("RssFile") - files_before
        after_reading = read_memory(None, "scrape")
        held = bytearray(128 << 20)
        held[::4096] = b"\1" * len(held[::4096])
        after_allocating = read_memory(None, "scrape")
    assert files_resident >= 100 << 20  # the file's pages are resident...
    assert after_reading.allocated - before.allocated < 16 << 20  # ...and not read as allocated
    assert after_reading.peak < before.allocated + (64 << 20)
    assert after_allocating.allocated - after_reading.allocated >= 112 << 20
    del held


def test_the_diagnosis_and_the_scrape_each_see_a_spike_between_their_readings():
    from lossbeat.measure.memory import read_memory

    read_memory(None, "scrape"), read_memory(None, "diagnosis")  # open both windows
    spike = bytearray(256 << 20)
    spike[::4096] = b"\1" * len(spike[::4096])
    high = _vm("RssAnon")
    del spike
    assert read_memory(None, "diagnosis").peak >= high - (64 << 20)  # the diagnosis saw it...
    assert read_memory(None, "scrape").peak >= high - (64 << 20)  # ...and did not take it from the scrape
    assert read_memory(None, "scrape").peak < high - (128 << 20)  # then it is gone from that window


def test_the_memory_check_recovers_after_a_transient_spike():
    from lossbeat.diagnosis.thresholds import load_thresholds
    from lossbeat.diagnosis.vitals import Vitals
    from lossbeat.measure.memory import MemoryReading

    vitals = Vitals(load_thresholds())
    gib = float(2**30)
    statuses = []
    for i in range(20):  # one reading touches 96 % (the first compiled step), then 60 %
        peak = 0.96 * 80 * gib if i == 12 else 0.6 * 80 * gib
        memory = next(
            f
            for f in vitals.findings(i, None, MemoryReading("cuda:0", 0.6 * 80 * gib, peak, 80 * gib))
            if f.check == "memory"
        )
        statuses.append(memory.status.name)
    assert statuses[12] == "DANGER" and statuses[13:] == ["GOOD"] * 7
