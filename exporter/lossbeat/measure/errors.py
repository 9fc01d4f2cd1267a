"""The gradient measurement's errors, importable without torch (the monitor names them before any model comes)."""

from __future__ import annotations

__all__ = ["ShardedMeasurementError", "ShardHandshakeError"]


class ShardedMeasurementError(RuntimeError):
    """Not every rank of a sharded model measures its gradients: the collective would hang."""


class ShardHandshakeError(RuntimeError):
    """The shard handshake's store failed, or every rank came but late: the exporter's trouble,
    not a usage error (``clip_grad_norm_`` clips as torch does instead of raising)."""
