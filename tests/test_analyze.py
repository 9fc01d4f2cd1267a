"""``lossbeat analyze``: the live diagnosis replayed over the real corpus, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REAL_LOGS, require_module

from lossbeat.analyze import analyze_file, analyze_runs
from lossbeat.cli import main
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.thresholds import load_thresholds

CORPUS = REAL_LOGS
DATA = Path(__file__).resolve().parent / "data"
EXPORTER = Path(__file__).resolve().parents[1] / "exporter"


def _corpus(name: str) -> Path:
    path = CORPUS / name
    if not path.exists():
        pytest.fail(f"real-log corpus missing: {path}")
    return path


def _final(analysis, check: str, component: str = ""):
    (finding,) = [f for f in analysis.findings if f.check == check and f.component == component]
    return finding


@pytest.fixture(scope="module")
def defaults():
    return load_thresholds()


def test_whisper_ja_overfitting(defaults):
    a = analyze_file(_corpus("hf-whisper-large-v2-ja-overfit-trainer_state.json"), defaults)
    f = _final(a, "overfitting")
    assert f.status is Status.WARNING and "0.42" in f.message and "best 0.321" in f.message
    # Sustained: the second eval in a row above the best (1000) is the one at 3000 (the 25 records
    # before it are the judgment's cadence). One eval above the best is not yet overfitting.
    assert a.worst[("overfitting", "")].step == 3025
    assert len([c for c in a.changes if c.finding.check == "overfitting"]) == 1  # and it stays to the end


def test_classifier_overfitting_per_eval_group():
    a = analyze_file(
        _corpus("hf-classifier-multi-eval-overfit-trainer_state.json"), load_thresholds(profile="classification")
    )
    for group in ("g0", "g1", "g2", "g3", "g4", "g5"):
        assert _final(a, "overfitting", group).status is Status.WARNING
    assert "best 1.114" in _final(a, "overfitting", "g0").message
    assert not _final(a, "overfitting").known  # no plain eval_loss key in this file


def test_token_compressor_plateau(defaults):
    a = analyze_file(_corpus("hf-llama3.1-8b-lora-token-compressor-plateau-trainer_state.json"), defaults)
    assert a.reached("loss_trend") and "plateaued" in a.worst[("loss_trend", "")].finding.message
    assert a.worst[("loss_trend", "")].step < 300  # while the LR was still high
    f = _final(a, "loss_trend")  # the cosine reached 0, but the run never learned: not excused
    assert f.status is Status.WARNING and "never fell below its start" in f.message
    assert _final(a, "learning").status is Status.WARNING


def test_t5_grad_norm_spikes_are_explosion_events(defaults):
    a = analyze_file(_corpus("hf-t5-small-summarization-gradspike-trainer_state.json"), defaults)
    assert a.counters["grad_explosions"] == 2
    # Against a baseline near 2.4: 13.2 is above the ceiling (10) and 3x the baseline; 35.6 is a x15 jump.
    assert a.event_steps["grad_explosions"] == [164000, 190000]
    assert a.counters["loss_spikes"] == 0  # the loss does not react
    assert _final(a, "grad_norm").status is Status.GOOD  # isolated: the windowed mean stays healthy


def test_qwen_law_huge_loss_out_of_range(defaults):
    a = analyze_file(_corpus("hf-qwen2.5-3b-lora-law-hugeloss-trainer_state.json"), defaults)
    f = _final(a, "loss_range")
    # 284.9 at the first record, 78.6 at the end: still far out of range (the start is a fact of the past).
    assert f.status is Status.WARNING and "mean loss 78.6 is above 5" in f.message
    # Its grad norms (197, 422) come before any baseline: the first steps, not judged as explosions.
    assert a.event_steps["grad_explosions"] == []


def test_megatron_nan_strings_are_missing_not_non_finite(defaults):
    a = analyze_file(_corpus("megatron-gpt3-15b-release-sm-golden_values.json"), defaults)
    assert (a.train_records, a.missing_losses) == (2601, 57)
    assert a.counters["nonfinite_loss"] == a.counters["nonfinite_grad"] == 0
    assert _final(a, "nonfinite").status is Status.GOOD
    assert any("missing" in n for n in a.notes)
    assert 2845 in a.event_steps["loss_spikes"]  # the bump 3.16 against about 2.99


def test_healthy_tinyllama_sft_never_in_danger(defaults):
    a = analyze_file(_corpus("hf-tinyllama-1.1b-chat-lora-sft-trainer_state.json"), defaults)
    assert a.worst_status < Status.DANGER
    assert a.counters == {"nonfinite_loss": 0, "nonfinite_grad": 0, "loss_spikes": 0, "grad_explosions": 0}
    assert _final(a, "overfitting").status is Status.GOOD


def test_nanogpt_single_step_loss_spike(defaults):
    a = analyze_file(_corpus("modded-nanogpt-muon-gpt2-124m-train.txt"), defaults)
    assert 947 in a.event_steps["loss_spikes"]  # 5.28 against about 3.80


def test_whisper_tr_degradation_after_best_checkpoint(defaults):
    a = analyze_file(_corpus("hf-whisper-large-v3-tr-lora-earlystop-trainer_state.json"), defaults)
    # The train loss itself climbs from its best (about 0.12-0.14 by step 200) to about 0.3 as the LR
    # warms up: the run settled well above its best, named with the best's step; the eval loss
    # stays above its best (step 250) to the end: overfitting once the train loss came back down.
    worst = a.worst[("loss_trend", "")].finding
    assert worst.status is Status.DANGER and "above its best 0.13" in worst.message and "(step 200)" in worst.message
    assert _final(a, "overfitting").status is Status.WARNING


def test_documented_misses(defaults):
    """What docs/analyze.md says the checks do not catch, pinned so the doc stays true."""
    llmc = analyze_file(_corpus("llmc-gpt2-124m-fineweb-main.log"), defaults)
    # Isolated grad-norm spikes (0.83-2.02 against ~0.27: 3-8x) are under the x10 jump, and the
    # first steps (norm 15 at initialisation) come before the baseline: no explosion events.
    assert llmc.event_steps["grad_explosions"] == [] and not llmc.reached("grad_norm")
    resumed = analyze_file(_corpus("lightning-wikitext103-slm-resumed-metrics.csv"), defaults)
    # val_loss rises 3.563 -> 3.604 (+1.2%): below overfitting.eval_rise (5%).
    assert not resumed.reached("overfitting")


def test_windows_count_records_not_steps(tmp_path, defaults):
    history = [{"step": 1000 * (i + 1), "loss": 2.0 - 0.01 * i, "learning_rate": 1e-4} for i in range(40)]
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": history}))
    a = analyze_file(path, defaults)
    # 2 x trend_steps (20) records fill the trend windows, whatever the 1000-step spacing.
    assert _final(a, "loss_trend").known


def test_nonfinite_values_are_counted(tmp_path, defaults):
    history = [{"step": i, "loss": 2.0, "grad_norm": 1.0} for i in range(1, 30)]
    history[10]["loss"] = float("nan")
    history[20]["grad_norm"] = float("inf")
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": history}))  # json writes NaN / Infinity literals
    a = analyze_file(path, defaults)
    assert a.counters["nonfinite_loss"] == 1 and a.counters["nonfinite_grad"] == 1
    assert a.event_steps["nonfinite_loss"] == [11] and a.event_steps["nonfinite_grad"] == [21]
    f = _final(a, "nonfinite")  # two isolated values in a run that goes on: a warning that says so
    assert f.status is Status.WARNING and "isolated" in f.message


# --- command line -------------------------------------------------------------------------


def test_cli_json_report(capsys):
    rc = main(
        [
            "analyze",
            str(_corpus("hf-t5-small-summarization-gradspike-trainer_state.json")),
            str(_corpus("hf-qwen2.5-3b-lora-law-hugeloss-trainer_state.json")),
            "--json",
            "--fail-on",
            "never",
        ]
    )
    assert rc == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["format"] for d in docs] == ["hf", "hf"]
    assert docs[0]["events"]["grad_explosions"] == 2 and docs[0]["train_records"] == 430
    assert docs[1]["status"] == "warning"  # 285 -> 79 in a few records: too few to call its noise a danger
    assert {"check": "loss_range", "status": "warning"}.items() <= next(
        f for f in docs[1]["findings"] if f["check"] == "loss_range"
    ).items()


def test_cli_text_report_and_thresholds_file(tmp_path, capsys):
    path = str(_corpus("hf-t5-small-summarization-gradspike-trainer_state.json"))
    assert main(["analyze", path, "--fail-on", "never"]) == 0
    out = capsys.readouterr().out
    assert "grad_explosions 2 (steps 164000, 190000)" in out and "430 train records" in out
    custom = tmp_path / "thresholds.yaml"
    custom.write_text("gradients:\n  explosion: 40.0\n  jump_ratio: 20.0\n")
    assert main(["analyze", path, "--thresholds", str(custom), "--fail-on", "never"]) == 0
    assert "grad_explosions 0" in capsys.readouterr().out


def test_cli_profile_changes_loss_range(capsys):
    path = str(_corpus("hf-classifier-multi-eval-overfit-trainer_state.json"))
    main(["analyze", path, "--json", "--profile", "causal-lm"])
    causal = json.loads(capsys.readouterr().out)[0]
    main(["analyze", path, "--json"])  # its eval_accuracy names the task
    detected = json.loads(capsys.readouterr().out)[0]
    status = lambda doc: next(f["status"] for f in doc["findings"] if f["check"] == "loss_range")  # noqa: E731
    assert (status(causal), status(detected)) == ("warning", "good")  # 0.056: low for an LM, fine here
    assert detected["profile"] == "classification" and "_accuracy" in detected["profile_reason"]
    assert causal["profile"] == "causal-lm" and causal["profile_reason"] == "profile causal-lm (given)"


def test_cli_bad_file_exit_status(tmp_path, capsys):
    bad = tmp_path / "x.txt"
    bad.write_text("nothing to see\n")
    assert main(["analyze", str(bad)]) == 2
    assert "unknown log format" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing.json")]) == 2


def test_cli_plot(tmp_path, capsys):
    require_module("matplotlib")
    out = tmp_path / "run.png"
    paths = [
        str(_corpus("hf-t5-small-summarization-gradspike-trainer_state.json")),
        str(_corpus("megatron-gpt3-15b-release-sm-golden_values.json")),
    ]
    assert main(["analyze", paths[0], "--plot", str(out), "--fail-on", "never"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["analyze", *paths, "--plot", str(out), "--fail-on", "never"]) == 0
    written = sorted(p.name for p in tmp_path.glob("run-*.png"))
    assert written == [
        "run-hf-t5-small-summarization-gradspike-trainer_state.png",
        "run-megatron-gpt3-15b-release-sm-golden_values.png",
    ]


# --- several runs in one file -----------------------------------------------------------------


def test_each_run_in_a_file_is_analysed_on_its_own(tmp_path, defaults):
    def run(seed_offset):
        train = [{"step": s, "loss": 3.0 - s / 100 + seed_offset, "learning_rate": 1e-4} for s in range(10, 210, 10)]
        evals = [{"step": s, "eval_loss": 3.0 - s / 100 + seed_offset} for s in (50, 100, 150, 200)]
        return sorted(train + evals, key=lambda e: e["step"])

    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": run(0.0) + run(0.01)}))  # a restart from step 10
    fa = analyze_runs(path, defaults)
    assert len(fa.runs) == 2
    for a in fa.runs:
        assert (a.first_step, a.last_step, a.train_records, a.eval_records) == (10, 200, 20, 4)
        # Merged, the second run's first eval (2.51) would read as 'overfitting: far above the best 1.0'.
        assert not a.reached("overfitting")
    assert analyze_file(path, defaults).first_step == 10  # the last run


def test_text_report_says_what_was_read_and_shows_each_run(capsys):
    assert main(["analyze", str(DATA / "llmc-three-seeds-main.log"), "--fail-on", "never"]) == 0
    out = capsys.readouterr().out
    assert "read 186 lines: 180 train records, 6 eval records" in out
    assert out.count("-- run ") == 3 and "3 runs in one file" in out


# --- the gate -----------------------------------------------------------------------------------


def test_gate_exit_status(tmp_path, capsys):
    nan_run = str(DATA / "megatron-train.log")  # one NaN interval, recovered: the final diagnosis holds a WARNING
    assert main(["analyze", nan_run]) == 0
    assert main(["analyze", nan_run, "--fail-on", "warning"]) == 1
    assert main(["analyze", nan_run, "--fail-on", "never"]) == 0
    healthy = str(DATA / "hf-custom-lr-key-trainer_state.json")
    assert main(["analyze", healthy]) == 0
    overfit = str(_corpus("hf-whisper-large-v2-ja-overfit-trainer_state.json"))  # eval loss up at every eval
    assert main(["analyze", overfit, "--fail-on", "warning"]) == 1
    missing = str(tmp_path / "missing.json")
    assert main(["analyze", nan_run, missing, "--fail-on", "warning"]) == 2  # could not read wins over the gate
    capsys.readouterr()
    assert main(["analyze", nan_run, "--json", "--fail-on", "warning"]) == 1
    doc = json.loads(capsys.readouterr().out)[0]
    assert doc["file_status"] == "warning" and doc["read"]["train"] == 30 and len(doc["runs"]) == 1


def _lossbeat(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lossbeat", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(EXPORTER)},
        **kwargs,
    )


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_closed_pipe_ends_quietly(json_flag):
    """``lossbeat analyze ... | head -n 2``: a real pipe that the reader closes early."""
    files = [str(DATA / "llmc-three-seeds-main.log")] * 40  # well over a pipe buffer (64 KiB) of output
    proc = subprocess.Popen(
        [sys.executable, "-m", "lossbeat", "analyze", *files, *json_flag, "--fail-on", "never"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(EXPORTER)},
    )
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its lines
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=300)
    assert first.strip()
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert rc == 0


def test_broken_inputs_one_line_each_never_a_traceback(tmp_path):
    cases = {
        "truncated.json": b'{"log_history": [{"step": 1, "loss": 2.0}, {"step": 2, "lo',
        "garbage.bin": os.urandom(200_000),
        "empty.log": b"",
        "unknown.txt": b"hello\nworld\n" * 100,
        "jsonl-bad.jsonl": b'{"current_steps": 1\n',
        "csv-no-rows.csv": b"epoch,step,train_loss\n",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    os.mkfifo(tmp_path / "a-fifo")
    (tmp_path / "a-dir").mkdir()
    paths = [str(tmp_path / name) for name in [*cases, "a-fifo", "a-dir", "no-such-file.json"]]
    result = _lossbeat("analyze", *paths)  # one process for all: each file gets its own line
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == len(paths)
    for path, line in zip(paths, lines):
        assert line.startswith(f"lossbeat analyze: {path}: "), line


def test_readable_odd_inputs_are_analysed(tmp_path):
    one = tmp_path / "one-step-trainer_state.json"
    one.write_text('{"log_history": [{"step": 1, "loss": 2.0}]}')
    utf16 = tmp_path / "utf16.log"
    utf16.write_bytes("".join(f"s:{i} trl:{3 - i / 100:.4f}\n" for i in range(30)).encode("utf-16"))
    result = _lossbeat("analyze", str(one), str(utf16))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert f"== {one} [hf]" in result.stdout and f"== {utf16} [llmc]" in result.stdout


# --- plots ----------------------------------------------------------------------------------------


def _figure(path, defaults, edit=None):
    require_module("matplotlib")
    from lossbeat.analyze.plot import draw

    fa = analyze_runs(path, defaults)
    if edit:
        edit(fa.runs)
    return draw(fa.log, fa.runs, defaults)


def _history(tmp_path, losses, name="trainer_state.json", evals=()):
    entries = [{"step": 10 * (i + 1), "loss": v, "learning_rate": 1e-4} for i, v in enumerate(losses)]
    entries += [{"step": s, "eval_loss": v} for s, v in evals]
    path = tmp_path / name
    path.write_text(json.dumps({"log_history": sorted(entries, key=lambda e: e["step"])}))
    return path


def test_plot_log_axis_past_a_decade_and_minimum_range_when_flat(tmp_path, defaults):
    falling = _history(tmp_path, [11.0 * 0.9**i for i in range(60)], "falling.json")
    fig = _figure(falling, defaults)
    assert fig.axes[0].get_yscale() == "log"
    flat = _history(tmp_path, [2.0 + (1e-4 if i % 2 else -1e-4) for i in range(60)], "flat.json")
    fig = _figure(flat, defaults)
    lo, hi = fig.axes[0].get_ylim()
    assert fig.axes[0].get_yscale() == "linear" and hi - lo >= 0.2 * 2.0 * 0.99  # not a wild zoom on 2e-4 noise


def test_plot_legends_sit_outside_the_data(tmp_path, defaults):
    fig = _figure(_corpus("hf-qwen2.5-3b-lora-law-hugeloss-trainer_state.json"), defaults)
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # right of the axes, never over markers


def test_plot_many_events_are_a_rug_few_are_markers(tmp_path, defaults):
    path = _history(tmp_path, [3.0 - i / 1000 for i in range(500)])

    def events(n):
        def edit(runs):
            steps = [10 * (i + 1) for i in range(0, 500, 500 // n)][:n]
            runs[-1].event_steps["loss_spikes"] = steps
            runs[-1].counters["loss_spikes"] = len(steps)

        return edit

    many = _figure(path, defaults, events(250))
    labels = [line.get_label() for line in many.axes[0].get_lines()]
    assert any("loss spikes (250): rug" in label for label in labels)
    few = _figure(path, defaults, events(5))
    (marks,) = [line for line in few.axes[0].get_lines() if line.get_label() == "loss spikes (5)"]
    assert len(marks.get_xdata()) == 5 and marks.get_marker() == "x"


def test_plot_marks_runs_and_overfitting(defaults, tmp_path):
    fig = _figure(DATA / "llmc-three-seeds-main.log", defaults)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert {"run 1: train loss", "run 2: train loss", "run 3: train loss"} <= set(labels)
    fig = _figure(_corpus("hf-whisper-large-v2-ja-overfit-trainer_state.json"), defaults)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    assert any(label.startswith("overfitting from step") for label in labels)
    assert any(label.startswith("best eval 0.321") for label in labels)


def test_plot_many_non_finite_steps_are_one_band(tmp_path, defaults):
    from matplotlib.colors import to_rgb

    path = _history(tmp_path, [3.0 - i / 1000 if i < 200 else float("nan") for i in range(500)])
    fig = _figure(path, defaults)
    ax = fig.axes[0]
    magenta = [p for p in ax.patches if tuple(p.get_facecolor()[:3]) == to_rgb("m")]
    assert len(magenta) == 1  # 300 consecutive NaN records: one band, not 300 lines
    assert magenta[0].get_x() == pytest.approx(2010)
    assert any(label.startswith("non-finite (loss 300") for label in ax.get_legend_handles_labels()[1])


def test_a_run_that_diverged_never_reads_as_learning(defaults, capsys):
    """real-logs-2's LSTM: the loss fell from 3.36 to about 0.37, then diverged to about 12. Every
    check tells that story: no "fell from 3.355 to 11.93", no overfitting for an eval loss that rose
    with the train loss, and lossbeat analyze exits 1."""
    path = CORPUS.parent / "real-logs-2" / "lightning-lstm-hydrology-regression-divergence-metrics.csv"
    a = analyze_file(path, defaults)
    trend = _final(a, "loss_trend")
    assert trend.status is Status.DANGER and "above its best 0.2" in trend.message, trend.message
    learning = _final(a, "learning")
    assert learning.status is not Status.GOOD and "lost much of it" in learning.message, learning.message
    assert _final(a, "overfitting").status is Status.GOOD
    from lossbeat.cli import build_parser

    args = build_parser().parse_args(["analyze", str(path)])
    assert args._run(args) == 1
    capsys.readouterr()
