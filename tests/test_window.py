import math
import random
import statistics
import tracemalloc

import pytest

from lossbeat.diagnosis.window import LossWindow, Ring


def test_ring_keeps_the_last_values_in_order():
    ring = Ring(3)
    for v in [1.0, 2.0, 3.0, 4.0, 5.0]:
        ring.push(v)
    assert list(ring) == [3.0, 4.0, 5.0]
    assert ring.back(0) == 5.0 and ring.back(2) == 3.0
    assert ring.last(2) == [4.0, 5.0]
    with pytest.raises(IndexError):
        ring.back(3)


def test_ring_rejects_a_bad_capacity():
    with pytest.raises(ValueError, match="capacity"):
        Ring(0)


def test_loss_window_statistics_match_a_full_recomputation():
    rng = random.Random(1)
    window = LossWindow(cv_steps=50, trend_steps=20)
    values = []
    for i in range(2345):  # many laps of the ring, so drift control runs
        v = 2.0 + math.sin(i / 30) + rng.gauss(0, 0.2)
        values.append(v)
        window.push(v)
        if i % 97 == 0 and i >= 40:
            last50 = values[-50:]
            assert window.cv() == pytest.approx(statistics.pstdev(last50) / statistics.fmean(last50), rel=1e-9)
            recent, previous = statistics.fmean(values[-20:]), statistics.fmean(values[-40:-20])
            assert window.trend_ratio() == pytest.approx((previous - recent) / previous, rel=1e-9, abs=1e-12)


def test_trend_is_unknown_until_both_halves_are_full():
    window = LossWindow(cv_steps=50, trend_steps=20)
    for i in range(39):
        window.push(3.0 - i * 0.01)
    assert math.isnan(window.trend_ratio())
    window.push(2.6)
    assert window.trend_ratio() > 0  # falling loss -> positive ratio


def test_memory_is_fixed_whatever_the_number_of_pushes():
    window = LossWindow(cv_steps=50, trend_steps=20)
    for i in range(1000):
        window.push(float(i % 13))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(200_000):
        window.push(float(i % 13))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 20_000
    assert len(window) == window.ring.capacity == 51


def test_detrended_cv_ignores_a_steady_descent_but_not_jitter():
    steady, jittery = LossWindow(50, 20), LossWindow(50, 20)
    rng = random.Random(3)
    for i in range(50):
        steady.push(4.0 - 0.05 * i)  # falls from 4.0 to 1.55: a large plain CV
        jittery.push(2.0 + (0.8 if i % 2 else -0.8) + rng.gauss(0, 0.01))
    assert steady.cv() > 0.2
    assert steady.detrended_cv() == pytest.approx(0.0, abs=1e-9)
    assert jittery.detrended_cv() == pytest.approx(0.4, rel=0.02)
    assert math.isnan(LossWindow(50, 20).detrended_cv())


def test_robust_noise_ignores_a_steep_trend_and_outliers():
    from lossbeat.diagnosis.window import robust_noise

    rng = random.Random(5)
    noisy = [10.0 - 0.5 * i + rng.gauss(0, 0.1) for i in range(400)]  # steep fall + noise 0.1
    assert robust_noise(noisy) == pytest.approx(0.1, rel=0.15)
    with_spikes = [2.0 + rng.gauss(0, 0.05) + (3.0 if i % 50 == 0 else 0.0) for i in range(400)]
    assert robust_noise(with_spikes) == pytest.approx(0.05, rel=0.15)
    assert robust_noise([14.7, 1.2, 0.8] + [0.75] * 50) < 0.01  # the first fall is not noise
    assert math.isnan(robust_noise([1.0, 2.0, 3.0]))


def test_step_summary_windows_are_in_steps_whatever_the_log_interval():
    from lossbeat.diagnosis.window import StepSummary

    dense, sparse = StepSummary(64), StepSummary(64)
    for s in range(100000):
        dense.push(s, s / 1000.0)
        if s % 500 == 0:
            sparse.push(s, s / 1000.0)
    assert len(dense.blocks) <= 64 and len(sparse.blocks) <= 64  # memory fixed
    assert dense.span == 99999 and sparse.span == 99500
    for summary in (dense, sparse):
        count, mean = summary.window(75000, 100000)
        assert mean == pytest.approx(87.5, abs=1.5)  # the mean of the steps in (75000, 100000]
    assert dense.window(75000, 100000)[0] > 100 * sparse.window(75000, 100000)[0]
    dense.clear()
    assert dense.span == 0 and len(dense) == 0
    with pytest.raises(ValueError, match="capacity"):
        StepSummary(5)


def test_step_summary_windows_are_the_loop_over_their_blocks_bit_for_bit():
    """window() keeps the sums over blocks that no longer change: the same floats as the plain loop,
    as the last block fills, new blocks come and blocks merge."""
    from lossbeat.diagnosis.window import StepSummary

    def loop(summary, start, end):
        count = total = 0.0
        for first, n, s in summary.blocks:
            if start < first <= end:
                count += n
                total += s
        return int(count), (total / count if count else math.nan)

    rng = random.Random(3)
    summary = StepSummary(16)
    step = 0
    for i in range(3000):
        step += rng.choice((1, 1, 1, 3))
        summary.push(step, rng.uniform(0.1, 10.0) * 1e-3 ** rng.random())
        if i % 7 == 0:
            for _ in range(3):
                width = rng.uniform(1.0, 0.6 * max(1, summary.span))
                end = summary.last_step - rng.choice((0.0, width / 2.0, width))
                got, expected = summary.window(end - width, end), loop(summary, end - width, end)
                assert got[0] == expected[0] and (
                    got[1] == expected[1] or got[1] != got[1] and expected[1] != expected[1]
                )
    assert summary.width > 1  # the blocks merged along the way
