"""Rule-test scenarios of the alerts that compare the ranks of a job: a rank down, a rank's loss
apart from the others', a straggler, replicas whose gradient norms disagree. The expected values
are computed as PromQL computes them (its quantile's interpolation, the median and MAD)."""

from __future__ import annotations

import math

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.mixin.alert_rules import JOB_RANK, MAD_TO_SIGMA, RANK_SEEN_LOOKBACK, duration_seconds
from lossbeat.mixin.rule_series import JOB, Expect, Scenario, Series, _Builder, _target, run

__all__ = ["cross_rank"]


def _quantile(values: list[float], q: float) -> float:
    """PromQL's quantile(): linear interpolation between the closest ranks."""
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = max(0, math.floor(rank))
    high = min(len(ordered) - 1, low + 1)
    weight = rank - math.floor(rank)
    return ordered[low] * (1 - weight) + ordered[high] * weight


def _spread_firing(t: Thresholds, losses: list[float]) -> dict[str, float]:
    """Reference of TrainingLossRankSpread: {rank: robust z} of the ranks that depart."""
    c = t.cross_rank
    if len(losses) < c.min_ranks:
        return {}
    median = _quantile(losses, 0.5)
    mad = _quantile([abs(x - median) for x in losses], 0.5)
    out = {}
    for rank, x in enumerate(losses):
        z = MAD_TO_SIGMA * (x - median) / mad if mad else math.copysign(math.inf, x - median)
        if abs(z) > c.loss_spread_z and abs(x - median) > c.loss_spread_min_relative * abs(median):
            out[str(rank)] = z
    return out


def cross_rank(b: _Builder) -> dict[str, list[Scenario]]:
    a, c = b.t.alerts, b.t.cross_rank

    def job_labels(rank: str, **extra: str) -> dict[str, str]:
        return {**{k: v for k, v in _target(rank).items() if k in JOB_RANK}, **extra}

    down = b.rule("TrainingRankDown")
    up_for = 3
    fires = b.after_for(a.rank_down_for, start=up_for * b.i)
    samples = int(fires // b.i) + 2

    def info(rank: str, world: int, values: list[str] | None = None) -> Series:
        labels = {**_target(rank), "run": "test", "profile": b.t.profile.name, "world_size": str(world)}
        return Series("training_run_info", labels, values or [run(1, samples)])

    gone = [run(1, up_for), "stale"]
    beyond = duration_seconds(RANK_SEEN_LOOKBACK) + 15 * b.i
    long = int(beyond // b.i) + 2
    out = {
        down.name: [
            Scenario(
                "a rank that stops reporting fires, named",
                [info("0", 4), info("1", 4), info("2", 4), info("3", 4, gone)],
                [
                    (fires, down.name, [Expect(down, job_labels("3", world_size="4"), 3)]),
                    (fires - 2 * b.i, down.name, []),
                ],
            ),
            Scenario("all ranks reporting is silent", [info(str(r), 4) for r in range(4)], [(fires, down.name, [])]),
            Scenario(
                "a job whose ranks all ended is silent",
                [info(str(r), 4, gone) for r in range(4)],
                [(fires, down.name, [])],
            ),
            Scenario("a single-rank job is silent", [info("0", 1)], [(fires, down.name, [])]),
            # Named while the lookback group remembers it (past the raw samples' window), unknown after.
            Scenario(
                f"a rank gone half an hour is still named, unknown after {RANK_SEEN_LOOKBACK}",
                [*(info(str(r), 4, [run(1, long)]) for r in range(3)), info("3", 4, gone)],
                [
                    (1800.0, down.name, [Expect(down, job_labels("3", world_size="4"), 3)]),
                    (beyond, down.name, [Expect(down, {"job": JOB, "rank": "unknown", "world_size": "4"}, 3)]),
                ],
            ),
        ]
    }

    spread = b.rule("TrainingLossRankSpread")
    at = b.after_for(a.loss_spread_for)
    samples = int(at // b.i) + 2
    base, rel = 2.0, c.loss_spread_min_relative
    noise = [0.0, 0.01, -0.01, 0.005]  # relative per-rank noise: the healthy spread of data shards

    def scenario(name: str, losses: list[float], without_loss: int = 0) -> Scenario:
        """``without_loss``: more ranks that export no loss (pipeline stages before the last):
        they take no part in the median, the MAD or the rank count."""
        series = [b.hold("training_loss", _target(str(r)), x, samples) for r, x in enumerate(losses)]
        series += [
            b.hold("training_grad_norm", _target(str(r)), 1.0, samples)
            for r in range(len(losses), len(losses) + without_loss)
        ]
        firing = _spread_firing(b.t, losses)
        return Scenario(
            name, series, [(at, spread.name, [Expect(spread, job_labels(r), z) for r, z in firing.items()])]
        )

    healthy = [base * (1 + e) for e in noise]
    high = healthy[:3] + [base * (1 + 5 * rel)]
    low = healthy[:3] + [base * (1 - 5 * rel)]
    small = [base * (1 + e / 100) for e in noise[:3]] + [base * (1 + rel / 2)]
    cases = [
        scenario("a rank far above the others fires", high),
        scenario("a rank far below the others fires", low),
        scenario("ranks within their noise are silent", healthy),
        scenario("a departure below the relative minimum is silent", small),
        scenario(f"fewer than {c.min_ranks} ranks are silent", [base, base * (1 + 5 * rel)][: c.min_ranks - 1]),
        scenario(
            "ranks without a loss (pipeline stages) take no part: the departing rank fires",
            high,
            without_loss=len(high),
        ),
        scenario(
            f"fewer than {c.min_ranks} ranks with a loss are silent, whatever the ranks without one",
            [base, base * (1 + 5 * rel)][: c.min_ranks - 1],
            without_loss=2 * c.min_ranks,
        ),
    ]
    # Checks on the generator: the firing cases fire, the silent ones do not, before and at `for`.
    if (
        not (_spread_firing(b.t, high) and _spread_firing(b.t, low))
        or _spread_firing(b.t, healthy)
        or _spread_firing(b.t, small)
    ):
        raise ValueError("cross_rank: thresholds leave no firing or no silent TrainingLossRankSpread test")
    cases[0].checks.append((at - 2 * b.i, spread.name, []))
    out[spread.name] = cases
    out.update(_straggler(b))
    out.update(_gradient_mismatch(b))
    return out


def _straggler(b: _Builder) -> dict[str, list[Scenario]]:
    a, c = b.t.alerts, b.t.cross_rank
    rule = b.rule("TrainingStraggler")
    at = b.after_for(a.straggler_for)
    samples = int(at // b.i) + 2

    def ranks(times: list[float]) -> list[Series]:
        return [b.hold("training_rank_work_seconds", _target(str(r)), x, samples) for r, x in enumerate(times)]

    # Steps long enough that the ratio, not the absolute floor, decides; and steps so short it does.
    base = 10 * c.straggler_min_seconds / (c.straggler_ratio - 1)
    slow = base * c.straggler_ratio * 1.5
    tiny = c.straggler_min_seconds / (4 * c.straggler_ratio)
    return {
        rule.name: [
            Scenario(
                "a rank far slower than the job's median fires, named",
                ranks([base, base, base, slow]),
                [(at, rule.name, [Expect(rule, _target("3"), slow / base)]), (at - 2 * b.i, rule.name, [])],
            ),
            Scenario(
                "just under the ratio is silent",
                ranks([base, base, base, base * c.straggler_ratio * 0.99]),
                [(at, rule.name, [])],
            ),
            Scenario(
                "a slow rank on tiny steps (under the absolute floor) is silent",
                ranks([tiny, tiny, tiny, tiny * c.straggler_ratio * 1.5]),
                [(at, rule.name, [])],
            ),
            Scenario(
                f"fewer than {c.min_ranks} ranks are silent",
                ranks([base, slow][: c.min_ranks - 1]),
                [(at, rule.name, [])],
            ),
        ]
    }


def _gradient_mismatch(b: _Builder) -> dict[str, list[Scenario]]:
    a, c = b.t.alerts, b.t.cross_rank
    rule = b.rule("TrainingRankGradientMismatch")
    at = b.after_for(a.grad_mismatch_for)
    samples = int(at // b.i) + 2

    def ranks(norms: list[float], steps: list[int] | None = None) -> list[Series]:
        steps = steps or [200] * len(norms)
        return [
            series
            for r, (x, step) in enumerate(zip(norms, steps))
            for series in (
                b.hold("training_grad_norm_aligned", _target(str(r)), x, samples),
                b.hold("training_grad_norm_aligned_step", _target(str(r)), step, samples),
            )
        ]

    def job_rank(rank: str) -> dict[str, str]:
        return {k: v for k, v in _target(rank).items() if k in JOB_RANK}

    corrupt = [1.5, 1.5, 1.5, 1.5 * (1 + 10 * c.grad_norm_rtol)]
    median = _quantile(corrupt, 0.5)
    later = at + 4 * b.i  # past the for duration, with the last half of it half scraped

    def moving() -> list[Series]:
        """Every rank at step 200 (rank 3 off), then ranks 0 and 1 at step 300 (agreeing) while 2 and 3
        are not scraped there yet, for the rest of the test."""
        total, complete = int(later // b.i) + 2, int(later // b.i) // 2
        out = []
        for r, x in enumerate(corrupt):
            out.append(b.hold("training_grad_norm_aligned", _target(str(r)), x, total))
            steps = [run(200, complete), run(300, total - complete)] if r < 2 else [run(200, total)]
            out.append(Series("training_grad_norm_aligned_step", _target(str(r)), steps))
        return out

    return {
        rule.name: [
            Scenario(
                "a replica whose norm differs fires, named",
                ranks(corrupt),
                [
                    (at, rule.name, [Expect(rule, job_rank("3"), abs(corrupt[3] - median) / abs(median))]),
                    (at - 2 * b.i, rule.name, []),
                ],
            ),
            Scenario(
                "replicas within float tolerance are silent",
                ranks([1.5, 1.5, 1.5, 1.5 * (1 + c.grad_norm_rtol / 2)]),
                [(at, rule.name, [])],
            ),
            Scenario(
                "a rank still at an older aligned step is not compared",
                ranks([1.5, 1.5, 1.5, 3.0], steps=[200, 200, 200, 100]),
                [(at, rule.name, [])],
            ),
            Scenario("a single rank is silent", ranks([1.5]), [(at, rule.name, [])]),
            # While the scrapes of a new aligned step come in, the ranks already there are not compared
            # among themselves: two of four at step 200, one of them off, is no median of the job.
            Scenario(
                "an aligned step only some ranks have reached is not judged",
                ranks([1.5, corrupt[3], 1.5, 1.5], steps=[200, 200, 100, 100]),
                [(at, rule.name, [])],
            ),
            Scenario(
                "a mismatch still fires while a newer aligned step is half scraped",
                moving(),
                [(later, rule.name, [Expect(rule, job_rank("3"), abs(corrupt[3] - median) / abs(median))])],
            ),
        ]
    }
