"""``lossbeat stack``: Debian's Prometheus and Alertmanager on loopback, wired to lossbeat.

``stack up`` writes a Prometheus config that scrapes the exporter targets (through a
file_sd targets file, so targets can change while it runs), loads rules generated from the
thresholds (the packaged ones, or ``--thresholds``) and sends alerts to an Alertmanager
running the packaged ``alertmanager.yml``, whose page and ticket webhooks reach a local
receiver (:mod:`lossbeat.stack.webhook`) that records what arrives. It needs nothing from the
repository: it works from an installed package in an empty folder. Everything lives in one
private folder (``$XDG_RUNTIME_DIR/lossbeat-stack``, else ``<tmp>/lossbeat-stack-<uid>``; mode
0700, owned by the user, checked before anything is read or written there: see
:func:`private_dir`); its ``state.json`` records the PIDs so that ``stack down`` stops
exactly what ``up`` started, and ``stack status`` shows each firing alert, the receiver
Alertmanager routed it to and whether the notification arrived.

The end-to-end tests reuse :class:`Stack` with their own ports, rules and timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from lossbeat.diagnosis.thresholds import ThresholdsError, load_thresholds
from lossbeat.exposition.registration import write_atomic
from lossbeat.mixin import rules as rules_module
from lossbeat.mixin.generated import shipped_text, with_runbook_base
from lossbeat.stack.alerts import alert_lines, scraped_targets
from lossbeat.stack.private import UnsafeDirError, default_dir, private_dir
from lossbeat.stack.webhook import read_notifications

__all__ = [
    "Stack",
    "MissingBinaryError",
    "render_prometheus_config",
    "write_targets_file",
    "write_target_groups",
    "find_binary",
    "private_dir",
    "alert_lines",
    "add_arguments",
    "run",
]

INSTALL_HINT = "install them with: sudo apt-get install prometheus prometheus-alertmanager"
DEFAULT_TARGET = "127.0.0.1:8470"
DEFAULT_JOB = "training"
# Where the shipped alertmanager.yml sends its page and ticket webhooks; the stack's receiver
# listens there (or the stack rewrites these URLs to the receiver's own port).
SHIPPED_RECEIVER = "127.0.0.1:5001"
# Debian ships Alertmanager as `prometheus-alertmanager`; upstream tarballs as `alertmanager`.
_BINARIES = {
    "prometheus": ("prometheus",),
    "alertmanager": ("alertmanager", "prometheus-alertmanager"),
}


class MissingBinaryError(RuntimeError):
    """A server binary is not installed; the message says how to install it."""


class PortInUseError(RuntimeError):
    """A port the stack needs is taken; the message names it and the option to change it."""


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do: a port in TIME_WAIT is free, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_binary(server: str) -> str:
    """Path of the ``prometheus`` or ``alertmanager`` binary (env LOSSBEAT_<SERVER> wins)."""
    override = os.environ.get(f"LOSSBEAT_{server.upper()}")
    if override:
        if not os.access(override, os.X_OK):
            raise MissingBinaryError(f"LOSSBEAT_{server.upper()}={override} is not an executable")
        return override
    for name in _BINARIES[server]:
        found = shutil.which(name)
        if found:
            return found
    raise MissingBinaryError(f"{server} is not installed; {INSTALL_HINT}")


def write_targets_file(
    path: Path, targets: Iterable[str], job: str = DEFAULT_JOB, labels: dict[str, str] | None = None
) -> None:
    """Write a Prometheus file_sd targets file atomically (Prometheus watches it)."""
    group = {"targets": list(targets), "labels": {"job": job, **(labels or {})}}
    write_target_groups(path, [group] if group["targets"] else [])


def write_target_groups(path: Path, groups: list[dict]) -> None:
    """Write file_sd target groups ({"targets": [...], "labels": {...}}) atomically."""
    write_atomic(Path(path), json.dumps(groups, indent=2))


def render_prometheus_config(
    *,
    targets_file: Path,
    rule_files: Sequence[Path],
    alertmanagers: Sequence[str],
    scrape_interval: str = "5s",
    evaluation_interval: str | None = None,
) -> dict:
    """The Prometheus configuration as a dict: one file_sd scrape job, rules, Alertmanagers.

    The scrape job's own name is a fallback: every target group sets its ``job`` label.
    """
    return {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": evaluation_interval or scrape_interval,
        },
        "rule_files": [str(p) for p in rule_files],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]},
        "scrape_configs": [
            {
                "job_name": DEFAULT_JOB,
                # Short refresh as a fallback where inotify is unavailable.
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
            }
        ],
    }


def _http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _is_our_process(pid: int, binary: str) -> bool:
    """True if ``pid`` is alive and runs ``binary`` (guards against PID reuse; Linux /proc).

    Reads /proc/PID/exe, which is set as soon as exec starts (cmdline is briefly
    empty then) and is gone once the process is a zombie.
    """
    try:
        return os.path.realpath(os.readlink(f"/proc/{pid}/exe")) == os.path.realpath(binary)
    except OSError:
        return False


def stop_pid(pid: int, binary: str, timeout: float = 10.0) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; only if ``pid`` still runs ``binary``."""
    if not _is_our_process(pid, binary):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # Reap it if it is our child; otherwise poll /proc.
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            if not _is_our_process(pid, binary):
                return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)  # reap our child; another process's child is reaped by its parent
    except ChildProcessError:
        pass


@dataclass
class Stack:
    """A Prometheus and an Alertmanager (and, with ``receiver_port``, the webhook receiver) on
    127.0.0.1, with config, data and logs in ``workdir``."""

    workdir: Path
    prometheus_port: int = 9090
    alertmanager_port: int = 9093
    targets: Sequence[str] = (DEFAULT_TARGET,)
    job: str = DEFAULT_JOB
    scrape_interval: str = "5s"
    evaluation_interval: str | None = None
    rule_files: Sequence[Path] = ()
    """Rules to load; empty: ``rules.yml`` generated into ``workdir`` from ``thresholds``."""
    alertmanager_config: Path | None = None
    """Alertmanager configuration; None: the packaged ``alertmanager.yml``."""
    thresholds: Path | None = None
    """Thresholds file the generated rules use (None: the packaged defaults)."""
    receiver_port: int | None = None
    """Port of the local webhook receiver to run (None: none). Webhooks of the configuration
    that point at the shipped receiver address (127.0.0.1:5001) are sent to it."""
    extra_alertmanagers: Sequence[str] = ()
    """Further host:port Alertmanagers Prometheus also sends to (started by the caller)."""
    pids: dict[str, int] = field(default_factory=dict)
    binaries: dict[str, str] = field(default_factory=dict)

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    @property
    def alertmanager_url(self) -> str:
        return f"http://127.0.0.1:{self.alertmanager_port}"

    @property
    def receiver_url(self) -> str | None:
        return None if self.receiver_port is None else f"http://127.0.0.1:{self.receiver_port}"

    @property
    def notifications_file(self) -> Path:
        return Path(self.workdir) / "notifications.jsonl"

    @property
    def targets_file(self) -> Path:
        return Path(self.workdir) / "targets.json"

    @property
    def state_file(self) -> Path:
        return Path(self.workdir) / "state.json"

    def set_targets(self, targets: Iterable[str], job: str | None = None) -> None:
        """Replace the scraped targets; Prometheus picks the change up within seconds."""
        write_targets_file(self.targets_file, targets, job or self.job)

    def start(self, timeout: float = 30.0) -> None:
        """Write the configs, start the servers (and the receiver) and wait until all report ready."""
        self.workdir = private_dir(Path(self.workdir))
        for server in ("prometheus", "alertmanager"):
            self.binaries[server] = find_binary(server)
        ports = {
            "prometheus": self.prometheus_port,
            "alertmanager": self.alertmanager_port,
            "receiver": self.receiver_port,
        }
        for server, port in ports.items():
            if port is not None and not _port_free(port):
                raise PortInUseError(
                    f"port {port} ({server}) is in use on 127.0.0.1; pass --{server}-port with a free one"
                )
        missing = [p for p in (*self.rule_files, self.alertmanager_config) if p and not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(
                f"missing {', '.join(map(str, missing))}; write them with `lossbeat generate --output-dir DIR`"
            )
        rule_files = [Path(p).resolve() for p in self.rule_files] or [self._generate_rules()]
        am_config = self._alertmanager_config()
        self.set_targets(self.targets)
        config = render_prometheus_config(
            targets_file=self.targets_file,
            rule_files=rule_files,
            alertmanagers=[f"127.0.0.1:{self.alertmanager_port}", *self.extra_alertmanagers],
            scrape_interval=self.scrape_interval,
            evaluation_interval=self.evaluation_interval,
        )
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        try:
            if self.receiver_port is not None:
                self.binaries["receiver"] = sys.executable
                runbooks = self.workdir / "runbooks.md"
                runbooks.write_text(shipped_text("runbooks.md"), encoding="utf-8")
                # Run as a file in isolated mode: stdlib only, without importing lossbeat (and torch).
                self._spawn(
                    "receiver",
                    [
                        "-I",
                        str(Path(__file__).with_name("webhook.py")),
                        f"--port={self.receiver_port}",
                        f"--log={self.notifications_file}",
                        f"--runbooks={runbooks}",
                        f"--targets={self.targets_file}",
                    ],
                )
            self._spawn(
                "alertmanager",
                [
                    f"--config.file={am_config}",
                    f"--storage.path={self.workdir / 'alertmanager-data'}",
                    f"--web.listen-address=127.0.0.1:{self.alertmanager_port}",
                    "--cluster.listen-address=",  # no gossip port: a single local instance
                ],
            )
            self._spawn(
                "prometheus",
                [
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                    f"--web.listen-address=127.0.0.1:{self.prometheus_port}",
                    "--web.enable-lifecycle",
                    "--storage.tsdb.retention.time=1d",
                ],
            )
            self._save_state()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _generate_rules(self) -> Path:
        """``rules.yml`` from the thresholds; with a receiver, runbook links point at its /runbooks."""
        thresholds = load_thresholds(self.thresholds)
        if self.receiver_url:
            thresholds = with_runbook_base(thresholds, f"{self.receiver_url}/runbooks")
        path = self.workdir / "rules.yml"
        path.write_text(rules_module.render_rules(thresholds), encoding="utf-8")
        return path

    def _alertmanager_config(self) -> Path:
        """The configuration Alertmanager runs: the given or packaged one, its webhooks to the
        shipped receiver address sent to this stack's receiver."""
        if self.alertmanager_config is not None and self.receiver_port is None:
            return Path(self.alertmanager_config).resolve()
        text = (
            Path(self.alertmanager_config).read_text(encoding="utf-8")
            if self.alertmanager_config
            else shipped_text("alertmanager.yml")
        )
        config = yaml.safe_load(text)
        if self.receiver_port is not None:
            for receiver in config.get("receivers") or []:
                for hook in receiver.get("webhook_configs") or []:
                    hook["url"] = hook["url"].replace(f"//{SHIPPED_RECEIVER}/", f"//127.0.0.1:{self.receiver_port}/")
        path = self.workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        return path

    def stop(self) -> None:
        """Stop the servers by PID (Prometheus first, so it sends no alerts to a dead peer)."""
        for server in ("prometheus", "alertmanager", "receiver"):
            pid = self.pids.pop(server, None)
            if pid is not None:
                stop_pid(pid, self.binaries.get(server, server))
        if self.state_file.exists():
            self.state_file.unlink()

    def running(self) -> dict[str, bool]:
        return {s: _is_our_process(pid, self.binaries.get(s, s)) for s, pid in self.pids.items()}

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, server: str, lines: int = 20) -> str:
        path = self.workdir / f"{server}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _spawn(self, server: str, args: list[str]) -> None:
        log = open(self.workdir / f"{server}.log", "ab")
        with log:
            # Own session: a Ctrl-C meant for the shell does not reach a detached stack.
            proc = subprocess.Popen(
                [self.binaries[server], *args], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.pids[server] = proc.pid

    def _wait_ready(self, timeout: float) -> None:
        urls = {"prometheus": self.prometheus_url, "alertmanager": self.alertmanager_url}
        if self.receiver_url:
            urls["receiver"] = self.receiver_url
        deadline = time.monotonic() + timeout
        pending = dict(urls)
        while pending:
            for server, url in list(pending.items()):
                if not self.running().get(server):
                    raise RuntimeError(
                        f"{server} exited on start: {self.log_tail(server, 1) or '(no output)'} "
                        f"(log: {self.workdir / (server + '.log')})"
                    )
                if _http_ok(f"{url}/-/ready"):
                    del pending[server]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(pending)} not ready after {timeout:.0f}s")
            time.sleep(0.1)

    def _save_state(self) -> None:
        state = {
            "pids": self.pids,
            "binaries": self.binaries,
            "prometheus_url": self.prometheus_url,
            "alertmanager_url": self.alertmanager_url,
            "receiver_url": self.receiver_url,
        }
        self.state_file.write_text(json.dumps(state, indent=2), encoding="utf-8")

    @classmethod
    def from_state(cls, workdir: Path) -> Stack | None:
        """The stack a previous ``stack up`` left in ``workdir``, or None."""
        path = Path(workdir) / "state.json"
        if not path.exists():
            return None
        state = json.loads(path.read_text(encoding="utf-8"))
        ports = [int(state[f"{s}_url"].rsplit(":", 1)[1]) for s in ("prometheus", "alertmanager")]
        receiver = state.get("receiver_url")
        return cls(
            workdir=Path(workdir),
            prometheus_port=ports[0],
            alertmanager_port=ports[1],
            receiver_port=int(receiver.rsplit(":", 1)[1]) if receiver else None,
            pids={k: int(v) for k, v in state["pids"].items()},
            binaries=state["binaries"],
        )


# --- the command line ----------------------------------------------------------------

DEFAULT_DIR = default_dir()
# What `up` may delete in --dir from an earlier stack; anything else there is left alone.
_STACK_FILES = (
    "prometheus-data",
    "alertmanager-data",
    "prometheus.log",
    "alertmanager.log",
    "receiver.log",
    "prometheus.yml",
    "alertmanager.yml",
    "rules.yml",
    "runbooks.md",
    "targets.json",
    "targets.tmp",
    "notifications.jsonl",
    "state.json",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="config, data, logs and state (default: $XDG_RUNTIME_DIR/lossbeat-stack, else <tmp>/lossbeat-stack-<uid>)",
    )
    parser.add_argument("--prometheus-port", type=int, default=9090)
    parser.add_argument("--alertmanager-port", type=int, default=9093)
    parser.add_argument(
        "--receiver-port",
        type=int,
        default=5001,
        help="the local webhook receiver for pages and tickets (default %(default)s; 0: run none)",
    )
    parser.add_argument(
        "--targets",
        default=DEFAULT_TARGET,
        help="comma-separated exporter host:port list (default %(default)s; "
        "each local rank listens on 8470 + LOCAL_RANK)",
    )
    parser.add_argument("--job-name", default=DEFAULT_JOB, help="the job label of the targets")
    parser.add_argument("--scrape-interval", default="5s", help="scrape and rule evaluation interval")
    parser.add_argument(
        "--rules", type=Path, action="append", help="rules file (repeatable; default: generated from the thresholds)"
    )
    parser.add_argument(
        "--thresholds", type=Path, help="thresholds file the rules are generated from (default: the packaged one)"
    )
    parser.add_argument(
        "--alertmanager-config", type=Path, help="Alertmanager configuration (default: the packaged alertmanager.yml)"
    )
    parser.add_argument("--foreground", action="store_true", help="wait; Ctrl-C stops everything")


def _clear(workdir: Path) -> None:
    """Remove what an earlier stack left in ``workdir`` (its own files only)."""
    for name in _STACK_FILES:
        path = workdir / name
        if path.is_symlink():  # dangling or not: removed, never followed
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _up(args: argparse.Namespace) -> int:
    previous = Stack.from_state(args.dir)
    if previous and any(previous.running().values()):
        print(f"stack already running ({previous.prometheus_url}); `lossbeat stack down` first", file=sys.stderr)
        return 1
    _clear(args.dir)  # stale data from a stack that is gone
    stack = Stack(
        workdir=args.dir,
        prometheus_port=args.prometheus_port,
        alertmanager_port=args.alertmanager_port,
        targets=[t.strip() for t in args.targets.split(",") if t.strip()],
        job=args.job_name,
        scrape_interval=args.scrape_interval,
        rule_files=args.rules or (),
        thresholds=args.thresholds,
        alertmanager_config=args.alertmanager_config,
        receiver_port=args.receiver_port or None,
    )
    try:
        stack.start()
    except MissingBinaryError as exc:
        print(f"lossbeat stack: {exc}", file=sys.stderr)
        return 2
    except ThresholdsError as exc:
        print(f"lossbeat stack: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"lossbeat stack: {exc}", file=sys.stderr)
        return 1
    print(
        f"Prometheus:   {stack.prometheus_url}  (targets: {', '.join(stack.targets)}; "
        f"edit {stack.targets_file} to change them)"
    )
    print(f"              alerts: {stack.prometheus_url}/classic/alerts")
    print(
        f"Alertmanager: {stack.alertmanager_url}  (no web UI in Debian's package: "
        f"amtool --alertmanager.url={stack.alertmanager_url} alert query)"
    )
    if stack.receiver_url:
        print(
            f"Receiver:     {stack.receiver_url}  (pages and tickets land in {stack.notifications_file}; "
            f"shown, linked to each rank's status page, at {stack.receiver_url}/; "
            f"runbooks at {stack.receiver_url}/runbooks)"
        )
    print(f"Logs and data: {stack.workdir}")
    where = "" if args.dir == DEFAULT_DIR else f" --dir {args.dir}"
    print(f"Firing alerts and their notifications: lossbeat stack status{where}")
    if not args.foreground:
        print(f"Stop with: lossbeat stack down{where}")
        return 0
    print("Ctrl-C stops everything.")
    try:
        while all(stack.running().values()):
            time.sleep(0.5)
        print("a server exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def _down(args: argparse.Namespace) -> int:
    stack = Stack.from_state(args.dir)
    if stack is None:
        print(f"no stack recorded in {args.dir}")
        return 0
    stack.stop()
    print(f"stopped {', '.join(sorted(stack.binaries))} ({args.dir})")
    return 0


def _get_json(url: str) -> Any:  # Any: the servers' JSON, read by key where it is used
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def _status(args: argparse.Namespace) -> int:
    stack = Stack.from_state(args.dir)
    if stack is None:
        print(f"no stack recorded in {args.dir}")
        return 3
    ok = True
    servers = [("prometheus", stack.prometheus_url), ("alertmanager", stack.alertmanager_url)]
    if stack.receiver_url:
        servers.append(("receiver", stack.receiver_url))
    for server, url in servers:
        alive = stack.running().get(server, False) and _http_ok(f"{url}/-/ready")
        ok &= alive
        print(f"{server:13} {url:24} {'up' if alive else 'DOWN'}")
    if not ok:
        return 1
    try:
        active = _get_json(f"{stack.prometheus_url}/api/v1/targets")["data"]["activeTargets"]
        for target in active:
            print(f"  target {target['scrapeUrl']:32} {target['health']}")
        prometheus_alerts = _get_json(f"{stack.prometheus_url}/api/v1/alerts")["data"]["alerts"]
        alertmanager_alerts = _get_json(f"{stack.alertmanager_url}/api/v2/alerts")
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        print(f"lossbeat stack: cannot read the servers' APIs: {exc}", file=sys.stderr)
        return 1
    notifications = read_notifications(stack.notifications_file) if stack.receiver_url else None
    lines = alert_lines(prometheus_alerts, alertmanager_alerts, notifications, scraped_targets(active))
    print("\n".join(lines) if lines else "  no alerts pending or firing")
    return 0


def run(args: argparse.Namespace) -> int:
    try:  # before anything in the folder is read (state.json names pids to stop) or written
        private_dir(args.dir, create=args.action == "up")
    except UnsafeDirError as exc:
        print(f"lossbeat stack: {exc}", file=sys.stderr)
        return 2
    return {"up": _up, "down": _down, "status": _status}[args.action](args)
