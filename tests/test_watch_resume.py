"""`lossbeat watch` keeps its place across time: a resumed run's redo appended to its log, a
watcher restarted on the same log, an fp16 GradScaler's warm-up, and the end of a run whose log
has no end marker (the training step's exit status). Real watcher threads and processes, real
HTTP scrapes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_watch import Writer, scrape, start, step_is, stop, try_scrape, value, wait_for

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("LOSSBEAT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")},
    "PYTHONPATH": str(ROOT / "exporter"),
}
ENV.pop("MASTER_ADDR", None)


def jsonl(step: int, loss: float, total: int = 1000) -> str:
    """A LLaMA-Factory ``trainer_log.jsonl`` record."""
    record = {"current_steps": step, "total_steps": total, "loss": loss, "lr": 1e-5, "epoch": step / total}
    return json.dumps(record).replace("NaN", "NaN") + "\n"


def nanogpt(step: int, loss: float) -> str:
    return f"iter {step}: loss {loss:.4f}, time 12.00ms, mfu 1.00%\n"


def hf(loss: float, grad_norm: float, epoch: float) -> str:
    return f"{{'loss': {loss}, 'grad_norm': {grad_norm}, 'learning_rate': 1e-05, 'epoch': {epoch}}}\n"


def test_a_resumed_run_appending_its_redo_is_followed_and_its_nan_counted_once(tmp_path):
    """LLaMA-Factory appends to trainer_log.jsonl: a run killed at step 30 and resumed from its
    step-20 checkpoint logs 21, 22, ... again. The redo is the run's progress (step, heartbeat)
    and its NaN at step 25 is counted, once."""
    log = tmp_path / "trainer_log.jsonl"
    out = Writer(log)
    for s in range(1, 31):
        out.write(jsonl(s, 3.0 - s / 100))
    w, t, _ = start(log)
    wait_for(step_is(w, 30), "the first attempt's last step")
    port = w.monitor.port
    beat = value(scrape(port), "training_last_heartbeat_timestamp_seconds")
    for s in range(21, 26):
        out.write(jsonl(s, math.nan if s == 25 else 3.0 - s / 100))
    wait_for(step_is(w, 25), "the redo's step 25")
    metrics = scrape(port)
    assert value(metrics, "training_nonfinite_loss_total") == 1
    assert value(metrics, "training_last_heartbeat_timestamp_seconds") > beat
    for s in range(26, 36):
        out.write(jsonl(s, 3.0 - s / 100))
    wait_for(step_is(w, 35), "past the first attempt's last step")
    assert value(scrape(port), "training_nonfinite_loss_total") == 1
    assert w.builder.resumes == 1 and w.builder.runs == 1
    # a step logged twice (two ranks appending to one file) is still a repeat, not a resume
    out.write(jsonl(35, 2.0))
    out.write(jsonl(36, 2.0))
    wait_for(step_is(w, 36), "step 36")
    assert w.builder.resumes == 1
    stop(w, t)
    out.close()


def test_an_fp16_gradscaler_warm_up_is_no_fault_and_pages_nothing(tmp_path):
    """The HF Trainer logs grad_norm inf on a GradScaler's first overflowing steps, with a finite
    loss: counted as the scaler's overflows, never as non-finite gradients, never a danger."""
    log = tmp_path / "train.log"
    out = Writer(log)
    w, t, _ = start(log)
    statuses = []
    for i in range(1, 41):
        out.write(hf(2.0 - i / 100, math.inf if i <= 5 else 1.5, round(i / 100, 4)))
        wait_for(step_is(w, i), f"record {i}")
        found = scrape(w.monitor.port).get("training_health_status", [])
        statuses += [v for labels, v in found if labels.get("check") == "nonfinite"]
    metrics = scrape(w.monitor.port)
    assert value(metrics, "training_nonfinite_grad_total") == 0
    assert value(metrics, "training_grad_scaler_overflows_total") == 5
    assert statuses and max(statuses) < 2
    stop(w, t)
    out.close()


def test_overflows_past_a_warm_up_are_non_finite_gradients(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(hf(2.0, math.inf, round(i / 100, 4)) for i in range(1, 21)), encoding="utf-8")
    w, t, _ = start(log)
    wait_for(step_is(w, 20), "record 20")
    metrics = scrape(w.monitor.port)
    assert value(metrics, "training_grad_scaler_overflows_total") == 16
    assert value(metrics, "training_nonfinite_grad_total") == 4
    stop(w, t)


def _watch(log: Path, *more: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lossbeat", "watch", str(log), "--port", "0", "--addr", "127.0.0.1"]
    return subprocess.Popen(
        [*cmd, "--linger", "0", "--poll-interval", "0.02", *more],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _port_of(proc: subprocess.Popen) -> int:
    """The port the watcher serves on, from its log line (it asked for port 0)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "on port" in line:
            return int(line.rsplit("on port", 1)[1].split()[0])
        assert line or proc.poll() is None, "the watcher exited before serving"
    raise AssertionError("the watcher never said its port")


def _ended(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_a_restarted_watcher_serves_the_same_run_at_the_same_counts(tmp_path):
    """A watcher restarted on the same log (a sidecar restarted, an OOM kill) replays it into the
    same run's series: the same run_id, its counters back at their values, never lower on the
    way (a scrape during the replay waits for its end), so the rules see no new event."""
    log = tmp_path / "train.log"
    lines = [nanogpt(s, math.nan if s == 50 else 3.0 - s / 10000) for s in range(1, 20001)]
    log.write_text("".join(lines), encoding="utf-8")
    seen = []
    for attempt in range(2):
        proc = _watch(log)
        try:
            port = _port_of(proc)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                metrics = try_scrape(port)
                if "training_nonfinite_loss_total" in metrics:
                    labels, count = metrics["training_nonfinite_loss_total"][0]
                    step = value(metrics, "training_step")
                    seen.append((attempt, labels["run_id"], count, step))
                    if step == 20000:
                        break
                time.sleep(0.01)
        finally:
            _ended(proc)
    assert {a for a, *_ in seen} == {0, 1}, seen[-3:]
    assert len({run_id for _, run_id, _, _ in seen}) == 1, "a restart changed the run identity"
    assert {count for _, _, count, _ in seen} == {1.0}, "a scrape saw the counter below its total"
    assert all(step == 20000 for *_, step in seen), "a scrape saw the replay half done"


def test_without_an_end_marker_the_training_commands_status_ends_the_run(tmp_path):
    """nanoGPT prints no end line: `lossbeat watch LOG -- CMD` runs the command, reads the log to
    its end when the command exits, closes the run as completed on status 0 and exits with the
    command's status; any other status closes it as not completed."""
    script = (
        "import sys, time\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    for s in range(1, 201):\n"
        "        f.write(f'iter {s}: loss {3 - s / 1000:.4f}, time 12.00ms, mfu 1.00%\\n'); f.flush()\n"
        "        time.sleep(0.002)\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    for status in (0, 1):
        log = tmp_path / f"train-{status}.log"
        proc = _watch(log, "--", sys.executable, "-c", script, str(log), str(status))
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            _ended(proc)
        assert proc.returncode == status, err
        if status == 0:
            assert "completed (the training step exited 0)" in err and "200 train records" in err, err
        else:
            assert "failed" in err and "200 train records" in err, err


def test_an_end_file_written_by_the_launcher_ends_a_watched_pid(tmp_path):
    """`--pid` alone cannot read another process's exit status; the launcher's end file can."""
    log = tmp_path / "train.log"
    log.write_text("".join(nanogpt(s, 2.0) for s in range(1, 11)), encoding="utf-8")
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    end_file = tmp_path / "status"
    proc = _watch(log, "--pid", str(trainer.pid), "--end-file", str(end_file))
    try:
        trainer.wait(30)
        end_file.write_text("0\n", encoding="utf-8")
        _, err = proc.communicate(timeout=60)
    finally:
        _ended(proc)
    assert proc.returncode == 0, err
    assert "completed (the training step exited 0)" in err
    # the process gone and no end file: how it ended is unknown, so not a completion
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    proc = _watch(log, "--pid", str(gone.pid))
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        _ended(proc)
    assert proc.returncode == 3 and "failed" in err, err
