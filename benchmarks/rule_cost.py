"""What each rule group costs its Prometheus per evaluation, measured so that load does not move it.

    python benchmarks/rule_cost.py --ranks 1250 --shards 1 --label after
    python benchmarks/rule_cost.py --ranks 1250 --shards 1 --label before --commit 32c9faf
    python benchmarks/rule_cost.py --report                 # the before/after tables of docs/scale.md

Wall times (``prometheus_rule_group_last_duration_seconds``) on a shared machine carry the wait
for a core; this measures the work itself, in two phases:

1. **Fill.** The synthetic ranks of ``benchmarks/scale.py`` (real expositions, re-rendered at
   every scrape) are scraped and judged for ``--minutes`` by the set-up ``deploy/`` ships
   (``--shards 0``: one Prometheus with ``rules.yml``; else ``deploy/sharding``: that many shards
   and the global), from the checkout's files or ``--commit``'s. Sampled every interval: each
   server's process CPU, head series and rule-group wall times.
2. **Replay.** Every server is stopped and started again on its own data, scraping and evaluating
   nothing. Each rule's expression is queried at the fill's last instant with ``stats=all``: the
   samples it reads (``totalQueryableSamples``) and its peak. Then each expression is queried
   again and again, wrapped in ``count()`` (the answer is one number, not a vector to encode),
   and the process's CPU seconds (utime + stime) per query, less those of as many ``vector(1)``
   queries (the HTTP and JSON around a query), are the rule's evaluation CPU. A group's cost is
   the sum over its rules. Not counted: writing a recording rule's output and an alert's state.

A shard of a 10,000-rank job on 8 shards holds 1,250 ranks: ``--ranks 1250 --shards 1`` is one
such shard exactly, and a global holding an eighth of that job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.scale import (  # noqa: E402 (after the sys.path entry that makes it importable)
    RankFarm,
    Server,
    Setup,
    SetupFiles,
    _log,
    real_expositions,
)

RESULTS = HERE / "rule_cost_results.json"
_GROUP = re.compile(r'rule_group="[^"]*;([^"]+)"')


def _rule_files(setup: Setup, files: SetupFiles) -> dict[str, Path]:
    if setup.global_server is None:
        return {setup.shards[0].name: files.rules}
    return {s.name: (files.global_rules if s is setup.global_server else files.shard_rules) for s in setup.servers}


def _groups(path: Path) -> list[dict]:
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]


def _get(server: Server, expr: str, at: float, stats: bool = False) -> dict:
    params = {"query": expr, "time": f"{at:.3f}", **({"stats": "all"} if stats else {})}
    with urllib.request.urlopen(f"{server.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=120) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]


def _allocated(server: Server) -> float:
    """Bytes the Go runtime of ``server`` allocated so far (deterministic for a given query)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("go_memstats_alloc_bytes_total "):
                return float(line.split()[1])
    raise RuntimeError("no go_memstats_alloc_bytes_total")


def _allocated_per_query(server: Server, expr: str, at: float, repeat: int = 3) -> float:
    start = _allocated(server)
    for _ in range(repeat):
        _get(server, expr, at)
    return (_allocated(server) - start) / repeat


def _wait_idle(server: Server, most_s: float = 120.0) -> None:
    """Until the freshly started ``server`` (WAL replay, its garbage) spends < 20 ms of CPU in 2 s."""
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline:
        before = server.cpu_seconds()
        time.sleep(2.0)
        if server.cpu_seconds() - before < 0.02:
            return


def _cpu_per_query(server: Server, expr: str, at: float, budget_s: float = 0.3, most: int = 60) -> float:
    """CPU seconds of ``server`` per query of ``expr``: repeated until ``budget_s`` of CPU (the
    clock ticks are 10 ms) or ``most`` queries."""
    done, start = 0, server.cpu_seconds()
    while done < most and (done < 3 or server.cpu_seconds() - start < budget_s):
        _get(server, expr, at)
        done += 1
    return (server.cpu_seconds() - start) / done


def replay(server: Server, groups: list[dict], at: float, rounds: int = 3) -> dict:
    """Samples and CPU of every rule of ``groups`` evaluated at ``at`` on a quiet ``server``: the
    CPU is the median of ``rounds`` rounds over every rule (a garbage collection lands on
    whichever query runs then)."""
    _wait_idle(server)
    overhead = _cpu_per_query(server, "vector(1)", at, budget_s=0.5, most=400)
    allocated_overhead = _allocated_per_query(server, "vector(1)", at)
    rules_of = [[r for r in group["rules"]] for group in groups]
    cpus: dict[tuple[int, int], list[float]] = {}
    for _ in range(rounds):
        for g, rules in enumerate(rules_of):
            for i, rule in enumerate(rules):
                cpu = _cpu_per_query(server, f"count(({rule['expr']}))", at, budget_s=0.25)
                cpus.setdefault((g, i), []).append(max(0.0, cpu - overhead))
    out = {}
    for g, group in enumerate(groups):
        rules = []
        for i, rule in enumerate(rules_of[g]):
            stats = _get(server, rule["expr"], at, stats=True)
            cpu = sorted(cpus[(g, i)])[len(cpus[(g, i)]) // 2]
            allocated = _allocated_per_query(server, f"count(({rule['expr']}))", at) - allocated_overhead
            rules.append(
                {
                    "rule": rule.get("record") or rule["alert"],
                    "series": len(stats["result"]),
                    "samples": stats["stats"]["samples"]["totalQueryableSamples"],
                    "peak_samples": stats["stats"]["samples"]["peakSamples"],
                    "cpu_ms": 1e3 * cpu,
                    "allocated_mib": max(0.0, allocated) / 2**20,
                }
            )
        interval = group.get("interval")
        out[group["name"]] = {
            "interval": interval,
            "rules": rules,
            "samples": sum(r["samples"] for r in rules),
            "peak_samples": max((r["peak_samples"] for r in rules), default=0),
            "cpu_ms": sum(r["cpu_ms"] for r in rules),
            "allocated_mib": sum(r["allocated_mib"] for r in rules),
        }
    return out


def measure(ranks: int, shards: int, minutes: float, interval: float, files: SetupFiles, templates: dict) -> dict:
    farm = RankFarm(templates, ranks, max(1, math.ceil(ranks / 4000)))
    with tempfile.TemporaryDirectory(prefix="lossbeat-rulecost-") as tmp:
        workdir = Path(tmp)
        setup = Setup(workdir, farm.ports, shards, interval, files)
        try:
            setup.wait_up(ranks)
            _log(f"all {ranks} up on {len(setup.shards)} shard(s); filling for {minutes:g} min")
            started = time.time()
            cpu0 = {s.name: s.cpu_seconds() for s in setup.servers}
            farm0 = farm.stats()
            walls: dict[str, dict[str, list[float]]] = {s.name: {} for s in setup.servers}
            offsets: dict[str, dict[str, float]] = {s.name: {} for s in setup.servers}
            heads, load = {}, []
            while time.time() - started < 60 * minutes:
                time.sleep(interval)
                load.append(os.getloadavg()[0])
                for server in setup.servers:
                    own = server.own_metrics()
                    heads[server.name] = own.get("prometheus_tsdb_head_series")
                    for key, value in own.items():
                        if key.startswith("prometheus_rule_group_last_duration_seconds{"):
                            walls[server.name].setdefault(_GROUP.search(key).group(1), []).append(value)
                        elif key.startswith("prometheus_rule_group_last_evaluation_timestamp_seconds{"):
                            offsets[server.name][_GROUP.search(key).group(1)] = value % interval
            at = time.time() - 1.0
            elapsed = time.time() - started
            cpu = {s.name: (s.cpu_seconds() - cpu0[s.name]) / elapsed for s in setup.servers}
            farm_cpu = (farm.stats()["cpu_s"] - farm0["cpu_s"]) / elapsed
            missed = {
                s.name: sum(
                    v
                    for k, v in s.own_metrics().items()
                    if k.startswith("prometheus_rule_group_iterations_missed_total")
                )
                for s in setup.servers
            }
            rule_files = _rule_files(setup, files)
            datas = {s.name: s.data for s in setup.servers}
        finally:
            setup.stop()
            farm.close()
        _log("replaying every rule on quiet servers")
        servers = {}
        for name, data in datas.items():
            quiet = Server(workdir, f"{name}-replay", {"global": {"evaluation_interval": "1h"}}, data=data)
            try:
                groups = replay(quiet, _groups(rule_files[name]), at)
            finally:
                quiet.stop()
            for group, values in groups.items():
                wall = walls[name].get(group) or [math.nan]
                values.update(
                    wall_mean_ms=1e3 * sum(wall) / len(wall),
                    wall_max_ms=1e3 * max(wall),
                    offset_s=offsets[name].get(group),
                )
            servers[name] = {
                "head_series": heads.get(name),
                "cpu_cores": cpu[name],
                "cpu_s_per_interval": cpu[name] * interval,
                "iterations_missed": missed[name],
                "rule_groups": groups,
            }
    return {
        "ranks": ranks,
        "shards": shards,
        "interval_s": interval,
        "filled_for_s": elapsed,
        "farm_cpu_cores": farm_cpu,
        "load_average_1m": {"min": min(load), "max": max(load)},
        "servers": servers,
    }


def per_interval(run: dict, server: str, key: str) -> float | None:
    """``key`` (samples, allocated_mib, cpu_ms) of ``server``'s rules per evaluation interval: a
    group with its own, longer interval counts the share of its evaluations that falls in one."""
    from lossbeat.mixin.alert_rules import duration_seconds

    total = 0.0
    for group in (run["servers"].get(server) or {}).get("rule_groups", {}).values():
        if key not in group:
            return None
        share = run["interval_s"] / duration_seconds(group["interval"]) if group.get("interval") else 1.0
        total += share * group[key]
    return total


_COLUMNS = (
    ("samples", "samples", "{:,.0f}"),
    ("allocated_mib", "MiB allocated", "{:.1f}"),
    ("cpu_ms", "CPU ms", "{:.0f}"),
)


def report(runs: list[dict]) -> str:
    """Per set-up and server: every group's samples, allocations and CPU per evaluation, one
    column per label, and the wall times the fill saw."""
    out = []
    for ranks, shards, interval in sorted({(r["ranks"], r["shards"], r["interval_s"]) for r in runs}):
        same = sorted(
            (r for r in runs if (r["ranks"], r["shards"], r["interval_s"]) == (ranks, shards, interval)),
            key=lambda r: r["label"] != "before",
        )
        labels = [r["label"] for r in same]
        out.append(
            f"{ranks:,} ranks, {'one Prometheus' if not shards else f'{shards} shard(s) + global'}, "
            f"{interval:g} s, filled {same[0]['filled_for_s'] / 60:.0f} min "
            f"({', '.join(r['label'] + ': ' + (r.get('commit') or 'checkout') for r in same)})"
        )
        for server in sorted({s for r in same for s in r["servers"]}, key=lambda s: (s != "global", s)):
            of = [r["servers"].get(server) or {} for r in same]
            heads = " / ".join(f"{o.get('head_series') or 0:,.0f}" for o in of)
            cpus = " / ".join(f"{o.get('cpu_s_per_interval', 0):.2f}" for o in of)
            out += [
                "",
                f"{server}: head series {heads}; the process's CPU seconds per {interval:g} s interval "
                f"(scrapes, rules, remote write) {cpus} ({' / '.join(labels)})",
                "",
                "| group | "
                + " | ".join(f"{title} ({label})" for _, title, _ in _COLUMNS for label in labels)
                + " | "
                + " | ".join(f"wall mean / max ms ({label})" for label in labels)
                + " |",
                "|---|" + "---:|" * ((len(_COLUMNS) + 1) * len(labels)),
            ]
            groups = list(dict.fromkeys(g for o in of for g in o.get("rule_groups", {})))
            for group in groups:
                cells = [o.get("rule_groups", {}).get(group) for o in of]
                values = [
                    ("-" if c is None or key not in c else fmt.format(c[key]))
                    for key, _, fmt in _COLUMNS
                    for c in cells
                ]
                walls = ["-" if c is None else f"{c['wall_mean_ms']:.0f} / {c['wall_max_ms']:.0f}" for c in cells]
                interval_of = next((c.get("interval") for c in cells if c and c.get("interval")), None)
                name = f"{group} (every {interval_of})" if interval_of else group
                out.append(f"| {name} | " + " | ".join(values + walls) + " |")
            paced = [
                ("-" if (v := per_interval(r, server, key)) is None else fmt.format(v))
                for key, _, fmt in _COLUMNS
                for r in same
            ]
            out.append(
                f"| **all groups, per {interval:g} s** | "
                + " | ".join(paced)
                + " | "
                + " | ".join("" for _ in same)
                + " |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1250)
    parser.add_argument("--shards", type=int, default=1, help="0: one Prometheus with rules.yml (default 1)")
    parser.add_argument("--minutes", type=float, default=7.0, help="fill time after every rank is up (default 7)")
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--label", default="checkout", help="the run's name in the tables (before, after, ...)")
    parser.add_argument("--commit", help="take the rules and deploy/sharding configs of this commit")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args(argv)
    stored = json.loads(args.results.read_text()) if args.results.exists() else {"runs": []}
    if args.report:
        print(report(stored["runs"]))
        return 0
    with tempfile.TemporaryDirectory(prefix="lossbeat-rulecost-files-") as tmp:
        files = SetupFiles.at_commit(args.commit, Path(tmp)) if args.commit else SetupFiles()
        _log("rendering real expositions (TinyLM 10M, 12 steps)")
        templates = real_expositions(world_size=args.ranks)
        result = measure(args.ranks, args.shards, args.minutes, args.interval, files, templates)
    result.update(label=args.label, commit=args.commit, date=time.strftime("%Y-%m-%d %H:%M"))
    stored["runs"] = [
        r
        for r in stored["runs"]
        if (r["label"], r["ranks"], r["shards"], r["interval_s"])
        != (args.label, args.ranks, args.shards, args.interval)
    ] + [result]
    args.results.write_text(json.dumps(stored, indent=2) + "\n")
    print(report(stored["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
