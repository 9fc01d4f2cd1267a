"""The monitoring variants compared: one object per way of watching a training step.

Every variant runs the same step (forward, backward, clip to norm 1, AdamW);
``after_backward`` is the part that differs: clipping plus whatever the
variant monitors. Third-party monitors are optional imports: a missing
package makes the variant unavailable, with the reason, never a crash.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import os
import shutil
import tempfile
from typing import Any

import torch

from lossbeat.monitor import Monitor, MonitorConfig

from .models import Workload, make_optimizer
from .naive_monitor import NaiveGradientMonitor

__all__ = ["Variant", "default_variants", "package_version"]

MAX_NORM = 1.0
WANDB_LOG_FREQ = 10


def package_version(distribution: str) -> str | None:
    """The installed version of an optional package, or None; reads metadata, imports nothing."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_clip(workload: Workload) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(workload.model.parameters(), MAX_NORM)


class Variant:
    name = "baseline"
    title = "no monitoring (torch clip_grad_norm_ only)"
    work_in_backward = False
    """True when the variant's cost lands in backward hooks, outside the timed section."""

    def __init__(self) -> None:
        self.unavailable: str | None = None
        self.steps = 0

    def setup(self, workload: Workload) -> None:
        pass

    def workload_for(self, shared: Workload) -> Workload:
        """The model this variant trains: the shared one, unless it must not touch it."""
        return shared

    def after_backward(self, workload: Workload, loss: torch.Tensor) -> None:
        _torch_clip(workload)

    def close(self) -> None:
        pass

    @property
    def host_transfers(self) -> int | None:
        """lossbeat's own count of device->host reads, where the variant is lossbeat."""
        return None

    @property
    def blocking_waits(self) -> int | None:
        """lossbeat's own count of waits for a deferred device copy, where the variant is lossbeat."""
        return None


class LossbeatVariant(Variant):
    def __init__(self, name: str, title: str, *, per_layer: bool, lossbeat_clip: bool = False, **config: Any) -> None:
        super().__init__()
        self.name, self.title = name, title
        self.per_layer, self.lossbeat_clip = per_layer, lossbeat_clip
        self.config = config
        self.monitor: Monitor | None = None

    def setup(self, workload: Workload) -> None:
        self.monitor = Monitor(MonitorConfig(port=0, log_status_changes=False, **self.config), serve=False)

    def after_backward(self, workload: Workload, loss: torch.Tensor) -> None:
        model, monitor = workload.model, self.monitor
        grad_norm = monitor.clip_grad_norm_(model, MAX_NORM) if self.lossbeat_clip else _torch_clip(workload)
        monitor.observe(
            self.steps,
            loss=loss,
            optimizer=workload.optimizer,
            grad_norm=grad_norm,
            model=model if self.per_layer else None,
        )
        self.steps += 1

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    @property
    def host_transfers(self) -> int | None:
        return self.monitor.host_transfers if self.monitor else None

    @property
    def blocking_waits(self) -> int | None:
        return self.monitor.blocking_waits if self.monitor else None


class NaiveVariant(Variant):
    name = "naive_per_param"
    title = "naive per-parameter monitor (p.grad.norm().item() each)"

    def setup(self, workload: Workload) -> None:
        self.monitor = NaiveGradientMonitor(workload.model)

    def after_backward(self, workload: Workload, loss: torch.Tensor) -> None:
        _torch_clip(workload)
        self.monitor.observe(loss)


class LightningVariant(Variant):
    name = "lightning_grad_norm"
    title = "Lightning grad_norm(model, 2) every step"

    def __init__(self) -> None:
        super().__init__()
        if package_version("lightning") is None:
            self.unavailable = "not installed (pip install lightning)"

    def setup(self, workload: Workload) -> None:
        from lightning.pytorch.utilities import grad_norm

        self._grad_norm = grad_norm

    def after_backward(self, workload: Workload, loss: torch.Tensor) -> None:
        # Lightning's on_before_optimizer_step idiom: norms before clipping.
        self.latest = self._grad_norm(workload.model, norm_type=2)
        _torch_clip(workload)


class WandbVariant(Variant):
    name = "wandb_watch"
    title = f"wandb.watch(log='gradients', log_freq={WANDB_LOG_FREQ}) offline + wandb.log(loss, grad_norm)"
    work_in_backward = True

    def __init__(self) -> None:
        super().__init__()
        if package_version("wandb") is None:
            self.unavailable = "not installed (pip install wandb)"
        self.run = None

    def setup(self, workload: Workload) -> None:
        import wandb

        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        # watch() hooks every parameter of the model it is given, and would fire in the
        # other variants' steps too: it gets a copy of the model, optimizer and batches.
        model = copy.deepcopy(workload.model)
        optimizer = make_optimizer(model)
        self._own = dataclasses.replace(workload, model=model, optimizer=optimizer)
        self._dir = tempfile.mkdtemp(prefix="lossbeat-bench-wandb-")
        # watch()'s hooks log through the global wandb.run: one global run, finished in close().
        self.run = wandb.init(mode="offline", dir=self._dir, project="lossbeat-bench")
        wandb.watch(model, log="gradients", log_freq=WANDB_LOG_FREQ)

    def workload_for(self, shared: Workload) -> Workload:
        return self._own

    def after_backward(self, workload: Workload, loss: torch.Tensor) -> None:
        grad_norm = _torch_clip(workload)
        self.run.log({"loss": float(loss.detach()), "grad_norm": float(grad_norm)})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            shutil.rmtree(self._dir, ignore_errors=True)
            self.run = None


def default_variants(device: torch.device, third_party: bool = True) -> list[Variant]:
    variants: list[Variant] = [
        Variant(),
        LossbeatVariant("lossbeat_scalars", "lossbeat observe(loss, lr, grad_norm) - scalars only", per_layer=False),
        LossbeatVariant(
            "lossbeat_layers_every_step", "lossbeat observe(model=...) - per-layer every step", per_layer=True
        ),
        LossbeatVariant(
            "lossbeat_layers_every_10", "lossbeat observe(model=...), layer_every=10", per_layer=True, layer_every=10
        ),
        LossbeatVariant(
            "lossbeat_clip", "lossbeat monitor.clip_grad_norm_ + observe(model=...)", per_layer=True, lossbeat_clip=True
        ),
    ]
    if device.type == "cuda":
        variants.append(
            LossbeatVariant(
                "lossbeat_layers_blocking",
                "lossbeat per-layer every step, defer_device_reads=False",
                per_layer=True,
                defer_device_reads=False,
            )
        )
    variants.append(NaiveVariant())
    if third_party:
        variants += [LightningVariant(), WandbVariant()]
    return variants
