"""HTTP serving of /metrics on a daemon thread, one port per local rank."""

from __future__ import annotations

import os
from dataclasses import dataclass

from prometheus_client.registry import CollectorRegistry

from .endpoint import start_server
from .webconfig import WebConfig

__all__ = ["RankContext", "MetricsServer"]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {raw!r}") from None


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in a torch.distributed job (from torchrun's variables)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> "RankContext":
        return cls(_env_int("RANK", 0), _env_int("LOCAL_RANK", 0), _env_int("WORLD_SIZE", 1))


class MetricsServer:
    """The /metrics endpoint (:mod:`lossbeat.endpoint`) on a daemon thread; ``port=0`` picks a free port.

    ``web_config``: TLS, mutual TLS and basic auth; ``certfile``/``keyfile`` are TLS alone."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        addr: str = "0.0.0.0",
        certfile: str | None = None,
        keyfile: str | None = None,
        web_config: WebConfig | None = None,
    ) -> None:
        if web_config is None and certfile is not None and keyfile is not None:
            web_config = WebConfig.from_tls_files(certfile, keyfile)
        try:
            self._server, self._thread = start_server(registry, port, addr, web_config)
        except OSError as exc:
            raise OSError(
                f"lossbeat: cannot serve metrics on {addr}:{port} ({exc.strerror or exc}); "
                "pass another port, or port=0 for a free one"
            ) from exc
        self.addr = addr
        self.port: int = self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
