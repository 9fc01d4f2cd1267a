"""Self-registration (file_sd entries written by the ranks): atomic entries with the real port,
removal on close / exit / SIGTERM (chained), pruning of dead writers, and a real Prometheus
discovering a rank at its fallback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import require_binary
from lossbeat import Monitor, MonitorConfig
from lossbeat.exposition.registration import META, Owner, prune, process_start_ticks, read_entries, register

REPO = Path(__file__).resolve().parents[1]


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("lossbeat-*.json"))


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _wait(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def test_entry_has_the_real_port_and_labels_and_goes_on_close(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("LOSSBEAT_JOB", raising=False)
    sd = tmp_path / "sd"
    with _busy_port() as busy:
        base = busy.getsockname()[1] - 1  # base + LOCAL_RANK 1 is the busy one
        m = Monitor(MonitorConfig(port=base, addr="127.0.0.1", run_name="lm-7b", file_sd_dir=str(sd)))
        try:
            assert m.port != base + 1
            [path] = _entries(sd)
            assert path.name == f"lossbeat-{socket.gethostname()}-{os.getpid()}-{m.port}.json"
            [group] = json.loads(path.read_text())
            assert group["targets"] == [f"127.0.0.1:{m.port}"]
            labels = group["labels"]
            assert {k: labels[k] for k in ("job", "node", "slurm_job_id")} == {
                "job": "lm-7b", "node": socket.gethostname(), "slurm_job_id": "4242"}
            assert labels[f"{META}rank"] == "5" and labels[f"{META}pid"] == str(os.getpid())
            assert labels[f"{META}start_ticks"] == str(process_start_ticks(os.getpid()))
            assert "rank" not in labels  # would rename the exporter's own `rank` to exported_rank
            assert not list(sd.glob(".*tmp"))  # written through a renamed temporary file
        finally:
            m.close()
    assert _entries(sd) == []
    m.close()  # idempotent


def test_two_monitors_in_one_process_keep_their_own_entries(tmp_path):
    first = register(tmp_path, addr="127.0.0.1", port=1111, rank=0)
    second = register(tmp_path, addr="127.0.0.1", port=2222, rank=0)
    assert first.path != second.path and len(_entries(tmp_path)) == 2
    first.remove()
    assert _entries(tmp_path) == [second.path]
    second.remove()


def test_a_forked_child_never_removes_the_parents_entry(tmp_path):
    registration = register(tmp_path, addr="127.0.0.1", port=1234, rank=0, job="j")
    try:
        pid = os.fork()
        if pid == 0:  # a DataLoader worker would inherit the registration like this
            registration.remove()
            os._exit(0)
        os.waitpid(pid, 0)
        assert registration.path.exists()
    finally:
        registration.remove()
    assert not registration.path.exists()


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from lossbeat import start_exporter
    sd, mode, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "chained":
        def previous(signum, frame):
            open(marker, "w").write("called")
            sys.exit(7)
        signal.signal(signal.SIGTERM, previous)
    monitor = start_exporter(0, addr="127.0.0.1", file_sd_dir=sd, run_name="child")
    monitor.observe(0, loss=1.0)
    print("serving", monitor.port, flush=True)
    if mode == "exit":
        sys.exit(0)  # no close(): atexit cleans up
    while True:
        time.sleep(0.05)
""")


def _child(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    sd, marker = tmp_path / "sd", tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(sd), mode, str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert line.startswith("serving"), line + proc.stdout.read()
    return proc, sd, marker


def test_sigterm_removes_the_entry_and_calls_the_previous_handler(tmp_path):
    proc, sd, marker = _child(tmp_path, "chained")
    assert len(_entries(sd)) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 7  # the application's own handler ran and chose the exit code
    assert marker.read_text() == "called"
    assert _entries(sd) == []


def test_sigterm_with_the_default_action_still_ends_the_process(tmp_path):
    proc, sd, _ = _child(tmp_path, "default")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM  # not swallowed: killed by the signal, as without lossbeat
    assert _entries(sd) == []


def test_a_normal_exit_without_close_removes_the_entry(tmp_path):
    proc, sd, _ = _child(tmp_path, "exit")
    assert proc.wait(30) == 0
    assert _entries(sd) == []


def test_a_killed_rank_leaves_a_recognisable_entry_that_prune_removes(tmp_path):
    dead, sd, _ = _child(tmp_path, "default")
    alive, _, _ = _child(tmp_path, "default")
    try:
        dead.kill()
        dead.wait(30)
        owners = {owner.pid: owner.alive() for _, owner, _ in read_entries(sd)}
        assert owners == {dead.pid: False, alive.pid: True}
        listing = subprocess.run([sys.executable, "-m", "lossbeat", "targets", "list", str(sd)],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"pid={dead.pid} dead" in listing and f"pid={alive.pid} alive" in listing
        out = subprocess.run([sys.executable, "-m", "lossbeat", "targets", "prune", str(sd)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"-{dead.pid}-" in out
        assert [owner.pid for _, owner, _ in read_entries(sd)] == [alive.pid]
    finally:
        for proc in (dead, alive):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_a_rank_that_registers_prunes_dead_entries_of_its_host(tmp_path):
    dead, sd, _ = _child(tmp_path, "default")
    dead.kill()
    dead.wait(30)
    assert len(_entries(sd)) == 1
    registration = register(sd, addr="127.0.0.1", port=1, rank=0)
    try:
        assert [owner.pid for _, owner, _ in read_entries(sd)] == [os.getpid()]
    finally:
        registration.remove()


def _fake_entry(directory: Path, host: str, pid: int, ticks: int | None, **labels: str) -> Path:
    path = directory / f"lossbeat-{host}-{pid}.json"
    meta = {f"{META}host": host, f"{META}pid": str(pid), f"{META}start_ticks": "" if ticks is None else str(ticks)}
    path.write_text(json.dumps([{"targets": [f"{host}:8470"], "labels": {**labels, **meta}}]))
    return path


def test_prune_tells_a_reused_pid_and_keeps_other_hosts_unless_their_job_ended(tmp_path):
    me = Owner.current()
    reused = _fake_entry(tmp_path, me.host, me.pid, me.start_ticks + 1)  # this pid, but another process
    elsewhere = _fake_entry(tmp_path, "node76", 1, 5)  # another host: unknowable here, kept
    other_job = _fake_entry(tmp_path, "node77", 2, 9, slurm_job_id="99")
    stale_tmp = tmp_path / ".lossbeat-x.tmp"
    stale_tmp.write_text("[")
    os.utime(stale_tmp, (time.time() - 3600,) * 2)
    assert sorted(prune(tmp_path)) == sorted([reused, stale_tmp])
    assert elsewhere.exists() and other_job.exists()
    assert prune(tmp_path, slurm_job_id="99") == [other_job]  # the sbatch trap / epilog of job 99
    assert elsewhere.exists()
    live = _fake_entry(tmp_path, me.host, me.pid, me.start_ticks)
    assert prune(tmp_path) == [] and live.exists()  # the live owner keeps its entry


def test_a_registration_failure_is_counted_and_training_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with Monitor(MonitorConfig(port=0, addr="127.0.0.1", file_sd_dir=str(blocker / "sd"))) as m:
        m.observe(0, loss=1.0)
        assert m.state.errors.get("register") == 1
        assert m.port


def test_file_sd_dir_is_validated():
    with pytest.raises(TypeError, match="file_sd_dir: expected a folder path"):
        MonitorConfig(file_sd_dir=3)


def test_prometheus_discovers_a_rank_at_its_fallback_port(tmp_path, monkeypatch):
    require_binary("prometheus")
    from e2e.e2e_harness import wait_until
    from e2e.prometheus_process import PrometheusProcess

    sd = tmp_path / "file_sd"
    sd.mkdir()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "training",
            "file_sd_configs": [{"files": [str(sd / "*.json")], "refresh_interval": "2s"}],
            # The owner's labels are for relabelling only; keep the rank's as a check.
            "relabel_configs": [{"source_labels": [f"{META}rank"], "target_label": "registered_rank"}],
        }],
    }
    prom = PrometheusProcess(tmp_path / "prom", config).wait_ready()
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    monkeypatch.setenv("RANK", "3")
    try:
        with _busy_port() as busy:
            taken = busy.getsockname()[1]
            with Monitor(MonitorConfig(port=taken, addr="127.0.0.1", port_per_local_rank=False,
                                       run_name="shared-node-job", file_sd_dir=str(sd))) as m:
                m.observe(10, loss=2.25)
                assert m.port != taken
                found = wait_until(lambda: prom.api.query('training_loss{job="shared-node-job"}'), 60,
                                   "the self-registered rank's training_loss in Prometheus")
                labels = found[0]["metric"]
                assert labels["instance"] == f"127.0.0.1:{m.port}" and labels["rank"] == "3"
                assert labels["slurm_job_id"] == "31337" and labels["node"] == socket.gethostname()
                assert labels["registered_rank"] == "3" and not any(k.startswith("__meta") for k in labels)
                assert float(found[0]["value"][1]) == 2.25
            # close() removed the entry: Prometheus drops the target instead of seeing it down.
            wait_until(lambda: not prom.api.target_health("shared-node-job"), 60, "the target to be dropped")
    finally:
        prom.stop()
