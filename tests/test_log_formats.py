"""Every log read in full, or a one-line reason
(docs/decisions.md#every-log-is-read-in-full-or-refused-with-a-reason).

The synthetic logs are written with the print statements of each project (quoted beside each
builder); the real-log test reads every file of the shared corpora and compares the records read
with the counts their ground truth states.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import CORPORA, require_module
from helpers.real_logs import REAL_LOGS_COUNTS

from lossbeat.logs import LogFormatError, detect_format, parse_log


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- HF Trainer stdout ------------------------------------------------------------------------------


def _hf(loss: float, epoch: float, quoted: bool = False) -> str:
    if quoted:  # transformers >= 4.5x: every value formatted as a string
        return f"{{'loss': '{loss:.4g}', 'grad_norm': '0.7695', 'learning_rate': '2.262e-05', 'epoch': '{epoch:.4g}'}}"
    return f"{{'loss': {loss}, 'grad_norm': 0.77, 'learning_rate': 2e-05, 'epoch': {epoch}}}"


def test_hf_stdout_with_a_bar_drawn_in_blocks_keeps_every_record(tmp_path):
    # stderr (the bar) and stdout (the dicts) flushed in blocks: five dicts after one bar position
    lines = []
    for block in range(4):
        lines.append(f" {block * 5 * 10 + 48}/200 [00:10<00:30,  1.7s/it]")
        lines.extend(_hf(3.0 - 0.1 * (block * 5 + i), (block * 5 + i + 1) / 20) for i in range(5))
    log = parse_log(write(tmp_path, "out.log", "\n".join(lines) + "\n"))
    assert log.counts.train == 20 and [r.step for r in log.train] == list(range(1, 21))
    assert [r.loss for r in log.train][:3] == [3.0, 2.9, 2.8]
    assert "repeated steps (the latest record of a step kept)" not in log.counts.skipped
    assert any("record numbers" in n and "drawn in blocks" in n for n in log.notes)


def test_hf_stdout_string_values_and_an_epoch_going_back_without_a_bar(tmp_path):
    dicts = [_hf(2.9 - i / 10, (i + 1) / 10, quoted=True) for i in range(4)]
    dicts += [_hf(2.8 - i / 10, (i + 1) / 10, quoted=True) for i in range(3)]  # a second run
    log = parse_log(write(tmp_path, "out.log", "\n".join(dicts) + "\n"))
    first, second = log.segments
    assert [(r.step, r.loss, r.grad_norm, r.epoch) for r in first.train][:2] == [
        (1, 2.9, 0.7695, 0.1),
        (2, 2.8, 0.7695, 0.2),
    ]
    assert first.train[0].learning_rate == pytest.approx(2.262e-05)
    assert len(first.train) == 4 and len(second.train) == 3 and not log.counts.unreadable


def test_hf_stdout_keeps_the_fields_beside_the_loss_as_a_trainer_state_would(tmp_path):
    """TRL's GRPOTrainer prints the same dict trainer_state.json logs: its reward spread and KL are
    read as signals and its field names name the task, string values (transformers >= 4.5x) too."""
    dicts = [
        f"{{'loss': '0.0002', 'grad_norm': '0.002', 'learning_rate': '5e-06', 'reward': '{-1 + i / 10:.3g}', "
        f"'reward_std': '{0.5 - i / 10:.3g}', 'frac_reward_zero_std': '{i / 5:.3g}', 'kl': '0.01', "
        f"'completions/clipped_ratio': '1', 'epoch': '{(i + 1) / 10:.3g}'}}"
        for i in range(5)
    ]
    dicts.append("{'eval_loss': '0.5', 'eval_accuracy': '0.75', 'epoch': '0.5'}")
    log = parse_log(write(tmp_path, "grpo.log", "\n".join(dicts) + "\n"))
    assert log.format == "hf-stdout" and len(log.train) == 5
    assert log.signals["reward_std"] == [(1, 0.5), (2, 0.4), (3, 0.3), (4, 0.2), (5, 0.1)]
    assert log.signals["frac_reward_zero_std"][-1] == (5, 0.8)
    assert log.signals["kl"][0] == (1, 0.01) and log.signals["eval_accuracy"] == [(5, 0.75)]
    assert {"reward_std", "frac_reward_zero_std", "completions/clipped_ratio"} <= set(log.fields)


def test_hf_stdout_in_a_notebook_and_in_a_kaggle_stream(tmp_path):
    texts = [_hf(3.0 - i / 10, i / 10) + "\n" for i in range(1, 7)] + ["{'eval_loss': 2.5, 'epoch': 0.6}\n"]
    notebook = {
        "cells": [
            {
                "cell_type": "code",
                "source": ["trainer.train()"],
                "outputs": [{"name": "stdout", "output_type": "stream", "text": texts}],
            }
        ]
    }
    nb = write(tmp_path, "train.ipynb", json.dumps(notebook, indent=1))
    kaggle = write(
        tmp_path,
        "kaggle.log",
        "["
        + "\n,".join(json.dumps({"stream_name": "stdout", "time": 10.0 + i, "data": t}) for i, t in enumerate(texts))
        + "]\n",
    )
    for path in (nb, kaggle):
        log = parse_log(path)
        assert log.format == "hf-stdout"
        assert [r.loss for r in log.train] == pytest.approx([2.9, 2.8, 2.7, 2.6, 2.5, 2.4])
        assert [(e.step, e.loss) for e in log.evals] == [(6, 2.5)]
        assert any("JSON stream" in n for n in log.notes)  # the report says what was unwrapped


def test_nanogpt_prints_inside_a_notebook_are_read(tmp_path):
    # karpathy/nanoGPT: print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
    text = [f"iter {i * 10}: loss {4 - i / 10:.4f}, time 21.50ms, mfu 3.10%\n" for i in range(8)]
    cell = {"cells": [{"outputs": [{"name": "stdout", "output_type": "stream", "text": text}]}]}
    log = parse_log(write(tmp_path, "nanogpt.ipynb", json.dumps(cell, indent=1)))
    assert log.format == "nanogpt" and [r.step for r in log.train] == list(range(0, 80, 10))
    assert any("JSON stream" in n for n in log.notes)


# --- Lightning metrics.csv ----------------------------------------------------------------------------


def test_lightning_user_named_loss_column_is_read_nan_included(tmp_path):
    rows = ["step,epoch,mean_loss,val_acc"]
    rows += [f"{s},{s // 10},{'nan' if s >= 20 else 2.0 - s / 30}," for s in range(30)]
    rows += ["9,0,,0.5", "19,1,,0.6"]
    log = parse_log(write(tmp_path, "metrics.csv", "\n".join(rows) + "\n"))
    assert log.counts.train == 30 and len(log.train) == 30
    assert sum(1 for r in log.train if math.isnan(r.loss)) == 10 and log.train[0].loss == 2.0
    assert "train loss from column 'mean_loss'" in log.notes


def test_lightning_loss_column_chosen_by_name_and_the_rest_listed(tmp_path):
    head = "step,epoch,train/ce_loss,train/total_loss,train/aux_loss,val/total_loss,test_loss"
    rows = [head] + [f"{s},0,{1.5 - s / 100},{2.0 - s / 100},0.5,," for s in range(10)] + ["9,0,,,,1.7,", "9,0,,,,,1.8"]
    log = parse_log(write(tmp_path, "metrics.csv", "\n".join(rows) + "\n"))
    assert [r.loss for r in log.train][:2] == [2.0, 1.99]
    assert [(e.step, e.loss) for e in log.evals] == [(9, 1.7)]
    assert (
        "train loss from column 'train/total_loss'; other loss columns, not read: train/ce_loss, train/aux_loss"
        in log.notes
    )
    assert "eval loss from column 'val/total_loss'" in log.notes


# --- line prefixes ------------------------------------------------------------------------------------


def _llmc(step: int) -> str:
    return f"step {step:4d}/100 | loss {7 - step / 10:.6f} (+0.00z)| norm 1.2000 (+0.00z)| lr 6.00e-04 | 120.00 ms\n"


@pytest.mark.parametrize(
    "prefix",
    [
        lambda i: "0: ",  # srun --label
        lambda i: f"[rank{i % 2}]:",  # torchrun --log-dir / --tee
        lambda i: f"[default{i % 2}]:",  # torchrun's local ranks
        lambda i: f"2024-05-01 12:00:{i:02d},123 - INFO - ",  # logging's default format
        lambda i: f"[2024-05-01 12:00:{i:02d}] ",
        lambda i: f"[rank0]:[titan] 2024-05-01 12:00:{i:02d},657 - root - INFO - \x1b[31m",
        lambda i: f"[2024-05-01 12:00:{i:02d},123][__main__][INFO] - ",  # Hydra's job logging
        lambda i: f"I0501 12:00:{i:02d}.123456 140231 train.py:88] ",  # absl / glog
    ],
)
def test_prefixed_lines_are_read_every_one(tmp_path, prefix):
    # half the lines prefixed, half not: every record is read, not only the clean ones
    lines = [(prefix(i) if i % 2 == 0 else "") + _llmc(i) for i in range(1, 21)]
    log = parse_log(write(tmp_path, "slurm.out", "banner\n" + "".join(lines)))
    assert log.format == "llmc-stdout"
    assert [r.step for r in log.train] == list(range(1, 21))
    assert log.train[0].loss == pytest.approx(6.9) and log.train[0].grad_norm == 1.2
    assert any("prefixes" in n for n in log.notes)


def test_prefixed_nanogpt_and_speedrun_lines(tmp_path):
    text = "".join(f"[default0]:iter {i}: loss {3 - i / 10:.4f}, time 20.00ms, mfu 1.00%\n" for i in range(10))
    assert [r.step for r in parse_log(write(tmp_path, "a.log", text)).train] == list(range(10))
    text = "".join(f"0: step:{i}/100 train_loss:{3 - i / 10:.4f} train_time:{i}ms step_avg:1ms\n" for i in range(1, 9))
    assert [r.step for r in parse_log(write(tmp_path, "b.log", text)).train] == list(range(1, 9))


# --- new formats, from each project's print statements ------------------------------------------------


def test_build_nanogpt_stdout_and_log_txt(tmp_path):
    # print(f"step {step:5d} | loss: {loss_accum.item():.6f} | lr {lr:.4e} | norm: {norm:.4f} | dt: {dt*1000:.2f}ms | tok/sec: {tokens_per_sec:.2f}")
    # print(f"validation loss: {val_loss_accum.item():.4f}")  (before the step is trained)
    lines = ["nohup: ignoring input", "using device: cuda"]
    for step in range(12):
        if step % 5 == 0:
            lines += [
                f"validation loss: {11 - step / 5:.4f}",
                "HellaSwag accuracy: 2486/10042=0.2476",
                "rank 0 sample 0: Hello, I'm a language model,",
            ]
        lines.append(
            f"step {step:5d} | loss: {10.955 - step / 10:.6f} | lr {6e-4 * (step + 1) / 715:.4e} | "
            f"norm: {15.34 / (step + 1):.4f} | dt: 4738.40ms | tok/sec: 110646.69"
        )
    path = write(tmp_path, "train.log", "\n".join(lines) + "\n")
    assert detect_format(path) == "build-nanogpt"
    log = parse_log(path)
    assert [r.step for r in log.train] == list(range(12))
    r1 = log.train[1]
    assert (r1.loss, r1.grad_norm, r1.learning_rate) == (10.855, 7.67, pytest.approx(1.6783e-06, rel=1e-4))
    assert [(e.step, e.loss) for e in log.evals] == [(0, 11.0), (5, 10.0), (10, 9.0)]
    # log.txt: f.write(f"{step} val {val_loss_accum.item():.4f}\n"), f"{step} train {loss_accum.item():.6f}\n",
    # f"{step} hella {acc_norm:.4f}\n"
    txt = "".join(f"{s} val {9 - s / 10:.4f}\n{s} hella 0.2500\n" if s % 5 == 0 else "" for s in range(10))
    txt += "".join(f"{s} train {10 - s / 10:.6f}\n" for s in range(10))
    log = parse_log(write(tmp_path, "log.txt", txt))
    assert log.format == "build-nanogpt" and len(log.train) == 10 and [e.step for e in log.evals] == [0, 5]


def test_nanochat_base_mid_and_sft_are_three_runs(tmp_path):
    # base_train: print0(f"step {step:05d}/{num_iterations:05d} ({pct_done:.2f}%) | loss: {debiased_smooth_loss:.6f} |
    #   lrm: {lrm:.2f} | dt: {dt * 1000:.2f}ms | tok/sec: {tok_per_sec:,} | mfu: {mfu:.2f} | total time: ...m")
    # print0(f"Step {step:05d} | Validation bpb: {val_bpb:.4f}"); mid_train drops the total;
    # chat_sft: print0(f"Step {step:05d}/{num_iterations:05d} | Training loss: {train_loss_item:.6f}| lrm: {lrm:.6f}| ...")
    lines = ["Step 00000 | Validation bpb: 3.2987"]
    lines += [
        f"step {s:05d}/00010 ({s * 10:.2f}%) | loss: {11 - s / 2:.6f} | lrm: 1.00 | dt: 874.40ms | "
        f"tok/sec: 299,799 | mfu: 52.92 | total time: 0.00m"
        for s in range(10)
    ]
    lines += ["Step 00010 | Validation bpb: 0.8155", "Step 00000 | Validation bpb: 0.7004"]
    lines += [
        f"step {s:05d} ({s * 20:.2f}%) | loss: {1.7 - s / 20:.6f} | lrm: 1.00 | dt: 900.00ms | tok/sec: 14,766 | "
        f"mfu: 2.61 | total time: 0.00m"
        for s in range(1, 6)
    ]
    lines += ["Step 00000 | Validation loss: 1.010513"]
    lines += [
        f"Step {s:05d}/00004 | Training loss: {0.9 - s / 50:.6f}| lrm: 1.000000| num_tokens: 12,345" for s in range(4)
    ]
    path = write(tmp_path, "speedrun.log", "\n".join(lines) + "\n")
    assert detect_format(path) == "nanochat"
    base, mid, sft = parse_log(path).segments
    assert [len(s.train) for s in (base, mid, sft)] == [10, 5, 4]
    assert [(e.step, e.loss, e.group) for e in base.evals] == [(0, 3.2987, "bpb"), (10, 0.8155, "bpb")]
    assert [(e.step, e.loss) for e in mid.evals] == [(0, 0.7004)] and [(e.step, e.loss) for e in sft.evals] == [
        (0, 1.010513)
    ]
    assert base.train[0].learning_rate is None and any("'lrm'" in n for n in base.notes)


def test_olmo_and_olmo_core_console_metrics(tmp_path):
    # OLMo: log.info(f"{prefix}\n" + "\n".join(f"    {name}={format_float(value)}" ...)),
    # prefix = f"[step={self.global_step}/{self.max_steps},epoch={self.epoch}]"
    olmo = []
    for s in range(1, 6):
        olmo += [
            f"2024-05-01 12:00:0{s}.123\tnode01:0\tolmo.train:967\tINFO\t[step={s}/100,epoch=0]",
            f"    train/CrossEntropyLoss={10 - s:.3f}",
            f"    train/Perplexity={2 ** (10 - s):.1f}",
            f"    optim/total_grad_norm={1 / s:.4f}",
            "    throughput/device/tokens_per_second=12,345",
        ]
    # eval: log.info(f"[eval_step={eval_step + 1}/{num_eval_batches}]"), then
    # self.log_metrics_to_console(f"{evaluator.label}", metrics) with keys "eval/{label}/CrossEntropyLoss"
    olmo += [
        "2024-05-01 12:00:09.123\tnode01:0\tolmo.train:1000\tINFO\t[eval_step=5/10]",
        "2024-05-01 12:00:09.123\tnode01:0\tolmo.train:1000\tINFO\t[eval_step=10/10]",
        "2024-05-01 12:00:10.123\tnode01:0\tolmo.train:1000\tINFO\tc4_en-validation",
        "    eval/c4_en-validation/CrossEntropyLoss=5.100",
        "    eval/c4_en-validation/Perplexity=164.0",
    ]
    log = parse_log(write(tmp_path, "olmo.log", "\n".join(olmo) + "\n"))
    assert log.format == "olmo" and [(r.step, r.loss, r.grad_norm) for r in log.train][:2] == [
        (1, 9.0, 1.0),
        (2, 8.0, 0.5),
    ]
    assert len(log.train) == 5 and [(e.step, e.loss, e.group) for e in log.evals] == [(5, 5.1, "c4_en-validation")]
    # OLMo-core: "train/CE loss", "optim/total grad norm", eval losses in the step's own block
    core = []
    for s in (10, 20, 30):
        core += [
            f"[step={s}/1000,epoch=0]",
            f"    train/CE loss={4 - s / 100:.3f}",
            "    train/PPL=30.1",
            "    optim/total grad norm=0.2300",
            "    optim/LR (group 0)=6.00E-04",
        ]
    core += ["    eval/lm/c4_en-validation/CE loss=3.900"]
    log = parse_log(write(tmp_path, "olmo-core.log", "\n".join(core) + "\n"))
    assert log.format == "olmo" and [r.step for r in log.train] == [10, 20, 30]
    assert (log.train[0].loss, log.train[0].grad_norm, log.train[0].learning_rate) == (3.9, 0.23, 6e-4)
    assert [(e.step, e.loss, e.group) for e in log.evals] == [(30, 3.9, "lm/c4_en-validation")]


def _composer_block(progress: str, prefix: str, metrics: dict[str, object]) -> list[str]:
    # ConsoleLogger.log_to_console: f"{progress}" + ":", then f"\n\t {prefix}{name}: {value}" per metric,
    # floats as f"{value:.4f}" (format_log_data_value)
    return [progress + ":"] + [
        f"\t {prefix}{k}: {v:.4f}" if isinstance(v, float) else f"\t {prefix}{k}: {v}" for k, v in metrics.items()
    ]


def test_composer_console_logger_with_evals_and_epoch_progress(tmp_path):
    lines = ["*" * 30, "Config:", "max_duration: 4ba", "*" * 30]
    for b in range(1, 5):
        metrics = {"time/batch": b - 1, "loss/train/total": 3.0 - b / 10, "metrics/train/LanguageCrossEntropy": 2.9}
        metrics |= {"lr-DecoupledAdamW/group0": 6e-4 * b, "l2_norm/grad/global": float("nan") if b == 3 else 0.5}
        lines += _composer_block(f"[batch={b}/4]", "Train ", metrics)
    lines += ["[Eval batch=1/10] Eval on eval data", "[Eval batch=6/10] Eval on eval data"]
    lines += _composer_block(
        "[Eval batch=10/10] Eval on eval data", "Eval ", {"metrics/eval/LanguageCrossEntropy": 2.5}
    )
    lines += _composer_block(
        "[Eval batch=2/2] Eval on gsm8k data", "Eval ", {"metrics/gsm8k/LanguageCrossEntropy": 1.25}
    )
    log = parse_log(write(tmp_path, "composer.log", "\n".join(lines) + "\n"))
    assert log.format == "composer"
    assert [(r.step, r.loss, r.learning_rate) for r in log.train] == [
        (1, 2.9, 6e-4),
        (2, 2.8, 1.2e-3),
        (3, 2.7, 1.8e-3),
        (4, 2.6, 2.4e-3),
    ]
    assert math.isnan(log.train[2].grad_norm) and log.train[3].grad_norm == 0.5
    assert [(e.step, e.loss, e.group) for e in log.evals] == [(4, 2.5, ""), (4, 1.25, "gsm8k")]
    # A duration in epochs counts batches within the epoch: the step goes on across epochs.
    epochs = []
    for epoch, batch in ((1, 1), (1, 2), (2, 1), (2, 2)):
        epochs += _composer_block(f"[epoch={epoch}][batch={batch}/2]", "Train ", {"loss/train/total": 1.0 + batch})
    log = parse_log(write(tmp_path, "composer-epochs.log", "\n".join(epochs) + "\n"))
    assert log.format == "composer" and [r.step for r in log.train] == [1, 2, 3, 4] and len(log.segments) == 1
    # srun --label before each line, the metric lines' indentation after it
    labelled = [f"0: {line.replace(chr(9), '      ')}" for line in lines]
    log = parse_log(write(tmp_path, "composer-srun.log", "\n".join(labelled) + "\n"))
    assert log.format == "composer" and [r.loss for r in log.train] == [2.9, 2.8, 2.7, 2.6] and len(log.evals) == 2


def test_torchtitan_with_colour_codes_and_rank_prefixes(tmp_path):
    # logger.info(f"{color.red}step: {step:2}  {color.green}loss: {loss:7.4f}  {color.orange}grad_norm: {grad_norm:7.4f}
    #   {color.turquoise}memory: ...GiB(...%)  {color.blue}tps: {round(tps):,}  {color.cyan}tflops: ...  mfu: ...%{color.reset}")
    lines = []
    for s in (1, 10, 20, 30):
        for rank in (0, 7):  # each rank prints each step
            norm = "    inf" if s == 20 else f"{1.2345:7.4f}"
            lines.append(
                f"[rank{rank}]:[titan] 2025-05-11 08:31:08,657 - root - INFO - \x1b[31mstep: {s:2}  "
                f"\x1b[32mloss: {8 - s / 10:7.4f}  \x1b[38;2;180;60;0mgrad_norm: {norm}  "
                "\x1b[38;2;54;234;195mmemory: 24.28GiB(77.42%)  \x1b[34mtps: 4,477  \x1b[36mtflops: 10.76  "
                "\x1b[35mmfu: 3.45%\x1b[39m"
            )
    lines.append("[rank0]:[titan] 2025-05-11 08:35:00,000 - root - INFO - validate step: 30  loss:  7.5000")
    log = parse_log(write(tmp_path, "train.log", "\n".join(lines) + "\n"))
    assert log.format == "torchtitan" and [r.step for r in log.train] == [1, 10, 20, 30]
    assert log.train[1].loss == 7.0 and log.train[1].grad_norm == 1.2345 and math.isinf(log.train[2].grad_norm)
    assert [(e.step, e.loss) for e in log.evals] == [(30, 7.5)]
    assert log.counts.skipped["repeated steps (the latest record of a step kept)"] == 4  # rank 7 repeats rank 0


def test_key_value_records_restarting_within_the_first_interval(tmp_path):
    runs = [range(9, 70, 10), range(10, 81, 10), range(10, 41, 10)]  # "batch: 9 ... 69", then "batch: 10 ..."
    text = "OVERFLOW! Scale value 4294967296 -> 2147483648\n" + "".join(
        f"batch: {b}, time: 28.32, ntokens: 618.06/1024, loss: {55 - b / 100:.2f}\n" for run in runs for b in run
    )
    log = parse_log(write(tmp_path, "train.log", text))
    assert log.format == "kv-stdout"
    assert [len(s.train) for s in log.segments] == [7, 8, 4]
    assert any("train loss from 'loss'" in n for n in log.notes)


def test_key_value_records_name_the_loss_read(tmp_path):
    # DeepSpeed-Chat step 3: print(f"epoch: {epoch}|step: {step}|ppo_ep: {ppo_ep+1}|act_loss: {actor_loss_sum/inner_iter}|
    #   cri_loss: {critic_loss_sum/inner_iter}|unsuper_loss: {unsup_loss_sum/inner_iter}")
    text = "".join(
        f"epoch: 0|step: {s}|ppo_ep: 1|act_loss: {0.2 + s / 100}|cri_loss: 0.12|unsuper_loss: 0.0\n"
        f"average reward score: {s / 10}\n"
        for s in range(6)
    )
    log = parse_log(write(tmp_path, "ds.log", text))
    assert [r.loss for r in log.train] == pytest.approx([0.2, 0.21, 0.22, 0.23, 0.24, 0.25])
    assert any("train loss from 'act_loss'" in n and "cri_loss, unsuper_loss" in n for n in log.notes)


# --- every real log, read in full --------------------------------------------------------------------

_NOT_LOGS = {"SOURCES.md", "RESULTS.md", "truth.json", "groundtruth.py", "groundtruth_stats.json"}

# train records (with a loss value), eval records, runs: real-logs/ from its SOURCES.md (the table the
# parsers' tests share), real-logs-3 from its SOURCES.md (the record counts of each row); real-logs-2
# and -4 have them in truth.json.
KNOWN = {
    **{f"real-logs/{name}": (c.train, c.evals, 1) for name, c in REAL_LOGS_COUNTS.items()},
    "real-logs-3/hf-vit-skin-cancer-10ep-overfit-trainer_state.json": (892, 89, 1),
    "real-logs-3/hf-quality-lrqa-multichoice-stuck-at-ln4-trainer_state.json": (62, 62, 1),
    "real-logs-3/hf-eagle3-draft-model-gradspikes-trainer_state.json": (2000, None, 1),
    "real-logs-3/hf-whisper-bashkir-high-gradnorm-trainer_state.json": (400, 20, 1),
    "real-logs-3/hf-gemma3-1b-qlora-healthy-trainer_state.json": (75, 19, 1),
    "real-logs-3/hf-llada-grpo-remasking-policy-ckpt1000-trainer_state.json": (1000, None, 1),
    "real-logs-3/llamafactory-qwen2.5-7b-medical-lora-trainer_log.jsonl": (675, 13, 1),
    "real-logs-3/llamafactory-luojiu-7b-base-3ep-trainer_log.jsonl": (1742, 0, 1),
    "real-logs-3/lightning-dnabert-classifier-metrics.csv": (80, 20, 1),
    "real-logs-3/lightning-yolov3-pascal-voc-metrics.csv": (744, 0, 1),
    "real-logs-3/nanogpt-parameter-golf-3runs-concatenated-train.log": (206, 17, 3),
    "real-logs-3/llmc-stdout-gpt2-124m-nan-from-step1-slurm.log": (902, 4, 1),
}


def _truth() -> dict[str, tuple[int, int | None, int]]:
    """The record counts of every corpus with a truth.json (real-logs-2, real-logs-4)."""
    known = {}
    for path in sorted(CORPORA.glob("real-logs*/truth.json")):
        for entry in json.loads(path.read_text()):
            name = entry["file"].split("/")[0]
            # truth.json counts the primary eval series: the first run's (nanochat's base-stage val bpb)
            known[f"{path.parent.name}/{name}"] = (entry["records"], entry["eval_records"], entry.get("segments", 1))
    return known


def _real_logs() -> list[str]:
    found = []
    for folder in sorted(CORPORA.glob("real-logs*")):
        for path in sorted(folder.iterdir()):
            if path.name not in _NOT_LOGS:
                found.append(f"{folder.name}/{path.name}")
    return found


def test_every_real_log_with_a_known_count_is_known_here():
    known = {**KNOWN, **_truth()}
    files = _real_logs()
    assert len(files) >= 50
    assert not [f for f in files if f not in known], "a real log without a known record count: add its count"


@pytest.mark.parametrize("name", _real_logs())
def test_every_real_log_is_read_in_full(name):
    path = CORPORA / name
    if path.is_dir():
        require_module("tensorboard")
    known = {**KNOWN, **_truth()}.get(name)
    try:
        log = parse_log(path)
    except LogFormatError as exc:  # a log that cannot be read says why, in one line
        assert known is None and "\n" not in str(exc), f"{name}: {exc}"
        return
    train, evals, runs = known
    # records, or records with a loss value (a closing line without a loss, Megatron's "nan" strings)
    assert train in (log.counts.train, sum(s.losses for s in log.segments)), log.notes
    assert len(log.segments) == runs, log.notes
    if evals is not None:  # the file's, or the first run's (nanochat's base stage)
        assert evals in (log.counts.evals, len(log.segments[0].evals)), log.notes
    assert log.counts.stopped_at is None
