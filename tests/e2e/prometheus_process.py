"""A bare Prometheus server (full or agent mode) on a free loopback port, with a config the
test writes: for set-ups the stack fixture does not cover (self-registration, sharding)."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import yaml

from lossbeat.stack.local import find_binary

from .e2e_harness import Prometheus, free_port, terminate, wait_until

__all__ = ["PrometheusProcess"]


class PrometheusProcess:
    """``prometheus`` with ``config`` (a dict) in ``workdir``; ``agent=True`` starts agent mode
    (scrape and remote-write only, no rules, no queries)."""

    def __init__(
        self,
        workdir: Path,
        config: dict,
        *,
        agent: bool = False,
        extra_flags: tuple[str, ...] = (),
        name: str = "prometheus",
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = Prometheus(self.url)
        config_path = self.workdir / f"{name}.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        storage = (
            [f"--storage.agent.path={self.workdir / (name + '-wal')}", "--enable-feature=agent"]
            if agent
            else [f"--storage.tsdb.path={self.workdir / (name + '-data')}"]
        )
        self.log_path = self.workdir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    find_binary("prometheus"),
                    f"--config.file={config_path}",
                    *storage,
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    *extra_flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def wait_ready(self, timeout: float = 60) -> PrometheusProcess:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_until(ready, timeout, f"{self.name} ready")
        return self

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        terminate(self.proc)
