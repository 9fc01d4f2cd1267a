"""``observe(expert_load=...)`` on the training thread: the router statistics measured on the
device (:mod:`lossbeat.measure.experts`, loaded with the first expert load) join the step's
values, and, once the step's one host transfer has arrived, its plain floats go to the exported
state and to the router check's track (:mod:`lossbeat.diagnosis.moe`)."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from lossbeat.diagnosis.history import History
from lossbeat.monitor.record import DeviceStep, HostStep

__all__ = ["ExpertLoads", "apply_experts"]


class ExpertLoads:
    """The monitor's router measurement: nothing until the first ``expert_load``."""

    def __init__(self, window: int, on_error: Any = None) -> None:
        self.window = window
        self.on_error = on_error
        """Called on each failed measurement (the monitor counts it: training_exporter_errors_total{where="observe"})."""
        self.meter: Any = None
        self.errors = 0
        """Steps whose expert load could not be measured (logged; the step itself is observed)."""

    def add(self, step: int, expert_load: Mapping[str, Any], values: DeviceStep) -> None:
        """Measure ``expert_load`` into ``values`` (device work only: no host read here)."""
        if not isinstance(expert_load, Mapping):
            raise TypeError(
                f"expert_load: expected a mapping of layer name to tokens per expert, got {type(expert_load).__name__}"
            )
        if self.meter is None:
            # torch: whoever passes expert loads trains a model with it (a sequence alone loads it here).
            from lossbeat.measure.experts import ExpertLoadMeter

            self.meter = ExpertLoadMeter(self.window)
        try:
            measured = self.meter.measure(step, expert_load)
        except TypeError:  # a wrong type or shape: the caller's mistake, said at once
            raise
        except Exception:  # anything else must not stop the run: counted, logged, the step goes on
            self.errors += 1
            if self.on_error is not None:
                self.on_error()
            if self.errors == 1 or self.errors % 100 == 0:
                logging.getLogger("lossbeat").exception("lossbeat: error measuring expert_load (step %d)", step)
            return
        if measured is not None:
            values.expert_layers, values.experts = measured
            values.expert_sizes = self.meter.experts


def apply_experts(state: Any, history: History, values: HostStep, step: int) -> None:
    """One step's router statistics (host floats now) into the exported state and the check's track."""
    names, packed, sizes = values.expert_layers, values.experts, values.expert_sizes
    if names is None or packed is None or sizes is None:  # set together by ExpertLoads.add
        return
    n = len(names)
    imbalance, dead = packed[:n], packed[n : 2 * n]
    state.set_moe(names, imbalance, dead, sizes)
    history.add_router_stats(step, names, imbalance, dead, sizes)
