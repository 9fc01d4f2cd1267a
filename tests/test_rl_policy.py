"""RL policy health with a real TRL GRPOTrainer on CPU (a tiny random GPT-2 and a word-level
tokenizer built here, saved to a temporary folder: no download): the lossbeat HF callback passes
TRL's logged entropy and KL to the monitor. A healthy run is silent; a policy forced to collapse
(its final norm scaled up after a few steps: near-deterministic, far from the reference) is named
(rl_entropy and rl_kl judged a danger) and paged (promtool over the monitor's own scrape), and
``lossbeat analyze`` finds the same in the run's trainer_state.json, and in verl's and OpenRLHF's
console logs. Plus the names of verl, OpenRLHF and prime-rl, and the checks on plain series."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from conftest import require_module
from helpers.paging import pages
from prometheus_client import generate_latest

from lossbeat import Monitor, MonitorConfig, load_thresholds
from lossbeat.diagnosis import History
from lossbeat.diagnosis.profiles import detect_profile, signal_kind
from lossbeat.diagnosis.rl import check_rl_entropy, check_rl_kl
from lossbeat.exposition.status import status_document

STEPS = 14
MIN_RECORDS = 8  # rl_policy.min_records for these short runs
WORDS = [f"w{i}" for i in range(40)]
PREFIXES = ("training_signal", "training_health_status")


def _thresholds():
    t = load_thresholds()
    return dataclasses.replace(t, rl_policy=dataclasses.replace(t.rl_policy, min_records=MIN_RECORDS))


def _grpo(tmp_path, *, collapse: bool, monitor: Monitor | None = None):
    require_module("trl")
    require_module("datasets")
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lossbeat.integrations.hf import LossbeatCallback

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(vocab),
        n_positions=64,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    path = tmp_path / "policy"
    GPT2LMHeadModel(config).save_pretrained(path)  # GRPO loads the reference model from the policy's path
    tokenizer.save_pretrained(path)

    class Collapse(TrainerCallback):
        """After 4 steps, the final norm's output pinned to one word's embedding (scaled): the policy
        emits that word ~always, whatever the context (a forced collapse, finite logits)."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if collapse and state.global_step == 4:
                with torch.no_grad():
                    word = model.transformer.wte.weight[vocab["w5"]]
                    model.transformer.ln_f.weight.zero_()
                    model.transformer.ln_f.bias.copy_(200.0 * word / word.norm())

    def distinct_words(completions, **kwargs):
        return [len(set(c.split())) / 8 for c in completions]

    if monitor is None:
        monitor = Monitor(MonitorConfig(thresholds=_thresholds()), serve=False)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-5,
        beta=0.04,  # a KL term: TRL logs kl
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=str(path),
        reward_funcs=distinct_words,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [" ".join(WORDS[i : i + 3]) for i in range(32)]}),
        processing_class=tokenizer,
        callbacks=[Collapse(), LossbeatCallback(monitor)],
    )
    trainer.train()
    monitor.flush()
    state_file = tmp_path / "trainer_state.json"
    trainer.state.save_to_json(str(state_file))
    return monitor, trainer.state.log_history, state_file


def _finding(findings, check):
    return next(f for f in findings if f.check == check)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _grpo(tmp_path_factory.mktemp("healthy"), collapse=False)


@pytest.fixture(scope="module")
def collapsed(tmp_path_factory):
    return _grpo(tmp_path_factory.mktemp("collapsed"), collapse=True)


def test_trl_grpo_healthy_policy_is_silent(healthy, tmp_path):
    monitor, logs, _ = healthy
    logged = [r for r in logs if "entropy" in r]
    assert len(logged) == STEPS
    # The callback observes each step itself and passes a step's logged values with the next one;
    # the run's last log, which no step follows, at the end of training: every log reaches it.
    assert monitor.history.signals["entropy"].count == STEPS
    assert monitor.state.signals["entropy"] == pytest.approx(logged[-1]["entropy"])
    assert monitor.state.signals["kl"] == pytest.approx(logged[-1]["kl"])
    scraped = {
        line.split('signal="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in generate_latest(monitor.registry).decode().splitlines()
        if line.startswith("training_signal{")
    }
    assert scraped["entropy"] == pytest.approx(logged[-1]["entropy"]) and scraped["kl"] == pytest.approx(
        logged[-1]["kl"]
    )
    assert monitor._judge.thresholds.profile.name == "rl"
    entropy, kl = _finding(monitor.findings, "rl_entropy"), _finding(monitor.findings, "rl_kl")
    assert entropy.status.name == "GOOD" and entropy.known, entropy
    assert kl.status.name == "GOOD" and kl.known, kl
    body = generate_latest(monitor.registry).decode()
    for alert, for_ in (("TrainingRLEntropyCollapse", "10m"), ("TrainingRLKLExploded", "5m")):
        pages(tmp_path, body, alert, for_, PREFIXES, [])


def test_trl_grpo_collapsed_policy_is_named_and_paged(collapsed, tmp_path):
    monitor, logs, _ = collapsed
    t = _thresholds()
    entropy, kl = _finding(monitor.findings, "rl_entropy"), _finding(monitor.findings, "rl_kl")
    assert entropy.status.name == "DANGER" and "entropy fell to" in entropy.message, entropy
    assert kl.status.name == "DANGER" and f"above {t.rl_policy.kl_bound:g}" in kl.message, kl
    last = [r for r in logs if "entropy" in r][-1]
    assert last["entropy"] < t.rl_policy.entropy_collapse_fraction * logs[0]["entropy"]
    policy = status_document(monitor.state)["policy"]  # the status page's RL section
    assert policy["entropy"] == monitor.state.signals["entropy"] and policy["kl"] > t.rl_policy.kl_bound
    body = generate_latest(monitor.registry).decode()
    target = {"rank": "0", "run_id": monitor.state.run_id}
    pages(
        tmp_path,
        body,
        "TrainingRLEntropyCollapse",
        t.rl_policy.entropy_for,
        PREFIXES,
        [({**target, "check": "rl_entropy", "component": ""}, 2.0)],
    )
    pages(tmp_path, body, "TrainingRLKLExploded", t.rl_policy.kl_for, PREFIXES, [(target, monitor.state.signals["kl"])])


def test_analyze_finds_the_collapse_in_trl_trainer_state_json(healthy, collapsed):
    from lossbeat.analyze import analyze_file

    t = _thresholds()
    bad = analyze_file(collapsed[2], t)
    assert bad.profile == "rl"
    assert bad.reached("rl_entropy", status=bad.status.DANGER) and bad.reached("rl_kl", status=bad.status.DANGER)
    good = analyze_file(healthy[2], t)
    assert not good.reached("rl_entropy") and not good.reached("rl_kl")


@pytest.mark.parametrize(
    "name, kind",
    [
        ("entropy", "entropy"),  # TRL GRPO
        ("objective/entropy", "entropy"),  # TRL PPO
        ("actor/entropy", "entropy"),  # verl
        ("entropy/mean", "entropy"),  # prime-rl
        ("kl", "kl"),
        ("objective/kl", "kl"),
        ("actor/kl_loss", "kl"),  # verl, use_kl_loss
        ("actor/ppo_kl", "policy_kl"),  # verl: the old and new policy, not the reference
        ("clip_ratio/region_mean", "clip_ratio"),
        ("actor/pg_clipfrac", "clip_ratio"),
        ("mismatch_kl/mean", "mismatch_kl"),  # prime-rl: trainer vs inference engine
        ("vllm_kl", "mismatch_kl"),  # OpenRLHF
        ("frac_reward_zero_std", "frac_reward_zero_std"),
    ],
)
def test_the_frameworks_names_map_to_the_signals(name, kind):
    assert signal_kind(name) == kind


def test_verl_names_alone_detect_rl():
    assert detect_profile(["actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"]).profile == "rl"
    assert detect_profile(["entropy", "mean_token_accuracy"]).profile is None  # TRL's SFTTrainer logs entropy too
    assert detect_profile(["eval_mean_token_accuracy", "eval_entropy"]).profile is None  # nor a classifier


def _history(entropy, reward=None, kl=None):
    t = _thresholds().with_profile("rl")
    h = History(t)
    for step, e in enumerate(entropy):
        h.add_signal("entropy", e, step)
        if reward is not None:
            h.add_signal("reward", reward[step], step)
        if kl is not None:
            h.add_signal("kl", kl[step], step)
    return h, t


def test_entropy_collapse_needs_a_stalled_reward_for_danger():
    falling = [2.0] * 8 + [0.05] * 32
    h, t = _history(falling, reward=[0.5 + 0.0001 * (i % 2) for i in range(40)])
    assert check_rl_entropy(h, t).status.name == "DANGER"
    h, t = _history(falling, reward=[0.01 * i for i in range(40)])  # still rising
    assert check_rl_entropy(h, t).status.name == "WARNING"
    h, t = _history(falling)
    assert check_rl_entropy(h, t).status.name == "WARNING"  # no reward logged: said so
    h, t = _history([2.0] * 8 + [0.5] * 32, reward=[0.5] * 40)  # a quarter of the early level: healthy
    assert check_rl_entropy(h, t).status.name == "GOOD"


def test_kl_explodes_past_its_bound_or_by_orders_of_magnitude():
    steady = [2.0] * 40
    h, t = _history(steady, kl=[0.001] * 8 + [0.05] * 32)
    assert check_rl_kl(h, t).status.name == "GOOD"  # x50 but below kl_bound / 10
    h, t = _history(steady, kl=[0.001] * 8 + [0.3] * 32)
    assert check_rl_kl(h, t).status.name == "DANGER"  # x300
    h, t = _history(steady, kl=[0.5] * 8 + [1.5] * 32)
    assert check_rl_kl(h, t).status.name == "DANGER"  # past the bound


def _verl_console(path, collapse_at: int | None) -> None:
    """verl's console logger before July 2025 (``{v:.4f}``-style numbers): one ``step:N - key:value - ...``
    line per step."""
    lines = []
    for step in range(1, 61):
        bad = collapse_at is not None and step >= collapse_at
        entropy, kl = (0.03, 2.5) if bad else (1.2 - 0.002 * step, 0.001 + 0.0001 * step)
        lines.append(
            f"(TaskRunner pid=1234) step:{step} - actor/entropy:{entropy + 0.001 * (step % 3):.4f} - "
            f"actor/kl_loss:{kl:.4f} - actor/pg_loss:{0.001 * (step % 5 - 2):.4f} - actor/pg_clipfrac:0.002 - "
            f"actor/ppo_kl:0.0001 - actor/grad_norm:0.{40 + step % 7} - critic/score/mean:{0.25 + 0.001 * (step % 2):.3f}"
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_analyze_reads_verl_console_logs_names(tmp_path):
    from lossbeat.analyze import analyze_file
    from lossbeat.logs import detect_format

    bad, good = tmp_path / "verl-collapsed.log", tmp_path / "verl-healthy.log"
    _verl_console(bad, collapse_at=12)
    _verl_console(good, collapse_at=None)
    assert detect_format(bad) == "verl"
    collapsed = analyze_file(bad)
    assert collapsed.profile == "rl"
    assert collapsed.reached("rl_entropy", status=collapsed.status.DANGER)
    assert collapsed.reached("rl_kl", status=collapsed.status.DANGER)
    healthy = analyze_file(good)
    assert not healthy.reached("rl_entropy") and not healthy.reached("rl_kl")


OPENRLHF = Path(__file__).resolve().parent / "data" / "formats"  # written by the frameworks' own statements


def _openrlhf_status(name: str, step: int) -> dict[str, float]:
    """The status dict OpenRLHF printed at ``step``, read back with Python's own parser."""
    import ast

    for line in (OPENRLHF / name / "train.log").read_text(encoding="utf-8").splitlines():
        if m := re.search(r"Global step (\d+): (\{.*\})$", line):
            if int(m.group(1)) == step:
                return ast.literal_eval(m.group(2))
    raise AssertionError(f"no status line for step {step}")


def test_openrlhf_console_log_is_read_with_its_names_mapped_to_the_signals():
    from lossbeat.logs import detect_format, parse_log

    path = OPENRLHF / "openrlhf-collapsed" / "train.log"
    assert detect_format(path) == "openrlhf"
    log = parse_log(path)
    assert [r.step for r in log.train] == list(range(1, 81))  # the progress bars between them are skipped
    assert sum(log.counts.skipped.values()) == 80 and not log.counts.unreadable
    status = _openrlhf_status("openrlhf-collapsed", 30)
    record = log.train[29]
    assert (record.loss, record.grad_norm, record.learning_rate) == (
        status["policy_loss"],
        status["actor_grad_norm"],
        status["actor_lr"],
    )
    signals = {name: dict(points) for name, points in log.signals.items()}
    assert signals["entropy"][30] == status["entropy_loss"]  # OpenRLHF's entropy_loss is the mean entropy
    assert signals["kl"][30] == status["kl"] and signals["ppo_kl"][30] == status["ppo_kl"]
    assert signals["ppo_clip_ratio"][30] == status["ppo_clip_ratio"]
    assert signals["reward"][30] == status["reward"] and signals["reward_std"][30] == status["group_reward_std"]


def test_openrlhf_async_trainers_status_line_is_read_too(tmp_path):
    """The streaming async trainer (``ppo_trainer_async.py``) logs the same dict without the ✨."""
    from lossbeat.logs import parse_log

    lines = [
        f"(PPOTrainer pid=7) INFO 08-13 19:25:{step:02d} ppo_trainer_async.py:244] Global step {step}: "
        f"{{'policy_loss': {0.01 * step}, 'entropy_loss': {1.0 - 0.01 * step}, 'kl': 0.002, 'ppo_kl': 0.0001, "
        f"'actor_lr': 1e-06, 'actor_grad_norm': np.float64(0.5), 'rollout/reward_mean': 0.25}}"
        for step in range(1, 4)
    ]
    path = tmp_path / "async.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log = parse_log(path)
    assert log.format == "openrlhf"
    assert [(r.step, r.loss, r.grad_norm, r.learning_rate) for r in log.train] == [
        (1, 0.01, 0.5, 1e-06),
        (2, 0.02, 0.5, 1e-06),
        (3, 0.03, 0.5, 1e-06),
    ]
    signals = {name: dict(points) for name, points in log.signals.items()}
    assert signals["entropy"] == {1: 0.99, 2: 0.98, 3: 0.97} and signals["reward"] == {1: 0.25, 2: 0.25, 3: 0.25}


def test_analyze_names_an_openrlhf_entropy_collapse_and_kl_explosion_and_exits_1(capsys):
    from lossbeat.cli import main

    t = load_thresholds()
    healthy = OPENRLHF / "openrlhf-healthy" / "train.log"
    collapsed = OPENRLHF / "openrlhf-collapsed" / "train.log"
    assert main(["analyze", str(healthy)]) == 0
    out = capsys.readouterr().out
    assert "judged as profile rl" in out and "DANG" not in out
    assert re.search(r"ok +rl_entropy", out) and re.search(r"ok +rl_kl", out)
    assert main(["analyze", str(collapsed)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"DANG +rl_entropy +the policy's entropy fell to", out), out
    assert re.search(rf"DANG +rl_kl .* above {t.rl_policy.kl_bound:g}", out), out


def test_verl_console_log_with_numpy_values_is_read_with_the_policy_loss():
    """verl prints each number with pprint.pformat: its numpy means as ``np.float64(...)``. The loss is
    actor/pg_loss, not the first ``*_loss`` of the line (actor/kl_loss, the KL term)."""
    from lossbeat.logs import detect_format, parse_log

    path = OPENRLHF / "verl-collapsed" / "train.log"
    assert detect_format(path) == "verl"
    log = parse_log(path)
    assert [r.step for r in log.train] == list(range(1, 81))  # step 0, the validation line, holds no loss
    line = next(ln for ln in path.read_text(encoding="utf-8").splitlines() if " step:30 - " in ln)
    printed = {k: v for k, _, v in (part.rpartition(":") for part in line.split(" - ")[1:])}

    def number(text: str) -> float:
        return float(text.removeprefix("np.float64(").removesuffix(")"))

    record = log.train[29]
    assert record.loss == number(printed["actor/pg_loss"]) != number(printed["actor/kl_loss"])
    assert record.grad_norm == number(printed["actor/grad_norm"])
    assert record.learning_rate == number(printed["actor/lr"]) == 1e-06
    signals = {name: dict(points) for name, points in log.signals.items()}
    assert signals["actor/entropy"][30] == number(printed["actor/entropy"])
    assert signals["actor/kl_loss"][30] == number(printed["actor/kl_loss"])
    assert signals["critic/score/mean"][30] == float(printed["critic/score/mean"])


def test_analyze_names_a_verl_entropy_collapse_and_kl_explosion_and_exits_1(capsys):
    from lossbeat.cli import main

    assert main(["analyze", str(OPENRLHF / "verl-healthy" / "train.log")]) == 0
    out = capsys.readouterr().out
    assert "[verl]" in out and "judged as profile rl" in out and "DANG" not in out
    assert main(["analyze", str(OPENRLHF / "verl-collapsed" / "train.log")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"DANG +rl_entropy +the policy's entropy fell to", out), out
    assert re.search(r"DANG +rl_kl ", out), out
