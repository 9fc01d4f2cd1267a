"""What on-call receives from two long situations, measured on real components.

A real Prometheus with the shipped production rules (``alerting/rules.yml``: default
thresholds, ``TrainingRankDown`` after 2 m, ``TrainingStalled`` after 10 m in training and 1 h in
an evaluation) and a real Alertmanager with the shipped ``alerting/alertmanager.yml`` (routing,
inhibitions and timing as shipped; only its webhooks point at the stack's local receiver)
scrape two runs at once (``--scrape-interval``, 15 s as the deploy examples ship):

- ``staggered-end``: a 4-rank torchrun/gloo DDP job; ranks 1-3 close with the completion
  marker, rank 0 goes on alone for 5 minutes (a final evaluation or upload), then closes;
- ``long-validation``: a real Lightning fit through lossbeat's callback whose one validation
  takes 15 minutes (slow batches; the callback heartbeats every batch);
- ``control-crash``: the control, one process SIGKILLed after 120 s of training (no completion
  marker): it must page ``TrainingExporterDown`` once, so "nothing" above is the rules' verdict
  and not a broken pipeline.

Both are wall-clock, not CPU: paced steps and sleeping batches. Every scrape interval the
script samples Prometheus' pending and firing alerts, the phase and heartbeat age of the
validation, and the ranks each run counts as present; it watches ``--after-s`` past the last
close (longer than ``TrainingExporterDown``'s 2 m) and then reads every notification the
receiver got: pages (``/page``) and tickets (``/ticket``). The summary goes to stdout and to
``--out`` (JSON).

Run: ``PYTHONPATH=exporter python scripts/reliability_runs.py --out scripts/reliability_runs.json``
(about 24 minutes); ``--quick`` scales every duration down for a smoke run (about 5 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from lossbeat.stack.local import Stack, write_target_groups
from lossbeat.stack.webhook import read_notifications

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("reliability_worker.py")
RANKS = 4
JOBS = ("staggered-end", "long-validation", "control-crash")


def _free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it on 127.0.0.1."""
    for base in range(23000, 60000, 97):
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def _get(url: str, path: str, **params: str) -> dict:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}{path}{query}", timeout=10) as resp:
        return json.load(resp)["data"]


def _query(url: str, expr: str) -> list[dict]:
    return _get(url, "/api/v1/query", query=expr)["result"]


def _sample(url: str, started: float) -> dict:
    """One look at Prometheus: its alerts (pending and firing), what each run shows."""
    alerts = [
        {
            "alertname": a["labels"]["alertname"],
            "job": a["labels"].get("job"),
            "rank": a["labels"].get("rank"),
            "severity": a["labels"].get("severity"),
            "state": a["state"],
        }
        for a in _get(url, "/api/v1/alerts")["alerts"]
    ]
    phase = _query(url, 'training_phase{job="long-validation"} == 1')
    age = _query(url, 'training_heartbeat_age_seconds{job="long-validation"}')
    present = _query(url, "count by (job) (training_run_info)")
    completed = _query(url, "count by (job) (last_over_time(training_run_completed[1h]) == 1)")
    return {
        "t": round(time.time() - started, 1),
        "alerts": alerts,
        "validation_phase": phase[0]["metric"]["phase"] if phase else None,
        "validation_heartbeat_age_s": float(age[0]["value"][1]) if age else None,
        "ranks_serving": {s["metric"]["job"]: float(s["value"][1]) for s in present},
        "ranks_completed": {s["metric"]["job"]: float(s["value"][1]) for s in completed},
    }


def _start_runs(folder: Path, ports: dict[str, int], durations: dict[str, float]) -> dict[str, subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "LOSSBEAT_RUN_ID", "LOSSBEAT_FILE_SD_DIR")}
    common = ["--dir", str(folder), "--train-s", str(durations["train"])]
    commands = {
        "staggered-end": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(RANKS),
            str(WORKER),
            "staggered",
            "--job",
            "staggered-end",
            "--port",
            str(ports["staggered-end"]),
            "--tail-s",
            str(durations["tail"]),
            *common,
        ],
        "long-validation": [
            sys.executable,
            str(WORKER),
            "validation",
            "--job",
            "long-validation",
            "--port",
            str(ports["long-validation"]),
            "--validation-s",
            str(durations["validation"]),
            "--val-batch-s",
            str(durations["val_batch"]),
            *common,
        ],
        "control-crash": [
            sys.executable,
            str(WORKER),
            "crash",
            "--job",
            "control-crash",
            "--port",
            str(ports["control-crash"]),
            *common,
        ],
    }
    procs = {}
    for job, cmd in commands.items():
        with open(folder / f"{job}.log", "wb") as log:
            procs[job] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return procs


def _transitions(samples: list[dict]) -> list[dict]:
    """Each alert's first sample in each state: when it went pending, when it fired."""
    seen: dict[tuple, dict] = {}
    for s in samples:
        for a in s["alerts"]:
            key = (a["alertname"], a["job"], a["rank"], a["state"])
            seen.setdefault(key, {**a, "first_t": s["t"]})
    return sorted(seen.values(), key=lambda a: a["first_t"])


def _deliveries(notifications: list[dict], started: float) -> list[dict]:
    out = []
    for n in notifications:
        for a in n["alerts"]:
            out.append(
                {
                    "t": round(n["received_at"] - started, 1),
                    "route": n["path"].strip("/"),
                    "status": a["status"],
                    "alertname": a["labels"].get("alertname"),
                    "job": a["labels"].get("job"),
                    "rank": a["labels"].get("rank"),
                }
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every duration scaled down: a smoke run")
    parser.add_argument("--scrape-interval", default=None, help="default 15s (--quick: 5s)")
    parser.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = parser.parse_args()
    if args.quick:
        durations = {"train": 30, "tail": 60, "validation": 60, "val_batch": 5, "after": 90}
    else:
        durations = {"train": 120, "tail": 300, "validation": 900, "val_batch": 5, "after": 180}
    interval = args.scrape_interval or ("5s" if args.quick else "15s")
    every = float(interval.rstrip("s"))

    with tempfile.TemporaryDirectory(prefix="lossbeat-reliability-") as tmp:
        folder = Path(tmp)
        base = _free_ports(RANKS + 5)  # the ranks, the validation, the control, Prometheus, Alertmanager, receiver
        ports = {"staggered-end": base, "long-validation": base + RANKS, "control-crash": base + RANKS + 1}
        stack = Stack(
            workdir=folder / "stack",
            prometheus_port=base + RANKS + 2,
            alertmanager_port=base + RANKS + 3,
            receiver_port=base + RANKS + 4,
            targets=(),
            scrape_interval=interval,
            rule_files=[REPO / "alerting" / "rules.yml"],
            alertmanager_config=REPO / "alerting" / "alertmanager.yml",
        )
        stack.start(timeout=120)
        procs: dict[str, subprocess.Popen] = {}
        samples: list[dict] = []
        try:
            write_target_groups(
                stack.targets_file,
                [
                    {
                        "targets": [f"127.0.0.1:{ports['staggered-end'] + r}" for r in range(RANKS)],
                        "labels": {"job": "staggered-end"},
                    },
                    *(
                        {"targets": [f"127.0.0.1:{ports[job]}"], "labels": {"job": job}}
                        for job in ("long-validation", "control-crash")
                    ),
                ],
            )
            started = time.time()
            procs = _start_runs(folder, ports, durations)
            ended_at: float | None = None
            limit = started + 2 * (durations["train"] + durations["validation"]) + 600  # a hang guard
            while time.time() < limit:
                samples.append(_sample(stack.prometheus_url, started))
                last = samples[-1]
                print(
                    f"t={last['t']:7.1f}s serving={last['ranks_serving']} completed={last['ranks_completed']} "
                    f"phase={last['validation_phase']} age={last['validation_heartbeat_age_s']} "
                    f"alerts={[(a['alertname'], a['job'], a['rank'], a['state']) for a in last['alerts']]}",
                    flush=True,
                )
                if ended_at is None and all(p.poll() is not None for p in procs.values()):
                    ended_at = time.time()
                if ended_at is not None and time.time() > ended_at + durations["after"]:
                    break
                time.sleep(every)
            time.sleep(15)  # Alertmanager's group_wait for a last notification
            notifications = read_notifications(stack.notifications_file)
            records = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.[0-9].json")}
            exit_codes = {job: p.poll() for job, p in procs.items()}
            logs = {job: (folder / f"{job}.log").read_text(errors="replace")[-2000:] for job in procs}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            stack.stop()

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - started, 1)

    deliveries = _deliveries(notifications, started)
    val = records.get("validation.0", {})
    # Prometheus' view lags the process by up to one scrape interval.
    in_validation = [
        s
        for s in samples
        if val.get("validation_started")
        and val.get("validation_ended")
        and rel(val["validation_started"]) + every <= s["t"] <= rel(val["validation_ended"])
    ]
    crash = records.get("crash.0", {})
    summary = {
        "scrape_interval": interval,
        "durations_s": durations,
        "exit_codes": exit_codes,
        "samples": len(samples),
        "watched_s": samples[-1]["t"] if samples else 0,
        "pages": [d for d in deliveries if d["route"] == "page" and d["status"] == "firing"],
        "tickets": [d for d in deliveries if d["route"] == "ticket" and d["status"] == "firing"],
        "received_by_job": {
            job: {
                "pages": sorted(
                    d["alertname"]
                    for d in deliveries
                    if d["job"] == job and d["route"] == "page" and d["status"] == "firing"
                ),
                "tickets": sorted(
                    d["alertname"]
                    for d in deliveries
                    if d["job"] == job and d["route"] == "ticket" and d["status"] == "firing"
                ),
            }
            for job in JOBS
        },
        "alert_states_seen": _transitions(samples),
        "staggered_end": {
            r: {
                "closed": rel(v.get("closed")),
                "trained_until": rel(v.get("trained_until")),
                "tail_until": rel(v.get("tail_until")),
                "steps": v.get("steps"),
                "lingered_s": round(v["closed"] - v["close_started"], 1),
            }
            for r, v in sorted(records.items())
            if r.startswith("staggered")
        },
        "long_validation": {
            "validation_started": rel(val.get("validation_started")),
            "validation_ended": rel(val.get("validation_ended")),
            "validation_s": round(val["validation_ended"] - val["validation_started"], 1)
            if val.get("validation_ended")
            else None,
            "steps": val.get("steps"),
            "closed": rel(val.get("closed")),
            "phases_during_validation": sorted({s["validation_phase"] for s in in_validation if s["validation_phase"]}),
            "max_heartbeat_age_during_validation_s": max(
                (s["validation_heartbeat_age_s"] for s in in_validation if s["validation_heartbeat_age_s"] is not None),
                default=None,
            ),
            "samples_during_validation": len(in_validation),
        },
        "control_crash": {"killed": rel(crash.get("killed")), "steps": crash.get("steps")},
        "ranks_serving_min": {
            job: min((s["ranks_serving"].get(job, 0) for s in samples if s["ranks_serving"].get(job)), default=0)
            for job in JOBS
        },
    }
    expected = {"staggered-end": 0, "long-validation": 0, "control-crash": -9}
    if exit_codes != expected:
        summary["logs"] = logs
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0 if exit_codes == expected else 1


if __name__ == "__main__":
    sys.exit(main())
