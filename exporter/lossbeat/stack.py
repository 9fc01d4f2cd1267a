"""``lossbeat stack``: Debian's Prometheus and Alertmanager on loopback, wired to lossbeat.

``stack up`` writes a Prometheus config that scrapes the exporter targets (through a
file_sd targets file, so targets can change while it runs), loads the shipped
``alerting/rules.yml`` and sends alerts to an Alertmanager running the shipped
``alerting/alertmanager.yml``. Everything lives in one folder under the temp dir; its
``state.json`` records the PIDs so that ``stack down`` stops exactly what ``up`` started.

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
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import yaml

__all__ = [
    "Stack",
    "MissingBinaryError",
    "render_prometheus_config",
    "write_targets_file",
    "write_target_groups",
    "find_binary",
    "add_arguments",
    "run",
]

INSTALL_HINT = "install them with: sudo apt-get install prometheus prometheus-alertmanager"
DEFAULT_TARGET = "127.0.0.1:8470"
DEFAULT_JOB = "training"
_REPO_ALERTING = Path(__file__).resolve().parents[2] / "alerting"
# Debian ships Alertmanager as `prometheus-alertmanager`; upstream tarballs as `alertmanager`.
_BINARIES = {
    "prometheus": ("prometheus",),
    "alertmanager": ("alertmanager", "prometheus-alertmanager"),
}


class MissingBinaryError(RuntimeError):
    """A server binary is not installed; the message says how to install it."""


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


def write_targets_file(path: Path, targets: Iterable[str], job: str = DEFAULT_JOB,
                       labels: dict[str, str] | None = None) -> None:
    """Write a Prometheus file_sd targets file atomically (Prometheus watches it)."""
    group = {"targets": list(targets), "labels": {"job": job, **(labels or {})}}
    write_target_groups(path, [group] if group["targets"] else [])


def write_target_groups(path: Path, groups: list[dict]) -> None:
    """Write file_sd target groups ({"targets": [...], "labels": {...}}) atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=2), encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file


def render_prometheus_config(*, targets_file: Path, rule_files: Sequence[Path], alertmanagers: Sequence[str],
                             scrape_interval: str = "5s", evaluation_interval: str | None = None) -> dict:
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
        "scrape_configs": [{
            "job_name": DEFAULT_JOB,
            # Short refresh as a fallback where inotify is unavailable.
            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
        }],
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
    """A Prometheus and an Alertmanager on 127.0.0.1, with config and data in ``workdir``."""

    workdir: Path
    prometheus_port: int = 9090
    alertmanager_port: int = 9093
    targets: Sequence[str] = (DEFAULT_TARGET,)
    job: str = DEFAULT_JOB
    scrape_interval: str = "5s"
    evaluation_interval: str | None = None
    rule_files: Sequence[Path] = (_REPO_ALERTING / "rules.yml",)
    alertmanager_config: Path = _REPO_ALERTING / "alertmanager.yml"
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
    def targets_file(self) -> Path:
        return Path(self.workdir) / "targets.json"

    @property
    def state_file(self) -> Path:
        return Path(self.workdir) / "state.json"

    def set_targets(self, targets: Iterable[str], job: str | None = None) -> None:
        """Replace the scraped targets; Prometheus picks the change up within seconds."""
        write_targets_file(self.targets_file, targets, job or self.job)

    def start(self, timeout: float = 30.0) -> None:
        """Write the configs, start both servers and wait until both report ready."""
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for server in ("prometheus", "alertmanager"):
            self.binaries[server] = find_binary(server)
        missing = [p for p in (*self.rule_files, self.alertmanager_config) if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"missing {', '.join(map(str, missing))}; generate with `lossbeat rules`")
        self.set_targets(self.targets)
        config = render_prometheus_config(
            targets_file=self.targets_file, rule_files=[Path(p).resolve() for p in self.rule_files],
            alertmanagers=[f"127.0.0.1:{self.alertmanager_port}", *self.extra_alertmanagers],
            scrape_interval=self.scrape_interval, evaluation_interval=self.evaluation_interval,
        )
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        try:
            self._spawn("alertmanager", [
                f"--config.file={Path(self.alertmanager_config).resolve()}",
                f"--storage.path={self.workdir / 'alertmanager-data'}",
                f"--web.listen-address=127.0.0.1:{self.alertmanager_port}",
                "--cluster.listen-address=",  # no gossip port: a single local instance
            ])
            self._spawn("prometheus", [
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.prometheus_port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1d",
            ])
            self._save_state()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop both servers by PID (Prometheus first, so it sends no alerts to a dead peer)."""
        for server in ("prometheus", "alertmanager"):
            pid = self.pids.pop(server, None)
            if pid is not None:
                stop_pid(pid, self.binaries.get(server, server))
        if self.state_file.exists():
            self.state_file.unlink()

    def running(self) -> dict[str, bool]:
        return {s: _is_our_process(pid, self.binaries.get(s, s)) for s, pid in self.pids.items()}

    def __enter__(self) -> "Stack":
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
            proc = subprocess.Popen([self.binaries[server], *args], stdout=log, stderr=log,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.pids[server] = proc.pid

    def _wait_ready(self, timeout: float) -> None:
        urls = {"prometheus": self.prometheus_url, "alertmanager": self.alertmanager_url}
        deadline = time.monotonic() + timeout
        pending = dict(urls)
        while pending:
            for server, url in list(pending.items()):
                if not self.running().get(server):
                    raise RuntimeError(f"{server} exited on start:\n{self.log_tail(server)}")
                if _http_ok(f"{url}/-/ready"):
                    del pending[server]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(pending)} not ready after {timeout:.0f}s")
            time.sleep(0.1)

    def _save_state(self) -> None:
        state = {
            "pids": self.pids, "binaries": self.binaries,
            "prometheus_url": self.prometheus_url, "alertmanager_url": self.alertmanager_url,
        }
        self.state_file.write_text(json.dumps(state, indent=2), encoding="utf-8")

    @classmethod
    def from_state(cls, workdir: Path) -> "Stack | None":
        """The stack a previous ``stack up`` left in ``workdir``, or None."""
        path = Path(workdir) / "state.json"
        if not path.exists():
            return None
        state = json.loads(path.read_text(encoding="utf-8"))
        ports = [int(state[f"{s}_url"].rsplit(":", 1)[1]) for s in ("prometheus", "alertmanager")]
        return cls(workdir=Path(workdir), prometheus_port=ports[0], alertmanager_port=ports[1],
                   pids={k: int(v) for k, v in state["pids"].items()}, binaries=state["binaries"])


# --- the command line ----------------------------------------------------------------

DEFAULT_DIR = Path(tempfile.gettempdir()) / "lossbeat-stack"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"config, data, logs and state (default {DEFAULT_DIR})")
    parser.add_argument("--prometheus-port", type=int, default=9090)
    parser.add_argument("--alertmanager-port", type=int, default=9093)
    parser.add_argument("--targets", default=DEFAULT_TARGET,
                        help="comma-separated exporter host:port list (default %(default)s; "
                             "each local rank listens on 8470 + LOCAL_RANK)")
    parser.add_argument("--job-name", default=DEFAULT_JOB, help="the job label of the targets")
    parser.add_argument("--scrape-interval", default="5s", help="scrape and rule evaluation interval")
    parser.add_argument("--rules", type=Path, action="append",
                        help="rules file (repeatable; default: alerting/rules.yml)")
    parser.add_argument("--thresholds", type=Path,
                        help="generate the rules from this thresholds file instead")
    parser.add_argument("--alertmanager-config", type=Path, default=_REPO_ALERTING / "alertmanager.yml")
    parser.add_argument("--foreground", action="store_true", help="wait; Ctrl-C stops everything")


def _generate_rules(thresholds: Path | None, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    source = ["--thresholds", str(thresholds)] if thresholds else []
    subprocess.run([sys.executable, "-m", "lossbeat", "rules", *source, "--output-dir", str(out_dir)], check=True)
    return out_dir / "rules.yml"


def _up(args: argparse.Namespace) -> int:
    previous = Stack.from_state(args.dir)
    if previous and any(previous.running().values()):
        print(f"stack already running ({previous.prometheus_url}); `lossbeat stack down` first",
              file=sys.stderr)
        return 1
    if args.dir.exists():
        shutil.rmtree(args.dir)  # stale data from a stack that is gone
    rules = args.rules or [_REPO_ALERTING / "rules.yml"]
    if args.thresholds or not all(Path(r).is_file() for r in rules) and not args.rules:
        # A custom thresholds file, or an install without the checkout's alerting/.
        rules = [_generate_rules(args.thresholds, args.dir / "rules")]
    stack = Stack(workdir=args.dir, prometheus_port=args.prometheus_port,
                  alertmanager_port=args.alertmanager_port,
                  targets=[t.strip() for t in args.targets.split(",") if t.strip()],
                  job=args.job_name, scrape_interval=args.scrape_interval,
                  rule_files=rules, alertmanager_config=args.alertmanager_config)
    try:
        stack.start()
    except MissingBinaryError as exc:
        print(f"lossbeat stack: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"lossbeat stack: {exc}", file=sys.stderr)
        return 1
    print(f"Prometheus:   {stack.prometheus_url}  (targets: {', '.join(stack.targets)}; "
          f"edit {stack.targets_file} to change them)")
    print(f"Alertmanager: {stack.alertmanager_url}")
    print(f"Logs and data: {stack.workdir}")
    if not args.foreground:
        print("Stop with: lossbeat stack down" + ("" if args.dir == DEFAULT_DIR else f" --dir {args.dir}"))
        return 0
    print("Ctrl-C stops both.")
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
    print(f"stopped prometheus and alertmanager ({args.dir})")
    return 0


def _status(args: argparse.Namespace) -> int:
    stack = Stack.from_state(args.dir)
    if stack is None:
        print(f"no stack recorded in {args.dir}")
        return 3
    ok = True
    for server, url in (("prometheus", stack.prometheus_url), ("alertmanager", stack.alertmanager_url)):
        alive = stack.running().get(server, False) and _http_ok(f"{url}/-/ready")
        ok &= alive
        print(f"{server:13} {url:24} {'up' if alive else 'DOWN'}")
    if ok:
        with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/targets", timeout=2) as resp:
            for target in json.load(resp)["data"]["activeTargets"]:
                print(f"  target {target['scrapeUrl']:32} {target['health']}")
        with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/alerts", timeout=2) as resp:
            for alert in json.load(resp)["data"]["alerts"]:
                print(f"  alert  {alert['labels']['alertname']:32} {alert['state']}")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status}[args.action](args)
