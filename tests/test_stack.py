"""`lossbeat stack`: the rendered config is valid for the real promtool, and up/status/down
start, report and stop real Prometheus and Alertmanager processes by PID."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import require_binary
from e2e.e2e_harness import Prometheus, free_port, wait_until

from lossbeat.stack.local import Stack, alert_lines, render_prometheus_config, write_target_groups, write_targets_file
from lossbeat.stack.webhook import notifications_html, read_notifications, read_targets, serve, status_links

pytestmark = pytest.mark.servers  # also run against the Prometheus 3 line (make test-prometheus3)

RULES = """\
groups:
- name: stack-test
  rules:
  - alert: TargetDown
    expr: up == 0
"""
ALERTMANAGER = """\
route:
  receiver: nobody
receivers:
- name: nobody
"""


@pytest.fixture
def config_files(tmp_path) -> tuple[Path, Path]:
    rules, am = tmp_path / "rules.yml", tmp_path / "alertmanager.yml"
    rules.write_text(RULES)
    am.write_text(ALERTMANAGER)
    return rules, am


@pytest.fixture
def exporter():
    """A real HTTP endpoint serving one metric in the exposition format."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'# TYPE training_step gauge\ntraining_step{rank="0"} 42\n'
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _lossbeat(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lossbeat", "stack", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_rendered_config_passes_promtool(tmp_path, config_files):
    promtool = require_binary("promtool")
    rules, _ = config_files
    targets = tmp_path / "targets.json"
    write_targets_file(targets, ["127.0.0.1:8470", "127.0.0.1:8471"], job="train-a")
    config = render_prometheus_config(
        targets_file=targets, rule_files=[rules], alertmanagers=["127.0.0.1:9093"], scrape_interval="1s"
    )
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert config["global"]["evaluation_interval"] == "1s"


def test_stack_python_api_scrapes_targets_under_their_job_label(tmp_path, config_files, exporter):
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    rules, am = config_files
    stack = Stack(
        workdir=tmp_path / "stack",
        prometheus_port=free_port(),
        alertmanager_port=free_port(),
        targets=[exporter],
        job="train-b",
        scrape_interval="1s",
        rule_files=[rules],
        alertmanager_config=am,
    )
    with stack:
        prom = Prometheus(stack.prometheus_url)
        result = wait_until(lambda: prom.query('training_step{job="train-b"}'), 20, "a scrape of the exporter")
        assert result[0]["value"][1] == "42"
        assert result[0]["metric"]["instance"] == exporter
        # A live change of the targets file is picked up without a restart.
        stack.set_targets([exporter], job="train-c")
        wait_until(lambda: prom.query('training_step{job="train-c"}'), 20, "the relabelled target")
        pids = dict(stack.pids)
    for pid in pids.values():
        assert not Path(f"/proc/{pid}/exe").exists(), f"pid {pid} still running after stop()"


def test_stack_cli_up_status_down(tmp_path, config_files, exporter):
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    rules, am = config_files
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text("alerts:\n  stalled_after: 15s\n")
    workdir = tmp_path / "cli-stack"
    prom_port, am_port = free_port(), free_port()
    up = _lossbeat(
        "up",
        "--dir",
        str(workdir),
        "--prometheus-port",
        str(prom_port),
        "--alertmanager-port",
        str(am_port),
        "--receiver-port",
        "0",
        "--targets",
        exporter,
        "--scrape-interval",
        "1s",
        "--thresholds",
        str(thresholds),
        "--alertmanager-config",
        str(am),
    )
    try:
        assert up.returncode == 0, up.stderr
        assert f"http://127.0.0.1:{prom_port}" in up.stdout
        assert f"http://127.0.0.1:{am_port}" in up.stdout
        again = _lossbeat("up", "--dir", str(workdir), "--rules", str(rules))
        assert again.returncode == 1 and "already running" in again.stderr

        prom = Prometheus(f"http://127.0.0.1:{prom_port}")
        # The rules were generated from the thresholds file given to `up`.
        stalled = prom.rule_queries("TrainingStalled")
        # stalled_after (15 s here) is the bound the heartbeat age is compared with, in training
        assert stalled and '(training_phase{phase="train"} == 1) * 0 + 15' in stalled[0], stalled
        wait_until(lambda: prom.target_health("training") == ["up"], 20, "the target to be scraped")
        status = _lossbeat("status", "--dir", str(workdir))
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"http://{exporter}/metrics" in status.stdout and " up" in status.stdout
    finally:
        down = _lossbeat("down", "--dir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert not (workdir / "state.json").exists()
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    live = [line for line in out.splitlines() if str(workdir) in line and " Z" not in line]
    assert not live, f"processes survived `stack down`: {live}"


def test_stack_up_says_how_to_install_missing_binaries(tmp_path, config_files):
    rules, am = config_files
    env = {**os.environ, "PATH": str(tmp_path)}  # no prometheus on this PATH
    env.pop("LOSSBEAT_PROMETHEUS", None)
    result = _lossbeat(
        "up", "--dir", str(tmp_path / "s"), "--rules", str(rules), "--alertmanager-config", str(am), env=env
    )
    assert result.returncode == 2
    assert "apt-get install prometheus prometheus-alertmanager" in result.stderr


# --- the local receiver and `stack status` ----------------------------------------------

NAN = {"alertname": "TrainingLossNaN", "job": "train", "rank": "0", "severity": "critical"}
PLATEAU = {"alertname": "TrainingLossPlateau", "job": "train", "rank": "0", "severity": "warning"}
VOLATILE = {"alertname": "TrainingLossVolatile", "job": "train", "rank": "0", "severity": "warning"}


def _post(url: str, document: dict) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(document).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.status


def test_receiver_records_webhooks_and_serves_the_runbooks(tmp_path):
    log = tmp_path / "notifications.jsonl"
    server = serve(0, log, runbooks="# Runbooks\n\n## TrainingLossNaN\n\nStop <the> run.\n")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        payload = {"receiver": "page", "status": "firing", "alerts": [{"status": "firing", "labels": NAN}]}
        assert _post(f"{url}/page", payload) == 200
        json_type = {"Content-Type": "application/json"}
        for body, headers, code in (
            (b"{nope", json_type, 400),
            (b"[1, 2]", json_type, 400),  # not an object
            (b'{"alerts": ["firing"]}', json_type, 400),  # an alert that is not an object
            # What a web page can send to 127.0.0.1 without a preflight: text/plain, a form.
            (json.dumps(payload).encode(), {"Content-Type": "text/plain"}, 415),
            (json.dumps(payload).encode(), {"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ):
            with pytest.raises(urllib.error.HTTPError) as bad:
                request = urllib.request.Request(f"{url}/page", data=body, headers=headers, method="POST")
                urllib.request.urlopen(request, timeout=10)
            assert bad.value.code == code, body
        (note,) = read_notifications(log)
        assert note["receiver"] == "page" and note["path"] == "/page"
        assert note["alerts"] == [{"labels": NAN, "annotations": {}, "status": "firing", "startsAt": None}]
        with urllib.request.urlopen(f"{url}/runbooks", timeout=10) as resp:
            page = resp.read().decode()
        assert '<h2 id="traininglossnan">TrainingLossNaN</h2>' in page and "Stop &lt;the&gt; run." in page
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{url}/other", timeout=10)
        assert missing.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_status_lines_name_the_receiver_and_the_delivery():
    prometheus = [
        {"labels": NAN, "state": "firing"},
        {"labels": PLATEAU, "state": "firing"},
        {"labels": VOLATILE, "state": "firing"},
        {"labels": {**NAN, "rank": "1"}, "state": "pending"},
    ]
    alertmanager = [
        {"labels": NAN, "receivers": [{"name": "page"}], "status": {"state": "active"}},
        {"labels": PLATEAU, "receivers": [{"name": "ticket"}], "status": {"state": "active"}},
        {"labels": VOLATILE, "receivers": [{"name": "ticket"}], "status": {"state": "suppressed"}},
    ]
    notifications = [
        {"receiver": "page", "received_at": 0.0, "alerts": [{"labels": NAN, "status": "firing"}]},
        # delivered to another receiver, or resolved: not this alert's delivery
        {"receiver": "ticket", "received_at": 0.0, "alerts": [{"labels": NAN, "status": "firing"}]},
        {"receiver": "ticket", "received_at": 0.0, "alerts": [{"labels": PLATEAU, "status": "resolved"}]},
    ]
    lines = alert_lines(prometheus, alertmanager, notifications)
    by_name = {}
    for line in lines:
        by_name.setdefault(line.split()[1], []).append(line)
    assert (
        "receiver page" in by_name["TrainingLossNaN"][0] and "paged: TrainingLossNaN" in by_name["TrainingLossNaN"][0]
    )
    assert "receiver ticket" in by_name["TrainingLossPlateau"][0]
    assert "not delivered yet" in by_name["TrainingLossPlateau"][0]
    assert (
        "suppressed" in by_name["TrainingLossVolatile"][0] and "no notification" in by_name["TrainingLossVolatile"][0]
    )
    assert "pending" in by_name["TrainingLossNaN"][1] and "paged" not in by_name["TrainingLossNaN"][1]
    assert lines[-1] == by_name["TrainingLossNaN"][1]  # firing first
    unknown = alert_lines(prometheus[:1], alertmanager[:1], None)
    assert "delivery not recorded" in unknown[0] and "paged" not in unknown[0]


# --- each alert links to the status page of its rank ----------------------------------

LINK_RULES = """\
groups:
- name: links
  rules:
  - alert: RankUp
    expr: up == 1
    labels: {severity: critical}
    annotations: {summary: "rank {{ $labels.instance }} is up"}
  - alert: JobUp
    expr: count by (job) (up == 1) > 0
    labels: {severity: critical}
  - alert: HostileLabel
    expr: up == 1
    labels: {severity: critical, note: "<script>alert(1)</script>"}
    annotations: {summary: "<script>alert(2)</script>", runbook_url: "javascript:alert(3)"}
"""
# Webhooks to the shipped receiver address: the stack sends them to its own receiver.
LINK_ALERTMANAGER = """\
route: {receiver: page, group_by: [alertname], group_wait: 1s, group_interval: 1s, repeat_interval: 1h}
receivers:
- name: page
  webhook_configs: [{url: "http://127.0.0.1:5001/page"}]
"""


def test_stack_status_and_the_receivers_page_link_each_alert_to_its_ranks_status_page(tmp_path, exporter):
    """Real Prometheus alerts, routed by a real Alertmanager to the stack's own receiver: its page
    of notifications and `stack status` link each alert to http://<instance>/ (a job-level alert
    to the job's ranks), and a `<script>` in a label or an annotation is shown as text."""
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    rules, am = tmp_path / "rules.yml", tmp_path / "alertmanager.yml"
    rules.write_text(LINK_RULES)
    am.write_text(LINK_ALERTMANAGER)
    workdir, receiver_port = tmp_path / "links-stack", free_port()
    up = _lossbeat(
        "up",
        "--dir",
        str(workdir),
        "--prometheus-port",
        str(free_port()),
        "--alertmanager-port",
        str(free_port()),
        "--receiver-port",
        str(receiver_port),
        "--targets",
        exporter,
        "--job-name",
        "train-links",
        "--scrape-interval",
        "1s",
        "--rules",
        str(rules),
        "--alertmanager-config",
        str(am),
    )
    receiver = f"http://127.0.0.1:{receiver_port}"
    try:
        assert up.returncode == 0, up.stderr
        assert f"{receiver}/" in up.stdout

        def delivered() -> set[str]:
            with urllib.request.urlopen(f"{receiver}/notifications", timeout=10) as resp:
                return {a["labels"]["alertname"] for n in json.load(resp) for a in n["alerts"]}

        wait_until(lambda: delivered() >= {"RankUp", "JobUp", "HostileLabel"}, 60, "the three notifications")
        with urllib.request.urlopen(f"{receiver}/", timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/html")
            page = resp.read().decode()
        rows = {
            name: next(r for r in page.splitlines() if f"<b>{name}</b>" in r)
            for name in ("RankUp", "JobUp", "HostileLabel")
        }
        link = f'<a class=page href="http://{exporter}/">http://{exporter}/</a>'
        assert link in rows["RankUp"] and f"rank {exporter} is up" in rows["RankUp"]
        assert "instance=" not in rows["JobUp"] and link in rows["JobUp"]  # the job's one rank
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in rows["HostileLabel"]
        assert "&lt;script&gt;alert(2)&lt;/script&gt;" in rows["HostileLabel"]
        assert "<script" not in page and 'href="javascript' not in page

        status = _lossbeat("status", "--dir", str(workdir))
        assert status.returncode == 0, status.stdout + status.stderr
        lines = {line.split()[1]: line for line in status.stdout.splitlines() if line.startswith("  alert ")}
        assert lines["RankUp"].endswith(f"page http://{exporter}/"), lines
        assert "paged: RankUp" in lines["RankUp"]
        assert lines["JobUp"].endswith(f"page http://{exporter}/"), lines
    finally:
        down = _lossbeat("down", "--dir", str(workdir))
    assert down.returncode == 0, down.stderr


def test_status_links_follow_the_instance_the_scheme_and_the_jobs_ranks(tmp_path):
    ranks = [
        {"instance": "node1:8470", "job": "train", "scheme": "https"},
        {"instance": "node1:8471", "job": "train", "scheme": "https"},
        {"instance": "127.0.0.1:8470", "job": "other", "scheme": "http"},
    ]
    assert status_links({"instance": "127.0.0.1:8470", "job": "other"}, ranks) == ["http://127.0.0.1:8470/"]
    assert status_links({"instance": "node1:8471"}, ranks) == ["https://node1:8471/"]  # scraped over TLS
    assert status_links({"instance": "[::1]:8470"}) == ["http://[::1]:8470/"]
    assert status_links({"job": "train"}, ranks) == ["https://node1:8470/", "https://node1:8471/"]
    assert status_links({"job": "unknown"}, ranks) == [] and status_links({}, ranks) == []
    for hostile in ('x"><script>alert(1)</script>:1', "javascript:alert(1)", "evil.example/@x:80", "node1"):
        assert status_links({"instance": hostile}) == [], hostile
    # The stack's file_sd targets file: a group's __scheme__ label says it is scraped over TLS.
    targets = tmp_path / "targets.json"
    write_target_groups(
        targets,
        [
            {"targets": ["node1:8470"], "labels": {"job": "train", "__scheme__": "https"}},
            {"targets": ["node2:8470"], "labels": {"job": "train"}},
        ],
    )
    assert read_targets(targets) == [
        {"instance": "node1:8470", "job": "train", "scheme": "https"},
        {"instance": "node2:8470", "job": "train", "scheme": "http"},
    ]
    assert read_targets(tmp_path / "absent.json") == [] and read_targets(None) == []


def test_the_page_of_notifications_escapes_every_string_from_the_alerts():
    hostile = '"><script>alert(1)</script>'
    notifications = [
        {
            "receiver": "page",
            "received_at": 0.0,
            "alerts": [
                {
                    "status": "firing",
                    "labels": {"alertname": "Nan<script>", "job": hostile, "instance": hostile + ":1"},
                    "annotations": {"summary": hostile, "runbook_url": "javascript:alert(1)"},
                }
            ],
        },
        {
            "receiver": "ticket",
            "received_at": 1.0,
            "alerts": [
                {
                    "status": "firing",
                    "labels": {"alertname": "TrainingLossNaN", "job": "train", "instance": "h:8470"},
                    "annotations": {"runbook_url": "http://127.0.0.1:5001/runbooks#traininglossnan"},
                }
            ],
        },
    ]
    page = notifications_html(notifications)
    assert "<script" not in page and "javascript:" not in page.replace("javascript:alert(1)", "")
    assert "&lt;b&gt;" not in page and "Nan&lt;script&gt;" in page
    assert "&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert 'href="http://h:8470/"' in page and 'href="http://127.0.0.1:5001/runbooks#traininglossnan"' in page
    assert page.index("TrainingLossNaN") < page.index("Nan&lt;script&gt;")  # newest first
    assert page.count("<a class=page ") == 1  # the hostile instance gets no link


def test_status_lines_end_with_the_status_page_of_the_rank():
    targets = [
        {"instance": "127.0.0.1:8470", "job": "train", "scheme": "http"},
        {"instance": "127.0.0.1:8471", "job": "train", "scheme": "http"},
    ]
    rank = {**NAN, "instance": "127.0.0.1:8471"}
    job_level = {"alertname": "TrainingRanksMissing", "job": "train", "severity": "warning"}
    lonely = {"alertname": "TrainingRanksMissing", "job": "gone", "severity": "warning"}
    hostile = {**NAN, "instance": "\x1b[2J\x1b[31mred:1"}  # a terminal escape sequence in a label
    prometheus = [
        {"labels": rank, "state": "firing"},
        {"labels": job_level, "state": "pending"},
        {"labels": lonely, "state": "pending"},
        {"labels": hostile, "state": "pending"},
    ]
    lines = alert_lines(
        prometheus, [{"labels": rank, "receivers": [{"name": "page"}], "status": {"state": "active"}}], [], targets
    )
    firing = lines[0]
    (red,) = [line for line in lines if "red:1" in line]
    (train,) = [line for line in lines if "TrainingRanksMissing" in line and "job=train" in line]
    (gone,) = [line for line in lines if "job=gone" in line]
    assert firing.endswith("instance=127.0.0.1:8471  page http://127.0.0.1:8471/")
    assert train.endswith("job=train  page http://127.0.0.1:8470/ http://127.0.0.1:8471/")  # the job's ranks
    assert gone.endswith("job=gone")  # no rank known: no link
    assert "\x1b" not in red and red.endswith("instance=\\x1b[2J\\x1b[31mred:1")  # escaped, unlinked


def test_a_busy_port_is_one_line_naming_it(tmp_path):
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _lossbeat(
            "up",
            "--dir",
            str(tmp_path / "s"),
            "--prometheus-port",
            str(free_port()),
            "--alertmanager-port",
            str(free_port()),
            "--receiver-port",
            str(port),
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"lossbeat stack: port {port} (receiver) is in use on 127.0.0.1; pass --receiver-port with a free one"
    ]
    assert not (tmp_path / "s" / "state.json").exists()


def test_up_leaves_foreign_files_in_its_folder(tmp_path):
    require_binary("prometheus")
    require_binary("alertmanager", "prometheus-alertmanager")
    workdir = tmp_path / "mine"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep me")
    (workdir / "prometheus.log").write_text("an old stack's log")
    with socket.socket() as busy:  # stops `up` after it cleared its own files
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = _lossbeat(
            "up",
            "--dir",
            str(workdir),
            "--prometheus-port",
            str(busy.getsockname()[1]),
            "--alertmanager-port",
            str(free_port()),
            "--receiver-port",
            "0",
        )
    assert result.returncode == 1
    assert (workdir / "notes.txt").read_text() == "keep me" and not (workdir / "prometheus.log").exists()


# --- the stack's own folder: private, never a shared /tmp name ------------------------


def test_up_refuses_a_shared_folder_with_a_planted_symlink_and_writes_nothing_through_it(tmp_path):
    """Another user's pre-made, world-writable folder with `targets.tmp` -> a victim's path."""
    shared, victim = tmp_path / "fake-stack", tmp_path / "victim"
    shared.mkdir()
    victim.mkdir()
    shared.chmod(0o777)
    for name in ("targets.tmp", "targets.json", "prometheus.yml", "state.json"):
        (shared / name).symlink_to(victim / f"created-by-{name}")
    result = _lossbeat(
        "up",
        "--dir",
        str(shared),
        "--prometheus-port",
        str(free_port()),
        "--alertmanager-port",
        str(free_port()),
        "--receiver-port",
        "0",
    )
    assert result.returncode == 2
    assert "writable by others" in result.stderr
    assert list(victim.iterdir()) == []  # nothing created or clobbered through the symlinks


def test_the_stack_folder_must_be_the_users_own_and_not_a_symlink(tmp_path):
    from lossbeat.stack.private import UnsafeDirError, private_dir

    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.getuid() == 0:  # only root can make a folder owned by someone else
        os.chown(foreign, 12345, 12345)
        with pytest.raises(UnsafeDirError, match="belongs to uid 12345"):
            private_dir(foreign)
    dangling = tmp_path / "planted"
    dangling.symlink_to(tmp_path / "elsewhere")  # a dangling symlink where the folder would be
    with pytest.raises(UnsafeDirError, match="is a symlink"):
        private_dir(dangling)
    assert not (tmp_path / "elsewhere").exists()  # not created through it
    fresh = private_dir(tmp_path / "new")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700 and fresh.stat().st_uid == os.getuid()


def test_the_default_folder_is_per_user_not_a_shared_tmp_name(tmp_path, monkeypatch):
    from lossbeat.stack.private import default_dir

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert default_dir().name == f"lossbeat-stack-{os.getuid()}"
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_dir() == runtime / "lossbeat-stack"
    runtime.chmod(0o777)  # an XDG_RUNTIME_DIR others can write is not used
    assert default_dir().name == f"lossbeat-stack-{os.getuid()}"
    from lossbeat.stack.local import DEFAULT_DIR

    assert DEFAULT_DIR != Path(tempfile.gettempdir()) / "lossbeat-stack"


def test_clear_removes_a_dangling_symlink_instead_of_leaving_it_to_be_written_through(tmp_path):
    from lossbeat.stack.local import _clear

    workdir = private_dir_for_test(tmp_path)
    (workdir / "targets.tmp").symlink_to(tmp_path / "victim-file")
    _clear(workdir)
    assert not (workdir / "targets.tmp").is_symlink()
    write_targets_file(workdir / "targets.json", ["127.0.0.1:8470"])
    assert not (tmp_path / "victim-file").exists()


def private_dir_for_test(tmp_path: Path) -> Path:
    from lossbeat.stack.private import private_dir

    return private_dir(tmp_path / "stack-dir")
