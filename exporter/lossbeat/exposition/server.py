"""HTTP serving of /metrics on a daemon thread, one port per local rank; where this process sits in the job."""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.registry import CollectorRegistry

from lossbeat.exposition.endpoint import start_server
from lossbeat.exposition.scrapers import Scrapers
from lossbeat.exposition.status import StatusSource
from lossbeat.exposition.webconfig import WebConfig

__all__ = ["RankContext", "MetricsServer"]

log = logging.getLogger("lossbeat")

# bind() errors that mean "this port, not this address": another port may work.
_PORT_UNAVAILABLE = frozenset({errno.EADDRINUSE, errno.EACCES})


log = logging.getLogger("lossbeat")

# Launchers' variables as (launcher, rank, local rank, world size), most specific first:
# torchrun inside an srun step, or mpirun inside an sbatch script, inherit the Slurm
# variables of the step that launched them (SLURM_PROCID=0 in every process).
_LAUNCHERS = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpich", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
)
_HOST_WAIT_S = 30.0
"""How long a rank waits, once, for the lower ranks' host names in the process group's store."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {raw!r}") from None


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in a distributed job: global rank, rank on its node, world size."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    source: str = field(default="default", compare=False)
    """Where the values came from: a launcher's name, "process group", "trainer" or "default"."""

    def __post_init__(self) -> None:
        for name in ("rank", "local_rank", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "world_size" else 0):
                raise ValueError(f"{name}: expected an int >= {1 if name == 'world_size' else 0}, got {value!r}")

    @classmethod
    def detect(cls) -> RankContext:
        """From the initialised default process group (rank, world size) when there is one, else
        from the launcher's variables (:meth:`from_env`).

        A group started without launcher variables (``torch.multiprocessing.spawn`` with
        ``init_process_group(rank=..., world_size=...)``) gives no local rank: each rank then
        writes its host name to the group's store and counts the lower ranks on its host
        (waiting up to 30 s, once, for them to start their monitors; no collective).
        """
        initialised = False
        if "torch" in sys.modules:  # a process that never imported torch has no process group
            try:
                import torch.distributed as dist

                initialised = dist.is_available() and dist.is_initialized()
            except ImportError:  # pragma: no cover - torch without distributed support
                pass
        env = cls.from_env()
        if not initialised:
            return env
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # The launcher's local rank holds when its ranks are the group's: not when one srun task
        # (SLURM_LOCALID=0) spawns the group's processes itself.
        if env.source != "default" and (env.rank, env.world_size) == (rank, world_size):
            return cls(rank, env.local_rank, world_size, env.source)
        return cls(rank, _local_rank_from_store(dist, rank), world_size, "process group")

    @classmethod
    def from_env(cls) -> RankContext:
        """From the launcher's variables: torchrun (RANK, LOCAL_RANK, WORLD_SIZE), Open MPI
        (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_RANK, MPI_LOCALRANKID, PMI_SIZE), Slurm
        (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS), or Lightning's launcher (LOCAL_RANK,
        NODE_RANK, WORLD_SIZE, no RANK); rank 0 of 1 when there are none."""
        for launcher, rank_name, local_name, size_name in _LAUNCHERS:
            rank = _env_int(rank_name)
            if rank is None:
                continue
            local_rank = _env_int(local_name)
            world_size = _env_int(size_name)
            return cls(rank, rank if local_rank is None else local_rank, world_size or rank + 1, launcher)
        local_rank = _env_int("LOCAL_RANK")
        if local_rank is not None:  # Lightning's subprocess launcher: no global rank given
            world_size = _env_int("WORLD_SIZE") or local_rank + 1
            node_rank = _env_int("NODE_RANK") or _env_int("GROUP_RANK") or 0
            per_node = _env_int("LOCAL_WORLD_SIZE") or (world_size if node_rank == 0 else None)
            if per_node is None:
                log.warning(
                    "lossbeat: NODE_RANK=%s without LOCAL_WORLD_SIZE: the global rank is unknown "
                    "until the process group starts; using LOCAL_RANK",
                    node_rank,
                )
                return cls(local_rank, local_rank, world_size, "lightning")
            return cls(node_rank * per_node + local_rank, local_rank, world_size, "lightning")
        return cls()


def _local_rank_from_store(dist: Any, rank: int) -> int:
    """The number of lower ranks on this host, through the default group's key-value store.

    Key writes and reads only: a rank waits for the lower ranks' keys, never for a
    collective, so a rank that builds its monitor alone cannot hang the job.
    """
    host = socket.gethostname()
    try:
        store = dist.PrefixStore("lossbeat/host/", dist.distributed_c10d._get_default_store())
        store.set(str(rank), host)
        if rank == 0:
            return 0
        keys = [str(r) for r in range(rank)]
        store.wait(keys, datetime.timedelta(seconds=_HOST_WAIT_S))
        hosts = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
        return sum(1 for h in hosts if h.decode() == host)
    except Exception as exc:
        log.warning(
            "lossbeat: no local rank from the launcher or the process group's store (%s); "
            "using the global rank %d; pass rank_context=RankContext(...) to start_exporter to choose",
            exc,
            rank,
        )
        return rank


class MetricsServer:
    """The /metrics endpoint (:mod:`lossbeat.exposition.endpoint`) on a daemon thread; ``port=0`` picks a free port.

    ``web_config``: TLS, mutual TLS and basic auth; ``certfile``/``keyfile`` are TLS alone.
    A taken port (two jobs sharing a node both want ``8470 + LOCAL_RANK``) is not fatal:
    the server falls back to a free port the OS picks and logs one line naming both
    (``fallback`` is then True; file_sd self-registration tells Prometheus the real port).
    ``strict_port=True`` raises instead. ``status``: the monitor's status page at ``/``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        addr: str = "0.0.0.0",
        certfile: str | None = None,
        keyfile: str | None = None,
        web_config: WebConfig | None = None,
        *,
        strict_port: bool = False,
        status: StatusSource | None = None,
    ) -> None:
        if web_config is None and certfile is not None and keyfile is not None:
            web_config = WebConfig.from_tls_files(certfile, keyfile)
        self.addr = addr
        self.requested_port = port
        self.fallback = False
        self.scrapers = Scrapers()
        """Who scrapes /metrics, each on its own (the linger after the completion marker waits for each)."""
        try:
            self._server, self._thread = start_server(registry, port, addr, web_config, self.scrapers, status)
        except OSError as exc:
            if strict_port or port == 0 or exc.errno not in _PORT_UNAVAILABLE:
                raise OSError(exc.errno, self._bind_error(port, exc, strict_port)) from exc
            self._server, self._thread = start_server(registry, 0, addr, web_config, self.scrapers, status)
            self.fallback = True
            log.warning(
                "lossbeat: port %s:%d is unavailable (%s: another job on this node?); serving /metrics on "
                "port %d instead. Prometheus finds it through file_sd self-registration (LOSSBEAT_FILE_SD_DIR); "
                "strict_port=True makes a taken port an error",
                addr,
                port,
                exc.strerror or exc,
                self._server.server_address[1],
            )
        self.port: int = self._server.server_address[1]
        self._pid = os.getpid()
        _serving.add(self)

    def _bind_error(self, port: int, exc: OSError, strict_port: bool) -> str:
        reason = exc.strerror or str(exc)
        if strict_port and exc.errno in _PORT_UNAVAILABLE:
            return (
                f"lossbeat: cannot serve metrics on {self.addr}:{port} ({reason}) and strict_port=True; "
                f"free port {port} (another job on this node?), pass another base port "
                "(start_exporter(port=...)), port=0 for a free one, or strict_port=False to fall back "
                "to a free port"
            )
        return (
            f"lossbeat: cannot serve metrics on {self.addr}:{port} ({reason}); "
            "check addr (an address of this host), or pass port=0 for a free port"
        )

    def close(self) -> None:
        _serving.discard(self)
        if self._pid != os.getpid():  # a forked copy: its serving thread stayed in the parent
            self._server.server_close()
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


_serving: weakref.WeakSet[MetricsServer] = weakref.WeakSet()


def _close_inherited_sockets() -> None:
    """In a forked child (a DataLoader worker, a ddp_fork rank): close the listening sockets it
    inherited, so the parent's close() frees the port and no scrape reaches a process that
    never answers."""
    for server in list(_serving):
        server.close()


os.register_at_fork(after_in_child=_close_inherited_sockets)
