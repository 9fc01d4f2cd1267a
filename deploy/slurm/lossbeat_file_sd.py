#!/usr/bin/env python3
"""Write a Prometheus file_sd targets file for one training job: every node, every local rank.

    lossbeat_file_sd.py --job lm-train --local-ranks 8 --output /shared/sd/lossbeat-42.json node01 node02

Rank r of a node serves /metrics on ``base_port + LOCAL_RANK``. The file has one target
group per node, labelled with the training job's name (the ``job`` label alerts group by)
and the node. Written atomically: Prometheus never reads half a file. Standard library only,
so it runs on any login or compute node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

__all__ = ["target_groups", "main"]


def target_groups(
    nodes: list[str], job: str, local_ranks: int, base_port: int = 8470, extra_labels: dict[str, str] | None = None
) -> list[dict]:
    """One file_sd target group per node, with a target per local rank."""
    return [
        {
            "targets": [f"{node}:{base_port + local_rank}" for local_rank in range(local_ranks)],
            "labels": {"job": job, "node": node, **(extra_labels or {})},
        }
        for node in nodes
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nodes", nargs="+", help="host names (e.g. from `scontrol show hostnames`)")
    parser.add_argument("--job", required=True, help="the job label: the training run's name")
    parser.add_argument("--local-ranks", type=int, default=8, help="ranks per node (default 8)")
    parser.add_argument("--base-port", type=int, default=8470, help="port of LOCAL_RANK 0 (default 8470)")
    parser.add_argument("--slurm-job-id", help="added as the slurm_job_id label")
    parser.add_argument("--output", required=True, help="targets file to write ('-' for stdout)")
    args = parser.parse_args(argv)
    if args.local_ranks < 1:
        parser.error("--local-ranks must be >= 1")
    labels = {"slurm_job_id": args.slurm_job_id} if args.slurm_job_id else {}
    text = json.dumps(target_groups(args.nodes, args.job, args.local_ranks, args.base_port, labels), indent=2)
    if args.output == "-":
        print(text)
        return 0
    folder = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as tmp:
        os.fchmod(tmp.fileno(), 0o644)  # on the open file, never by path: no TOCTOU in a shared folder
        tmp.write(text + "\n")
    os.replace(tmp.name, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
