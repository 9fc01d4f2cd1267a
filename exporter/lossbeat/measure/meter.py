"""The monitor's gradient measurement for one step: the layer grouping (kept, and checked now and
then against the model), the per-layer cadence, and norms measured ahead by ``clip_grad_norm_``
or ``measure_gradients`` and reused by the next ``observe``. All device tensors, no host read.
torch and the measurement itself load with the first model (a monitor fed floats never needs them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

from lossbeat.measure.errors import ShardedMeasurementError, ShardHandshakeError

if TYPE_CHECKING:
    import torch

    from lossbeat.measure.gradients import GradientNorms, LayerGrouping

__all__ = ["GradientMeter", "NormsInto", "ShardedMeasurementError", "ShardHandshakeError"]

log = logging.getLogger("lossbeat")

# Every N submitted steps the trainable parameters are compared with the layer grouping's
# (a pass over the parameters: too slow for every step, cheap amortised): unfreezing layers
# mid-run, or adding adapters, regroups.
REGROUP_CHECK_EVERY = 100
# Steps measured ahead by ``measure_gradients(step=...)`` kept for their observe (a trainer that
# passes its metrics on in bursts: OLMo-core's metrics_collect_interval); the oldest go first.
MAX_STEPS_AHEAD = 256


class NormsInto(Protocol):
    """What a step's measurement writes (the monitor's step record: measure never imports monitor)."""

    grad_norm: Any
    """The global gradient norm (a device tensor here)."""
    layers: Any
    """The per-layer norms (a 1-d device tensor here)."""
    clip: Any
    """The clip coefficient (a device tensor here)."""


class GradientMeter:
    """Measures a model's gradient norms on the device, for the monitor.

    ``on_error(where, error)`` is called when a measurement fails; the step goes on without
    gradient values."""

    def __init__(
        self,
        *,
        layer_depth: int | None,
        max_layers: int,
        layer_every: int,
        reduce_shards: bool,
        pipeline_group: Any,
        exports_layers: bool,
        on_error: Callable[[str, Exception], None],
    ) -> None:
        self.layer_depth, self.max_layers, self.layer_every = layer_depth, max_layers, layer_every
        self.reduce_shards, self.pipeline_group = reduce_shards, pipeline_group
        self.exports_layers = exports_layers
        self.on_error = on_error
        self.grouping: LayerGrouping | None = None
        self.submitted = 0
        """Steps submitted so far: the per-layer cadence counts these, the same on every rank."""
        self._grouping_checked = 0
        self._warned_deepspeed = False
        # Norms measured ahead of the next observe(model=...): (model, norms, clip coefficient or None).
        self._measured: tuple[torch.nn.Module, GradientNorms, torch.Tensor | None] | None = None
        # Norms measured for a given step, reported by observe(step): step -> (norms, layer names).
        # Written by the training thread, taken by the thread that observes (OLMo-core's bookkeeping one).
        self._ahead: dict[int, tuple[GradientNorms, list[str]]] = {}
        self._ahead_model: torch.nn.Module | None = None
        """The model measured by step: observe never reads its gradients (by then they are a later step's)."""
        self.measured_ahead = 0
        """Steps measured by step so far: their per-layer cadence (observe may lag them by several steps)."""

    @property
    def holds_norms(self) -> bool:
        """Norms measured ahead (``clip``, ``measure_ahead``) wait for an observe, with a model or
        without: then ``measure_step`` must run; else an observe without a model skips it."""
        return self._measured is not None or bool(self._ahead)

    def layers_due(self) -> bool:
        """Whether this step is one for per-layer norms (every ``layer_every`` submitted steps).

        The same on every rank: counted at submission, not when the values arrive
        (on CUDA they arrive a step late, which would skip or repeat a due step)."""
        return self.submitted % self.layer_every == 0

    def grouping_for(self, model: torch.nn.Module) -> LayerGrouping:
        grouping = self.grouping
        if grouping is not None and grouping.model_ref is model:
            if self.submitted - self._grouping_checked < REGROUP_CHECK_EVERY:
                return grouping
            # Counted in submitted steps, the same on every rank: a sharded model regroups everywhere.
            self._grouping_checked = self.submitted
            if grouping.matches(model):
                return grouping
        self._grouping_checked = self.submitted
        from lossbeat.measure.gradients import LayerGrouping, deepspeed_zero_stage  # a model: torch is loaded

        grouping = self.grouping = LayerGrouping(
            model,
            self.layer_depth,
            self.max_layers,
            self.reduce_shards,
            self.pipeline_group,
        )
        grouping.on_late = lambda error: self.on_error("handshake", error)
        stage = deepspeed_zero_stage(model)
        if stage is not None and not self._warned_deepspeed:
            self._warned_deepspeed = True
            log.warning(
                "lossbeat: DeepSpeed ZeRO-%d keeps partitioned gradients outside p.grad: per-layer and "
                "global gradient norms cannot be measured from the model; pass "
                "grad_norm=engine.get_global_grad_norm() to observe() (see the README)",
                stage,
            )
        return grouping

    def clip(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip like ``torch.nn.utils.clip_grad_norm_``, keeping the norms for the next step."""
        import torch  # a model: torch is loaded

        from lossbeat.measure.gradients import clip_with_norms

        self._measured = None
        try:
            per_layer = self.layers_due() and self.exports_layers
            norms, coefficient = clip_with_norms(self.grouping_for(model), max_norm, per_layer)
        except ShardedMeasurementError as e:
            # torch's clip would wait in the same collective forever: say why instead
            self.on_error("clip_grad_norm_", e)
            raise RuntimeError(f"clip_grad_norm_: {e}") from None
        except Exception as e:  # clip as torch does (a failed shard handshake too); only the measurement is lost
            self.on_error("clip_grad_norm_", e)
            return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
        if norms is None:
            return torch.zeros(())
        self._measured = (model, norms, coefficient)
        return norms.global_norm

    def measure_ahead(
        self, model: torch.nn.Module, scale: torch.Tensor | None, step: int | None = None
    ) -> torch.Tensor | None:
        """Measure now (norms divided by a loss ``scale`` on the device); the next step reuses them,
        or, with ``step``, ``observe(step)`` does, with or without the model (per-layer norms every
        ``layer_every`` steps measured so: observe may come several steps later)."""
        from lossbeat.measure.gradients import compute_grad_norms  # a model: torch is loaded

        try:
            due = self.layers_due() if step is None else self.measured_ahead % self.layer_every == 0
            if step is not None:
                self._ahead_model = model
                self.measured_ahead += 1
            norms = compute_grad_norms(self.grouping_for(model), due and self.exports_layers)
            if norms is not None and scale is not None:
                layers = norms.layer_norms
                norms = dataclasses.replace(
                    norms, global_norm=norms.global_norm / scale, layer_norms=None if layers is None else layers / scale
                )
        except Exception as e:  # may run inside an autograd callback: never break backward
            self._measured = None
            self.on_error("measure_gradients", e)
            return None
        if step is None:
            self._measured = None if norms is None else (model, norms, None)
        elif norms is not None:
            names = self.grouping.layer_names if self.grouping and norms.layer_norms is not None else []
            self._ahead[step] = (norms, names)  # the names of the grouping measured, should another regroup
            for old in sorted(self._ahead)[:-MAX_STEPS_AHEAD]:  # never observed (sorted: a snapshot)
                self._ahead.pop(old, None)
        return None if norms is None else norms.global_norm

    def measure_step(
        self, model: torch.nn.Module | None, need_global: bool, values: NormsInto, step: int | None = None
    ) -> list[str]:
        """Sets device tensors for the global and per-layer norms in ``values``; returns the layer names.

        Isolated: a failure here (an unsupported gradient, a sharded model some rank
        does not measure) is reported to ``on_error`` and the step is still recorded with
        its loss, learning rates and timestamp, without gradient values."""
        measured, self._measured = self._measured, None
        if self._ahead and step is not None:  # measured by step: that step's norms, if any
            ahead = self._ahead.pop(step, None)
            for old in sorted(self._ahead):  # the steps before this one were never observed
                if old >= step:
                    break
                self._ahead.pop(old, None)
            if ahead is not None:
                return self._report(ahead[0], need_global, values, ahead[1])
        if model is None or model is self._ahead_model:  # by now its gradients are a later step's
            return []
        try:
            due = self.layers_due()
            per_layer = due and self.exports_layers
            norms: GradientNorms | None  # None: no parameter has a gradient this step
            if measured is not None and measured[0] is model:
                norms, coefficient = measured[1], measured[2]
            else:
                coefficient = None
                grouping = self.grouping_for(model)
                # A sharded or pipelined model's ranks all-reduce together: every rank measures on
                # due steps, whether it exports the layers or not.
                if not (per_layer or need_global or (due and grouping.collective)):
                    return []
                from lossbeat.measure.gradients import compute_grad_norms  # imported with the grouping

                norms = compute_grad_norms(grouping, per_layer)
        except Exception as e:
            self.on_error("observe", e)
            return []
        if coefficient is not None:
            values.clip = coefficient
        if norms is None:  # no parameter has a gradient this step
            return []
        return self._report(norms, need_global, values, self.grouping.layer_names if self.grouping else [])

    @staticmethod
    def _report(norms: GradientNorms, need_global: bool, values: NormsInto, names: list[str]) -> list[str]:
        if need_global:
            values.grad_norm = norms.global_norm
        if norms.layer_norms is None:
            return []
        values.layers = norms.layer_norms
        return names
