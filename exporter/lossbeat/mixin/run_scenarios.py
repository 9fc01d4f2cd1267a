"""Rule-test scenarios of the run's identity, start and end: concurrent runs under one job label
are never compared with each other, ranks not scraped yet at the run's start and ranks that
finished are not down."""

from __future__ import annotations

from lossbeat.mixin.alert_rules import JOB_RANK, RANK_DISCOVERY_GRACE, RANK_SEEN_LOOKBACK, duration_seconds
from lossbeat.mixin.rule_series import INSTANCE, JOB, OTHER_INSTANCE, Expect, Scenario, Series, _Builder, _target, run

__all__ = ["concurrent_cross_rank", "ranks_discovered", "ranks_finishing"]


def concurrent_cross_rank(b: _Builder) -> dict[str, list[Scenario]]:
    """Two healthy 2-rank runs under one job label (a sweep from one sbatch script: Slurm job ids
    101 and 102 as their ``run_id``): every cross-rank rule compares the ranks of one run only."""
    a, c = b.t.alerts, b.t.cross_rank
    runs = {"101": (INSTANCE, "gpu-a:8471"), "102": (OTHER_INSTANCE, "gpu-b:8471")}
    at = b.after_for(max((a.rank_down_for, a.straggler_for, a.grad_mismatch_for), key=duration_seconds))
    samples = int(at // b.i) + 2

    def per_rank(metric: str, value_of, **extra: str) -> list[Series]:
        return [
            b.hold(metric, _target(str(r), instance, run_id=run_id, **extra), value_of(run_id), samples)
            for run_id, instances in runs.items()
            for r, instance in enumerate(instances)
        ]

    info = per_rank("training_run_info", lambda _: 1, run="test", profile=b.t.profile.name, world_size="2")
    # Each run's replicas agree; the runs differ (another learning rate, another seed).
    norms = per_rank("training_grad_norm_aligned", lambda run_id: 1.5 if run_id == "101" else 2.5)
    norms += per_rank("training_grad_norm_aligned_step", lambda _: 200)
    # The second run's model is larger: its ranks are slower, each as slow as the other.
    base = 10 * c.straggler_min_seconds / (c.straggler_ratio - 1)
    work = per_rank(
        "training_rank_work_seconds", lambda run_id: base if run_id == "101" else base * c.straggler_ratio * 2
    )
    name = "two healthy 2-rank runs under one job label (run_id 101, 102) are silent"
    return {
        rule: [Scenario(name, series, [(at, rule, [])])]
        for rule, series in (
            ("TrainingRankDown", info),
            ("TrainingRankGradientMismatch", norms),
            ("TrainingStraggler", work),
        )
    }


def ranks_finishing(b: _Builder) -> dict[str, list[Scenario]]:
    """Ranks 1..3 finish (completion marker, then gone) while rank 0 goes on (a final eval, an
    upload): they are not down. Ranks gone without the marker still are."""
    a = b.t.alerts
    down = b.rule("TrainingRankDown")
    up_for = 3
    fires = b.after_for(a.rank_down_for, start=up_for * b.i)
    samples = int(fires // b.i) + 2

    def rank(r: str, ends: str | None, n: int = samples) -> list[Series]:
        """``ends``: None (still running), "completed" or "crashed" after ``up_for`` intervals."""
        labels = {**_target(r), "run": "test", "profile": b.t.profile.name, "world_size": "4"}
        if ends is None:
            return [
                Series("training_run_info", labels, [run(1, n)]),
                b.hold("training_run_completed", _target(r), 0, n),
            ]
        last = "1" if ends == "completed" else "0"
        return [
            Series("training_run_info", labels, [run(1, up_for), "stale"]),
            Series("training_run_completed", _target(r), [run(0, up_for - 1), last, "stale"]),
        ]

    job_rank = lambda r: {k: v for k, v in _target(r).items() if k in JOB_RANK}  # noqa: E731
    # Rank 0's wrap-up (a final save, push_to_hub, an evaluation) outlasting the lookback that
    # remembers the ranks seen: the completed ones stay present while a rank of their run reports.
    long_at = 2 * duration_seconds(RANK_SEEN_LOOKBACK)
    long_n = int(long_at // b.i) + 2
    wrap_up = [*rank("0", None, long_n), *(x for r in "123" for x in rank(r, "completed"))]
    return {
        down.name: [
            Scenario(
                "ranks that completed while rank 0 goes on are silent",
                [*rank("0", None), *rank("1", "completed"), *rank("2", "completed"), *rank("3", "completed")],
                [(fires, down.name, [])],
            ),
            Scenario(
                "a rank gone without its marker next to completed ones fires, named",
                [*rank("0", None), *rank("1", "completed"), *rank("2", "completed"), *rank("3", "crashed")],
                [(fires, down.name, [Expect(down, {**job_rank("3"), "world_size": "4"}, 3)])],
            ),
            Scenario(
                f"ranks that completed while rank 0's wrap-up lasts twice {RANK_SEEN_LOOKBACK} are silent",
                wrap_up,
                [(t, down.name, []) for t in (fires, long_at / 2 + fires, long_at)],
            ),
        ]
    }


def ranks_discovered(b: _Builder) -> dict[str, list[Scenario]]:
    """A run's ranks are first scraped one after another (their scrape offsets, their discovery):
    the ones not seen yet are not down while the run is younger than RANK_DISCOVERY_GRACE (a
    healthy 4-rank job once went pending at the evaluation between its first and last rank's
    first scrape); a rank never seen still fires, as unknown, after the grace and the ``for``."""
    a = b.t.alerts
    down = b.rule("TrainingRankDown")
    fires = b.after_for(a.rank_down_for, start=duration_seconds(RANK_DISCOVERY_GRACE))
    samples = int(fires // b.i) + 2
    # The last rank's first scrape a `for` and an interval after the others': without the grace
    # the run counts short from its first evaluation and fires at the `for`.
    late = int(duration_seconds(a.rank_down_for) // b.i) + 1

    def info(r: str, first: int = 0) -> Series:
        labels = {**_target(r), "run": "test", "profile": b.t.profile.name, "world_size": "4"}
        return Series("training_run_info", labels, ([f"_x{first}"] if first else []) + [run(1, samples - first)])

    unknown = Expect(down, {"job": JOB, "rank": "unknown", "world_size": "4"}, 3)
    return {
        down.name: [
            Scenario(
                "a healthy run whose last rank is first scraped late is silent",
                [info("0"), info("1"), info("2"), info("3", first=late)],
                [((late - 1) * b.i, down.name, []), (late * b.i, down.name, []), (fires, down.name, [])],
            ),
            # Counted per run: no instance to name.
            Scenario(
                "a rank that never reported fires as unknown, after the discovery grace",
                [info("0"), info("1"), info("2")],
                [(fires - 2 * b.i, down.name, []), (fires, down.name, [unknown])],
            ),
        ]
    }
