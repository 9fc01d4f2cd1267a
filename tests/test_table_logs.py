"""Tables of named values: MLflow runs, W&B runs, stable-baselines3's progress.csv, detectron2's
metrics.json, and any CSV, JSON lines or printout whose names hold a loss (the generic reader).

The runs in tests/data/formats were written by the real libraries (tests/data/make_format_fixtures.py;
detectron2 does not install here: its files are written as its JSONWriter writes them)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_module

from lossbeat.analyze import analyze_runs
from lossbeat.diagnosis import Status
from lossbeat.logs import LogFormatError, detect_format, parse_log
from lossbeat.logs.columns import parse_column_map

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ROOT / "tests" / "data" / "formats"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT / "exporter"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "lossbeat", "analyze", *args], capture_output=True, text=True, env=env, timeout=120
    )


# --- each format, written by its library: read in full, named, a NaN or divergence exits 1 --------

CASES = [
    # (path, format, train records, eval records, the faulty run's DANGER check)
    ("sb3-healthy/progress.csv", "sb3", 15, 0, None),
    ("sb3-nan/progress.csv", "sb3", 15, 0, "nonfinite"),
    ("mlflow-healthy/mlruns", "mlflow", 60, 6, None),
    ("mlflow-nan/mlruns", "mlflow", 60, 6, "nonfinite"),
    ("wandb-healthy/wandb", "wandb", 60, 6, None),
    ("wandb-nan/wandb", "wandb", 60, 6, "nonfinite"),
    ("detectron2-healthy/metrics.json", "detectron2", 50, 0, None),
    ("detectron2-diverging/metrics.json", "detectron2", 50, 0, "loss_trend"),
]


@pytest.mark.parametrize("name,fmt,train,evals,danger", CASES, ids=[c[0].split("/")[0] for c in CASES])
def test_each_format_is_read_in_full_and_judged(name, fmt, train, evals, danger):
    path = FORMATS / name
    assert detect_format(path) == fmt
    log = parse_log(path)
    assert log.format == fmt
    assert (log.counts.train, log.counts.evals) == (train, evals)
    assert not log.counts.unreadable and log.counts.stopped_at is None
    fa = analyze_runs(path)
    worst = {f.check: f.status for f in fa.runs[-1].findings}
    if danger is None:
        assert fa.status < Status.DANGER, worst
    else:
        assert worst[danger] is Status.DANGER, worst
    proc = cli(str(path))
    assert proc.returncode == (1 if danger else 0), proc.stderr
    assert f"[{fmt}]" in proc.stdout


def test_sb3_values_rewards_and_entropy_reach_the_rl_profile():
    log = parse_log(FORMATS / "sb3-nan" / "progress.csv")
    rows = (FORMATS / "sb3-nan" / "progress.csv").read_text().splitlines()
    header = rows[0].split(",")
    last = dict(zip(header, rows[-1].split(",")))
    assert log.train[-1].step == int(last["time/total_timesteps"])
    assert math.isnan(log.train[-1].loss)
    assert log.train[-1].learning_rate == pytest.approx(float(last["train/learning_rate"]))
    assert log.signals["rollout/ep_rew_mean"][-1] == (
        log.train[-1].step,
        pytest.approx(float(last["rollout/ep_rew_mean"])),
    )
    assert log.signals["entropy"][-1][1] == pytest.approx(-float(last["train/entropy_loss"]))
    # the first rollout's row has a reward but no update yet: not a train record
    assert log.signals["rollout/ep_rew_mean"][0][0] < log.train[0].step
    fa = analyze_runs(FORMATS / "sb3-healthy" / "progress.csv")
    assert fa.runs[-1].profile == "rl"
    assert "policy_gradient_loss" in fa.runs[-1].profile_reason


def test_mlflow_values_are_the_stores_and_metric_names_reach_the_profile(tmp_path):
    (run,) = (FORMATS / "mlflow-nan" / "mlruns").glob("*/*/metrics")
    lines = (run / "loss").read_text().split("\n")
    ts, value, step = lines[0].split()
    log = parse_log(run.parent)  # the run folder itself
    assert log.train[0].step == int(step) and log.train[0].loss == pytest.approx(float(value))
    assert any("status FINISHED" in n for n in log.notes)
    first_nan = next(r.step for r in log.train if math.isnan(r.loss))
    assert first_nan == 50
    # an MLflow run of an RL job: its metric names name the task, as the HF keys do
    copy = tmp_path / "mlruns" / "1" / "abc"
    (copy / "metrics").mkdir(parents=True)
    (copy / "meta.yaml").write_text("run_id: abc\nstatus: 1\nstart_time: 5\n")
    (copy.parent / "meta.yaml").write_text("experiment_id: '1'\nname: rl\n")
    for name, values in {"loss": [0.1, 0.2, 0.1], "reward": [1.0, 2.0, 3.0], "reward_std": [0.5, 0.4, 0.3]}.items():
        (copy / "metrics" / name).write_text("".join(f"17000000{i} {v} {i}\n" for i, v in enumerate(values)))
    log = parse_log(tmp_path / "mlruns")
    assert log.format == "mlflow" and len(log.train) == 3
    assert [v for _, v in log.signals["reward_std"]] == [0.5, 0.4, 0.3]
    assert analyze_runs(tmp_path / "mlruns").runs[-1].profile == "rl"


def test_wandb_reader_matches_the_wandb_protobuf_definitions():
    pb = require_module("wandb.proto.wandb_internal_pb2")
    from lossbeat.logs import wandb_run

    record = {f.name: f.number for f in pb.Record.DESCRIPTOR.fields}
    item = {f.name: f.number for f in pb.HistoryItem.DESCRIPTOR.fields}
    assert (record["history"], record["exit"]) == (wandb_run._HISTORY, wandb_run._EXIT)
    assert (item["key"], item["nested_key"], item["integer"], item["number"], item["value_json"]) == (1, 2, 5, 6, 16)
    # every history record the file holds, as wandb's own protobuf parses it
    (file,) = (FORMATS / "wandb-nan" / "wandb").glob("*/*.wandb")
    stream = wandb_run.RecordStream()
    ours, theirs = [], []
    for raw in stream.feed(file.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            theirs.append({("/".join(i.nested_key) or i.key): i.value_json for i in rec.history.item})
            ours.append(wandb_run.decode_record(raw)[1][0])
    assert len(ours) == 60 and stream.bad == 0
    for mine, real in zip(ours, theirs):
        assert set(mine) == set(real)
        assert all(str(mine[k]) == real[k] or float(real[k]) == mine[k] or math.isnan(mine[k]) for k in real)


def test_wandb_run_written_now_by_the_real_library(tmp_path, monkeypatch):
    wandb = require_module("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    for step in range(8):
        run.log({"train/loss": 2.0 - 0.1 * step if step < 7 else float("inf"), "train/learning_rate": 1e-4}, step=step)
    run.finish()
    wandb.teardown()
    log = parse_log(tmp_path / "wandb")
    assert [r.loss for r in log.train][:3] == [2.0, 1.9, 1.8] and math.isinf(log.train[-1].loss)
    assert all(r.learning_rate == 1e-4 for r in log.train)


# --- the generic reader ----------------------------------------------------------------------------


def test_plain_printouts_and_their_variants(tmp_path):
    a = tmp_path / "a.log"
    a.write_text(
        "loading data\n"
        "epoch 1 | step 12 | train_loss 2.31 | lr 1.0e-04\n"
        "epoch 1 | step 24 | train_loss 2.11 | lr 1.0e-04 | grad_norm 0.8\n"
        "epoch 1 | step 36 | train_loss 2.05 | lr 1.0e-04\n"
        "epoch 1 | step 48 | train_loss 2.01 | lr 1.0e-04\n"
        "epoch 1 | step 60 | train_loss nan | lr 1.0e-04 | val_loss 2.2\n"
    )
    log = parse_log(a)
    assert log.format == "printout"
    assert [(r.step, r.learning_rate) for r in log.train] == [(s, 1e-4) for s in (12, 24, 36, 48, 60)]
    assert log.train[1].grad_norm == 0.8 and math.isnan(log.train[-1].loss)
    assert [(e.step, e.loss) for e in log.evals] == [(60, 2.2)]
    assert any("loss 'train_loss'" in n and "step 'step'" in n for n in log.notes)
    assert cli(str(a)).returncode == 1
    # the PyTorch tutorials' print: the step counts batches within an epoch
    b = tmp_path / "b.log"
    b.write_text(
        "".join(
            f"Epoch [{e}/2], Step [{s}/300], Loss: {1 / (e * 300 + s):.4f}\n" for e in (1, 2) for s in (100, 200, 300)
        )
    )
    log = parse_log(b)
    assert log.format == "printout"
    assert [r.step for r in log.train] == [100, 200, 300, 400, 500, 600]
    assert any("starts again each epoch" in n for n in log.notes)
    c = tmp_path / "c.log"
    c.write_text("".join(f"[train] step={i} loss={3 - i / 10} lr=3e-4\n" for i in range(1, 6)))
    log = parse_log(c)
    assert [r.loss for r in log.train] == [2.9, 2.8, 2.7, 2.6, 2.5]


def test_any_csv_or_json_lines_naming_a_loss_and_the_map(tmp_path):
    d = tmp_path / "metrics.tsv"
    d.write_text(
        "iter\tmse_loss\tval_mse_loss\tlearning_rate\tgnorm\n1\t2.0\t\t0.1\t3\n2\t1.9\t\t0.1\t2\n3\t1.8\t1.95\t0.1\t1\n"
    )
    log = parse_log(d)
    assert log.format == "csv"
    assert [(r.step, r.loss, r.learning_rate, r.grad_norm) for r in log.train][-1] == (3, 1.8, 0.1, 1.0)
    assert [(e.step, e.loss) for e in log.evals] == [(3, 1.95)]
    e = tmp_path / "log.jsonl"
    e.write_text('{"it": 1, "train": {"loss": 2.0, "lr": 0.1}}\n{"it": 2, "train": {"loss": NaN, "lr": 0.1}}\n')
    log = parse_log(e)
    assert log.format == "jsonl" and log.train[0].loss == 2.0 and math.isnan(log.train[1].loss)
    assert log.train[1].learning_rate == 0.1
    # nothing names a loss: one line, exit 2; --map names it
    f = tmp_path / "f.csv"
    f.write_text("a,b,c\n1,2.5,3\n4,2.4,6\n5,2.3,7\n")
    with pytest.raises(LogFormatError, match="names a loss"):
        parse_log(f)
    proc = cli(str(f))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--map" in proc.stderr
    log = parse_log(f, column_map="loss=b,step=c")
    assert [(r.step, r.loss) for r in log.train] == [(3, 2.5), (6, 2.4), (7, 2.3)]
    assert any("loss 'b' (--map)" in n for n in log.notes)
    assert cli(str(f), "--map", "loss=b,step=c").returncode == 0
    # --map overrides a choice made by name
    log = parse_log(d, column_map={"loss": "val_mse_loss", "eval": "mse_loss"})
    assert [r.loss for r in log.train] == [1.95] and len(log.evals) == 3


def test_map_is_checked_and_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="--map: unknown role 'los'"):
        parse_column_map("los=b")
    with pytest.raises(ValueError, match="--map: expected ROLE=COLUMN"):
        parse_column_map("loss")
    with pytest.raises(TypeError, match="--map"):
        parse_column_map(3)  # type: ignore[arg-type]
    f = tmp_path / "f.csv"
    f.write_text("a,loss\n1,2\n2,3\n")
    with pytest.raises(LogFormatError, match="--map names columns the file does not have: step=zz"):
        parse_log(f, column_map="step=zz")
    proc = cli(str(f), "--map", "los=a")
    assert proc.returncode == 2 and "--map: unknown role" in proc.stderr


def test_the_generic_reader_does_not_take_files_the_named_parsers_read(tmp_path):
    lightning = ROOT / "tests" / "data" / "lightning-lr-monitor-metrics.csv"
    assert detect_format(lightning) == "lightning"
    kv = tmp_path / "kv.log"
    kv.write_text("step: 1 | loss: 2.0\nstep: 2 | loss: 1.9\n")
    assert detect_format(kv) == "kv-stdout"
    nano = ROOT / "tests" / "data" / "nanogpt-karpathy-stdout.log"
    assert detect_format(nano) == "nanogpt"


def test_a_printout_line_headed_by_its_phase_gives_that_phases_loss(tmp_path):
    """timm prints its validation as "Test: [48/48] ... Loss: 4.1": never the train loss. A line
    headed "Val" without a step is an eval record at the step of the train record before it."""
    lines = []
    for epoch in range(3):
        for batch in range(0, 500, 100):
            loss = 6.0 - epoch - batch / 1000
            lines.append(
                f"Train: {epoch} [{batch:>4}/500 ({batch // 5:>3d}%)]  Loss: {loss:.3f} ({loss + 0.05:.2f})  "
                "Time: 0.512s,  500.12/s  LR: 1.000e-03  Data: 0.012 (0.015)"
            )
        lines.append(f"Test: [  48/48]  Time: 0.1 (0.2)  Loss:  {9.0 + epoch:.4f} ({9.0 + epoch:.4f})  Acc@1: 50.0")
    path = tmp_path / "timm.log"
    path.write_text("\n".join(lines) + "\n")
    log = parse_log(path)
    assert log.format == "printout" and len(log.train) == 15
    assert max(r.loss for r in log.train) < 6.5  # the 9.x test losses stayed out of the train loss
    piped = [f"epoch {e} | step {e * 100} | loss {3.0 - e / 10:.2f} | lr 0.001" for e in range(1, 11)]
    piped.insert(5, "Val | loss 2.75 | acc 0.8")  # after step 500
    piped.append("Validation: loss=2.5")
    path = tmp_path / "piped.log"
    path.write_text("\n".join(piped) + "\n")
    log = parse_log(path)
    assert [r.step for r in log.train] == list(range(100, 1001, 100))
    assert [(e.step, e.loss) for e in log.evals] == [(500, 2.75), (1000, 2.5)]
