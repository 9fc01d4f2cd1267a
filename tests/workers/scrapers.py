"""N concurrent scrapers of one /metrics for S seconds, in their own process (so their own
Python work does not share the trainer's interpreter lock). Prints one JSON summary:
scrapes, failures, parse errors, counters seen going backwards, latency percentiles.

    python tests/workers/scrapers.py PORT N SECONDS [INTERVAL] [--each COUNT] [--final]

INTERVAL: seconds between one scraper's scrapes (default 0: back to back, a stress test).
--each COUNT: each scraper stops after COUNT scrapes (or SECONDS, whichever comes first).
--final: when the scrapers have stopped, print "stopped", wait for stdin to close (the trainer
has stopped stepping), then scrape once more: that scrape must see every step trained.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time

from prometheus_client.parser import text_string_to_metric_families


def scraper(port: int, until: float, interval: float, out: dict, lock: threading.Lock, each: int = 0) -> None:
    last: dict[tuple, float] = {}
    latencies, failures, parse_errors, backwards = [], [], 0, []
    next_at = time.monotonic()
    attempts = 0
    while time.monotonic() < until and not (each and attempts >= each):
        attempts += 1
        if interval:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += interval
        start = time.monotonic()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/metrics", headers={"Accept-Encoding": "identity"})
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            if resp.status != 200:
                failures.append(f"HTTP {resp.status}")
                continue
        except OSError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            continue
        latencies.append(time.monotonic() - start)
        try:
            families = list(text_string_to_metric_families(body.decode()))
        except Exception as exc:
            parse_errors += 1
            failures.append(f"parse: {exc}")
            continue
        for family in families:
            if family.type != "counter":
                continue
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if s.value < last.get(key, float("-inf")):
                    backwards.append(f"{s.name}{dict(key[1])}: {last[key]} -> {s.value}")
                last[key] = s.value
    with lock:
        out["scrapes"] += len(latencies)
        out["failures"] += failures[:5]
        out["failure_count"] += len(failures)
        out["parse_errors"] += parse_errors
        out["backwards"] += backwards[:5]
        out["latencies"] += latencies
        out["last_counters"].append({f"{k[0]}{dict(k[1])}": v for k, v in last.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("n", type=int)
    parser.add_argument("seconds", type=float)
    parser.add_argument("interval", type=float, nargs="?", default=0.0)
    parser.add_argument("--each", type=int, default=0)
    parser.add_argument("--final", action="store_true")
    args = parser.parse_args()
    out = {
        "scrapes": 0,
        "failures": [],
        "failure_count": 0,
        "parse_errors": 0,
        "backwards": [],
        "latencies": [],
        "last_counters": [],
    }
    lock = threading.Lock()
    until = time.monotonic() + args.seconds
    threads = [
        threading.Thread(target=scraper, args=(args.port, until, args.interval, out, lock, args.each))
        for _ in range(args.n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if args.final:
        print("stopped", flush=True)
        sys.stdin.read()  # returns when the trainer closes our stdin: it steps no more
        scraper(args.port, float("inf"), 0.0, out, lock, each=1)
    lat = sorted(out.pop("latencies")) or [0.0]
    out["latency_p50_ms"] = 1000 * lat[len(lat) // 2]
    out["latency_p99_ms"] = 1000 * lat[int(len(lat) * 0.99)]
    out["latency_max_ms"] = 1000 * lat[-1]
    out["steps_total_seen"] = max(
        (
            v
            for c in out.pop("last_counters")
            for k, v in c.items()
            if k.startswith("training_steps_total{") and "'rank': '0'" in k
        ),
        default=0,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
