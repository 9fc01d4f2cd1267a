"""50 concurrent scrapers against a real training loop: every scrape answers and parses, no
counter goes backwards, the monitor counts no error of its own, and the training loop's cost is
measured (docs/reliability.md quotes the figures).

The suite's run is bounded by work, not time: 200 steps alone, then steps while 50 scrapers
scrape 6 times each back to back (a stress test far beyond Prometheus' use), then 200 steps
alone; a loaded machine makes it slower, never different. LOSSBEAT_LOAD_SCRAPERS /
LOSSBEAT_LOAD_EACH / LOSSBEAT_LOAD_INTERVAL change the scrapers; LOSSBEAT_LOAD_SECONDS=S makes
the scrapers scrape for S seconds instead (the alone phases min(10, S/3) s: the documented
benchmark); LOSSBEAT_LOAD_REPORT=FILE writes the measurements as JSON.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lossbeat import Monitor, MonitorConfig

SCRAPERS = Path(__file__).resolve().parent / "workers" / "scrapers.py"


def _phase(monitor: Monitor, model, optimizer, data, step0: int, done) -> dict:
    """Train until ``done(steps, seconds)``; time every whole step and the monitor's part of it."""
    x, y = data
    steps, observe_times = [], []
    step = step0
    start = time.perf_counter()
    while not done(len(steps), time.perf_counter() - start):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        t1 = time.perf_counter()
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model, tokens=x.shape[0])
        t2 = time.perf_counter()
        optimizer.step()
        steps.append(time.perf_counter() - t0)
        observe_times.append(t2 - t1)
        step += 1
    return {
        "steps": len(steps),
        "step_ms_median": 1000 * statistics.median(steps),
        "step_ms_mean": 1000 * statistics.fmean(steps),
        "observe_us_median": 1e6 * statistics.median(observe_times),
        "observe_share": sum(observe_times) / sum(steps),
        "last_step": step,
    }


def test_fifty_scrapers_during_training(tmp_path):
    timed = "LOSSBEAT_LOAD_SECONDS" in os.environ
    seconds = float(os.environ.get("LOSSBEAT_LOAD_SECONDS", "600"))  # untimed: a hang guard
    each = 0 if timed else int(os.environ.get("LOSSBEAT_LOAD_EACH", "6"))
    n = int(os.environ.get("LOSSBEAT_LOAD_SCRAPERS", "50"))
    interval = os.environ.get("LOSSBEAT_LOAD_INTERVAL", "0")

    def alone(steps: int, elapsed: float) -> bool:
        return elapsed >= min(10.0, seconds / 3) if timed else steps >= 200

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(m for i in range(6) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())), torch.nn.Linear(256, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = (torch.randn(64, 256), torch.randint(0, 10, (64,)))

    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", run_name="load")) as monitor:
        baseline = _phase(monitor, model, optimizer, data, 0, alone)
        scrapers = subprocess.Popen(
            [
                sys.executable,
                str(SCRAPERS),
                str(monitor.port),
                str(n),
                str(seconds),
                interval,
                "--each",
                str(each),
                "--final",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def scrapers_stopped(steps: int, elapsed: float) -> bool:
            """Their "stopped" line is out; then they scrape once more, training paused."""
            return bool(select.select([scrapers.stdout], [], [], 0)[0]) or elapsed > seconds + 120

        try:
            loaded = _phase(monitor, model, optimizer, data, baseline["last_step"], scrapers_stopped)
            stopped = scrapers.stdout.readline()
            out, err = scrapers.communicate(timeout=seconds + 120)
        finally:
            if scrapers.poll() is None:
                scrapers.kill()
        after = _phase(monitor, model, optimizer, data, loaded["last_step"], alone)
        errors = dict(monitor.state.errors)

    assert scrapers.returncode == 0 and stopped == "stopped\n", (stopped, err)
    result = json.loads(out)
    report = {
        "seconds": seconds if timed else None,
        "each": each,
        "scrapers": n,
        "interval": float(interval),
        "baseline": baseline,
        "under_load": loaded,
        "after": after,
        "scrape": result,
        "exporter_errors": errors,
        "step_slowdown": loaded["step_ms_median"]
        / statistics.fmean([baseline["step_ms_median"], after["step_ms_median"]])
        - 1,
    }
    if os.environ.get("LOSSBEAT_LOAD_REPORT"):
        Path(os.environ["LOSSBEAT_LOAD_REPORT"]).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

    assert result["failure_count"] == 0, result["failures"]
    assert result["parse_errors"] == 0
    assert result["backwards"] == [], result["backwards"]
    # Every scraper kept being answered (each scrape, with a count; one a second's worth, timed).
    assert result["scrapes"] >= (n * each + 1 if each else n * seconds / 20), result
    assert sum(errors.values()) == 0, errors
    # The scrapers saw the training progress, and training never stalled under load.
    assert result["steps_total_seen"] >= baseline["steps"] + loaded["steps"] * 0.9
    assert loaded["steps"] > 0 and loaded["step_ms_median"] < 20 * baseline["step_ms_median"]
