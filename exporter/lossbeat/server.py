"""HTTP serving of /metrics on a daemon thread, one port per local rank."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

__all__ = ["RankContext", "MetricsServer"]

log = logging.getLogger("lossbeat")

# bind() errors that mean "this port, not this address": another port may work.
_PORT_UNAVAILABLE = frozenset({errno.EADDRINUSE, errno.EACCES})


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
    """prometheus_client's WSGI server on a daemon thread; ``port=0`` picks a free port.

    A taken port (two jobs sharing a node both want ``8470 + LOCAL_RANK``) is not fatal:
    the server falls back to a free port the OS picks and logs one line naming both
    (``fallback`` is then True; file_sd self-registration tells Prometheus the real port).
    ``strict_port=True`` raises instead.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        addr: str = "0.0.0.0",
        certfile: str | None = None,
        keyfile: str | None = None,
        *,
        strict_port: bool = False,
    ) -> None:
        self.addr = addr
        self.requested_port = port
        self.fallback = False
        try:
            self._server, self._thread = self._start(registry, port, certfile, keyfile)
        except OSError as exc:
            if strict_port or port == 0 or exc.errno not in _PORT_UNAVAILABLE:
                raise OSError(exc.errno, self._bind_error(port, exc, strict_port)) from exc
            self._server, self._thread = self._start(registry, 0, certfile, keyfile)
            self.fallback = True
            log.warning(
                "lossbeat: port %s:%d is unavailable (%s: another job on this node?); serving /metrics on "
                "port %d instead. Prometheus finds it through file_sd self-registration (LOSSBEAT_FILE_SD_DIR); "
                "strict_port=True makes a taken port an error",
                addr, port, exc.strerror or exc, self._server.server_address[1],
            )
        self.port: int = self._server.server_address[1]

    def _start(self, registry: CollectorRegistry, port: int, certfile: str | None, keyfile: str | None):
        return start_http_server(port, addr=self.addr, registry=registry, certfile=certfile, keyfile=keyfile)

    def _bind_error(self, port: int, exc: OSError, strict_port: bool) -> str:
        reason = exc.strerror or str(exc)
        if strict_port and exc.errno in _PORT_UNAVAILABLE:
            return (f"lossbeat: cannot serve metrics on {self.addr}:{port} ({reason}) and strict_port=True; "
                    f"free port {port} (another job on this node?), pass another base port "
                    "(start_exporter(port=...)), port=0 for a free one, or strict_port=False to fall back "
                    "to a free port")
        return (f"lossbeat: cannot serve metrics on {self.addr}:{port} ({reason}); "
                "check addr (an address of this host), or pass port=0 for a free port")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
