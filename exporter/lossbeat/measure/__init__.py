"""Measure (torch): fused gradient norms, layer grouping, shards and pipeline stages, memory, cross-rank signals."""
