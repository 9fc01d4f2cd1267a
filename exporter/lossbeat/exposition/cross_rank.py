"""Renders one rank's cross-rank signals (:mod:`lossbeat.measure.cross_rank`) at scrape time: the
step-aligned grad norm and the rank's work time, compared across the ranks of a run by the rules."""

from __future__ import annotations

from typing import Iterator, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lossbeat.exposition.metrics import METRICS, with_run_id

__all__ = ["CrossRankCollector"]


class Signals(Protocol):
    """What the collector reads of :class:`lossbeat.measure.cross_rank.CrossRankSignals` (torch-free)."""

    @property
    def rank(self) -> str: ...
    @property
    def aligned(self) -> tuple[float, float] | None: ...
    @property
    def work_mean(self) -> float | None: ...


class CrossRankCollector(Collector):
    """Reads the signals' last values (each assigned whole by the training thread): no lock."""

    def __init__(self, signals: Signals, run_id: str = "") -> None:
        self.signals = signals
        self.run_id = run_id

    def collect(self) -> Iterator[Metric]:
        return with_run_id(self._families(), self.run_id)

    def _families(self) -> Iterator[Metric]:
        s = self.signals
        aligned = s.aligned
        if aligned is not None:
            for name, value in (
                ("training_grad_norm_aligned", aligned[1]),
                ("training_grad_norm_aligned_step", aligned[0]),
            ):
                g = GaugeMetricFamily(name, METRICS[name].help, labels=("rank",))
                g.add_metric([s.rank], value)
                yield g
        if s.work_mean is not None:
            g = GaugeMetricFamily(
                "training_rank_work_seconds", METRICS["training_rank_work_seconds"].help, labels=("rank",)
            )
            g.add_metric([s.rank], s.work_mean)
            yield g
