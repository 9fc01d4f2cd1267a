"""Bounded windows over a series of floats, with O(1) updates.

A :class:`Ring` keeps the last ``capacity`` values (a push is one list write); the
statistics over it are computed when they are read (the diagnosis, every
``windows.diagnose_every`` records, or a scrape), never kept up to date per push.
:class:`StepSummary` summarises a whole run in a fixed number of blocks.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable, Iterator, Sequence

__all__ = ["Ring", "LossWindow", "StepSummary", "SortedValues", "NoiseWindow", "fsum", "median", "robust_noise"]


def fsum(values: Iterable[float]) -> float:
    """``math.fsum``, except that a sum beyond the float range is +-inf (data), not an OverflowError."""
    if type(values) is not list and type(values) is not tuple:  # read twice below: a generator once
        values = list(values)
    try:
        return math.fsum(values)
    except OverflowError:  # finite values near 1.8e308: the exact sum does not fit a float
        return sum(values)


class Ring:
    """The last ``capacity`` floats; memory is fixed at construction."""

    __slots__ = ("_data", "_capacity", "_next", "_count")

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        self._data = [0.0] * capacity
        self._capacity = capacity
        self._next = 0
        self._count = 0

    def push(self, value: float) -> None:
        self._data[self._next] = value
        self._next = (self._next + 1) % self._capacity
        if self._count < self._capacity:
            self._count += 1

    def extend(self, values: Sequence[float]) -> None:
        """``push`` each of ``values``, in order: at most two slice writes."""
        k, capacity, data = len(values), self._capacity, self._data
        if k >= capacity:  # only the last `capacity` stay
            data[:] = values[k - capacity :]
            self._next, self._count = 0, capacity
            return
        start = self._next
        end = start + k
        if end <= capacity:
            data[start:end] = values
        else:
            data[start:] = values[: capacity - start]
            data[: end - capacity] = values[capacity - start :]
        self._next = end % capacity
        self._count = min(self._count + k, capacity)

    def back(self, k: int) -> float:
        """The value ``k`` pushes ago (0 = the newest)."""
        if not 0 <= k < self._count:
            raise IndexError(k)
        return self._data[(self._next - 1 - k) % self._capacity]

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return self._capacity

    def __iter__(self) -> Iterator[float]:
        """Oldest to newest."""
        return iter(self.last(self._count))

    def last(self, n: int) -> list[float]:
        """The newest ``n`` values (or fewer), oldest first: list slices (this runs every step)."""
        n = min(n, self._count)
        if n <= 0:
            return []
        start = self._next - n
        if start >= 0:
            return self._data[start : self._next]
        # Wrapped: only a full ring wraps (before that, _next == _count >= n).
        return self._data[start:] + self._data[: self._next]

    def clear(self) -> None:
        self._next = 0
        self._count = 0


class LossWindow:
    """Finite losses, and the raw statistics the exporter publishes (computed when read).

    ``cv()``: std / mean over the last ``cv_steps``; ``trend_ratio()``:
    (mean of the ``trend_steps`` before the last ``trend_steps`` - mean of the
    last ``trend_steps``) / the former, positive when the loss falls. A push is one
    ring write: the statistics are read at scrape time, not every step, so they are
    summed from the ring then (O(window), exact) instead of kept up to date per push.
    """

    __slots__ = ("ring", "trend_steps", "cv_steps")

    def __init__(self, cv_steps: int, trend_steps: int, history: int = 0) -> None:
        self.cv_steps = cv_steps
        self.trend_steps = trend_steps
        self.ring = Ring(max(cv_steps, 2 * trend_steps, history) + 1)

    def push(self, value: float) -> None:
        self.ring.push(value)

    def __len__(self) -> int:
        return self.ring._count

    def _cv_window(self) -> tuple[int, float, float]:
        """(count, mean, population std) of the last ``cv_steps`` values."""
        values = self.ring.last(self.cv_steps)
        n = len(values)
        if not n:
            return 0, math.nan, math.nan
        mean = fsum(values) / n
        return n, mean, math.sqrt(fsum([(v - mean) * (v - mean) for v in values]) / n)

    def mean(self) -> float:
        return self._cv_window()[1]

    def std(self) -> float:
        """Population standard deviation."""
        return self._cv_window()[2]

    def cv(self) -> float:
        """NaN until the window holds two values or when the mean is not positive."""
        n, mean, std = self._cv_window()
        if n < 2 or not mean > 0:
            return math.nan
        return std / mean

    def _halves(self) -> tuple[float, float]:
        """(mean of the previous ``trend_steps``, mean of the last ``trend_steps``); NaN until both are full."""
        k = self.trend_steps
        values = self.ring.last(2 * k)
        if len(values) < 2 * k:
            return math.nan, math.nan
        return fsum(values[:k]) / k, fsum(values[k:]) / k

    def trend_ratio(self) -> float:
        """NaN until both halves are full or when the previous mean is not positive."""
        previous, recent = self._halves()
        if not previous > 0:
            return math.nan
        return (previous - recent) / previous

    def detrended_cv(self) -> float:
        """Std of the CV window around its least-squares line, over its mean.

        A steadily falling loss has a large plain CV but is not volatile; this
        measures the jitter around the trend. O(window): for the periodic
        diagnosis, not the per-step path.
        """
        values = self.ring.last(self.cv_steps)
        n = len(values)
        mean = fsum(values) / n if n else math.nan
        if n < 3 or not mean > 0:
            return math.nan
        x_mean = (n - 1) / 2
        sxx = sum((i - x_mean) ** 2 for i in range(n))
        slope = sum((i - x_mean) * (v - mean) for i, v in enumerate(values)) / sxx
        residuals = [v - (mean + slope * (i - x_mean)) for i, v in enumerate(values)]
        return math.sqrt(fsum(r * r for r in residuals) / n) / mean

    def trend_noise_ratio(self) -> float:
        """Standard error of ``trend_ratio()`` if the window were pure noise (0 when unknown)."""
        previous, _ = self._halves()
        std = self._cv_window()[2]
        if not previous > 0 or not math.isfinite(std):
            return 0.0
        return std / previous * math.sqrt(2.0 / self.trend_steps)

    def clear(self) -> None:
        self.ring.clear()


def median(values: Sequence[float] | Ring) -> float:
    """The median of a non-empty list or ring (NaN for an empty one)."""
    n = len(values)
    if not n:
        return math.nan
    s = sorted(values)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def robust_noise(values: list[float]) -> float:
    """Standard deviation of the record-to-record noise, robust to the trend and to outliers.

    From second differences (x[i+1] - 2 x[i] + x[i-1], which cancel any locally
    linear trend, even a steep one in a sparse log): for white noise of standard
    deviation s they have standard deviation s * sqrt(6); their median absolute
    value x 1.4826 estimates that, ignoring the few large ones a fast initial fall
    (14.7, 1.2, 0.8, ...) or a single spike makes. NaN with fewer than 4 values.
    """
    if len(values) < 4:
        return math.nan
    second = [abs(c - 2.0 * b + a) for a, b, c in zip(values, values[1:], values[2:])]
    return 1.4826 * median(second) / math.sqrt(6.0)


class SortedValues:
    """A multiset of floats kept in the order ``sorted()`` gives them (equal values in the order
    they came, so 0.0 and -0.0 too): a change is a bisection and a C memmove, the median O(1)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, x: float) -> None:
        bisect.insort(self.values, x)  # after its equals: the order of arrival

    def remove_oldest(self, x: float) -> None:
        """Remove the earliest-added value equal to ``x`` (of its sign, for a zero)."""
        values = self.values
        i = bisect.bisect_left(values, x)
        if x == 0.0:
            sign = math.copysign(1.0, x)
            while math.copysign(1.0, values[i]) != sign:
                i += 1
        del values[i]

    def median(self) -> float:
        """:func:`median` of the values, the same float."""
        s = self.values
        n = len(s)
        if not n:
            return math.nan
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])

    def clear(self) -> None:
        self.values = []


class NoiseWindow:
    """The last ``size`` values of a :class:`Ring` sorted, their second differences sorted and
    their exact zeros counted, updated at each push: what a refresh of the robust level and noise
    (:func:`median`, :func:`robust_noise`) reads, in O(1) instead of sorting the window again.

    The ring must hold ``size + 1`` values (the one leaving is read from it)."""

    __slots__ = ("size", "values", "seconds", "zeros")

    def __init__(self, size: int) -> None:
        self.size = size
        self.values = SortedValues()
        self.seconds = SortedValues()
        self.zeros = 0

    def update(self, ring: Ring) -> None:
        """After ``ring.push``: the newest value in, the one ``size`` back out (every step:
        :class:`SortedValues`' operations written out, without their calls)."""
        data, capacity, newest, n = ring._data, ring._capacity, ring._next - 1, ring._count
        size = self.size
        values, seconds = self.values.values, self.seconds.values
        if n > size:  # the window slid: its oldest value and oldest second difference leave
            a = data[(newest - size) % capacity]
            if a == 0.0:
                self.values.remove_oldest(a)
                self.zeros -= 1
            else:
                del values[bisect.bisect_left(values, a)]
            if size >= 3:
                b, c = data[(newest - size + 1) % capacity], data[(newest - size + 2) % capacity]
                second = abs(c - 2.0 * b + a)
                del seconds[bisect.bisect_left(seconds, second)]  # >= 0.0: no -0.0 among them
        value = data[newest % capacity]
        bisect.insort(values, value)
        if value == 0.0:
            self.zeros += 1
        if n >= 3 and size >= 3:
            a, b = data[(newest - 2) % capacity], data[(newest - 1) % capacity]
            bisect.insort(seconds, abs(value - 2.0 * b + a))

    def extend(self, ring: Ring, new: Sequence[float]) -> None:
        """Push ``new`` to ``ring`` and update the window as ``update`` after each push would, to the
        same sorted lists: what leaves (read before the ring drops it) is removed first, then what
        comes is inserted in order (a multiset: equal values are interchangeable, and zeros keep
        their order of arrival, sign by sign, either way)."""
        k, size = len(new), self.size
        if k == 1 or size < 3 or k > size - 3 or ring._capacity <= size:  # one at a time
            for value in new:
                ring.push(value)
                self.update(ring)
            return
        count = ring._count
        held = min(size, count)
        old = ring.last(held)  # the window before (the last `size` values)
        leaving = max(0, held + k - size)  # its oldest values, which the new ones push out
        values, seconds = self.values.values, self.seconds.values
        for i in range(leaving):
            a = old[i]
            if a == 0.0:
                self.values.remove_oldest(a)
                self.zeros -= 1
            else:
                del values[bisect.bisect_left(values, a)]
            second = abs(old[i + 2] - 2.0 * old[i + 1] + a)  # its second difference leaves with it
            del seconds[bisect.bisect_left(seconds, second)]
        # In by one stable sort each: equal values stay in their order of arrival, after the ones
        # already there (where insort puts each), and the sort compares floats directly.
        values += new
        values.sort()
        self.zeros += new.count(0.0)
        tail = old[-2:] + list(new)  # each new value's second difference, once two came before it
        seconds += [abs(c - 2.0 * b + a) for a, b, c in zip(tail, tail[1:], tail[2:])]
        seconds.sort()
        ring.extend(new)

    def rebuild(self, ring: Ring) -> None:
        self.clear()
        values = ring.last(self.size)
        for v in values:
            self.values.add(v)
        self.zeros = values.count(0.0)
        for a, b, c in zip(values, values[1:], values[2:]):
            self.seconds.add(abs(c - 2.0 * b + a))

    def __len__(self) -> int:
        return len(self.values.values)

    def noise(self) -> float:
        """:func:`robust_noise` of the window, the same float."""
        if len(self.values.values) < 4:
            return math.nan
        return 1.4826 * self.seconds.median() / math.sqrt(6.0)

    def clear(self) -> None:
        self.values.clear()
        self.seconds.clear()
        self.zeros = 0


class StepSummary:
    """The whole run's values summarised in at most ``capacity`` blocks of equal width in steps.

    Each block keeps (first step, count, sum); when the blocks fill up,
    neighbours merge and the width doubles, so memory is fixed and a window of
    N steps means the same whether the log holds every step or every 500th.
    """

    __slots__ = (
        "capacity",
        "width",
        "blocks",
        "first_step",
        "last_step",
        "_starts",
        "_added",
        "_starts_at",
        "_ordered",
        "_merges",
        "_best_states",
        "_window_sums",
    )

    def __init__(self, capacity: int = 128) -> None:
        if not isinstance(capacity, int) or capacity < 4 or capacity % 2:
            raise ValueError(f"capacity: expected an even int >= 4, got {capacity!r}")
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        self.width = 1
        self.blocks: list[list[float]] = []  # [first step, count, sum]
        self.first_step: int | None = None
        self.last_step: int | None = None
        self._starts: list[float] = []
        self._added = 0  # blocks added or merged so far
        self._starts_at = -1  # ... when _starts was read
        self._ordered = True  # blocks in ascending order (a step before the last block's breaks it)
        self._merges = 0
        self._best_states: dict[tuple[int, int], tuple[int, float, float, int, float]] = {}
        """best()'s loop state over the blocks that no longer change, by (window blocks, min_count)."""
        self._window_sums: dict[tuple[int, int], tuple[float, float]] = {}
        """window()'s (count, sum) over blocks[i:j] that no longer change, by (i, j)."""

    def push(self, step: int, value: float) -> None:
        self.extend((step,), (value,))

    def extend(self, steps: Sequence[int], values: Sequence[float]) -> None:
        """``push`` each (step, value), in order: the same blocks, the same sums."""
        if self.first_step is None:
            self.first_step = steps[0]
        first, width, blocks = self.first_step, self.width, self.blocks
        last = blocks[-1] if blocks else None
        for step, value in zip(steps, values):
            start = first + (step - first) // width * width
            if last is not None and last[0] == start:
                last[1] += 1
                last[2] += value
                continue
            if last is not None and start < last[0]:
                self._ordered = False
            last = [float(start), 1.0, value]
            blocks.append(last)
            self._added += 1
            if len(blocks) > self.capacity:
                while len(self.blocks) > self.capacity:
                    self._merge(first)
                width, blocks = self.width, self.blocks
                last = blocks[-1]
        self.last_step = steps[-1]

    def _merge(self, first_step: int) -> None:
        """Merge neighbouring blocks; ``first_step``: the summary's (set by then, passed by extend())."""
        self.width *= 2
        self._merges += 1
        self._best_states.clear()
        self._window_sums.clear()
        merged: list[list[float]] = []
        for first, count, total in self.blocks:
            start = first_step + (int(first) - first_step) // self.width * self.width
            if merged and merged[-1][0] == start:
                merged[-1][1] += count
                merged[-1][2] += total
            else:
                merged.append([float(start), count, total])
        self.blocks = merged

    def _block_starts(self) -> list[float]:
        """The blocks' first steps, ascending: rebuilt only when a block was added or merged
        (a block's first step never changes), so the diagnosis finds windows by bisection."""
        if self._starts_at != self._added:
            self._starts = [b[0] for b in self.blocks]
            self._starts_at = self._added
        return self._starts

    @property
    def span(self) -> int:
        """Steps from the first value to the last (0 when empty)."""
        first, last = self.first_step, self.last_step
        return 0 if first is None or last is None else last - first  # both set by the first extend()

    def window(self, start: float, end: float) -> tuple[int, float]:
        """(count, mean) of the values in blocks starting in ``(start, end]``."""
        count, total = 0.0, 0.0
        if not self._ordered:
            for first, n, s in self.blocks:
                if start < first <= end:
                    count += n
                    total += s
            return int(count), (total / count if count else math.nan)
        starts = self._block_starts()
        i, j = bisect.bisect_right(starts, start), bisect.bisect_right(starts, end)
        if i >= j:
            return 0, math.nan
        # The same additions, in the same order, as over every block: only the ones inside. All but
        # the last block no longer change (until a merge): their part of the loop is kept, by (i, j),
        # and the last one, still filling, is added to it as the loop would add it.
        blocks = self.blocks
        filling = j == len(blocks)
        closed = j - 1 if filling else j
        kept = self._window_sums.get((i, closed))
        if kept is None:
            for _, n, s in blocks[i:closed]:
                count += n
                total += s
            if len(self._window_sums) >= 16:
                self._window_sums.clear()
            self._window_sums[(i, closed)] = (count, total)
        else:
            count, total = kept
        if filling:
            last = blocks[-1]
            count += last[1]
            total += last[2]
        return int(count), (total / count if count else math.nan)

    def best(self, width: float, min_count: int, end: float) -> tuple[int, float]:
        """(count, mean) of the lowest-mean window of ``width`` steps (block-aligned) ending by ``end``,
        among those holding at least ``min_count`` values; (0, nan) when none does. O(blocks)."""
        if self._ordered:
            starts = self._block_starts()
            cut = bisect.bisect_right(starts, end)
            if cut > 1 and starts[cut - 1] - starts[0] == (cut - 1) * self.width and width > 0:
                # A block leaves the window once it starts `width` or more before the newest: for
                # contiguous blocks, after ceil(width / block width) of them, unless `width` is a
                # hair from a multiple of the block width, where the loop's rounding decides.
                multiple = round(width / self.width) * self.width
                if width == multiple or abs(width - multiple) > 1e-9 * max(1.0, width, abs(starts[cut - 1])):
                    return self._best_contiguous(math.ceil(width / self.width), min_count, cut)
            blocks = self.blocks[:cut]
        else:
            blocks = [b for b in self.blocks if b[0] <= end]
            starts = [b[0] for b in blocks]
        best_n, best_mean = 0, math.nan
        i, count, total = 0, 0.0, 0.0
        for first, n, s in blocks:
            count += n
            total += s
            while starts[i] <= first - width:
                leaving = blocks[i]
                count -= leaving[1]
                total -= leaving[2]
                i += 1
            if count >= min_count and (best_n == 0 or total / count < best_mean):
                best_n, best_mean = int(count), total / count
        return best_n, best_mean

    def _best_contiguous(self, m: int, min_count: int, cut: int) -> tuple[int, float]:
        """best() over ``blocks[:cut]``, contiguous (each ``width`` steps after the one before),
        where a window is the last ``m`` blocks: the same loop, resumed where the previous call
        with these ``m`` and ``min_count`` left it over the blocks that have not changed since
        (all but the last, which still fills, until a merge): the same additions in the same
        order, so the same floats, without redoing the whole run at every diagnosis."""
        blocks = self.blocks
        key = (m, min_count)
        state = self._best_states.get(key)
        if state is None or state[0] > cut:
            k, count, total, best_n, best_mean = 0, 0.0, 0.0, 0, math.nan
        else:
            k, count, total, best_n, best_mean = state
        keep = min(cut, len(blocks) - 1)  # the state after blocks[:keep], which no longer change
        for j in range(k, cut):
            block = blocks[j]
            count += block[1]
            total += block[2]
            if j >= m:  # the block leaving the window (the loop's `while starts[i] <= first - width`)
                leaving = blocks[j - m]
                count -= leaving[1]
                total -= leaving[2]
            if count >= min_count and (best_n == 0 or total / count < best_mean):
                best_n, best_mean = int(count), total / count
            if j + 1 == keep:
                if len(self._best_states) >= 8 and key not in self._best_states:
                    del self._best_states[next(iter(self._best_states))]
                self._best_states[key] = (keep, count, total, best_n, best_mean)
        return best_n, best_mean

    def __len__(self) -> int:
        return int(sum(b[1] for b in self.blocks))
