"""20 normal completions behind an HA pair: two loopback scrapers (127.0.0.1, 127.0.0.2), every
T = 2 s, offset T/2; each trial closes at a random moment; counts the replicas whose last scrape
did not read training_run_completed 1."""

import http.client
import random
import sys
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from lossbeat.monitor import Monitor, MonitorConfig


def scrape(port, source):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    try:
        c.request("GET", "/metrics", headers={"User-Agent": "Prometheus/2.45.3"})
        text = c.getresponse().read().decode()
    finally:
        c.close()
    return next(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "training_run_completed"
    )


def replica(port, source, delay, T, stop, seen):
    stop.wait(delay)
    while not stop.is_set():
        try:
            seen.append(scrape(port, source))
        except OSError:
            pass
        stop.wait(T)


random.seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
T, missed, trials = 2.0, 0, 20
for trial in range(trials):
    m = Monitor(MonitorConfig(port=0, addr="127.0.0.1"))
    m.observe(1, loss=1.0)
    stop, a, b = threading.Event(), [], []
    ts = [
        threading.Thread(target=replica, args=(m.port, src, d, T, stop, seen), daemon=True)
        for src, d, seen in (("127.0.0.1", 0, a), ("127.0.0.2", T / 2, b))
    ]
    for t in ts:
        t.start()
    time.sleep(2 * T + random.uniform(0, T))
    t0 = time.monotonic()
    m.close()
    took = time.monotonic() - t0
    stop.set()
    for t in ts:
        t.join()
    miss = [n for n, seen in (("A", a), ("B", b)) if not seen or seen[-1] != 1]
    missed += bool(miss)
    print(f"trial {trial}: lingered {took:.2f}s; missed by {miss or 'none'}", flush=True)
print(f"{missed}/{trials} normal completions missed by at least one replica")
