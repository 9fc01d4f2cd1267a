"""Which rank each followed log is: ``lossbeat watch rank0.log rank1.log`` or ``'rank{rank}.log'``.

One log is one rank. Several logs, or one path with ``{rank}`` in it (expanded over
``--world-size``, so the files may not exist yet), are the ranks of one job: each gets its own
monitor, labelled with its rank and the job's world size, on ``port + rank``. A rank is the
number after ``rank`` in the file's name (``rank3.log``, ``train_rank-3.log``) when every name
has a different one, else the log's place in the list. Every rank reports the same world size,
as the in-process ranks do: the cross-rank alerts (``TrainingRankDown``) compare the ranks
reporting with it. Torch-free.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple, Sequence

__all__ = ["RankedLog", "assign_ranks", "RANK_FIELD"]

RANK_FIELD = "{rank}"
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


class RankedLog(NamedTuple):
    path: str
    rank: int
    world_size: int


def assign_ranks(paths: Sequence[str], rank: int | None = None, world_size: int | None = None) -> list[RankedLog]:
    """The logs with their ranks; raises ValueError naming the argument for a usage error."""
    if not paths:
        raise ValueError("path: at least one log to follow")
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size: expected a positive number of ranks, got {world_size}")
    if len(paths) == 1 and RANK_FIELD in paths[0]:
        if world_size is None:
            raise ValueError(f"--world-size: needed to expand {RANK_FIELD} in {paths[0]!r} (the number of ranks)")
        if rank is not None:
            raise ValueError(f"--rank: not with {RANK_FIELD} in the path (each log's rank is its number)")
        return [RankedLog(paths[0].replace(RANK_FIELD, str(r)), r, world_size) for r in range(world_size)]
    if len(paths) == 1:
        if rank is None:
            if world_size is not None:
                raise ValueError("--world-size: given without --rank (one log is one rank: say which)")
            return [RankedLog(paths[0], -1, 0)]  # rank and world size from the environment
        if rank < 0:
            raise ValueError(f"--rank: expected a rank >= 0, got {rank}")
        if world_size is None:
            raise ValueError(
                "--world-size: needed with --rank (every rank's watcher reports the job's "
                "world size, which TrainingRankDown compares the ranks reporting with)"
            )
        if rank >= world_size:
            raise ValueError(f"--rank: {rank} is not below --world-size {world_size}")
        return [RankedLog(paths[0], rank, world_size)]
    if rank is not None:
        raise ValueError("--rank: one log only (several logs: each one's rank is in its name, or its place)")
    if RANK_FIELD in "".join(paths):
        raise ValueError(f"path: {RANK_FIELD} in one path alone (it expands to every rank's log)")
    if len(set(map(os.path.abspath, paths))) < len(paths):
        raise ValueError("path: a log given twice")
    numbers = [m.group(1) if (m := _RANK_IN_NAME.search(os.path.basename(p))) else None for p in paths]
    if None not in numbers and len(set(map(int, numbers))) == len(paths):  # type: ignore[arg-type]
        ranks = [int(n) for n in numbers]  # type: ignore[arg-type]
    else:
        ranks = list(range(len(paths)))
    world = world_size if world_size is not None else max(len(paths), max(ranks) + 1)
    if max(ranks) >= world:
        raise ValueError(f"--world-size: {world} ranks, but a log is rank {max(ranks)}")
    return [RankedLog(p, r, world) for p, r in sorted(zip(paths, ranks), key=lambda pr: pr[1])]
