"""The shard handshake: before the first collective of a sharded or pipelined measurement, every
rank linked to this one through its process groups must have arrived, or the collective hangs.

Point to point with the default process group's store, not a collective, so a rank that
never comes (``if rank == 0: monitor.observe(...)``) cannot block it. The ranks that must come
are all those linked to this one through their groups (a 2-D mesh's row and column groups
meet other ranks' groups), not only its own groups' ranks: a *component*. It is found with
O(1) store requests per rank:

1. Each rank writes its own entry, its groups' ranks as arithmetic runs (``0-4095``: a few
   bytes for a mesh's group), and a pointer to the lowest rank of its own groups.
2. Pointers only go down, so following them ends at a rank that is the lowest of its own
   groups. That one closes the component over the entries (``multi_get``: a few requests,
   O(N) small values, on that rank alone) and either finds a lower rank, and points there,
   or is the component's lowest rank, its leader, and publishes the component's size.
   Under FSDP over the world every rank points at rank 0 at once.
3. Everyone meets at the leader's counter (``add``); the last arrival decides for all, and
   the others wait on the decision key on the store's side (``wait``: one request, no polling).

One decision for all, set once (compare-and-set), so no rank enters a collective the others
skip: ``reduce`` (all arrived by the deadline), ``late`` (all arrived by the deadline plus the
grace: a straggler, every rank still reduces) or ``absent`` (some rank never came: the usage
error). A rank that waited past the hard deadline for another's key marks it absent, so one
that comes later reads that instead of joining. Store failures raise to the caller.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Iterable, Sequence

__all__ = ["REDUCE", "LATE", "ABSENT", "meet", "encode_ranks", "decode_ranks"]

REDUCE, LATE, ABSENT = "reduce", "late", "absent"
_SKIP = "skip"  # the on-time decision when the deadline passed: the grace decides late or absent


def encode_ranks(ranks: Iterable[int]) -> str:
    """Sorted ranks as arithmetic runs: ``0-7`` (step 1), ``2-30/4``, single ranks; comma separated."""
    ranks = sorted(set(ranks))
    runs, i = [], 0
    while i < len(ranks):
        j = i + 1
        if j < len(ranks):
            step = ranks[j] - ranks[i]
            while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == step:
                j += 1
        if j < len(ranks) and j > i + 1:  # a run of three or more
            runs.append(f"{ranks[i]}-{ranks[j]}" + (f"/{step}" if step != 1 else ""))
            i = j + 1
        else:
            runs.append(str(ranks[i]))
            i += 1
    return ",".join(runs)


def decode_ranks(code: str) -> set[int]:
    out: set[int] = set()
    for run in filter(None, code.split(",")):
        first, _, rest = run.partition("-")
        if not rest:
            out.add(int(first))
            continue
        last, _, step = rest.partition("/")
        out.update(range(int(first), int(last) + 1, int(step or 1)))
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _wait_get(store: Any, key: str, until: float, mark: str) -> str:
    """``key``'s value once it exists; past ``until``, ``mark`` it (compare-and-set) and return
    what is there then: the mark, or the value that beat it. Waits on the store's side."""
    remaining = until - time.monotonic()
    if remaining > 0:
        try:
            store.wait([key], timedelta(seconds=remaining))
            return _text(store.get(key))
        except RuntimeError:  # the wait timed out (a dead store fails the compare-and-set below)
            pass
    return _text(store.compare_set(key, "", mark))


def _wait_all(store: Any, keys: list[str], until: float) -> bool:
    remaining = until - time.monotonic()
    try:
        store.wait(keys, timedelta(seconds=max(remaining, 0.001)))
        return True
    except RuntimeError:  # a timeout, or a dead store: the check raises then
        return bool(store.check(keys))


def _close(store: Any, prefix: str, rank: int, codes: Sequence[str], until: float) -> tuple[str, int] | None:
    """From a rank lowest among its own groups: ("leader", component size), ("defer", a lower
    rank of the component), or None when a rank of it never published by ``until``."""
    seen = set(codes)
    known = set().union(*map(decode_ranks, codes)) | {rank}
    pending = known - {rank}
    while pending:
        keys = [f"{prefix}/e/{r}" for r in sorted(pending)]
        if not _wait_all(store, keys, until):
            return None
        pending = set()
        for value in store.multi_get(keys):  # one request for them all
            for code in _text(value).split(";"):
                if code and code not in seen:  # identical groups expand once: O(N), not O(N^2)
                    seen.add(code)
                    new = decode_ranks(code) - known
                    known |= new
                    pending |= new
        lowest = min(known)
        if lowest < rank:
            return "defer", lowest
    return "leader", len(known)


def _leader(
    store: Any, prefix: str, rank: int, codes: Sequence[str], pointer: int, until: float
) -> tuple[int, int] | None:
    """(the component's leader, its size), following the pointers down; None: someone is absent."""
    cur = pointer
    while True:
        if cur == rank:  # the lowest of its own groups: close over the component
            found = _close(store, prefix, rank, codes, until)
            value = ABSENT if found is None else f"{found[0]} {found[1]}"
            if _text(store.compare_set(f"{prefix}/l/{rank}", "", value)) != value or found is None:
                return None  # someone waited for this rank past the deadline and marked it absent
            if found[0] == "leader":
                return rank, found[1]
            cur = found[1]
            continue
        value = _wait_get(store, f"{prefix}/l/{cur}", until, ABSENT)
        if value == ABSENT:
            return None
        kind, _, number = value.partition(" ")
        if kind == "leader":
            return cur, int(number)
        cur = int(number)  # "defer": strictly lower, so this ends


def _meet(store: Any, key: str, size: int, soft: float, hard: float) -> str:
    """``size`` ranks meet at ``key``: one decision for all, early and late."""
    if store.add(f"{key}/n", 1) >= size:  # the last arrival decides for all
        # Within its own timeout, all met in time; past it (it waited that long for the others'
        # entries), the meeting is late whatever the order of the last two arrivals.
        decided = _text(store.compare_set(f"{key}/d", "", REDUCE if time.monotonic() < soft else _SKIP))
        if decided == REDUCE:
            return REDUCE
        return _text(store.compare_set(f"{key}/late", "", LATE))  # late, unless the grace ran out
    if _wait_get(store, f"{key}/d", soft, _SKIP) == REDUCE:
        return REDUCE
    return _wait_get(store, f"{key}/late", hard, ABSENT)


def meet(store: Any, prefix: str, rank: int, groups: Sequence[Sequence[int]], timeout: float, grace: float) -> str:
    """REDUCE, LATE or ABSENT for ``rank``, whose process groups hold ``groups`` (ranks each),
    meeting the ranks linked to it at ``prefix`` in ``store`` (the same prefix on every rank).

    REDUCE: all arrived within ``timeout`` seconds; LATE: within ``timeout + grace``; ABSENT:
    not. Every rank of one component gets the same answer. Store errors raise.
    """
    soft = time.monotonic() + timeout
    hard = soft + grace
    codes = sorted({encode_ranks(g) for g in groups if len(g) > 1})
    own = set().union(*map(decode_ranks, codes)) | {rank}
    pointer = min(own)
    store.set(f"{prefix}/e/{rank}", ";".join(codes))
    if pointer != rank:  # not the lowest of its groups: point down at once
        value = f"defer {pointer}"
        if _text(store.compare_set(f"{prefix}/l/{rank}", "", value)) != value:
            return ABSENT  # it came after someone gave up waiting for it
    found = _leader(store, prefix, rank, codes, pointer, hard)
    if found is None:
        return ABSENT
    leader, size = found
    return _meet(store, f"{prefix}/m/{leader}", size, soft, hard)
