"""``lossbeat watch`` on the runs of tests/data/formats (written by the real libraries), written again
piece by piece while a real watcher follows them: a growing progress.csv (rewritten whole with a
wider header, as stable-baselines3 does), a live MLflow run folder, a W&B run file being written."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from conftest import require_module
from test_watch import Writer, scrape, start, step_is, value, wait_for

FORMATS = Path(__file__).resolve().parent / "data" / "formats"


def records_are(w, n: int):
    return lambda: w.builder is not None and w.builder.counts.train >= n


def signal(metrics: dict, name: str) -> float | None:
    return next((v for labels, v in metrics.get("training_signal", []) if labels.get("signal") == name), None)


def test_growing_sb3_progress_csv_rewritten_with_a_wider_header(tmp_path):
    rows = (FORMATS / "sb3-nan" / "progress.csv").read_text().splitlines()
    header = rows[0].split(",")
    first = rows[1].split(",")
    # stable-baselines3's first dump has only the rollout and time keys: a narrower header
    narrow = [i for i, cell in enumerate(first) if cell != ""]
    log = tmp_path / "progress.csv"
    log.write_text(",".join(header[i] for i in narrow) + "\n" + ",".join(first[i] for i in narrow) + "\n")
    w, t, result = start(log, idle_timeout=30)
    wait_for(lambda: w.builder is not None and w.builder.counts.read >= 2, "the first row")
    with open(log, "r+", encoding="utf-8") as fh:  # the second dump adds the train/* keys: the file is rewritten
        fh.seek(0)
        fh.write("\n".join(rows[:3]) + "\n")
    wait_for(records_are(w, 1), "the first update")
    out = Writer(log)
    for row in rows[3:]:
        out.write(row + "\n")
    wait_for(records_are(w, 15), "every update")
    m = scrape(w.monitor.port)
    assert w.builder.counts.train == 15 and w.builder.runs == 1  # the rewrite is not a restart
    assert value(m, "training_step") == int(rows[-1].split(",")[header.index("time/total_timesteps")])
    assert value(m, "training_nonfinite_loss_total") == 1
    last = dict(zip(header, rows[-1].split(",")))
    assert signal(m, "reward") == pytest.approx(float(last["rollout/ep_rew_mean"]))
    assert signal(m, "entropy") == pytest.approx(-float(last["train/entropy_loss"]))
    assert w.monitor._judge.thresholds.profile.name == "rl"
    w.stop()
    t.join(20)
    out.close()


def test_live_mlflow_run_folder_completes_when_finished(tmp_path):
    (src,) = (FORMATS / "mlflow-nan" / "mlruns").glob("*/*/metrics")
    exp = tmp_path / "mlruns" / "1"
    run = exp / "abc"
    (run / "metrics").mkdir(parents=True)
    shutil.copy(src.parent.parent / "meta.yaml", exp / "meta.yaml")
    meta = (src.parent / "meta.yaml").read_text()
    (run / "meta.yaml").write_text(meta.replace("status: 3", "status: 1"))
    series = {f.name: f.read_text().splitlines() for f in src.iterdir()}
    writers = {name: Writer(run / "metrics" / name) for name in series}
    w, t, result = start(tmp_path / "mlruns", idle_timeout=30)
    for i in range(60):  # MLflow appends each metric's line, step by step
        for name, lines in series.items():
            step_lines = [ln for ln in lines if ln.split()[2] == str(i + 1)]
            for ln in step_lines:
                writers[name].write(ln + "\n")
        if i == 10:
            wait_for(records_are(w, 10), "the first steps")
    wait_for(records_are(w, 59), "the steps written")
    assert t.is_alive()
    (run / "meta.yaml").write_text(meta)  # status: 3, FINISHED
    t.join(20)
    assert result == ["completed"]
    assert w.builder.counts.train == 60 and w.builder.counts.evals == 6
    assert w.monitor.state.completed
    for out in writers.values():
        out.close()


def test_wandb_offline_run_being_written(tmp_path):
    (src,) = (FORMATS / "wandb-nan" / "wandb").glob("*/*.wandb")
    data = src.read_bytes()
    folder = tmp_path / "wandb" / src.parent.name
    folder.mkdir(parents=True)
    w, t, result = start(tmp_path / "wandb", idle_timeout=30)
    with open(folder / src.name, "wb") as fh:
        for at in range(0, len(data), 997):  # odd pieces: records and block trailers cut anywhere
            fh.write(data[at : at + 997])
            fh.flush()
            if at == 997 * 10:
                wait_for(records_are(w, 1), "the first history rows")
    t.join(20)
    assert result == ["completed"]
    assert w.builder.counts.train == 60 and w.builder.counts.evals == 6
    assert w.feed.completed == "the W&B run exited with code 0"


def test_a_csv_without_a_loss_name_is_watched_with_map(tmp_path):
    log = tmp_path / "metrics.csv"
    out = Writer(log)
    out.write("it,objective,rate\n")
    w, t, result = start(log, idle_timeout=30, column_map="loss=objective,step=it,lr=rate")
    for i in range(1, 6):
        out.write(f"{i},{3 - i / 10},0.001\n")
    wait_for(records_are(w, 5), "five rows")
    m = scrape(w.monitor.port)
    assert value(m, "training_step") == 5 and value(m, "training_loss") == pytest.approx(2.5)
    assert value(m, "training_learning_rate") == pytest.approx(0.001)
    w.stop()
    t.join(20)
    out.close()


def test_a_real_ppo_run_followed_while_stable_baselines3_writes_it(tmp_path):
    sb3 = require_module("stable_baselines3")
    torch = require_module("torch")
    from stable_baselines3.common.logger import configure

    log = tmp_path / "progress.csv"
    w, t, result = start(log, idle_timeout=60)
    torch.manual_seed(0)
    model = sb3.PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1, seed=0, device="cpu")
    model.set_logger(configure(str(tmp_path), ["csv"]))
    model.learn(32 * 8)  # 8 dumps: the first without train/* keys, then the file rewritten with them
    model.logger.close()
    wait_for(records_are(w, 7), "the updates logged")
    m = scrape(w.monitor.port)
    assert w.builder.counts.train == 7 and w.builder.runs == 1
    assert value(m, "training_step") == 32 * 8
    assert signal(m, "reward") is not None and w.monitor._judge.thresholds.profile.name == "rl"
    w.stop()
    t.join(20)


def _mlflow_followed(tmp_path: Path, monkeypatch):
    """The real mlflow client on a file store under ``tmp_path``, and a watcher following it."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = require_module("mlflow")
    store = tmp_path / "mlruns"
    mlflow.set_tracking_uri(store.as_uri())
    mlflow.set_experiment("watched")
    return mlflow, start(store, idle_timeout=60)


def test_a_real_mlflow_run_followed_while_mlflow_writes_it(tmp_path, monkeypatch):
    mlflow, (w, t, result) = _mlflow_followed(tmp_path, monkeypatch)
    with mlflow.start_run():
        for step in range(1, 11):
            loss = 2.0 / step if step < 10 else float("nan")
            mlflow.log_metrics({"loss": loss, "learning_rate": 1e-3, "reward": step / 10}, step=step)
            if step == 3:
                wait_for(records_are(w, 2), "the first steps")
    t.join(30)
    assert result == ["completed"]
    assert w.builder.counts.train == 10
    assert w.monitor.state.completed
    assert w.feed.completed == "the MLflow run's status is FINISHED"


def test_an_mlflow_steps_metrics_logged_apart_stay_one_record(tmp_path, monkeypatch):
    """Each metric has its own file: polls that fall between a step's files (here 0.1 s of them)
    must not hand the step on without its grad norm."""
    mlflow, (w, t, result) = _mlflow_followed(tmp_path, monkeypatch)
    with mlflow.start_run():
        for step in (1, 2):
            mlflow.log_metric("loss", 2.0 / step, step=step)
            time.sleep(0.1)  # ten polls find nothing new
            mlflow.log_metric("grad_norm", 0.5 * step, step=step)
            wait_for(step_is(w, step), f"step {step}")
            assert value(scrape(w.monitor.port), "training_grad_norm") == 0.5 * step
    t.join(30)
    assert result == ["completed"] and w.builder.counts.train == 2


def test_map_naming_a_column_the_followed_file_lacks_ends_the_watch_in_one_line(tmp_path, capsys):
    from lossbeat.cli import main

    log = tmp_path / "metrics.csv"
    log.write_text("it,loss\n1,2.0\n2,1.9\n")
    args = ["watch", str(log), "--port", "0", "--addr", "127.0.0.1", "--linger", "0", "--idle-timeout", "5"]
    assert main(args + ["--map", "step=zz"]) == 2
    assert "--map names columns the file does not have: step=zz" in capsys.readouterr().err
    assert main(args + ["--map", "los=it"]) == 2
    assert "lossbeat watch: --map: unknown role 'los'" in capsys.readouterr().err


PRINTOUT = "".join(
    f"epoch {1 + i // 10} | step {i} | train_loss {3 / i:.4f} | lr 3.0e-04 | grad_norm {1 + i / 50:.3f}\n"
    for i in range(1, 31)
)
JSONL = "".join(
    f'{{"it": {i}, "train": {{"loss": {3 / i:.4f}, "lr": 0.001}}, "val_loss": {2 / i:.4f}}}\n' for i in range(1, 21)
)


@pytest.mark.parametrize(
    "name,text",
    [
        ("metrics.json", (FORMATS / "detectron2-diverging" / "metrics.json").read_text()),
        ("train.log", PRINTOUT),
        ("log.jsonl", JSONL),
    ],
    ids=["detectron2", "printout", "jsonl"],
)
def test_table_formats_written_line_by_line_are_read_as_offline(tmp_path, name, text):
    from lossbeat.logs import parse_log

    full = tmp_path / "full" / name
    full.parent.mkdir()
    full.write_text(text)
    offline = parse_log(full)
    log = tmp_path / name
    out = Writer(log)
    w, t, result = start(log, idle_timeout=30)
    for line in text.splitlines(keepends=True):
        out.write(line)
    wait_for(records_are(w, offline.counts.train), "every record")
    m = scrape(w.monitor.port)
    last = offline.train[-1]
    assert w.format == offline.format and w.builder.counts.train == offline.counts.train
    assert w.builder.counts.evals == offline.counts.evals
    assert value(m, "training_step") == last.step and value(m, "training_loss") == pytest.approx(last.loss)
    w.stop()
    t.join(20)
    out.close()


@pytest.mark.parametrize("fmt", ["openrlhf", "verl"])
def test_rl_console_followed_live_feeds_the_rl_signals_and_names_the_collapse(tmp_path, fmt):
    from lossbeat.logs import parse_log

    source = FORMATS / f"{fmt}-collapsed" / "train.log"
    offline = parse_log(source)
    log = tmp_path / "train.log"
    out = Writer(log, "w")
    w, t, result = start(log, idle_timeout=30)
    for line in source.read_text(encoding="utf-8").splitlines():  # as Ray prints the trainer's lines
        out.write(line + "\n")
    wait_for(records_are(w, 80), "every step line")
    w.monitor.flush()
    m = scrape(w.monitor.port)
    assert w.builder.format == fmt and w.builder.counts.train == 80
    last = offline.train[-1]
    assert value(m, "training_step") == last.step == 80
    assert value(m, "training_loss") == pytest.approx(last.loss)
    signals = {name: dict(points)[80] for name, points in offline.signals.items()}
    entropy = next(v for k, v in signals.items() if k in ("entropy", "actor/entropy"))
    kl = next(v for k, v in signals.items() if k in ("kl", "actor/kl_loss"))
    assert signal(m, "entropy") == pytest.approx(entropy) and signal(m, "kl") == pytest.approx(kl)
    assert w.monitor._judge.thresholds.profile.name == "rl"
    found = {f.check: f.status.name for f in w.monitor.findings}
    assert found["rl_entropy"] == "DANGER" and found["rl_kl"] == "DANGER", found
    w.stop()
    t.join(20)
    out.close()
