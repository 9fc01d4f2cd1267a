"""Self-registration (file_sd entries written by the ranks): atomic entries with the real port,
removal on close / exit (no signal handler of ours), pruning of dead writers (never of a live
rank in another PID namespace), an untrusted folder (FIFOs, symlinks), and a real Prometheus
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
from conftest import require, require_binary

from lossbeat import Monitor, MonitorConfig
from lossbeat.exposition import registration as registration_module
from lossbeat.exposition.registration import (
    META,
    Owner,
    boot_id,
    pid_namespace,
    process_start_ticks,
    prune,
    read_entries,
    register,
)

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
            me = Owner.current()
            assert path.name == (
                f"lossbeat-{socket.gethostname()}-{me.boot_id[:12]}-{me.pid_ns}-{os.getpid()}-"
                f"{me.start_ticks}-{m.port}.json"
            )  # the owner, readable without opening it
            [group] = json.loads(path.read_text())
            assert group["targets"] == [f"127.0.0.1:{m.port}"]
            labels = group["labels"]
            assert {k: labels[k] for k in ("job", "node", "slurm_job_id")} == {
                "job": "lm-7b",
                "node": socket.gethostname(),
                "slurm_job_id": "4242",
            }
            assert labels[f"{META}rank"] == "5" and labels[f"{META}pid"] == str(os.getpid())
            assert labels[f"{META}start_ticks"] == str(process_start_ticks(os.getpid()))
            assert labels[f"{META}boot_id"] == boot_id() and labels[f"{META}pid_ns"] == str(pid_namespace())
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
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(sd), mode, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("serving"), line + proc.stdout.read()
    return proc, sd, marker


def test_sigterm_runs_the_applications_handler_whose_exit_removes_the_entry(tmp_path):
    proc, sd, marker = _child(tmp_path, "chained")
    assert len(_entries(sd)) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 7  # the application's own handler ran and chose the exit code
    assert marker.read_text() == "called"
    assert _entries(sd) == []  # its sys.exit() ran atexit


def test_file_sd_installs_no_signal_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    registration = register(tmp_path, addr="127.0.0.1", port=1234, rank=0)
    try:
        assert signal.getsignal(signal.SIGTERM) is before  # docs/reliability.md: lossbeat installs none
    finally:
        registration.remove()


def test_sigterm_with_the_default_action_kills_and_the_next_rank_prunes_the_entry(tmp_path):
    proc, sd, _ = _child(tmp_path, "default")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM  # Python's default: killed at once, as without lossbeat
    [left] = _entries(sd)  # nothing ran in the killed process
    registration = register(sd, addr="127.0.0.1", port=1, rank=0)  # the next rank of this host
    try:
        assert not left.exists() and _entries(sd) == [registration.path]
    finally:
        registration.remove()


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
        listing = subprocess.run(
            [sys.executable, "-m", "lossbeat", "targets", "list", str(sd)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert f"pid={dead.pid} dead" in listing and f"pid={alive.pid} alive" in listing
        out = subprocess.run(
            [sys.executable, "-m", "lossbeat", "targets", "prune", str(sd)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
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


def _fake_entry(
    directory: Path,
    host: str,
    pid: int,
    ticks: int | None,
    *,
    boot: str | None = None,
    ns: int | None = None,
    **labels: str,
) -> Path:
    boot = boot_id() if boot is None else boot
    ns = pid_namespace() if ns is None else ns
    path = directory / f"lossbeat-{host}-{boot[:12]}-{ns}-{pid}-{ticks if ticks is not None else 'x'}-8470.json"
    meta = {
        f"{META}host": host,
        f"{META}pid": str(pid),
        f"{META}start_ticks": "" if ticks is None else str(ticks),
        f"{META}boot_id": boot,
        f"{META}pid_ns": str(ns),
    }
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
        "scrape_configs": [
            {
                "job_name": "training",
                "file_sd_configs": [{"files": [str(sd / "*.json")], "refresh_interval": "2s"}],
                # The owner's labels are for relabelling only; keep the rank's as a check.
                "relabel_configs": [{"source_labels": [f"{META}rank"], "target_label": "registered_rank"}],
            }
        ],
    }
    prom = PrometheusProcess(tmp_path / "prom", config).wait_ready()
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    monkeypatch.setenv("RANK", "3")
    try:
        with _busy_port() as busy:
            taken = busy.getsockname()[1]
            with Monitor(
                MonitorConfig(
                    port=taken,
                    addr="127.0.0.1",
                    port_per_local_rank=False,
                    run_name="shared-node-job",
                    file_sd_dir=str(sd),
                )
            ) as m:
                m.observe(10, loss=2.25)
                assert m.port != taken
                found = wait_until(
                    lambda: prom.api.query('training_loss{job="shared-node-job"}'),
                    60,
                    "the self-registered rank's training_loss in Prometheus",
                )
                labels = found[0]["metric"]
                assert labels["instance"] == f"127.0.0.1:{m.port}" and labels["rank"] == "3"
                assert labels["slurm_job_id"] == "31337" and labels["node"] == socket.gethostname()
                assert labels["registered_rank"] == "3" and not any(k.startswith("__meta") for k in labels)
                assert float(found[0]["value"][1]) == 2.25
            # close() removed the entry: Prometheus drops the target instead of seeing it down.
            wait_until(lambda: not prom.api.target_health("shared-node-job"), 60, "the target to be dropped")
    finally:
        prom.stop()


def test_a_dead_pid_of_another_pid_namespace_or_boot_is_unknowable_and_kept(tmp_path):
    me = Owner.current()
    dead_pid = 2**22 + 7  # above any pid_max here: no such process in this namespace
    other_ns = _fake_entry(tmp_path, me.host, dead_pid, 5, ns=me.pid_ns + 1)
    other_boot = _fake_entry(tmp_path, me.host, dead_pid + 1, 5, boot="0" * 32)
    mine_dead = _fake_entry(tmp_path, me.host, dead_pid + 2, 5)
    assert registration_module.prune_own_namespace(tmp_path) == [mine_dead]
    assert prune(tmp_path) == [] and other_ns.exists() and other_boot.exists()
    assert {owner.alive() for _, owner, _ in read_entries(tmp_path)} == {None}


_IN_NAMESPACE = textwrap.dedent("""
    import os, sys, time
    from lossbeat import start_exporter
    m = start_exporter(0, addr="127.0.0.1", port_per_local_rank=False, file_sd_dir=sys.argv[1], run_name="job-a")
    print("registered", os.getpid(), os.path.basename(m._registration.path), flush=True)
    sys.stdin.readline()  # trains until the test says stop
    m.close()
""")


def test_a_live_rank_in_another_pid_namespace_with_this_host_name_is_never_pruned(tmp_path):
    """Job A's rank runs in its own PID namespace with the node's host name (a hostNetwork pod,
    docker --network host); job B's rank on the host registers and prunes. A's entry stays."""
    require_binary("unshare")
    sd = tmp_path / "sd"
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _IN_NAMESPACE, str(sd)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("registered"):
            proc.kill()
            require(False, f"no PID namespace here (unshare --pid needs root): {line}{proc.stdout.read()}")
        _, pid_inside, name = line.split()
        # Pid 1 in A's namespace: on the host, pid 1 is another process (another start time),
        # which a host+pid(+start) check takes for a dead rank whose pid was reused.
        assert pid_inside == "1" and (sd / name).exists()
        registration = register(sd, addr="127.0.0.1", port=2, rank=0)  # job B's rank
        try:
            assert prune(sd) == []
            assert (sd / name).exists()
        finally:
            registration.remove()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
        assert not (sd / name).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_fifo_or_a_symlink_in_the_folder_never_blocks_a_registering_rank(tmp_path):
    sd = tmp_path / "sd"
    sd.mkdir()
    os.mkfifo(sd / "lossbeat-stale-node07-1234-8470.json")
    (sd / "lossbeat-zero-node07-1-8470.json").symlink_to("/dev/zero")
    code = (
        "from lossbeat import start_exporter; from lossbeat.exposition.registration import prune, read_entries;"
        f"m = start_exporter(0, addr='127.0.0.1', port_per_local_rank=False, file_sd_dir={str(sd)!r});"
        f"print(sorted((p.name, o is None) for p, o, _ in read_entries({str(sd)!r})));"
        f"print(prune({str(sd)!r})); m.close()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listing, pruned = done.stdout.splitlines()[-2:]
    assert "('lossbeat-stale-node07-1234-8470.json', True)" in listing  # unreadable, not waited on
    assert "('lossbeat-zero-node07-1-8470.json', True)" in listing  # not followed, not read to the end
    assert pruned == "[]"


def test_a_registering_rank_opens_no_other_ranks_entry(tmp_path, monkeypatch):
    for i in range(20):
        _fake_entry(tmp_path, f"node{i:02d}", 100 + i, 7)
    opened = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):  # a spy: every call goes through to the real os.open
        opened.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    real_read_text = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: opened.append(str(self)) or real_read_text(self, *a, **k)
    )
    registration = register(tmp_path, addr="127.0.0.1", port=3, rank=0)
    monkeypatch.undo()
    try:
        assert [p for p in opened if "lossbeat-node" in p] == []  # judged from the names: O(1) per rank
        assert len(_entries(tmp_path)) == 21
    finally:
        registration.remove()


def test_the_entry_mode_is_set_on_the_open_descriptor_never_by_path(tmp_path, monkeypatch):
    by_path = []
    real_chmod = os.chmod
    monkeypatch.setattr(
        os, "chmod", lambda path, mode, *a, **k: by_path.append(str(path)) or real_chmod(path, mode, *a, **k)
    )
    old_umask = os.umask(0o077)
    try:
        registration = register(tmp_path, addr="127.0.0.1", port=4, rank=0)
    finally:
        os.umask(old_umask)
        monkeypatch.undo()
    try:
        assert by_path == []  # a chmod by path after the write is a TOCTOU in a shared folder
        assert registration.path.stat().st_mode & 0o777 == 0o644  # Prometheus (another user) can read it
    finally:
        registration.remove()
