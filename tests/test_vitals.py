"""Memory, throughput and LR-schedule checks, and the loss-curve patterns (the article's
daily checklist): the pure checks, and a real Monitor on real training loops."""

from __future__ import annotations

import math

import pytest
import torch

from lossbeat import Monitor, MonitorConfig, load_thresholds
from lossbeat.diagnosis import Finding, Status
from lossbeat.diagnosis.patterns import PatternTracker, classify
from lossbeat.diagnosis.resources import ThroughputTracker, check_memory
from lossbeat.diagnosis.schedule import LRSchedule, ScheduleTracker

T = load_thresholds()
GIB = 2.0**30


def _health(monitor: Monitor, check: str) -> int:
    return monitor.state.health[(check, "")]


# --- memory -----------------------------------------------------------------------------


def test_memory_near_the_limit_is_danger():
    f = check_memory([70 * GIB] * 3, 77 * GIB, 80 * GIB, T.memory)
    assert f.status is Status.DANGER and "96%" in f.message


def test_memory_that_keeps_growing_warns_and_flat_or_noisy_memory_does_not():
    limit = 80 * GIB
    n = T.memory.samples
    growing = [40 * GIB + i * 0.15 * GIB for i in range(n)]  # thirds' medians 6 GiB apart: 7.5 % of the limit
    assert check_memory(growing, max(growing), limit, T.memory).status is Status.WARNING  # +15 %: not a leak's trend
    flat = [10 * GIB + (i % 3) * 0.01 * GIB for i in range(n)]
    assert check_memory(flat, max(flat), limit, T.memory).status is Status.GOOD
    one_bump = [10 * GIB] * n
    one_bump[n // 2] = 15 * GIB  # an evaluation's activations, freed again
    assert check_memory(one_bump, 15 * GIB, limit, T.memory).status is Status.GOOD


def test_memory_that_grows_with_no_plateau_is_a_leak_whatever_its_share_of_the_limit():
    limit = 22 * GIB
    n = T.memory.leak_min_samples + 3
    leak = [0.3 * GIB + i * 0.04 * GIB for i in range(n)]  # 40 MiB a diagnosis, 4 % of the limit at the end
    f = check_memory(leak, max(leak), limit, T.memory, every=10)
    assert f.status is Status.DANGER and "a leak" in f.message and "more steps" in f.message
    # A log has no limit: the trend alone still says so.
    assert check_memory(leak, None, None, T.memory).status is Status.DANGER
    filled = leak[: n // 3] + [leak[n // 3]] * (n - n // 3)  # grew, then stopped: a cache that filled
    assert check_memory(filled, max(filled), limit, T.memory).status is Status.GOOD
    assert check_memory(leak[: T.memory.leak_min_samples - 1], None, None, T.memory).known is False  # too few


def test_memory_without_samples_or_limit_is_not_judged():
    assert not check_memory([], None, 80 * GIB, T.memory).known
    assert not check_memory([GIB], GIB, None, T.memory).known


# --- throughput -------------------------------------------------------------------------


def _tracker(times):
    tracker = ThroughputTracker(T.throughput)
    for seconds in times:
        tracker.add(seconds)
    return tracker


def test_a_run_four_times_slower_warns_and_a_steady_one_does_not():
    tp = T.throughput
    normal = [0.1 + 0.01 * (i % 5) for i in range(tp.warmup_steps + 10 * tp.steps)]
    assert _tracker(normal).finding().status is Status.GOOD
    slowed = _tracker(normal + [0.4] * tp.steps)
    f = slowed.finding()
    assert f.status is Status.WARNING and "fell to" in f.message  # one slow block: a checkpoint, maybe
    for _ in range(tp.steps * (tp.danger_blocks - 1)):
        slowed.add(0.4)
    assert slowed.finding().status is Status.DANGER  # and stayed there
    slower = _tracker(normal + [0.3] * (tp.steps * tp.danger_blocks))  # 40 % of the speed: a warning still
    assert slower.finding().status is Status.WARNING


def test_a_long_slowdown_stays_reported_until_it_is_the_new_normal():
    tp = T.throughput
    normal = [0.1] * (tp.warmup_steps + 5 * tp.steps)
    tracker = _tracker(normal + [0.4] * (tp.steps * (tp.baseline_blocks - 1)))
    f = tracker.finding()  # the drop did not become its own level; 4x for many blocks: a danger
    assert f.status is Status.DANGER and "stayed there" in f.message and "4.0x" in f.message
    for _ in range(tp.steps):
        tracker.add(0.4)
    assert tracker.finding().status is Status.GOOD  # baseline_blocks slow blocks: the new normal


def test_warmup_steps_do_not_count():
    tp = T.throughput
    slow_start = [5.0] * tp.warmup_steps + [0.1] * (3 * tp.steps)  # compilation, first steps
    assert _tracker(slow_start).finding().status is Status.GOOD
    assert not _tracker([0.1] * tp.warmup_steps).finding().known


# --- LR schedule ------------------------------------------------------------------------


def test_declared_schedule_values_and_validation():
    s = LRSchedule(peak_lr=1e-3, warmup_steps=100, total_steps=1100, decay="cosine", min_lr=1e-5)
    assert s.lr_at(0) == 0 and s.lr_at(50) == pytest.approx(5e-4) and s.lr_at(100) == pytest.approx(1e-3)
    assert s.lr_at(600) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    assert s.lr_at(5000) == pytest.approx(1e-5)
    assert LRSchedule(1e-3, 10, 110, decay="linear").lr_at(60) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="lr_schedule.decay"):
        LRSchedule(1e-3, decay="step")
    with pytest.raises(ValueError, match="lr_schedule.total_steps"):
        LRSchedule(1e-3, warmup_steps=10)
    with pytest.raises(ValueError, match="lr_schedule.peak_lr"):
        LRSchedule(0.0, decay="constant")


def test_an_lr_that_departs_from_the_declared_schedule_warns_after_a_few_steps():
    schedule = LRSchedule(1e-3, 10, 1000)
    tracker = ScheduleTracker(T.lr_schedule, schedule)
    for step in range(10, 20):
        assert tracker.update(step, schedule.lr_at(step)).status is Status.GOOD
    statuses = [tracker.update(step, 30 * schedule.lr_at(step)).status for step in range(20, 30)]
    first_warning = statuses.index(Status.WARNING)
    assert first_warning == T.lr_schedule.consecutive - 1  # one odd step is not a broken schedule
    assert "departs from the declared schedule" in tracker.update(30, 1.0).message


def _scheduler_run(
    optimizer_steps: int,
    scheduler_steps_per_optimizer_step: int,
    tracker: ScheduleTracker,
    start: int = 0,
    scheduler=None,
):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    findings = []
    for step in range(start, start + optimizer_steps):
        optimizer.step()
        for _ in range(scheduler_steps_per_optimizer_step):
            scheduler.step()
        if step % 10 == 0:  # the monitor reads the counter at each diagnosis
            findings.append(tracker.update(step, None, scheduler.last_epoch))
    return findings, scheduler


@pytest.mark.parametrize("per_step, expected", [(1, Status.GOOD), (0, Status.WARNING), (4, Status.WARNING)])
def test_a_real_scheduler_not_stepped_or_stepped_per_micro_batch_is_caught(per_step, expected):
    findings, _ = _scheduler_run(200, per_step, ScheduleTracker(T.lr_schedule))
    assert findings[-1].status is expected, findings[-1]


def test_a_scheduler_reset_by_a_resume_is_caught():
    tracker = ScheduleTracker(T.lr_schedule)
    _scheduler_run(300, 1, tracker)
    findings, _ = _scheduler_run(200, 1, tracker, start=300)  # a new scheduler, its state not restored
    assert findings[-1].status is Status.WARNING and "reset" in findings[-1].message


# --- patterns ---------------------------------------------------------------------------


def _f(check: str, status: Status, fix: str = "") -> Finding:
    return Finding(check, status, check, fix)


@pytest.mark.parametrize(
    "findings, name",
    [
        ([_f("loss_trend", Status.GOOD)], "converging"),
        ([_f("loss_trend", Status.GOOD), _f("loss_volatility", Status.WARNING)], "oscillating"),
        ([_f("loss_trend", Status.GOOD), _f("overfitting", Status.WARNING)], "overfitting"),
        (
            [_f("loss_trend", Status.GOOD), _f("nonfinite", Status.DANGER), _f("overfitting", Status.WARNING)],
            "diverging",
        ),
        ([_f("loss_trend", Status.WARNING)], "no_progress"),
        ([Finding.unknown("loss_trend"), Finding("overfitting", Status.WARNING, "g0", component="g0")], "overfitting"),
        ([_f("loss_trend", Status.DANGER)], "diverging"),
    ],
)
def test_the_five_patterns(findings, name):
    assert classify(findings).name == name


def test_no_pattern_before_the_trend_is_known_and_since_step_follows_changes():
    assert classify([Finding.unknown("loss_trend")]) is None
    tracker = PatternTracker()
    falling = Finding("loss_trend", Status.GOOD, "loss falling (12.0% over the last 400 steps)")
    tracker.update([falling], 100)
    tracker.update([_f("loss_trend", Status.GOOD)], 200)
    assert tracker.since_step == 100
    tracker.update([_f("loss_trend", Status.GOOD), _f("overfitting", Status.WARNING)], 4200)
    assert tracker.describe().startswith("looks like pattern 3, overfitting, since step 4,200")


def test_a_run_that_never_fell_is_no_progress_even_with_an_expected_flat_end():
    tracker = PatternTracker()
    tracker.update([Finding("loss_trend", Status.WARNING, "loss has plateaued")], 220)
    flat_end = Finding("loss_trend", Status.GOOD, "loss flat (-0.3%) at the end of a decayed LR schedule: expected")
    assert tracker.update([flat_end], 820).name == "no_progress" and tracker.since_step == 220


def test_analyze_names_the_pattern_and_its_first_step():
    from conftest import REAL_LOGS as logs

    from lossbeat.analyze import analyze_file

    overfit = analyze_file(logs / "hf-whisper-large-v2-ja-overfit-trainer_state.json")
    assert overfit.pattern.name == "overfitting" and overfit.pattern_since is not None
    plateau = analyze_file(logs / "hf-llama3.1-8b-lora-token-compressor-plateau-trainer_state.json")
    assert plateau.pattern.name == "no_progress"
    healthy = analyze_file(logs / "hf-tinyllama-1.1b-chat-lora-sft-trainer_state.json")
    assert healthy.pattern.name == "converging"


# --- a real Monitor ---------------------------------------------------------------------


def _train(monitor: Monitor, steps: int, *, scheduler_steps: int = 1, leak: list | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10 * steps)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
        optimizer.step()
        optimizer.zero_grad()
        for _ in range(scheduler_steps):
            scheduler.step()
        if leak is not None:
            leak.append(torch.ones(2**18))  # 1 MiB kept alive each step
    return scheduler


def _monitor(tmp_path, yaml_text: str, **config) -> Monitor:
    path = tmp_path / "t.yaml"
    path.write_text(yaml_text)
    return Monitor(MonitorConfig(thresholds=str(path), profile="regression", **config), serve=False)


def test_monitor_catches_a_scheduler_stepped_per_micro_batch(tmp_path):
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
    monitor = _monitor(tmp_path, "windows:\n  diagnose_every: 5\n", lr_schedule=scheduler)
    for step in range(100):
        monitor.observe(step, loss=1.0 / (step + 1), optimizer=optimizer)
        optimizer.step()
        for _ in range(4):  # gradient accumulation 4, scheduler inside the micro-batch loop
            scheduler.step()
    assert _health(monitor, "lr_schedule") == Status.WARNING
    assert "per micro-batch" in {f.check: f for f in monitor.findings}["lr_schedule"].message


def test_monitor_catches_a_real_memory_leak_and_a_clean_run_is_silent(tmp_path):
    # Small thresholds: 1 MiB a step on a machine of tens of GiB; the rule of the
    # shipped file (5 % of the device) is tested in the pure check above.
    text = "windows:\n  diagnose_every: 5\nmemory:\n  growth_fraction: 0.0005\n  samples: 20\n  warmup_samples: 2\n"
    leaky = _monitor(tmp_path, text)
    leaked: list = []
    _train(leaky, 200, leak=leaked)
    assert _health(leaky, "memory") == Status.WARNING, leaky.findings
    clean = _monitor(tmp_path, text)
    _train(clean, 200)
    assert _health(clean, "memory") == Status.GOOD


def test_monitor_exports_memory_limit_and_pattern(tmp_path):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    monitor = _monitor(tmp_path, "windows:\n  diagnose_every: 5\n")
    _train(monitor, 400)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(generate_latest(monitor.registry).decode())
        for s in fam.samples
    }
    limit = next(v for (n, _), v in samples.items() if n == "training_memory_limit_bytes")
    peak = next(v for (n, _), v in samples.items() if n == "training_memory_peak_bytes")
    allocated = next(v for (n, _), v in samples.items() if n == "training_memory_allocated_bytes")
    assert 0 < allocated <= peak < limit
    patterns = {dict(labels)["pattern"]: v for (n, labels), v in samples.items() if n == "training_loss_pattern"}
    assert sorted(patterns) == ["converging", "diverging", "no_progress", "oscillating", "overfitting"]
    assert sum(patterns.values()) == 1
    assert "this run looks like pattern" in str(monitor.report())


def test_a_slowed_run_warns_and_an_evaluation_pause_does_not(tmp_path, monkeypatch):
    clock = {"now": 1000.0}
    monkeypatch.setattr("lossbeat.monitor.core.time.perf_counter", lambda: clock["now"])
    tp = T.throughput
    text = "windows:\n  diagnose_every: 10\n"

    def run(step_time, pause_every=0):
        monitor = _monitor(tmp_path, text)
        for step in range(tp.warmup_steps + 8 * tp.steps):
            if pause_every and step % pause_every == 0:
                with monitor.phase("eval"):
                    clock["now"] += 60.0  # a one-minute evaluation
            clock["now"] += step_time(step)
            monitor.observe(step, loss=1.0)
        return monitor

    steady = run(lambda s: 0.1, pause_every=100)
    assert _health(steady, "throughput") == Status.GOOD
    slowed = run(lambda s: 0.1 if s < tp.warmup_steps + 6 * tp.steps else 0.5)
    assert _health(slowed, "throughput") == Status.WARNING


def test_lr_schedule_setting_is_validated_naming_it():
    with pytest.raises(TypeError, match="lr_schedule"):
        MonitorConfig(lr_schedule=3)
    with pytest.raises(ValueError, match="lr_schedule.decay"):
        MonitorConfig(lr_schedule={"peak_lr": 1e-3, "decay": "exp"})
    with pytest.raises(TypeError, match="lr_schedule"):
        MonitorConfig(lr_schedule={"peak": 1e-3})
    assert math.isclose(MonitorConfig(lr_schedule={"peak_lr": 1e-3, "decay": "constant"}).lr_schedule["peak_lr"], 1e-3)
