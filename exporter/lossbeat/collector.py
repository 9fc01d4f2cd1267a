"""Renders the monitor's state as Prometheus metric families, at scrape time.

The training thread only assigns plain floats and swaps whole dicts; the
scrape thread reads them here. No work happens on the training thread for a
scrape, and a scrape never blocks training.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import sys
from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics import METRICS

if TYPE_CHECKING:
    from .monitor import MonitorState

__all__ = ["MonitorCollector"]

log = logging.getLogger("lossbeat")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _gauge(name: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, METRICS[name].help, labels=("rank",) + labels)


def _counter(name: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    # prometheus_client adds the _total suffix back when rendering.
    return CounterMetricFamily(name[: -len("_total")], METRICS[name].help, labels=("rank",) + labels)


class MonitorCollector(Collector):
    def __init__(self, state: "MonitorState") -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        s = self._state
        try:
            families = list(self._families(s))
        except Exception:  # never fail a scrape on our own bug: count it and serve what we can
            s.count_error("collect")
            log.exception("lossbeat: error while rendering metrics")
            families = []
        families.append(self._errors(s))
        yield from families

    def _families(self, s: "MonitorState") -> Iterator[Metric]:
        rank = s.rank
        scalars = (
            ("training_loss", s.loss),
            ("training_eval_loss", s.eval_loss),
            ("training_grad_norm", s.grad_norm),
            ("training_step", s.step),
            ("training_epoch", s.epoch),
            ("training_last_step_timestamp_seconds", s.last_step_time),
            ("training_step_duration_seconds", s.step_duration),
            ("training_loss_cv", s.loss_cv),
            ("training_loss_trend_ratio", s.loss_trend_ratio),
            ("training_grad_norm_baseline", s.grad_norm_baseline),
            ("training_grad_clip_coefficient", s.clip_coefficient),
            ("training_grad_scale", s.grad_scale),
        )
        for name, value in scalars:
            if value is not None:
                g = _gauge(name)
                g.add_metric([rank], value)
                yield g

        labelled = (
            ("training_loss_component", "component", s.components),
            ("training_learning_rate", "param_group", s.learning_rates),
            ("training_layer_grad_norm", "layer", s.layer_norms),
        )
        for name, label, values in labelled:
            if values:
                g = _gauge(name, (label,))
                for key, value in values.items():
                    g.add_metric([rank, key], value)
                yield g

        if s.health:
            g = _gauge("training_health_status", ("check", "component"))
            for (check, component), status in s.health.items():
                g.add_metric([rank, check, component], float(status))
            yield g

        yield from self._memory(s)

        info = InfoMetricFamily("training_run", METRICS["training_run"].help, labels=("rank",))
        info.add_metric([rank], s.run_info)
        yield info
        if s.first_nonfinite_layer is not None:
            bad = InfoMetricFamily(
                "training_nonfinite_grad_first_layer",
                METRICS["training_nonfinite_grad_first_layer"].help,
                labels=("rank",),
            )
            bad.add_metric([rank], {"layer": s.first_nonfinite_layer})
            yield bad

        counters = (
            ("training_steps_total", s.steps_total),
            ("training_tokens_total", s.tokens_total),
            ("training_eval_total", s.evals_total),
            ("training_nonfinite_loss_total", s.nonfinite_loss_total),
            ("training_nonfinite_grad_total", s.nonfinite_grad_total),
            ("training_loss_spikes_total", s.loss_spikes_total),
            ("training_grad_explosions_total", s.grad_explosions_total),
            ("training_grad_scaler_overflows_total", s.grad_scaler_overflows_total),
        )
        for name, value in counters:
            c = _counter(name)
            c.add_metric([rank], value)
            yield c

    def _memory(self, s: "MonitorState") -> Iterator[Metric]:
        allocated = _gauge("training_memory_allocated_bytes", ("device",))
        peak = _gauge("training_memory_peak_bytes", ("device",))
        torch = sys.modules.get("torch")
        device = s.cuda_device
        if device is not None and torch is not None and torch.cuda.is_initialized():
            # Host-side allocator counters: no device synchronisation.
            allocated.add_metric([s.rank, f"cuda:{device}"], float(torch.cuda.memory_allocated(device)))
            peak.add_metric([s.rank, f"cuda:{device}"], float(torch.cuda.max_memory_allocated(device)))
        else:
            allocated.add_metric([s.rank, "cpu"], _resident_bytes())
            peak.add_metric([s.rank, "cpu"], _peak_resident_bytes())
        yield allocated
        yield peak

    def _errors(self, s: "MonitorState") -> Metric:
        c = _counter("training_exporter_errors_total", ("where",))
        for where, count in sorted(s.errors.items()):
            c.add_metric([s.rank, where], count)
        return c


def _resident_bytes() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return float(int(fh.read().split()[1]) * _PAGE_SIZE)
    except (OSError, ValueError, IndexError):
        return _peak_resident_bytes()


def _peak_resident_bytes() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


def _finite_or_nan(value: float) -> float:
    return value if math.isfinite(value) else math.nan
