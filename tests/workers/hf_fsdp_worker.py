"""A torchrun worker for test_distributed.py: a Hugging Face Trainer on gloo FSDP with LossbeatCallback.

``--fsdp-version 1`` (``FullyShardedDataParallel``, original parameters) or
``2`` (``fully_shard``), sharded over the ranks, each rank on its own data.
``--max-grad-norm``: 0 measures in ``on_pre_optimizer_step``, above 0 at the
end of backward, before the Trainer clips. At every step the worker records
what the monitor exports and, independently of lossbeat, the norms of the full
(gathered) gradients when the Trainer calls its clip, with the norm that clip
returns; ``<dir>/result.<rank>.json`` holds them with what the Trainer logged.
"""

import argparse
import warnings

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from fsdp_worker import reference_norms
from hf_ddp_worker import Tokens, cpu_args, tiny_gpt2
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from transformers import Trainer, TrainerCallback
from worker_exit import run_rank

from lossbeat import Monitor, MonitorConfig
from lossbeat.integrations.hf import LossbeatCallback


def exported(monitor: Monitor) -> dict:
    """The step's loss, grad norm and layer norms as the exposition has them."""
    out = {"layers": {}}
    for family in text_string_to_metric_families(generate_latest(monitor.registry).decode()):
        for s in family.samples:
            if s.name in ("training_loss", "training_grad_norm", "training_step"):
                out[s.name] = s.value
            elif s.name == "training_layer_grad_norm":
                out["layers"][s.labels["layer"]] = s.value
    return out


class CpuFsdpTrainer(Trainer):
    """The Trainer's FSDP path on CPU: accelerate selects FSDP only on accelerators (on CPU
    it falls back to DDP); set as it would on GPUs, its FSDP code runs on gloo as well."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        # Both shared states: an AcceleratorState built later copies the PartialState's.
        PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        state.device = torch.device("cpu")  # FSDP1 takes it as device_id: "cpu:0" is not the CPU it computes on
        self.is_fsdp_enabled = True


class Record(TrainerCallback):
    """After LossbeatCallback's on_pre_optimizer_step: what the monitor exports for the step."""

    def __init__(self, monitor: Monitor, steps: list) -> None:
        self.monitor, self.steps = monitor, steps

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.monitor.flush()
        self.steps.append(exported(self.monitor))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2)
    parser.add_argument("--max-grad-norm", type=float, default=0.05)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """This rank's result (the Trainer initialises the process group unless it is already)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1's deprecation notice

    torch.set_num_threads(1)
    # Rank 0 exports the layers (the default); every rank exports the global norm.
    monitor = Monitor(MonitorConfig(port=0), serve=False)
    measure = monitor.measure_gradients
    measured_at_end_of_backward = []

    def counted_measure(model, **kwargs):
        measured_at_end_of_backward.append(type(model).__name__)
        return measure(model, **kwargs)

    monitor.measure_gradients = counted_measure
    training = cpu_args(
        args.dir,
        max_steps=3,
        gradient_accumulation_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        max_grad_norm=args.max_grad_norm,
        ddp_backend="gloo",
        # Each GPT2Block its own FSDP unit (FSDP1: its own flat parameter), the rest in the root's.
        fsdp=True,
        fsdp_config={
            "version": args.fsdp_version,
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
            "use_orig_params": True,
            "sync_module_states": False,
        },  # the latter needs a GPU
    )
    steps: list = []
    trainer = CpuFsdpTrainer(
        model=tiny_gpt2(),
        args=training,
        train_dataset=Tokens(64, 1),
        callbacks=[LossbeatCallback(monitor), Record(monitor, steps)],
    )

    references: list = []
    clip = trainer.accelerator.clip_grad_norm_

    def clip_recording_reference(parameters, max_norm, *a, **kw):
        # The Trainer clips (max_grad_norm 0: measures with an infinite max_norm) once the gradients are
        # reduced: the reference is read first, from the gathered gradients, then the Trainer's own norm.
        global_norm, layers = reference_norms(trainer.model_wrapped)
        returned = clip(parameters, max_norm, *a, **kw)
        full = returned.full_tensor() if hasattr(returned, "full_tensor") else returned
        references.append({"global": global_norm, "layers": layers, "trainer_clip": float(full)})
        return returned

    trainer.accelerator.clip_grad_norm_ = clip_recording_reference
    trainer.train()
    monitor.flush()
    wrapped = trainer.model_wrapped
    result = {
        "rank": trainer.args.process_index,
        "wrapped": type(wrapped).__name__,
        "placements": str(getattr(next(wrapped.parameters()), "placements", None)),
        "steps": steps,
        "references": references,
        "measured_at_end_of_backward": measured_at_end_of_backward,
        "logged": [
            {"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"]}
            for r in trainer.state.log_history
            if "grad_norm" in r
        ],
        "errors": dict(monitor.state.errors),
    }
    monitor.close()
    return result


if __name__ == "__main__":
    run_rank(run, parse_args(), join_group=False)  # the Trainer joins the group
