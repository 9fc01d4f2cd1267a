"""The demo: a healthy run raises no danger; each fault shows up where it should."""

import logging
import subprocess
import sys

import pytest

from lossbeat.cli import build_parser
from lossbeat.diagnosis import Status
from lossbeat.monitor import core as monitor_module


def test_healthy_demo_learns_and_raises_no_danger(tmp_path):
    csv = tmp_path / "metrics.csv"
    result = subprocess.run(
        # Batches of 16, as run_demo's: a quarter of the default's compute, and it learns as surely.
        # Paced like the slow fault's run (a step every 50 ms, several times what one takes), so that
        # the throughput judged ok is the run's and not the machine's load.
        [
            sys.executable,
            "-m",
            "lossbeat",
            "demo",
            "--port",
            "0",
            "--steps",
            "400",
            "--batch-size",
            "16",
            "--step-time",
            "0.05",
            "--no-progress",
            "--metrics-csv",
            str(csv),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "DANGER" not in result.stderr and "DANG " not in result.stdout
    assert "lossbeat report (last step 399)" in result.stdout
    assert "events: steps 400, nonfinite_loss 0, nonfinite_grad 0" in result.stdout
    assert "grad_explosions 0" in result.stdout
    mean_loss = float(result.stdout.split("mean loss ")[1].split()[0])
    assert 0.5 < mean_loss < 1.6  # learned from ~4.2 (ln 64) into the healthy band
    for check in ("layer_grad_norm", "memory", "throughput"):  # judged live, and all fine
        assert f"  ok   {check} " in result.stdout
    analyzed = subprocess.run(
        [sys.executable, "-m", "lossbeat", "analyze", str(csv)], capture_output=True, text=True, timeout=120
    )
    assert analyzed.returncode == 0, analyzed.stdout
    assert "ok   layer_grad_norm" in analyzed.stdout and "ok   throughput" in analyzed.stdout  # read from its log


# Each fault, the run that shows it (steps, fault step) and what its end-of-run report must say.
# The run lengths are the least each judgment needs: the throughput's level takes two blocks of 50
# steps after its 100 warm-up steps, the memory's trend 12 samples after 10 warm-up diagnoses, the
# plateau a window of 100 steps after the LR's collapse. The slow run is paced (--step-time), so
# that its normal and slow steps take 1 and 4 slots of wall time whatever the machine's load.
FAULT_RUNS = {
    "nan": (120, 100, "nonfinite", "still non-finite"),
    "explode": (120, 100, "grad_norm", "exploding gradients"),
    "vanish": (160, 100, "layer_grad_norm", "blocks.0.attn.qkv"),
    "lr-high": (200, 100, "learning_rate", "the learning rate jumped"),
    "plateau": (220, 100, "learning_rate", "a plateau, the model stopped learning"),
    "leak": (250, 130, "memory", "a leak"),
    "slow": (310, 200, "throughput", "throughput fell"),
}


@pytest.fixture(scope="module", params=sorted(FAULT_RUNS))
def fault_run(request, tmp_path_factory):
    """One demo run per fault, with the log it writes: its report, its metrics.csv."""
    fault = request.param
    steps, at, _, _ = FAULT_RUNS[fault]
    csv = tmp_path_factory.mktemp(fault) / "metrics.csv"
    argv = ["--steps", str(steps), "--fault", fault, "--fault-step", str(at), "--metrics-csv", str(csv)]
    if fault == "slow":
        argv += ["--step-time", "0.05"]
    result = subprocess.run(
        [sys.executable, "-m", "lossbeat", "demo", "--port", "0", "--no-progress", "--batch-size", "16", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return fault, result.stdout, csv


def test_every_fault_ends_in_a_danger_that_names_it(fault_run):
    fault, report, _ = fault_run
    _, _, check, words = FAULT_RUNS[fault]
    line = next((x for x in report.splitlines() if x.split()[1:2] == [check]), "")
    assert line.split()[:1] == ["DANG"], f"{fault}: {line or report}"
    assert words in line, f"{fault}: {line}"


def test_analyze_of_every_faults_log_exits_1(fault_run):
    fault, _, csv = fault_run
    _, _, check, words = FAULT_RUNS[fault]
    result = subprocess.run(
        [sys.executable, "-m", "lossbeat", "analyze", str(csv)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, f"{fault}: {result.stdout}{result.stderr}"
    final = result.stdout.split("final diagnosis")[1]
    line = next((x for x in final.splitlines() if x.split()[1:2] == [check]), "")
    assert line.split()[:1] == ["DANG"] and words in line, f"{fault}: {line or final}"


def run_demo(*argv):
    """The demo in-process, returning the monitor's last findings and counters."""
    captured = {}
    original = monitor_module.Monitor.report

    def report(self):
        result = original(self)
        captured["report"] = result
        captured["health"] = dict(self.state.health)
        return result

    monitor_module.Monitor.report = report
    try:
        args = build_parser().parse_args(["demo", "--port", "0", "--no-progress", "--batch-size", "16", *argv])
        assert args._run(args) == 0
    finally:
        monitor_module.Monitor.report = original
    return captured["report"], captured["health"]


def test_nan_fault_counts_every_bad_step(caplog):
    with caplog.at_level(logging.WARNING, logger="lossbeat"):
        report, health = run_demo("--steps", "120", "--fault", "nan", "--fault-step", "100")
    assert report.counters["nonfinite_loss"] == 20
    assert report.counters["nonfinite_grad"] == 20
    assert health[("nonfinite", "")] == Status.DANGER
    assert "non-finite loss nan at step 100" in caplog.text


def test_nan_under_loss_scaling_overflows_and_collapses_the_scale():
    report, health = run_demo("--steps", "120", "--fault", "nan", "--fault-step", "100", "--grad-scaler")
    assert report.counters["nonfinite_loss"] == 20  # a NaN loss still is one
    assert report.counters["grad_scaler_overflows"] == 20  # skipped by the scaler, not non-finite gradients
    assert report.counters["nonfinite_grad"] == 0
    assert health[("nonfinite", "")] == Status.DANGER
    finding = next(f for f in report.findings if f.check == "nonfinite")
    assert "loss scale collapsed to 0.00781" in finding.message  # 2**12 halved 19 times before the last read


def test_explode_fault_names_the_exploding_layer(caplog):
    with caplog.at_level(logging.WARNING, logger="lossbeat"):
        report, health = run_demo("--steps", "120", "--fault", "explode", "--fault-step", "100")
    assert report.counters["grad_explosions"] == 20
    assert health[("grad_norm", "")] == Status.DANGER
    assert health[("layer_grad_norm", "")] == Status.WARNING
    assert "largest layer: blocks.1.mlp.fc" in caplog.text


def test_lr_high_fault_makes_the_loss_volatile():
    # Volatility is a robust median over windows.noise_records (200) records: it shows once the
    # volatile steps fill half of it.
    # Judged at step 199, 100 steps into the fault (later the loss falls back towards its level
    # and the trend reads falling again).
    report, health = run_demo("--steps", "200", "--fault", "lr-high", "--fault-step", "100")
    findings = {f.check: f for f in report.findings}
    # LR 0.3: the loss jumps to ~18 and settles near 4.5, far above the best level it had reached.
    assert findings["learning_rate"].status is Status.DANGER
    assert "jumped" in findings["learning_rate"].message and "at step 100" in findings["learning_rate"].message
    assert health[("loss_trend", "")] == Status.DANGER and "best" in findings["loss_trend"].message


def test_lr_high_fault_that_settles_far_above_its_best_ends_in_danger():
    """LR x100 at step 300: the loss explodes, then settles near the model's starting loss, far above
    the best it had reached. The end of the run is judged against that best and the level before
    the jump, never against the explosion's peak: every check tells the same story."""
    report, health = run_demo("--steps", "600", "--fault", "lr-high", "--fault-step", "300")
    findings = {f.check: f for f in report.findings}
    trend = findings["loss_trend"]
    assert health[("loss_trend", "")] == Status.DANGER, trend.message
    assert "above its best" in trend.message and "went wrong at step 300" in trend.message
    assert "checkpoint saved before step 300" in trend.fix
    lr = findings["learning_rate"]
    assert lr.status is Status.DANGER and "jumped" in lr.message and "at step 300" in lr.message
    assert findings["overfitting"].status is Status.GOOD  # the train loss blew up with the eval loss
    learning = findings["learning"]
    assert learning.status is not Status.GOOD and "lost much of it" in learning.message
    for check in ("loss_spikes", "grad_explosions"):
        assert findings[check].status is Status.DANGER and "never came back" in findings[check].message
    assert "diverging" in report.pattern and report.worst is Status.DANGER
    from lossbeat.analyze.checklist import from_findings
    from lossbeat.exposition.status import checklist

    items = {item.number: item.ok for item in from_findings(report.findings)}
    assert items[2] is False and items[5] is False  # loss still falling; LR following its schedule
    page = {i["number"]: i["status"] for i in checklist(tuple(_as_row(f) for f in report.findings))}
    assert page[2] == "danger" and page[5] == "danger"  # the status page's checklist agrees


def _as_row(f):
    return (f.check, f.component, int(f.status), f.message, f.fix, f.known)


def test_plateau_fault_flags_the_learning_rate_and_the_trend():
    # The trend compares windows of at least 100 steps: flat on both sides of step 300.
    report, _ = run_demo("--steps", "400", "--fault", "plateau", "--fault-step", "100")
    findings = {f.check: f for f in report.findings}
    lr = findings["learning_rate"]  # 2e-3 -> 1e-8 at once, mid-schedule: the model stopped learning
    assert lr.status is Status.DANGER and "collapsed" in lr.message and "at step 100" in lr.message
    assert findings["loss_trend"].status is Status.WARNING  # plateau


def test_bad_demo_arguments_are_refused(capsys):
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        args = build_parser().parse_args(["demo", "--steps", "0"])
        args._run(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--fault", "fire"])
    assert "invalid choice: 'fire'" in capsys.readouterr().err
    assert build_parser().parse_args(["demo", "--fault", "explode,vanish"]).fault == ("explode", "vanish")


def test_explode_and_vanish_together_name_both_layers():
    report, health = run_demo("--steps", "60", "--fault", "explode,vanish", "--fault-step", "40")
    layer = {f.check: f for f in report.findings}["layer_grad_norm"]
    assert "above 10: blocks.1.mlp.fc" in layer.message and "below 1e-05: blocks.0.attn.qkv" in layer.message


def test_multi_task_demo_monitors_each_component_and_stays_healthy(caplog):
    with caplog.at_level(logging.INFO, logger="lossbeat"):
        report, health = run_demo("--steps", "300", "--multi-task", "--batch-size", "16")
    components = {f.component for f in report.findings if f.component}
    assert components == {"lm", "noise"}
    assert "-> DANGER" not in caplog.text  # at no diagnosis during the run
    assert max(health.values()) < Status.DANGER
    assert {f.check: f for f in report.findings if not f.component}["loss_range"].status is Status.GOOD
