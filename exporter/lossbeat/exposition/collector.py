"""Renders the monitor's state as Prometheus metric families, at scrape time.

The training thread only assigns plain floats and swaps whole dicts; the
scrape thread reads them here. No work happens on the training thread for a
scrape, and a scrape never blocks training.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from lossbeat.diagnosis.patterns import PATTERNS
from lossbeat.exposition.metrics import METRICS, PHASES, RUN_ID_LABEL, SKIP_REASONS, with_run_id
from lossbeat.exposition.moe import moe_families
from lossbeat.exposition.render import LayerFamily, LayerLines
from lossbeat.measure.memory import read_memory

if TYPE_CHECKING:
    from lossbeat.exposition.state import MonitorState

__all__ = ["MonitorCollector"]

log = logging.getLogger("lossbeat")


def _gauge(name: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, METRICS[name].help, labels=("rank",) + labels)


def _counter(name: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    # prometheus_client adds the _total suffix back when rendering.
    return CounterMetricFamily(name[: -len("_total")], METRICS[name].help, labels=("rank",) + labels)


class MonitorCollector(Collector):
    def __init__(self, state: MonitorState, before_scrape: Callable[[], None] | None = None) -> None:
        self._state = state
        self._before_scrape = before_scrape
        """Applies device values that arrived since the training thread last looked (never waits)."""
        self._layer_lines: LayerLines | None = None
        self.ready: Callable[[], bool] | None = None
        """While this returns False a scrape renders none of the run's series (a gap, not zeros)."""
        # Who scrapes, and how often, is the endpoint's: lossbeat.exposition.scrapers, per scraper.

    def collect(self) -> Iterator[Metric]:
        if self.ready is not None and not self.ready():
            return
        s = self._state
        try:
            if self._before_scrape is not None:
                self._before_scrape()
        except Exception:
            s.count_error("collect")
            log.exception("lossbeat: error applying deferred values at scrape time")
        try:
            families = list(self._families(s))
        except Exception:  # never fail a scrape on our own bug: count it and serve what we can
            if s.count_error("collect") % 100 == 1:  # the first, then every 100th: not one per scrape
                log.exception("lossbeat: error while rendering metrics (counted in training_exporter_errors_total)")
            families = []
        families.append(self._errors(s))
        yield from with_run_id(families, s.run_id)

    def _families(self, s: MonitorState) -> Iterator[Metric]:
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
            ("training_layers_without_grad", s.layers_without_grad),
        )
        for name, value in scalars:
            if value is not None:
                g = _gauge(name)
                g.add_metric([rank], value)
                yield g
        yield from self._progress(s)

        labelled = (
            ("training_loss_component", "component", s.components),
            ("training_signal", "signal", s.signals),
            ("training_learning_rate", "param_group", s.learning_rates),
        )
        for name, label, values in labelled:
            if values:
                g = _gauge(name, (label,))
                for key, value in values.items():
                    g.add_metric([rank, key], value)
                yield g
        layers = s.layer_norms  # swapped whole
        if layers:
            if self._layer_lines is None or self._layer_lines.fixed != {"rank": rank, RUN_ID_LABEL: s.run_id}:
                self._layer_lines = LayerLines(
                    "training_layer_grad_norm", "layer", {"rank": rank, RUN_ID_LABEL: s.run_id}
                )
            yield LayerFamily(
                "training_layer_grad_norm", METRICS["training_layer_grad_norm"].help, self._layer_lines, layers
            )

        yield from moe_families(s)
        if s.health:
            g = _gauge("training_health_status", ("check", "component"))
            for (check, component), status in s.health.items():
                g.add_metric([rank, check, component], float(status))
            yield g

        yield from self._memory(s)
        yield from self._pattern(s)

        info = InfoMetricFamily("training_run", METRICS["training_run"].help, labels=("rank",))
        info.add_metric([rank], s.run_info)
        yield info
        if s.profile_info:
            profile = InfoMetricFamily("training_profile", METRICS["training_profile"].help, labels=("rank",))
            profile.add_metric([rank], s.profile_info)
            yield profile
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
        if s.guard_mode != "off":
            skipped = s.skipped_steps  # swapped whole
            c = _counter("training_skipped_steps_total", ("reason",))
            for reason in SKIP_REASONS:
                c.add_metric([rank, reason], skipped.get(reason, 0))
            yield c
            for name, value in (
                ("training_guard_undecided_steps_total", s.guard_undecided_steps),
                ("training_guard_level_changes_total", s.guard_level_changes),
            ):
                c = _counter(name)
                c.add_metric([rank], value)
                yield c
            for name, value in (
                ("training_guard_consecutive_skips", s.guard_consecutive_skips),
                ("training_halted", 1.0 if s.halted else 0.0),
            ):
                g = _gauge(name)
                g.add_metric([rank], value)
                yield g

    def _progress(self, s: MonitorState) -> Iterator[Metric]:
        """Heartbeat, phase, time per phase and the completion marker (liveness alerts)."""
        beats = [t for t in (s.last_step_time, s.last_activity_time) if t is not None]
        if beats:
            g = _gauge("training_last_heartbeat_timestamp_seconds")
            g.add_metric([s.rank], max(beats))
            yield g
            age = _gauge("training_heartbeat_age_seconds")  # both times from this node's clock
            age.add_metric([s.rank], max(0.0, time.time() - max(beats)))
            yield age
        current, since, totals = s.phase  # swapped whole by the training thread
        now = time.monotonic()
        phase = _gauge("training_phase", ("phase",))
        seconds = _counter("training_phase_seconds_total", ("phase",))
        for name in PHASES:
            phase.add_metric([s.rank, name], 1.0 if name == current else 0.0)
            seconds.add_metric([s.rank, name], totals.get(name, 0.0) + (now - since if name == current else 0.0))
        yield phase
        yield seconds
        done = _gauge("training_run_completed")
        done.add_metric([s.rank], 1.0 if s.completed else 0.0)
        yield done

    def _pattern(self, s: MonitorState) -> Iterator[Metric]:
        current, since = s.pattern  # swapped whole
        if current is None:
            return
        g = _gauge("training_loss_pattern", ("pattern",))
        for p in PATTERNS:
            g.add_metric([s.rank, p.name], 1.0 if p.name == current else 0.0)
        yield g
        if since is not None:
            g = _gauge("training_loss_pattern_since_step")
            g.add_metric([s.rank], float(since))
            yield g

    def _memory(self, s: MonitorState) -> Iterator[Metric]:
        if not s.measures_memory:  # this process is not the one that trains (lossbeat watch)
            return
        reading = read_memory(s.cuda_device)
        for name, value in (
            ("training_memory_allocated_bytes", reading.allocated),
            ("training_memory_peak_bytes", reading.peak),
            ("training_memory_limit_bytes", reading.limit),
        ):
            if value is not None:
                g = _gauge(name, ("device",))
                g.add_metric([s.rank, reading.device], value)
                yield g

    def _errors(self, s: MonitorState) -> Metric:
        c = _counter("training_exporter_errors_total", ("where",))
        for where, count in sorted(s.errors.items()):
            c.add_metric([s.rank, where], count)
        return c
