"""The monitor's judgment: the Judge that ``lossbeat analyze`` replays, plus the live-only vitals
(memory, throughput, the LR schedule), their status changes logged, their findings exported."""

from __future__ import annotations

import logging
import sys

from lossbeat.diagnosis import Finding, Judge, Status, StatusChange
from lossbeat.diagnosis.vitals import Vitals
from lossbeat.exposition.state import MonitorState
from lossbeat.measure.memory import read_memory
from lossbeat.monitor.ratelog import RateLimitedLog
from lossbeat.monitor.report import Report

__all__ = ["Judgment"]

log = logging.getLogger("lossbeat")


class Judgment:
    """Judges the run every ``diagnose_every`` steps and after each evaluation."""

    def __init__(
        self, state: MonitorState, judge: Judge, vitals: Vitals, log_status_changes: bool, log_limited: RateLimitedLog
    ) -> None:
        self.state, self.judge, self.vitals = state, judge, vitals
        self.log_status_changes = log_status_changes
        self.log = log_limited
        self.findings: tuple[Finding, ...] = ()
        """The findings of the last diagnosis."""
        state.set_grad_norm_ceiling(judge.thresholds.gradients.explosion)  # for the status page
        self._evals_seen = 0
        self._health_from: tuple[int, int] = (-1, -1)  # (findings, history resets) the health dict holds

    def due(self, step: int) -> bool:
        return self.judge.due(step)

    def diagnose(self, step: int | None = None) -> None:
        s = self.state
        step = self.judge.history.last_step if step is None else step
        try:
            findings, changes = self.judge.judge(step)
            # Memory, throughput and the LR schedule: checks with their own bounded memory
            # (blocks, thirds, departures in a row) next to the Judge's.
            lrs = s.learning_rates
            memory = read_memory(s.cuda_device, "diagnosis") if s.measures_memory else None
            lr = (lrs["0"] if len(lrs) == 1 and "0" in lrs else max(lrs.values())) if lrs else None
            vitals = self.vitals.findings(step, lr, memory)
            held = s.health
            for f in vitals:
                was = held.get((f.check, f.component))
                if was is not None and was != f.status:
                    changes.append(StatusChange(Status(was), f, step))
            pattern = self.vitals.pattern(findings, step)  # named from the Judge's findings (none of the vitals')
            findings = findings + vitals
            s.set_pattern(pattern.name if pattern else None, self.vitals.pattern_since)
        except Exception:
            s.count_error("diagnose")
            self.log("diagnose", logging.ERROR, "lossbeat: error in the diagnosis", exc_info=True)
            return
        # The health dict moves only with a status change or a new check (a new loss component or
        # eval set; keys come and go only with a reset of the windows): else it stays as it is.
        source = (len(findings), self.judge.history.resets)
        if changes or source != self._health_from:
            health = dict(s.health)
            for f in findings:
                health[(f.check, f.component)] = int(f.status)
            s.set_health(health)
            self._health_from = source
        self.findings = tuple(findings)
        s.set_findings(self.findings)  # the status page reads them as plain tuples, when it asks
        if s.evals_total != self._evals_seen and s.eval_loss is not None:  # judged after each evaluation
            self._evals_seen = s.evals_total
            s.keep_eval(step, s.eval_loss)
        if self.log_status_changes:
            for change in changes:
                log_change(change)

    def report(self) -> Report:
        """Judge now and return the end-of-run report."""
        self.diagnose()
        s = self.state
        counters = {
            "steps": s.steps_total,
            "nonfinite_loss": s.nonfinite_loss_total,
            "nonfinite_grad": s.nonfinite_grad_total,
            "loss_spikes": s.loss_spikes_total,
            "grad_explosions": s.grad_explosions_total,
            "grad_scaler_overflows": s.grad_scaler_overflows_total,
            "exporter_errors": sum(s.errors.values()),
        }
        if s.guard_mode != "off":
            counters["skipped_steps"] = sum(s.skipped_steps.values())
        return Report(self.findings, counters, s.step, self.vitals.describe_pattern())


def log_change(change: StatusChange) -> None:
    """One line per status change, recoveries included (WARNING: visible by default, so a log
    never shows GOOD -> WARNING twice in a row). Written above an active tqdm bar, not onto it."""
    f = change.finding
    message = "lossbeat: %s %s -> %s at step %s: %s%s"
    args = (
        change.where,
        change.previous.name,
        f.status.name,
        change.step,
        f.message,
        f"; fix: {f.fix}" if f.fix and f.status else "",
    )
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if bars and tqdm is not None:
        try:  # tqdm's lock or a stale bar failing must not cost the line
            with tqdm.tqdm.external_write_mode(file=sys.stderr):
                log.warning(message, *args)
            return
        except Exception:
            pass
    log.warning(message, *args)
