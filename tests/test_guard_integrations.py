"""The guard through the HF Trainer and Lightning callbacks: real tiny CPU runs with a NaN loss at one step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import require_module
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lossbeat.monitor import Monitor, MonitorConfig, TrainingHalted

NAN_AT = 3  # the optimizer step (1-based, as the monitor numbers them) whose loss is NaN


def _skipped(monitor: Monitor) -> dict[str, float]:
    """training_skipped_steps_total by reason, read from the monitor's registry as a scrape would."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(monitor.registry).decode()):
        for s in family.samples:
            if s.name == "training_skipped_steps_total":
                out[s.labels["reason"]] = s.value
    return out


def _snapshot(optimizer: torch.optim.Optimizer, params) -> tuple[list[torch.Tensor], list[dict]]:
    state = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()} for p in params
    ]
    return [p.detach().clone() for p in params], state


class _WeightsRecorder:
    """An HF TrainerCallback that snapshots the weights and AdamW state around each optimizer step
    and keeps each step's LR; given ``poison``, it switches ``poison["on"]`` on for step NAN_AT."""

    @staticmethod
    def make(poison: dict | None = None):
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            def __init__(self) -> None:
                self.before, self.after, self.lrs = {}, {}, {}

            def on_step_begin(self, args, state, control, **kwargs):
                if poison is not None:
                    poison["on"] = state.global_step + 1 == NAN_AT

            def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
                self.before[state.global_step + 1] = _snapshot(optimizer.optimizer, list(model.parameters()))

            def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
                self.after[state.global_step + 1] = _snapshot(optimizer.optimizer, list(model.parameters()))

            def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
                if lr_scheduler is not None:
                    self.lrs[state.global_step] = lr_scheduler.get_last_lr()[0]

        return Recorder()


def _assert_bitwise_equal(before, after) -> None:
    (params_a, state_a), (params_b, state_b) = before, after
    assert len(params_a) == len(params_b) > 0
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    assert state_a == [] or any(st for st in state_a)  # Adam's moments and step exist by step k
    for sa, sb in zip(state_a, state_b):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


# --- Hugging Face Trainer ---------------------------------------------------------------


def _hf_trainer(tmp_path, guard: str, steps: int = 6):
    require_module("transformers")
    require_module("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from workers.hf_ddp_worker import Tokens

    from lossbeat.integrations.hf import LossbeatCallback

    class NaNAtStep(GPT2LMHeadModel):
        """GPT-2 whose training loss is NaN at one optimizer step (one micro-batch per step)."""

        calls = 0
        losses: dict[int, float] = {}

        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            if self.training and torch.is_grad_enabled():
                type(self).calls += 1
                if type(self).calls == NAN_AT:
                    out.loss = out.loss * math.nan  # NaN gradients too
                type(self).losses[type(self).calls] = out.loss.item()
            return out

    torch.manual_seed(0)
    model = NaNAtStep(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    monitor = Monitor(MonitorConfig(port=0, guard=guard), serve=False)
    recorder = _WeightsRecorder.make()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(64, 1), callbacks=[LossbeatCallback(monitor), recorder]
    )
    recorder.losses = NaNAtStep.losses  # per step (one micro-batch each), as the model computed them
    return trainer, monitor, recorder


def test_hf_guard_skip_leaves_weights_and_adamw_state_bitwise_and_training_goes_on(tmp_path):
    trainer, monitor, recorder = _hf_trainer(tmp_path, "skip")
    trainer.train()
    monitor.flush()

    _assert_bitwise_equal(recorder.before[NAN_AT], recorder.after[NAN_AT])
    # The steps around it were applied (the snapshots would be equal without training too).
    before, after = recorder.before[NAN_AT + 1], recorder.after[NAN_AT + 1]
    assert not all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert math.isnan(recorder.losses[NAN_AT])
    assert all(math.isfinite(recorder.losses[s]) for s in range(NAN_AT + 1, 7))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert _skipped(monitor) == {"nonfinite": 1, "explosion": 0, "spike": 0}
    # guard_schedule="advance": the skipped step took its slot of the linear schedule.
    assert recorder.lrs[NAN_AT] < recorder.lrs[NAN_AT - 1]
    assert trainer.optimizer.step.__qualname__ == "AcceleratedOptimizer.step"  # taken off at train end


def test_hf_guard_hold_keeps_the_lr_schedule_at_a_skipped_step(tmp_path):
    trainer, monitor, recorder = _hf_trainer(tmp_path, "skip")
    monitor.close()
    monitor = Monitor(MonitorConfig(port=0, guard="skip", guard_schedule="hold"), serve=False)
    from lossbeat.integrations.hf import LossbeatCallback

    trainer.callback_handler.callbacks = [
        c for c in trainer.callback_handler.callbacks if not isinstance(c, LossbeatCallback)
    ]
    trainer.add_callback(LossbeatCallback(monitor))
    trainer.train()

    assert recorder.lrs[NAN_AT] == recorder.lrs[NAN_AT - 1]  # accelerate held the scheduler
    assert recorder.lrs[NAN_AT + 1] < recorder.lrs[NAN_AT]
    assert _skipped(monitor)["nonfinite"] == 1


def test_hf_guard_stop_raises_training_halted_out_of_train_at_the_nan_step(tmp_path):
    trainer, monitor, recorder = _hf_trainer(tmp_path, "stop")
    with pytest.raises(TrainingHalted) as raised:
        trainer.train()
    assert (raised.value.step, raised.value.reason) == (NAN_AT, "nonfinite")
    assert trainer.state.global_step == NAN_AT - 1
    _assert_bitwise_equal(
        recorder.before[NAN_AT], _snapshot(trainer.optimizer.optimizer, list(trainer.model.parameters()))
    )
    assert monitor.state.halted
    assert trainer.optimizer.step.__qualname__ == "AcceleratedOptimizer.step"  # the user's again


def test_hf_guard_off_leaves_the_optimizer_step_untouched(tmp_path):
    trainer, monitor, recorder = _hf_trainer(tmp_path, "off", steps=NAN_AT)
    seen = []

    from transformers import TrainerCallback

    class Looks(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            seen.append(optimizer.step.__qualname__)  # torch's scheduler wrapper keeps the name

    trainer.add_callback(Looks())
    trainer.train()
    assert seen == ["AcceleratedOptimizer.step"] * NAN_AT
    assert _skipped(monitor) == {}  # no guard: nothing skipped, nothing exported
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())  # the NaN step was applied


def test_hf_guard_under_fp16_skips_through_the_scaler_and_puts_its_scale_back():
    """accelerate's optimizer with a GradScaler (on CUDA; built here on CPU), a NaN loss whose
    gradients are finite: the scaler finds no overflow, the guard skips it through the scaler."""
    require_module("transformers")
    accelerate_optimizer = require_module("accelerate.optimizer")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lossbeat.integrations.hf import LossbeatCallback

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    AcceleratorState._reset_state(reset_partial_state=True)
    Accelerator(cpu=True)
    optimizer = accelerate_optimizer.AcceleratedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), scaler=scaler)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    callback = LossbeatCallback(monitor)
    args = TrainingArguments(output_dir="/tmp/lossbeat-hf-fp16", max_grad_norm=0.0, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    x = torch.randn(16, 8)
    for poison in (False, True, False):
        callback.on_step_begin(args, state, control)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        if poison:
            loss = loss + math.nan  # a NaN loss; the gradients of a constant shift stay finite
        callback._loss_sum, callback._micro_batches = loss.detach(), 1  # what the forward hook keeps
        scaler.scale(loss).backward()
        callback.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
        before, scale = _snapshot(optimizer.optimizer, list(model.parameters())), scaler.get_scale()
        optimizer.step()  # the Trainer's call
        if poison:
            _assert_bitwise_equal(before, _snapshot(optimizer.optimizer, list(model.parameters())))
            assert scaler.get_scale() == scale  # not halved as for an overflow, not grown
            assert optimizer.step_was_skipped  # what the Trainer and accelerate read: the LR schedule holds
        else:
            assert not optimizer.step_was_skipped
            assert scaler.get_scale() == 2 * scale  # growth_interval=1: a good step grows it
        optimizer.zero_grad()
        state.global_step += 1
    monitor.flush()
    assert _skipped(monitor)["nonfinite"] == 1
    callback.on_train_end(args, state, control)
    assert "step" not in vars(optimizer)


def test_hf_guard_refuses_the_log_fallback():
    require_module("transformers")
    from lossbeat.integrations.hf import LossbeatCallback

    with pytest.raises(ValueError, match="guard"):
        LossbeatCallback(per_step=False, guard="skip")


def _tiny_tokenizer():
    """A word-level tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{f"w{i}": i + 3 for i in range(29)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


@pytest.mark.parametrize("mode,accumulation", [("skip", 1), ("stop", 1), ("skip", 2)])
def test_trl_reward_trainer_guard_acts_on_the_loss_its_compute_loss_backpropagates(tmp_path, mode, accumulation):
    """TRL's RewardTrainer computes its loss in compute_loss from the model's logits (the model
    returns no loss): the guard still skips the NaN step, bitwise, and training goes on; or stops."""
    require_module("trl")
    from datasets import Dataset
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from lossbeat.integrations.hf import LossbeatCallback

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=32, n_positions=16, num_labels=1, pad_token_id=0)
    model = GPT2ForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 32, (2, 6), generator=g).tolist() for _ in range(48)]
    data = Dataset.from_dict({"chosen_ids": [r[0] for r in rows], "rejected_ids": [r[1] for r in rows]})

    poison = {"on": False}
    model.score.register_forward_hook(lambda m, i, out: out * math.nan if poison["on"] and m.training else None)
    monitor = Monitor(MonitorConfig(port=0, guard=mode), serve=False)
    recorder = _WeightsRecorder.make(poison)
    args = RewardConfig(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        center_rewards_coefficient=None,
    )
    trainer = RewardTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=_tiny_tokenizer(),
        callbacks=[LossbeatCallback(monitor), recorder],
    )
    if mode == "stop":
        with pytest.raises(TrainingHalted, match=f"at step {NAN_AT}: nonfinite"):
            trainer.train()
        # what a user's `except TrainingHalted` would save: the last good state
        recorder.after[NAN_AT] = _snapshot(trainer.optimizer.optimizer, list(model.parameters()))
    else:
        trainer.train()
    _assert_bitwise_equal(recorder.before[NAN_AT], recorder.after[NAN_AT])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    monitor.flush()
    assert monitor.state.skipped_steps == {"nonfinite": 1}
    assert monitor.state.nonfinite_loss_total == 0 and monitor.state.guard_undecided_steps == 0
    if mode == "skip":
        assert monitor.state.steps_total == 6
        later = NAN_AT + 1  # the step after the skip trained
        assert not torch.equal(recorder.before[later][0][0], recorder.after[later][0][0])
        logged = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        assert monitor.state.loss == pytest.approx(logged[-1], rel=1e-3)  # the loss the Trainer backpropagated
    monitor.close(completed=mode == "skip")


def test_trl_dpo_trainer_guard_skips_a_nan_step_of_its_preference_loss(tmp_path):
    """TRL's DPOTrainer: the loss is the DPO loss of the policy against a reference model, computed
    in compute_loss from log-probabilities (the model returns no loss). A NaN born in the policy's
    forward at one step is withheld bitwise, counted once as a skip, and training goes on."""
    require_module("trl")
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl import DPOConfig, DPOTrainer

    from lossbeat.integrations.hf import LossbeatCallback

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=32, n_positions=32, pad_token_id=0, bos_token_id=2, eos_token_id=2
    )
    model = GPT2LMHeadModel(config)
    reference = GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())  # given: TRL would otherwise load one by the model's name
    g = torch.Generator().manual_seed(0)
    words = lambda n: " ".join(f"w{int(i)}" for i in torch.randint(0, 29, (n,), generator=g))  # noqa: E731
    data = Dataset.from_dict(
        {
            "prompt": [words(4) for _ in range(48)],
            "chosen": [words(3) for _ in range(48)],
            "rejected": [words(3) for _ in range(48)],
        }
    )
    poison = {"on": False}
    # The policy's last hidden states (TRL reads its log-probabilities without calling lm_head's forward).
    model.transformer.ln_f.register_forward_hook(
        lambda m, i, out: out * math.nan if poison["on"] and m.training else None
    )

    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    recorder = _WeightsRecorder.make(poison)
    args = DPOConfig(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        max_length=16,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=data,
        processing_class=_tiny_tokenizer(),
        callbacks=[LossbeatCallback(monitor), recorder],
    )
    trainer.train()
    monitor.flush()
    _assert_bitwise_equal(recorder.before[NAN_AT], recorder.after[NAN_AT])
    later = NAN_AT + 1
    assert not torch.equal(recorder.before[later][0][0], recorder.after[later][0][0])  # trained on
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert monitor.state.skipped_steps == {"nonfinite": 1} and monitor.state.steps_total == 6
    assert monitor.state.nonfinite_loss_total == 0 and monitor.state.guard_undecided_steps == 0
    monitor.close()


# --- Lightning ------------------------------------------------------------------------


def _lightning_fit(guard: str, *, nan: str = "times", steps: int = 6, **trainer_args):
    L = require_module("lightning")
    from lossbeat.integrations.lightning import LossbeatCallback

    class NaNAtStep(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            self.losses: list[float] = []
            self.before: dict[int, tuple] = {}
            self.after: dict[int, tuple] = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if self.trainer.global_step + 1 == NAN_AT:
                loss = loss * math.nan if nan == "times" else loss + math.nan
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):  # after the callback's: the guard has decided
            self.before[self.trainer.global_step + 1] = _snapshot(optimizer, list(self.parameters()))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.after[self.trainer.global_step] = _snapshot(self.optimizers().optimizer, list(self.parameters()))

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)}

    torch.manual_seed(0)
    x = torch.randn(8 * steps, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    monitor = Monitor(MonitorConfig(port=0, guard=guard), serve=False)
    module = NaNAtStep()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[LossbeatCallback(monitor)],
        **trainer_args,
    )
    return trainer, module, data, monitor


def test_lightning_guard_skip_leaves_weights_and_adamw_state_bitwise_and_training_goes_on():
    trainer, module, data, monitor = _lightning_fit("skip")
    trainer.fit(module, data)
    monitor.flush()

    _assert_bitwise_equal(module.before[NAN_AT], module.after[NAN_AT])
    assert not all(torch.equal(a, b) for a, b in zip(module.before[NAN_AT + 1][0], module.after[NAN_AT + 1][0]))
    assert math.isnan(module.losses[NAN_AT - 1])
    assert all(math.isfinite(v) for v in module.losses[NAN_AT:]) and len(module.losses) == 6
    assert trainer.global_step == 6
    assert _skipped(monitor) == {"nonfinite": 1, "explosion": 0, "spike": 0}
    optimizer = trainer.optimizers[0]
    assert "_wrapped_by_lr_sched" in dir(optimizer.step)  # torch's scheduler wrapper is back, not ours
    assert optimizer.state[next(module.parameters())]["step"] == 5  # 6 steps, one skipped


def test_lightning_guard_stop_raises_training_halted_out_of_fit_at_the_nan_step():
    trainer, module, data, monitor = _lightning_fit("stop")
    with pytest.raises(TrainingHalted) as raised:
        trainer.fit(module, data)
    assert (raised.value.step, raised.value.reason) == (NAN_AT, "nonfinite")
    _assert_bitwise_equal(module.before[NAN_AT], _snapshot(trainer.optimizers[0], list(module.parameters())))
    assert monitor.state.halted
    assert "_wrapped_by_lr_sched" in dir(trainer.optimizers[0].step)  # restored in on_exception


def test_lightning_guard_off_leaves_the_optimizer_step_untouched():
    trainer, module, data, monitor = _lightning_fit("off", steps=NAN_AT)
    seen = []
    original = type(module).on_before_optimizer_step

    def looks(self, optimizer):
        seen.append(getattr(optimizer.step, "__name__", ""))
        original(self, optimizer)

    type(module).on_before_optimizer_step = looks
    trainer.fit(module, data)
    assert seen == ["step"] * NAN_AT  # torch's (scheduler-wrapped) Adam step, never the guard's
    assert all(getattr(trainer.optimizers[0].step, "_wrapped_by_lr_sched", False) for _ in seen)
    assert _skipped(monitor) == {}
    assert not all(torch.isfinite(p).all() for p in module.parameters())  # the NaN step was applied


def test_lightning_guard_under_16_mixed_skips_through_the_scaler_and_keeps_its_scale():
    """16-mixed's GradScaler, on CPU; a NaN loss with finite gradients: no overflow for the
    scaler, a guard skip that leaves the weights, AdamW's state and the scale as they were."""
    require_module("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    trainer, module, data, monitor = _lightning_fit(
        "skip", nan="plus", plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    trainer.fit(module, data)
    monitor.flush()

    _assert_bitwise_equal(module.before[NAN_AT], module.after[NAN_AT])
    assert _skipped(monitor)["nonfinite"] == 1
    assert scaler.get_scale() == 2.0**8  # no overflow seen, none invented
    assert scaler._growth_tracker.item() == 5  # 6 steps, the skipped one not counted
    assert all(math.isfinite(v) for v in module.losses[NAN_AT:])
    assert "step" not in vars(scaler) and "update" not in vars(scaler)


def test_lightning_guard_refuses_a_held_schedule():
    require_module("lightning")
    from lossbeat.integrations.lightning import LossbeatCallback

    with pytest.raises(ValueError, match="guard_schedule"):
        LossbeatCallback(guard="skip", guard_schedule="hold")


# --- docs/guard.md: saving the last good state ------------------------------------------


def test_the_documented_hf_except_block_saves_the_weights_before_the_bad_step(tmp_path):
    """docs/guard.md's HF example, run as written: the saved model is the one before the NaN step."""
    from test_guard import GUARD_DOC, documented_save

    trainer, monitor, recorder = _hf_trainer(tmp_path, "stop")
    with pytest.raises(TrainingHalted, match=f"at step {NAN_AT}: nonfinite"):
        exec(
            compile(documented_save("trainer.train()"), str(GUARD_DOC), "exec"),
            {"trainer": trainer, "args": trainer.args},
        )
    saved = type(trainer.model).from_pretrained(tmp_path / "halted")
    before = recorder.before[NAN_AT][0]
    assert len(before) == len(list(saved.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, saved.parameters()))
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["global_step"] == NAN_AT - 1
    monitor.close(completed=False)
    assert monitor.state.halted and not monitor.state.completed


def test_the_documented_lightning_except_block_checkpoints_the_state_before_the_bad_step(tmp_path, monkeypatch):
    """docs/guard.md's Lightning example, run as written: the checkpoint's weights and AdamW state
    are those before the NaN step, and training resumes from it."""
    from test_guard import GUARD_DOC, documented_save

    trainer, module, data, monitor = _lightning_fit("stop")
    monkeypatch.chdir(tmp_path)
    names = {"trainer": trainer, "module": module, "datamodule": data}
    with pytest.raises(TrainingHalted, match=f"at step {NAN_AT}: nonfinite"):
        exec(compile(documented_save("trainer.fit("), str(GUARD_DOC), "exec"), names)
    saved = torch.load(tmp_path / "halted.ckpt", weights_only=False)
    assert saved["global_step"] == NAN_AT - 1
    params, states = module.before[NAN_AT]
    assert all(torch.equal(a, b) for a, b in zip(params, saved["state_dict"].values()))
    adam = saved["optimizer_states"][0]["state"]
    for i, before in enumerate(states):
        assert before.keys() == adam[i].keys() and all(torch.equal(before[k], adam[i][k]) for k in before)
    monitor.close(completed=False)
    assert monitor.state.halted and not monitor.state.completed


# --- a stop at the last step, with deferred reads (as on CUDA) --------------------------


def _deferred(monitor: Monitor) -> None:
    """As on CUDA with deferred reads: a halt is raised MAX_PENDING decisions after its bad step."""
    from lossbeat.monitor import guard as guard_module

    monitor._guard.lag = lambda: guard_module.MAX_PENDING


def test_hf_a_stop_at_the_last_step_with_deferred_reads_leaves_train_and_is_not_completed(tmp_path):
    """The NaN step is the run's last: no later monitor.step raises the halt, on_train_end's flush
    does, out of train(); the step was withheld and the run never reads as completed."""
    trainer, monitor, recorder = _hf_trainer(tmp_path, "stop", steps=NAN_AT)
    _deferred(monitor)
    with pytest.raises(TrainingHalted, match=f"at step {NAN_AT}: nonfinite"):
        trainer.train()
    _assert_bitwise_equal(recorder.before[NAN_AT], recorder.after[NAN_AT])
    assert trainer.optimizer.step.__qualname__ == "AcceleratedOptimizer.step"
    monitor.close()  # what a script's end does: the halt was raised already, so no second raise
    assert monitor.state.halted and not monitor.state.completed


def test_lightning_a_stop_at_the_last_step_with_deferred_reads_leaves_fit_and_is_not_completed():
    trainer, module, data, monitor = _lightning_fit("stop", steps=NAN_AT)
    _deferred(monitor)
    with pytest.raises(TrainingHalted, match=f"at step {NAN_AT}: nonfinite"):
        trainer.fit(module, data)
    _assert_bitwise_equal(module.before[NAN_AT], module.after[NAN_AT])
    assert "_wrapped_by_lr_sched" in dir(trainer.optimizers[0].step)  # the guard taken off: torch's wrapper again
    monitor.close()
    assert monitor.state.halted and not monitor.state.completed


def test_lightning_manual_optimization_withholds_both_optimizers_of_a_bad_step():
    """Manual optimization with two optimizers (a GAN's players, Muon and AdamW): the step's one
    decision withholds both, it is counted once, and the batches after it train both."""
    L = require_module("lightning")
    from lossbeat.integrations.lightning import LossbeatCallback

    class TwoOptimizers(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
            self.unchanged: list[bool] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt_a, opt_b = self.optimizers()
            loss = torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)
            if batch_idx + 1 == NAN_AT:
                loss = loss * math.nan
            opt_a.zero_grad()
            opt_b.zero_grad()
            self.manual_backward(loss)
            before = _snapshot(opt_a, list(self.a.parameters())), _snapshot(opt_b, list(self.b.parameters()))
            opt_a.step()
            opt_b.step()
            after = _snapshot(opt_a, list(self.a.parameters())), _snapshot(opt_b, list(self.b.parameters()))
            self.unchanged.append(all(_same(x, y) for x, y in zip(before, after)))

        def configure_optimizers(self):
            return [torch.optim.AdamW(self.a.parameters(), lr=1e-2), torch.optim.SGD(self.b.parameters(), lr=1e-2)]

    def _same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and all(
            k in sb and torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k]))
            for sa, sb in zip(a[1], b[1])
            for k in sa
        )

    torch.manual_seed(0)
    x = torch.randn(48, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    monitor = Monitor(MonitorConfig(port=0, guard="skip"), serve=False)
    module = TwoOptimizers()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LossbeatCallback(monitor)],
    )
    trainer.fit(module, data)
    monitor.flush()
    assert module.unchanged == [i + 1 == NAN_AT for i in range(6)]  # only the NaN batch left both untouched
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert _skipped(monitor) == {"nonfinite": 1, "explosion": 0, "spike": 0}
    assert monitor.state.guard_undecided_steps == 0
