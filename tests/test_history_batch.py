"""History.defer: the usual records' windows written in batches leave every window, limit and
finding as one add_step per record leaves them, float for float; events are still counted on
their own record."""

import math
import random
import struct

import pytest

from lossbeat.diagnosis import Judge
from lossbeat.diagnosis.history import NO_EVENTS, History
from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.diagnosis.window import Ring, StepSummary

_NOT_STATE = {"_held", "_held_grads", "t", "thresholds"}


def first_difference(a, b, path="history"):
    """Where two histories differ: every attribute, recursively; floats bit for bit (NaN = NaN);
    rings by their values oldest first (a batch writes the same values, maybe from another slot)."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, float):
        same = struct.pack("d", a) == struct.pack("d", b) or (a != a and b != b)
        return None if same else f"{path}: {a!r} != {b!r}"
    if isinstance(a, Ring):
        return first_difference(a.last(len(a)), b.last(len(b)), path) or (
            None if a.capacity == b.capacity else f"{path}: capacity"
        )
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}[{k!r}]"))), None)
    if isinstance(a, (int, str, type(None))):
        return None if a == b else f"{path}: {a!r} != {b!r}"
    names = [n for cls in type(a).__mro__ for n in getattr(cls, "__slots__", ())] + list(getattr(a, "__dict__", {}))
    return next(
        (
            d
            for n in names
            if n not in _NOT_STATE
            if (d := first_difference(getattr(a, n), getattr(b, n), f"{path}.{n}"))
        ),
        None,
    )


def _records(seed: int, n: int):
    """A run with what real logs hold: noise, a trend, spikes, explosions, NaN/Inf, zeros (losses
    and norms), missing values, sparse and repeated steps, a restart, a component now and then."""
    rnd = random.Random(seed)
    kind = ("clean", "dirty", "sparse", "zeros")[seed % 4]
    step, level, g0 = 0, rnd.uniform(0.1, 5.0), rnd.uniform(0.1, 3.0)
    for i in range(n):
        step += rnd.choice((1, 1, 2, 5, 50)) if kind == "sparse" else 1
        if rnd.random() < 0.002:
            step -= rnd.randint(1, 100)  # the step goes back: the windows reset
        loss = level * (1 + 0.05 * rnd.gauss(0, 1)) / (1 + 1e-4 * i)
        r = rnd.random()
        if kind == "dirty" and r < 0.01:
            loss = rnd.choice((math.nan, math.inf, -math.inf))
        elif kind == "zeros" and r < 0.3:
            loss = rnd.choice((0.0, -0.0))
        elif r < 0.004:
            loss *= 20  # a spike
        elif r < 0.008:
            loss = None
        g = g0 * (1 + 0.1 * rnd.gauss(0, 1))
        r = rnd.random()
        if r < 0.02:
            g = None
        elif kind == "dirty" and r < 0.03:
            g = rnd.choice((math.nan, math.inf, 0.0))
        elif kind == "zeros" and r < 0.2:
            g = 0.0
        elif r < 0.035:
            g *= 50  # an explosion
        lr = 1e-3 * (1 - i / n) if rnd.random() > 0.02 else rnd.choice((None, math.nan))
        components = {"aux": 1.0 if loss is None else 0.5 * loss} if rnd.random() < 0.01 else None
        yield step, loss, g, lr, components


def _events(e):
    return e.nonfinite_loss, e.nonfinite_grad, e.spike, e.explosion


@pytest.mark.parametrize(
    "seed, profile",
    [(0, None), (1, "classification"), (2, "rl"), (3, "multi-task"), (5, None), (6, None), (7, "causal-lm")],
)
def test_a_batched_history_is_the_history_of_one_record_at_a_time(seed, profile):
    t = load_thresholds(profile=profile) if profile else load_thresholds()
    one, batched = History(t), History(t)
    rnd = random.Random(seed + 100)
    taken = 0
    for i, (step, loss, g, lr, components) in enumerate(_records(seed, 1500)):
        expected = _events(one.add_step(step, loss, g, lr, components))
        got = None if components else batched.defer(step, loss, g, lr)
        if got is None:
            got = batched.add_step(step, loss, g, lr, components)
        else:
            taken += 1
            assert got is NO_EVENTS
        assert _events(got) == expected, f"record {i}"  # an event on its own record, never a batch later
        # What the next record and the optimizer guard are judged against, at every record.
        assert (batched.loss.spike_limit(), batched.grad.event_limit()) == (
            one.loss.spike_limit(),
            one.grad.event_limit(),
        )
        assert len(batched._held) < t.windows.diagnose_every  # bounded: written at every refresh
        if rnd.random() < 0.03:
            batched.flush()
            assert first_difference(one, batched) is None, f"record {i}"
    batched.flush()
    assert first_difference(one, batched) is None
    assert taken > 1000  # most records were batched (the test would pass vacuously otherwise)


def test_the_judge_finds_the_same_with_batched_records():
    t = load_thresholds()
    one, batched = Judge(t), Judge(t)
    judged = 0
    for step, loss, g, lr, components in _records(1, 1200):
        one.history.add_step(step, loss, g, lr, components)
        if components or batched.history.defer(step, loss, g, lr) is None:
            batched.history.add_step(step, loss, g, lr, components)
        due = one.due(step)
        assert batched.due(step) == due
        if due:  # judged where the monitor and `lossbeat analyze` judge
            assert batched.judge(step) == one.judge(step)
            judged += 1
    assert judged > 50


def test_only_the_usual_record_is_held_back():
    h = History(load_thresholds())
    for step in range(300):
        assert h.defer(step, 2.0 + 0.01 * (step % 7), 0.5, 1e-3) is NO_EVENTS
    assert h.steps_seen + len(h._held) == 300 and len(h._held) < 10
    for args in [
        (300, None),
        (300, math.nan),
        (300, 2.0, math.inf),
        (300, 2.0, 0.0),
        (298, 2.0),
        (300, 50.0),
        (300, 2.0, 40.0),
    ]:  # no loss, NaN, Inf norm, zero norm, back, spike, explosion
        assert h.defer(*args) is None
    events = h.add_step(300, 50.0, 0.5)
    assert events.spike and h.steps_seen == 301 and not h._held  # add_step writes the batch first


def test_ring_and_summary_extend_as_their_pushes():
    for k in (1, 2, 7, 9, 10, 31):
        pushed, extended = Ring(9), Ring(9)
        values = [float(i) for i in range(k)]
        for start in range(3):
            for v in values:
                pushed.push(v + start)
            extended.extend([v + start for v in values])
            assert pushed.last(9) == extended.last(9) and len(pushed) == len(extended)
    pushed, extended = StepSummary(8), StepSummary(8)
    steps = [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610]
    for s in steps:
        pushed.push(s, s * 0.1)
    extended.extend(steps[:4], [s * 0.1 for s in steps[:4]])
    extended.extend(steps[4:], [s * 0.1 for s in steps[4:]])
    assert first_difference(pushed, extended) is None
