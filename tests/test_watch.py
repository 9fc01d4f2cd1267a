"""``lossbeat watch``: a log written line by line while a real watcher follows it into a real Monitor,
scraped over real HTTP. Waits are for a condition (bounded), never a timed assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import CORPORA as REAL
from helpers.scrape import scrape

from lossbeat.logs import parse_log
from lossbeat.logs.live import LiveBuilder, live_parser
from lossbeat.logs.source import Source
from lossbeat.monitor import MonitorConfig
from lossbeat.watch import EXIT_COMPLETED, EXIT_IDLE, Follower, Watcher

ROOT = Path(__file__).resolve().parents[1]


def value(metrics: dict, name: str) -> float | None:
    samples = metrics.get(name)
    return samples[0][1] if samples else None


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def hf_line(loss, epoch, grad_norm=1.5, lr=1e-4) -> str:
    return f"{{'loss': {loss}, 'grad_norm': {grad_norm}, 'learning_rate': {lr}, 'epoch': {epoch}}}\n"


class Writer:
    """Appends lines to a log and flushes each, as a trainer's redirected stdout does."""

    def __init__(self, path: Path, mode: str = "a") -> None:
        self.path = path
        self.fh = open(path, mode, encoding="utf-8")

    def write(self, text: str) -> None:
        self.fh.write(text)
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def start(path: Path, **kw) -> tuple[Watcher, threading.Thread, list]:
    cfg = MonitorConfig(port=0, addr="127.0.0.1", run_name="watched", linger_seconds=0, port_per_local_rank=False)
    w = Watcher(path, cfg, poll_interval=0.01, **kw)
    result: list = []
    t = threading.Thread(target=lambda: result.append(w.run()), daemon=True)
    t.start()
    return w, t, result


def stop(w: Watcher, t: threading.Thread) -> None:
    w.stop()
    t.join(20)
    assert not t.is_alive()


def try_scrape(port: int) -> dict:
    try:
        return scrape(port)
    except OSError:  # between two runs' monitors the port is closed for a moment
        return {}


def step_is(w: Watcher, step: int):
    return lambda: value(try_scrape(w.monitor.port), "training_step") == step


def test_hf_printed_log_followed_live_nan_counted_and_completion_ends_the_watch(tmp_path):
    log = tmp_path / "train.log"
    w, t, result = start(log)  # the file does not exist yet
    wait_for(lambda: w.monitor.port, "the exporter")
    assert value(scrape(w.monitor.port), "training_step") is None  # up, no record yet
    out = Writer(log)
    out.write("***** Running training *****\n  Num examples = 800\n")
    for i in range(1, 5):
        out.write(hf_line(round(2.5 - 0.1 * i, 4), i / 10))
        wait_for(step_is(w, i), f"step {i}")
    m = scrape(w.monitor.port)
    assert value(m, "training_loss") == pytest.approx(2.1)
    assert value(m, "training_grad_norm") == pytest.approx(1.5)
    assert value(m, "training_nonfinite_loss_total") == 0
    info = m["training_run_info"][0][0]
    assert info["run"] == "watched" and info["feed"] == "log"  # the labels say the source is a log
    assert not [name for name in m if name.startswith("training_memory_")]  # the watcher's memory is not the run's
    out.write(hf_line("nan", 0.5))  # a NaN written at step 5
    wait_for(step_is(w, 5), "step 5")
    assert value(scrape(w.monitor.port), "training_nonfinite_loss_total") == 1
    out.write("{'eval_loss': 2.05, 'eval_runtime': 1.2, 'epoch': 0.5}\n")
    wait_for(lambda: value(scrape(w.monitor.port), "training_eval_loss") == pytest.approx(2.05), "the eval loss")
    assert t.is_alive()
    out.write("{'train_runtime': 29.1, 'train_samples_per_second': 27.5, 'train_loss': 2.2, 'epoch': 0.5}\n")
    t.join(20)
    assert result == ["completed"]
    assert w.monitor.closed and w.monitor.state.completed
    assert w.builder.counts.train == 5 and w.builder.counts.evals == 1
    out.close()


def test_half_written_line_is_held_until_its_newline(tmp_path):
    log = tmp_path / "train.log"
    out = Writer(log)
    out.write(hf_line(2.0, 0.1))
    w, t, _ = start(log)
    wait_for(step_is(w, 1), "step 1")
    out.write("{'loss': 1.75, 'grad_no")  # half a line, as a reader may catch it
    wait_for(lambda: w.follower.offset == log.stat().st_size, "the half line read")
    assert w.builder.counts.train == 1
    out.write("rm': 3.25, 'learning_rate': 1e-4, 'epoch': 0.2}\n")
    wait_for(step_is(w, 2), "step 2")
    m = scrape(w.monitor.port)
    assert value(m, "training_loss") == 1.75 and value(m, "training_grad_norm") == 3.25
    stop(w, t)
    out.close()


def jsonl(step, loss, total=100) -> str:
    return (
        json.dumps(
            {
                "current_steps": step,
                "total_steps": total,
                "loss": loss,
                "lr": 1e-5,
                "epoch": step / total,
                "percentage": step,
                "elapsed_time": "0:00:10",
            }
        )
        + "\n"
    )


def test_rotation_and_copytruncate_continue_the_run_and_a_restart_is_a_new_run(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    out = Writer(log)
    for s in range(1, 4):
        out.write(jsonl(s, 3.0 - s / 10))
    w, t, _ = start(log)
    wait_for(step_is(w, 3), "step 3")
    port = w.monitor.port
    # logrotate: the file moves away, a new one takes its name
    out.close()
    os.rename(log, tmp_path / "trainer_log.jsonl.1")
    out = Writer(log, "w")
    out.write(jsonl(4, 2.5))
    wait_for(step_is(w, 4), "step 4 after rotation")
    assert w.follower.resets == 1 and w.builder.runs == 1
    # copytruncate: the same file cut to zero, then appended
    out.fh.truncate(0)
    out.fh.seek(0)
    out.write(jsonl(5, 2.4))
    wait_for(step_is(w, 5), "step 5 after truncation")
    assert w.follower.resets == 2 and w.builder.runs == 1
    assert value(scrape(port), "training_loss") == pytest.approx(2.4)
    # a restarted job overwriting its log: the step goes back, a new run, served on the same port
    out.close()
    out = Writer(log, "w")
    out.write(jsonl(1, 9.0))
    wait_for(lambda: w.builder.runs == 2, "the new run")
    wait_for(lambda: value(try_scrape(port), "training_loss") == 9.0, "the new run's loss")
    assert w.monitor.port == port
    assert value(scrape(port), "training_step") == 1
    stop(w, t)
    out.close()


def test_llamafactory_jsonl_written_line_by_line_completes_at_total_steps(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    out = Writer(log)
    w, t, result = start(log)
    for s in range(10, 40, 10):
        out.write(jsonl(s, 2.3 - s / 100, total=40))
        wait_for(step_is(w, s), f"step {s}")
    out.write('{"current_steps": 35, "total_steps": 40, "eval_loss": 2.2, "epoch": 0.9}\n')
    wait_for(lambda: value(scrape(w.monitor.port), "training_eval_loss") == 2.2, "the eval loss")
    assert value(scrape(w.monitor.port), "training_learning_rate") == 1e-5
    assert t.is_alive()
    out.write(jsonl(40, 1.9, total=40))
    t.join(20)
    assert result == ["completed"] and w.builder.counts.train == 4
    out.close()


def test_step_time_is_per_step_over_the_logging_interval(tmp_path):
    # a record every 10 steps: the Monitor's step time is the time between the records over 10
    log = tmp_path / "trainer_log.jsonl"
    out = Writer(log)
    w, t, _ = start(log, fmt="llamafactory")
    wait_for(lambda: w.follower.opened and not w.feed.replaying, "the watcher at the end")  # live records only
    out.write(jsonl(10, 2.3))
    wait_for(step_is(w, 10), "step 10")
    assert value(scrape(w.monitor.port), "training_step_duration_seconds") is None  # one record: no interval yet
    time.sleep(1.0)  # step 20 is written >= 1 s after step 10 was read
    out.write(jsonl(20, 2.2))
    wait_for(step_is(w, 20), "step 20")
    per_step = value(scrape(w.monitor.port), "training_step_duration_seconds")
    assert 0.1 <= per_step < 1.0  # >= 1 s over 10 steps; the whole interval would be >= 1 s
    stop(w, t)
    out.close()


def test_replayed_backlog_stamps_the_heartbeat_at_the_files_last_growth(tmp_path):
    # a watcher restarted on a log that stopped an hour ago: TrainingStalled must see an hour-old heartbeat
    log = tmp_path / "train.log"
    log.write_text("".join(hf_line(2.0 - i / 100, i / 100) for i in range(1, 21)))
    old = time.time() - 3600
    os.utime(log, (old, old))
    w, t, _ = start(log)
    wait_for(lambda: not w.feed.replaying, "the replay")
    m = scrape(w.monitor.port)
    assert value(m, "training_step") == 20
    assert value(m, "training_last_heartbeat_timestamp_seconds") == pytest.approx(old, abs=1e-3)
    assert value(m, "training_last_step_timestamp_seconds") == pytest.approx(old, abs=1e-3)
    stop(w, t)


def test_tail_starts_at_the_end(tmp_path):
    log = tmp_path / "train.log"
    out = Writer(log)
    for i in range(1, 4):
        out.write(hf_line("nan", i / 10))  # history the tail must not judge
    w, t, _ = start(log, from_start=False, fmt="hf-stdout")
    wait_for(lambda: w.follower.opened and not w.feed.replaying, "the watcher at the end")
    out.write(hf_line(1.5, 0.4))
    wait_for(lambda: w.builder.counts.train == 1, "the new record")
    m = scrape(w.monitor.port)
    assert value(m, "training_loss") == 1.5 and value(m, "training_nonfinite_loss_total") == 0
    stop(w, t)
    out.close()


def test_follower_bounds_an_endless_line(tmp_path):
    from lossbeat.logs.source import MAX_LINE_CHARS

    log = tmp_path / "x.log"
    f = Follower(log)
    assert f.poll() == ([], False)  # not there yet
    log.write_bytes(b"a" * (5 * MAX_LINE_CHARS))
    while f.poll()[0]:
        pass
    assert f._partial == b"" and f.overlong == 1
    with open(log, "ab") as fh:
        fh.write(b"tail of the long line\nok\n")
    assert f.poll() == (["ok"], False)


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("real-logs/llamafactory-qwen2.5-3b-full-sft-7epoch-trainer_log.jsonl", "llamafactory"),
        ("real-logs-2/hf-stdout-llama3.2-3b-lora-jcommonsenseqa-string-values-train_log.txt", "hf-stdout"),
        ("real-logs/llmc-gpt2-124m-fineweb-main.log", "llmc"),
    ],
)
def test_live_parsers_read_real_logs_as_the_offline_ones(name, fmt):
    path = REAL / name
    offline = parse_log(path)
    got: list = []

    class Sink:
        def train(self, step, loss, *rest):
            got.append(step if fmt == "llamafactory" else (step, loss))

        def eval(self, *a):
            pass

        def new_run(self, step):
            got.append("new run")

        def complete(self, why):
            got.append("completed")

    builder = LiveBuilder(str(path), fmt, Sink())
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        lines = (line for line in fh)
        live_parser(fmt)(Source(str(path), 0, b"", "utf-8", "", lines=lines), builder)
    want = []
    for i, seg in enumerate(offline.segments):
        # two ranks append each LLaMA-Factory step with their own loss: the live reader keeps the first,
        # the offline one the latest, so the steps are compared there
        want += (["new run"] if i else []) + [r.step if fmt == "llamafactory" else (r.step, r.loss) for r in seg.train]
    if fmt == "hf-stdout":  # it ends with the Trainer's summary; the LLaMA-Factory log stops at 6565 of 6566
        want.append("completed")
    if fmt == "llamafactory":
        # The run was resumed from its step-5000 checkpoint after step 5220 and appended its redo
        # (5010-5220 again): the live reader follows the redo, the offline one keeps each step's
        # latest record. Each step once, in the order first logged, is the offline list.
        assert builder.resumes == 1
        got = list(dict.fromkeys(got))
    same = [a == b or str(a) == str(b) for a, b in zip(got, want)]  # str: NaN == NaN
    assert len(got) == len(want) and all(same), [(a, b) for a, b in zip(got, want) if str(a) != str(b)][:5]


def test_live_printed_trainer_dicts_hand_on_their_signals_before_their_record():
    """A TRL GRPO run printed by the Trainer: its reward spread and KL reach the watcher's monitor
    (which names the task from them) with the record they belong to, as offline."""
    got: list = []

    class Sink:
        def metrics(self, step, values):
            got.append(("metrics", step, values))

        def train(self, step, loss, *rest):
            got.append(("train", step, loss))

        def eval(self, *a):
            pass

        def new_run(self, step):
            pass

        def complete(self, why):
            pass

    lines = [
        "{'loss': '0.0002', 'grad_norm': '0.002', 'learning_rate': '5e-06', 'reward': '-1.5', 'reward_std': '0.25', "
        "'kl': '0.01', 'epoch': '0.1'}\n",
        "{'loss': '0.0001', 'reward_std': '0', 'frac_reward_zero_std': '1', 'epoch': '0.2'}\n",
    ]
    builder = LiveBuilder("grpo.log", "hf-stdout", Sink())
    live_parser("hf-stdout")(Source("grpo.log", 0, b"", "utf-8", "", lines=iter(lines)), builder)
    metrics = [(s, n, v) for kind, s, values in got if kind == "metrics" for n, v in values.items()]
    assert ("train", 1, 0.0002) in got and ("train", 2, 0.0001) in got
    assert {(1, "reward", -1.5), (1, "reward_std", 0.25), (1, "kl", 0.01)} <= set(metrics)
    assert {(2, "reward_std", 0.0), (2, "frac_reward_zero_std", 1.0)} <= set(metrics)
    first_train = got.index(("train", 1, 0.0002))
    assert all(got.index(m) < first_train for m in got if m[0] == "metrics" and m[1] == 1)


def test_command_exits_0_at_completion(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(hf_line(2.0, 0.1) + "{'train_runtime': 3.0, 'train_loss': 2.0, 'epoch': 1.0}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "exporter")}
    cmd = [sys.executable, "-m", "lossbeat", "watch", str(log), "--port", "0", "--addr", "127.0.0.1", "--linger", "0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_COMPLETED, done.stderr
    assert "completed (the HF Trainer printed its final summary" in done.stderr


def test_command_exits_3_when_idle_and_2_for_a_format_it_cannot_follow(tmp_path, capsys):
    from lossbeat.cli import main

    idle = tmp_path / "idle.log"
    idle.write_text(hf_line(2.0, 0.1))
    args = ["watch", str(idle), "--port", "0", "--addr", "127.0.0.1", "--linger", "0", "--poll-interval", "0.01"]
    assert main(args + ["--idle-timeout", "0.3"]) == EXIT_IDLE
    assert "idle; read 1 line: 1 train records" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fmt: .*hf.*not a line-by-line log"):
        Watcher(idle, MonitorConfig(port=0), fmt="hf")


def test_deploy_examples_validate():
    from conftest import require_module

    yaml = require_module("yaml")
    kubernetes_validate = require_module("kubernetes_validate")
    manifest = yaml.safe_load((ROOT / "deploy/watch/watch-sidecar.yaml").read_text())
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    sidecar = manifest["spec"]["template"]["spec"]["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always" and sidecar["command"] == ["lossbeat", "watch"]
    assert sidecar["ports"] == [{"name": "lossbeat-0", "containerPort": 8470}]  # what podmonitor.yaml scrapes
    script = ROOT / "deploy/watch/watch.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "srun --overlap" in script.read_text() and "lossbeat watch" in script.read_text()


def test_real_hf_printed_log_written_in_odd_chunks_is_read_whole(tmp_path):
    # the real printed output of an HF Trainer run (string values, progress bars drawn with \r),
    # written in 1777-byte pieces that cut lines (and multi-byte characters) anywhere
    real = REAL / "real-logs-2/hf-stdout-llama3.2-3b-lora-jcommonsenseqa-string-values-train_log.txt"
    data = real.read_bytes()
    offline = parse_log(real)
    log = tmp_path / "train.log"
    w, t, result = start(log, fmt="hf-stdout")  # its first dict lies 107 KB in, after the unbuffered bar
    with open(log, "wb") as fh:
        for i in range(0, len(data), 1777):
            fh.write(data[i : i + 1777])
            fh.flush()
            if w.builder is not None:  # the watcher reads up to here: mid-line, mid-character
                wait_for(lambda: w.follower.offset == fh.tell(), "the watcher to catch up")
    t.join(30)
    assert result == ["completed"]
    assert w.builder.counts.train == len(offline.train) == w.feed.records
    assert w.builder.counts.evals == len(offline.evals)
    assert w.monitor.history is not None


def test_a_steps_scalars_written_apart_stay_one_record(tmp_path):
    """A SummaryWriter writes a step's scalars as separate events; polls that fall between them
    (here 0.1 s of them) must not hand the step on without its grad norm."""
    from conftest import require_module

    require_module("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "runs" / "exp"
    w, t, result = start(run_dir)
    writer = SummaryWriter(str(run_dir))
    for step in (1, 2):
        writer.add_scalar("train/loss", 3.0 - step / 10, step)
        writer.flush()
        time.sleep(0.1)  # ten polls find nothing new
        writer.add_scalar("train/grad_norm", 0.5 * step, step)
        writer.flush()
        wait_for(step_is(w, step), f"step {step}")
        assert value(scrape(w.monitor.port), "training_grad_norm") == 0.5 * step
    writer.close()
    stop(w, t)


def test_tensorboard_run_dir_written_by_a_real_summary_writer(tmp_path):
    from conftest import require_module

    require_module("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "runs" / "exp"
    w, t, result = start(run_dir)  # the directory does not exist yet
    writer = SummaryWriter(str(run_dir))
    for step in range(1, 6):
        writer.add_scalar("train/loss", float("nan") if step == 4 else 3.0 - step / 10, step)
        writer.add_scalar("train/grad_norm", 0.5 * step, step)
        writer.add_scalar("train/learning_rate", 1e-4, step)
        writer.flush()
        wait_for(step_is(w, step), f"step {step}")
    writer.add_scalar("eval/loss", 2.25, 5)
    writer.flush()
    wait_for(lambda: value(try_scrape(w.monitor.port), "training_eval_loss") == 2.25, "the eval loss")
    m = scrape(w.monitor.port)
    assert value(m, "training_loss") == pytest.approx(2.5) and value(m, "training_grad_norm") == 2.5
    assert value(m, "training_nonfinite_loss_total") == 1
    assert value(m, "training_learning_rate") == pytest.approx(1e-4)
    assert t.is_alive()
    # the HF Trainer's final summary, as its TensorBoardCallback writes it at the last step: the run's end
    for tag, v in (("train/train_runtime", 12.5), ("train/train_loss", 2.75), ("train/epoch", 1.0)):
        writer.add_scalar(tag, v, 5)
    writer.flush()
    t.join(20)
    assert result == ["completed"] and w.monitor.state.completed
    assert w.builder.counts.train == 5 and w.builder.counts.evals == 1  # the summary's mean loss is no record
    assert w.monitor.state.loss == pytest.approx(2.5)  # the last step's, not the summary's 2.75
    writer.close()


LLMC = "step {:4d}/3 | loss {} (+nanz)| norm 1.2000 (+nanz)| lr 6.00e-04 | 3594.75 ms | 37.6% bf16 MFU | 144426 tok/s\n"
MEGATRON = (
    " [2024-10-10 02:20:29] iteration        {}/       3 | consumed samples:          96 | elapsed time per "
    "iteration (ms): 812.3 | learning rate: 6.000000E-04 | global batch size:    32 | lm loss: {} | "
    "loss scale: 1.0 | grad norm: 1.200 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
)


@pytest.mark.parametrize(
    "fmt, line, eval_line, why",
    [
        ("llmc-stdout", LLMC, "val loss 2.850000\n", "llm.c printed its last step (3/3)"),
        (
            "megatron-log",
            MEGATRON,
            " validation loss at iteration 2 | lm loss value: 2.850000E+00 | lm loss PPL: 17.3 |\n",
            "Megatron-LM logged its last iteration (3/3)",
        ),
    ],
)
def test_printed_last_step_completes_the_run(tmp_path, fmt, line, eval_line, why):
    log = tmp_path / "train.log"
    out = Writer(log)
    w, t, result = start(log)
    for step in (1, 2):
        out.write(line.format(step, f"{3.0 - step / 10:.6f}"))
        wait_for(step_is(w, step), f"step {step}")
    out.write(eval_line)
    wait_for(lambda: value(scrape(w.monitor.port), "training_eval_loss") == 2.85, "the eval loss")
    assert t.is_alive() and w.format == fmt  # detected
    out.write(line.format(3, "2.700000"))
    t.join(20)
    assert result == ["completed"] and w.builder.completed == why and w.builder.counts.train == 3
    out.close()


def test_ranks_of_the_logs_from_their_names_their_order_or_a_template():
    from lossbeat.watch.ranks import RankedLog, assign_ranks

    assert assign_ranks(["logs/rank1.log", "logs/rank0.log"]) == [
        RankedLog("logs/rank0.log", 0, 2),
        RankedLog("logs/rank1.log", 1, 2),
    ]
    assert [r.rank for r in assign_ranks(["a/train_rank-3.log", "a/train_rank-5.log"], world_size=8)] == [3, 5]
    assert assign_ranks(["node-a.log", "node-b.log"]) == [RankedLog("node-a.log", 0, 2), RankedLog("node-b.log", 1, 2)]
    assert assign_ranks(["out/rank{rank}.log"], world_size=3) == [RankedLog(f"out/rank{r}.log", r, 3) for r in range(3)]
    assert assign_ranks(["train.log"]) == [RankedLog("train.log", -1, 0)]  # one log: the environment says
    assert assign_ranks(["rank3.log"], rank=3, world_size=4) == [RankedLog("rank3.log", 3, 4)]
    for args, message in [
        ((["rank3.log"], 3), "--world-size: needed with --rank"),
        ((["r{rank}.log"],), "--world-size: needed to expand"),
        ((["a.log", "b.log"], 1), "--rank: one log only"),
        ((["rank0.log", "rank7.log"], None, 4), "--world-size: 4 ranks, but a log is rank 7"),
        ((["a.log", "./a.log"],), "path: a log given twice"),
        ((["train.log"], None, 2), "--world-size: given without --rank"),
    ]:
        with pytest.raises(ValueError, match=message):
            assign_ranks(*args)


def test_one_command_follows_the_ranks_of_a_job_each_its_own_rank(tmp_path):
    import argparse

    from lossbeat.watch import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    args = parser.parse_args(
        [
            str(tmp_path / "rank{rank}.log"),
            "--world-size",
            "2",
            "--port",
            "0",
            "--addr",
            "127.0.0.1",
            "--linger",
            "0",
            "--poll-interval",
            "0.01",
        ]
    )
    watchers = command.make_watchers(args)  # serving before the logs exist
    ended: list = []
    t = threading.Thread(target=lambda: ended.extend(command.follow(watchers)), daemon=True)
    t.start()
    for r, log in enumerate(logs):
        log.write_text(hf_line(2.0 + r, 0.1))
    for r, w in enumerate(watchers):
        wait_for(step_is(w, 1), f"rank {r}'s step")
        m = scrape(w.monitor.port)
        info = m["training_run_info"][0][0]
        assert (info["rank"], info["world_size"], info["run"]) == (str(r), "2", "rank{rank}.log")
        assert value(m, "training_loss") == 2.0 + r
    run_ids = {w.monitor.state.run_id for w in watchers}
    assert len(run_ids) == 1 and "" not in run_ids  # one run, its own identity: the ranks are compared
    with open(logs[0], "a") as fh:
        fh.write("{'train_runtime': 3.0, 'train_loss': 2.0, 'epoch': 0.1}\n")
    wait_for(lambda: watchers[0].ended == "completed", "rank 0's end")
    assert t.is_alive()  # rank 1 still runs
    with open(logs[1], "a") as fh:
        fh.write("{'train_runtime': 3.0, 'train_loss': 3.0, 'epoch': 0.1}\n")
    t.join(20)
    assert ended == ["completed", "completed"]
