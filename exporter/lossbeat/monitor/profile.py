"""The live profile: detected from the names ``observe`` and ``observe_eval`` are given, as
``lossbeat analyze`` detects it from a log's fields; ``MonitorConfig.profile`` overrides.

The choice is exported as ``training_profile_info{profile, source, fields}`` and in
``training_run_info{profile}``, and logged once when a detection changes it. It changes only
towards a profile the names say (RL before preference before seq2seq before classification,
:func:`lossbeat.diagnosis.profiles.detect_profile`): the windows are kept, the judgment uses
the profile's thresholds from the next diagnosis on.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from lossbeat.diagnosis import Judge
from lossbeat.diagnosis.profiles import Detection, detect_profile
from lossbeat.exposition.state import MonitorState

__all__ = ["ProfileChoice"]

log = logging.getLogger("lossbeat")
_SHOWN = 4  # field names in the info label


class ProfileChoice:
    """Which profile the run is judged with, and why (called with the transfer's lock held)."""

    def __init__(self, given: str | None, judge: Judge, state: MonitorState) -> None:
        self.given, self.judge, self.state = given, judge, state
        self.fields: list[str] = []
        self.names_seen: set[str] = set()  # names observe(metrics=...) was given (bounded by the inputs)
        self.detection = Detection(None)
        self._publish()

    @property
    def name(self) -> str:
        return self.judge.thresholds.profile.name

    @property
    def reason(self) -> str:
        """As ``lossbeat analyze`` says it: ``profile rl (detected from the fields reward_std, ...)``."""
        return self.detection.describe(self.name, given=self.given is not None)

    def seen(self, names: Iterable[str]) -> None:
        """Names observe was given for the first time (already bounded by the caller)."""
        self.fields.extend(names)
        if self.given is not None:
            return
        found = detect_profile(self.fields)
        t = self.judge.thresholds
        if found.profile is None or found.profile not in t.profiles:
            return
        changed = found.profile != self.detection.profile
        if not changed and found.fields[:_SHOWN] == self.detection.fields[:_SHOWN]:
            return
        self.detection = found
        if found.profile != self.name:
            self.judge.retarget(t.with_profile(found.profile))
        self._publish()
        if changed:
            log.info("lossbeat: judging this run with the %s", self.reason)

    def evaluation(self, step: int, signals: Mapping[str, Any], new_fields: tuple[str, ...]) -> None:
        """``observe_eval(metrics=...)`` or ``observe_metrics``: the names and known signals (not the hot
        path: tensors read here)."""
        if new_fields:
            self.seen(new_fields)
        named = {k: float(x.item()) if hasattr(x, "item") else x for k, x in signals.items()}
        for name, x in named.items():
            self.judge.history.add_signal(name, x, step)
        if named:
            self.state.merge_signals(named)

    def _publish(self) -> None:
        source = "given" if self.given is not None else "detected" if self.detection.profile else "default"
        fields = ",".join(self.detection.fields[:_SHOWN]) if source == "detected" else ""
        self.state.set_profile(self.name, source, fields)
