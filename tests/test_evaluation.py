"""The judgments measured: healthy shapes stay quiet, faults are caught, live = offline."""

import math

import pytest

from lossbeat import Monitor, MonitorConfig
from lossbeat.analyze.evaluation import (
    BEGIN,
    END,
    evaluate,
    healthy_shapes,
    render,
    synthetic_faults,
    update_doc,
    verdict,
)
from lossbeat.analyze.replay import replay
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.diagnosis.vitals import LIVE_ONLY_CHECKS

T = load_thresholds()


@pytest.fixture(scope="module")
def runs():
    return evaluate(None, demo_steps=0)


def test_healthy_shapes_never_page_flap_or_reach_danger(runs):
    healthy = [r for r in runs if not r.fault]
    assert len(healthy) == len(healthy_shapes()) >= 7
    for run in healthy:
        v = verdict(run, T)
        assert v.dangers == [] and v.pages == [] and v.flapping == [], run.name
        assert run.analysis.counters["grad_explosions"] == 0, run.name


# The most steps after its onset each synthetic fault may take to be caught.
BOUNDS = {"NaN": 10, "x10 grad jump": 10, "LR x30": 50, "grad-norm climb": 250, "overfitting": 1000}


def test_every_synthetic_fault_is_caught_in_time(runs):
    faults = [r for r in runs if r.fault]
    assert {r.fault for r in faults} == set(BOUNDS)
    for run in faults:
        v = verdict(run, T)
        assert v.caught, f"{run.name}: missed"
        assert 0 <= v.caught_step - run.onset <= BOUNDS[run.fault], (run.name, v.caught, v.caught_step)


def test_the_real_explosion_pages():
    (jump,) = [r for r in synthetic_faults() if r.fault == "x10 grad jump"]
    jump.analysis = replay(jump.log, T)
    assert verdict(jump, T).pages  # a danger of grad_norm and a burst of explosion events


@pytest.mark.parametrize("fault", ["LR x30", "overfitting", "NaN"])
def test_the_live_monitor_judges_as_analyze_does(fault):
    """One implementation: the same series fed to a Monitor step by step and replayed by analyze."""
    (run,) = [r for r in synthetic_faults() if r.fault == fault]
    offline = replay(run.log, T)
    monitor = Monitor(MonitorConfig(port=0, thresholds=T, log_status_changes=False), serve=False)
    evals = {e.step: e.loss for e in run.log.evals}
    live_changes = []
    original = monitor._judge.judge

    def judge(step=None):
        findings, changes = original(step)
        live_changes.extend((c.step, c.where, c.finding.status) for c in changes)
        return findings, changes

    monitor._judge.judge = judge
    for r in run.log.train:
        monitor.observe(r.step, loss=r.loss, grad_norm=r.grad_norm, learning_rate=r.learning_rate)
        if r.step in evals:
            monitor.observe_eval(r.step, evals[r.step])
    live = monitor.report()
    monitor.close()
    key = lambda f: (f.check, f.component, f.status, f.message)  # noqa: E731
    # Memory, step times and the scheduler exist only live: the rest is one implementation.
    shared = lambda findings: sorted(key(f) for f in findings if f.check not in LIVE_ONLY_CHECKS)  # noqa: E731
    assert shared(live.findings) == shared(offline.findings)
    assert live_changes == [(c.step, c.where, c.finding.status) for c in offline.changes]
    assert live.counters["grad_explosions"] == offline.counters["grad_explosions"]
    assert live.counters["loss_spikes"] == offline.counters["loss_spikes"]


def test_the_tables_are_written_between_the_markers(tmp_path, runs):
    doc = tmp_path / "analyze.md"
    doc.write_text(f"# x\n\nbefore\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    table = render(runs, T)
    assert update_doc(doc, table) and not update_doc(doc, table)  # idempotent
    text = doc.read_text()
    assert text.startswith("# x\n\nbefore\n\n" + BEGIN) and text.endswith(END + "\n\nafter\n")
    assert "| synthetic: fast early drop" in text and "MISSED" not in text
    assert "with a danger: 0; that would page: 0; flapping: 0" in text


def test_the_checked_in_doc_has_the_tables():
    from lossbeat.analyze.evaluation import DOC

    text = DOC.read_text()
    assert BEGIN in text and END in text and "would page" in text.split(BEGIN)[1]


def test_a_nan_at_the_end_leaves_no_stale_plateau():
    (nan,) = [r for r in synthetic_faults() if r.fault == "NaN"]
    a = replay(nan.log, T)
    final = {f.check: f for f in a.findings}
    assert final["nonfinite"].status is Status.DANGER
    assert all(not final[c].known for c in ("loss_trend", "loss_volatility", "loss_range"))
    assert math.isnan(nan.log.train[-1].loss)
