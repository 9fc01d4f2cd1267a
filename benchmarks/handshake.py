"""The shard handshake at scale, simulated: store requests, bytes and time, before and after.

    python -m benchmarks.handshake --ranks 1024 4096          # sizes after; before where --legacy-max allows
    python -m benchmarks.handshake --ranks 256 --legacy-max 256
    python -m benchmarks.handshake --report                   # the docs table from handshake_results.json

One real ``torch.distributed.TCPStore`` server (libuv, as torchrun's) in this process, and N
simulated ranks: one OS thread and one TCPStore client (its own TCP connection) per rank, so
the server sees N clients as in a job. Every rank runs the handshake's real code on one FSDP
group over the whole world (FSDP2's default 1-D mesh, torchtitan's ``dp_shard``: the review's
case C2), all released together by a barrier. Each client is wrapped to count what it asks of
the store: requests, and bytes of keys and values sent and returned (payload, not TCP framing).

"Before" is the algorithm of e03f983 (every rank publishes its groups' member list and reads
every linked rank's: N(N-1) gets, about 4·N³ bytes), kept here only for comparison. It runs up
to ``--legacy-max`` ranks (default 256: 8.5 s there, 72 s at 512 in the review); beyond, its
requests and bytes are computed exactly from the protocol (one get per other rank of a list of
``len(",".join(range(N)))`` bytes; its polls are not counted) and its time is not measured.

Results go to benchmarks/handshake_results.json (merged by size); docs/scale.md quotes them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

try:
    from lossbeat.measure import handshake
except ImportError:  # run from the checkout without PYTHONPATH=exporter
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))
    from lossbeat.measure import handshake

RESULTS = Path(__file__).with_name("handshake_results.json")
TIMEOUT_S = 30.0  # the shipped SHARD_HANDSHAKE_TIMEOUT_S


class CountingStore:
    """A store client that counts its requests and the payload bytes each way."""

    def __init__(self, store: Any) -> None:
        self.s = store
        self.requests = 0
        self.sent = 0
        self.received = 0
        self.keys_read = 0
        self.published: float | None = None
        self.decided: float | None = None

    def _count(self, sent: int, received: int = 0, keys_read: int = 0) -> None:
        self.requests += 1
        self.sent += sent
        self.received += received
        self.keys_read += keys_read

    def set(self, key: str, value: str) -> None:
        self.s.set(key, value)
        self._count(len(key) + len(value))
        if self.published is None:  # the rank's first request: its entry (both algorithms)
            self.published = time.monotonic()

    def get(self, key: str) -> bytes:
        value = self.s.get(key)
        self._count(len(key), len(value), 1)
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.s.multi_get(keys)
        self._count(sum(map(len, keys)), sum(map(len, values)), len(keys))
        return values

    def add(self, key: str, amount: int) -> int:
        value = self.s.add(key, amount)
        self._count(len(key) + 8, 8)
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = self.s.compare_set(key, expected, desired)
        self._count(len(key) + len(expected) + len(desired), len(value), 1)
        return value

    def check(self, keys: list[str]) -> bool:
        found = self.s.check(keys)
        self._count(sum(map(len, keys)), 1)
        return found

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        try:
            self.s.wait(keys, timeout)
        finally:
            self._count(sum(map(len, keys)))


# --- before: e03f983's _all_ranks_arrive, _linked_ranks and _store_handshake, on explicit arguments ---


def legacy_handshake(store: Any, prefix: str, rank: int, mine: Sequence[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    store.set(f"{prefix}/groups/{rank}", ",".join(map(str, mine)))
    known, todo = set(mine) | {rank}, set(mine) - {rank}
    delay = 0.001
    while todo:
        keys = [f"{prefix}/groups/{r}" for r in sorted(todo)]
        if store.check(keys):
            todo = set()
            for key in keys:
                linked = {int(r) for r in store.get(key).decode().split(",") if r}
                todo |= linked - known
                known |= linked
            continue
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    key = f"{prefix}/{','.join(map(str, sorted(known)))}"
    decision_key, ranks = key + "/decision", len(known)
    arrived = store.add(key + "/arrived", 1)
    delay = 0.001
    while True:
        if arrived >= ranks:
            return store.compare_set(decision_key, "", "reduce") == b"reduce"
        if time.monotonic() > deadline:
            return store.compare_set(decision_key, "", "skip") == b"reduce"
        if store.check([decision_key]):
            return store.get(decision_key) == b"reduce"
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        arrived = store.add(key + "/arrived", 0)


def simulate(ranks: int, algorithm: str, prefix: str) -> dict[str, Any]:
    """N threads, one client each, against one server; the handshake timed from a common start."""
    server = dist.TCPStore(
        "127.0.0.1", 0, ranks + 1, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False
    )
    world = list(range(ranks))
    barrier = threading.Barrier(ranks + 1)
    clients: list[CountingStore | None] = [None] * ranks
    outcomes: list[Any] = [None] * ranks
    errors: list[str] = []

    def rank_main(r: int) -> None:
        try:
            clients[r] = store = CountingStore(
                dist.TCPStore("127.0.0.1", server.port, ranks + 1, False, timeout=datetime.timedelta(seconds=600))
            )
        except Exception as e:  # counted: a rank that cannot connect never arrives
            errors.append(f"connect: {e}")
            barrier.wait()
            return
        barrier.wait()
        try:
            if algorithm == "before":
                outcomes[r] = "reduce" if legacy_handshake(store, prefix, r, world, TIMEOUT_S) else "skip"
            else:
                outcomes[r] = handshake.meet(store, prefix, r, [world], TIMEOUT_S, TIMEOUT_S)
        except Exception as e:
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
        store.decided = time.monotonic()

    threading.stack_size(512 * 1024)  # thousands of threads: small stacks
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.monotonic()
    for t in threads:
        t.join()
    seconds = time.monotonic() - started
    done = [c for c in clients if c is not None]
    per_rank = sorted(c.requests for c in done)
    keys_read = sorted(c.keys_read for c in done)
    published = sorted(c.published - started for c in done if c.published is not None)
    decided = sorted(c.decided - c.published for c in done if c.published is not None and c.decided is not None)
    return {
        "ranks": ranks,
        "algorithm": algorithm,
        "seconds": round(seconds, 3),
        "outcomes": {o: outcomes.count(o) for o in set(outcomes)},
        "requests": sum(per_rank),
        "requests_per_rank_median": per_rank[len(per_rank) // 2],
        "requests_per_rank_max": per_rank[-1],
        "keys_read_per_rank_median": keys_read[len(keys_read) // 2],
        "keys_read_per_rank_max": keys_read[-1],
        "bytes_sent": sum(c.sent for c in done),
        "bytes_returned": sum(c.received for c in done),
        "measured": True,
        "errors": errors[:5],
        # The simulation's own cost: 2 cores run N threads, so ranks start their handshake spread out
        # (a cluster's ranks each have a CPU); and each rank's own wait, from its entry to its decision.
        "last_entry_published_s": round(published[-1], 3),
        "rank_wait_s_median": round(decided[len(decided) // 2], 3),
        "rank_wait_s_max": round(decided[-1], 3),
    }


def legacy_counts(ranks: int) -> dict[str, Any]:
    """The before protocol's gets and bytes, exactly (polls aside): every rank gets every other's list."""
    listing = len(",".join(map(str, range(ranks))))
    gets = ranks * (ranks - 1)
    return {
        "ranks": ranks,
        "algorithm": "before",
        "seconds": None,
        "requests": gets,
        "bytes_returned": gets * listing,
        "measured": False,
        "note": "not run: N(N-1) gets of the N-rank list, computed; polls not counted",
    }


def render(results: dict[str, Any]) -> str:
    rows = [
        "| ranks | before: time | before: requests | before: bytes returned | after: time | after: requests "
        "(per rank: median / max) | after: keys read per rank (median / max) | after: bytes returned |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted(results, key=int):
        b, a = results[n].get("before"), results[n].get("after")
        if a is None:
            continue
        if b is None:
            b = legacy_counts(int(n))
        before_time = f"{b['seconds']:.1f} s" if b.get("seconds") is not None else "not run"
        mark = "" if b.get("measured") else " (computed)"
        rows.append(
            f"| {int(n):,} | {before_time} | {b['requests']:,}{mark} | {b['bytes_returned'] / 2**20:,.1f} MiB{mark} "
            f"| {a['seconds']:.2f} s | {a['requests']:,} ({a['requests_per_rank_median']} / "
            f"{a['requests_per_rank_max']}) | {a['keys_read_per_rank_median']} / {a['keys_read_per_rank_max']} "
            f"| {a['bytes_returned'] / 2**10:,.1f} KiB |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[256, 1024, 4096])
    parser.add_argument("--legacy-max", type=int, default=256, help="largest N the old algorithm is run at")
    parser.add_argument("--report", action="store_true", help="print the table from the results file")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.report:
        print(render(results))
        return
    for n in args.ranks:
        entry = results.setdefault(str(n), {})
        entry["after"] = after = simulate(n, "after", f"after/{n}")
        print(
            f"N={n} after: {after['seconds']:.2f}s {after['outcomes']} requests={after['requests']} "
            f"(per rank median {after['requests_per_rank_median']}, max {after['requests_per_rank_max']}) "
            f"returned={after['bytes_returned'] / 2**10:.1f} KiB errors={after['errors']}",
            flush=True,
        )
        if n <= args.legacy_max:
            entry["before"] = before = simulate(n, "before", f"before/{n}")
            print(
                f"N={n} before: {before['seconds']:.2f}s {before['outcomes']} requests={before['requests']} "
                f"returned={before['bytes_returned'] / 2**20:.1f} MiB",
                flush=True,
            )
        else:
            entry["before"] = legacy_counts(n)
        entry["machine"] = {
            "cpus": __import__("os").cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "load_average": list(__import__("os").getloadavg()),
        }
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(render(results))


if __name__ == "__main__":
    main()
