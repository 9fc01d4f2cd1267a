"""``lossbeat analyze --html OUT.html``: the exporter's status page, static, for a finished log.

The same document as the live ``/`` (:mod:`lossbeat.exposition.status`), with the run's data
inlined instead of polled: the whole run's curves (every record, thinned to at most
``MAX_POINTS``), the final findings, the checklist, the events with their last steps, the
loss-curve pattern, and one note per run segment. The data are escaped JSON (no ``<``), so
nothing from the log can close the script that holds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lossbeat._version import __version__
from lossbeat.analyze.replay import Analysis
from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.exposition.status import COUNTERS, STATUSES, checklist, page_html, render_json
from lossbeat.logs import ParsedLog

__all__ = ["static_document", "write_html", "MAX_POINTS"]

MAX_POINTS = 5000
"""Points per curve in the static page: a longer run is thinned evenly (its first and last kept)."""
_MARKER = b'<script>\n"use strict";'


def _thin(items: list, limit: int = MAX_POINTS) -> list:
    if len(items) <= limit:
        return items
    stride = (len(items) - 1) / (limit - 1)
    return [items[round(i * stride)] for i in range(limit)]


def _point(x: float | None) -> float | None:
    return x if x is not None and x == x and abs(x) != float("inf") else None


def static_document(log: ParsedLog, runs: list[Analysis], thresholds: Thresholds) -> dict[str, Any]:
    """The ``/status.json`` document of a finished log: its last run segment, the others as notes."""
    a = runs[-1]
    segment = log.segments[-1] if log.segments else log
    train = _thin(list(segment.train))
    evals = _thin([e for e in segment.evals if e.group == ""] or list(segment.evals))
    findings = [
        (f.check, f.component, int(f.status), f.message, f.fix if f.status else "", f.known) for f in a.findings
    ]
    notes = list(log.notes) + list(a.notes)
    if len(runs) > 1:
        notes += [
            f"run {i + 1} of {len(runs)}: steps {r.first_step}-{r.last_step}, final status {r.status.name.lower()}"
            for i, r in enumerate(runs)
        ]
        notes.append(f"the page shows run {len(runs)} of {len(runs)}")
    return {
        "run": {
            "name": log.path,
            "profile": thresholds.profile.name,
            "rank": "-",
            "world_size": "-",
            "version": __version__,
            "step": a.last_step,
            "uptime_s": None,
            "phase": f"finished log ({log.format})",
            "completed": False,
            "last_step_age_s": None,
        },
        "current": {"grad_norm_ceiling": thresholds.gradients.explosion},
        "findings": [
            {"check": c, "component": comp, "status": STATUSES[s] if known else "unknown", "message": m, "fix": fix}
            for c, comp, s, m, fix, known in findings
        ],
        "pattern": {
            "name": a.pattern.name if a.pattern else None,
            "since_step": a.pattern_since,
            "text": a.pattern.meaning if a.pattern else "",
        },
        "checklist": checklist(findings),
        "counters": {
            "steps": a.train_records,
            "evals": a.eval_records,
            **{k: a.counters.get(k, 0) for k in COUNTERS if k in a.counters},
        },
        "last_event_step": {k: (a.event_steps[k][-1] if a.event_steps.get(k) else None) for k in a.counters},
        "series": {
            "step": [r.step for r in train],
            "loss": [_point(r.loss) for r in train],
            "grad_norm": [_point(r.grad_norm) for r in train],
            "grad_norm_baseline": [None] * len(train),
            "learning_rate": [_point(r.learning_rate) for r in train],
        },
        "eval": {"step": [e.step for e in evals], "loss": [_point(e.loss) for e in evals]},
        "layers": {
            "steps": [],
            "names": [],
            "columns": [],
            "column_set": [],
            "sets": [],
            "q_low": -12.0,
            "q_step": 0.1,
        },
        "notes": notes,
    }


def write_html(log: ParsedLog, runs: list[Analysis], thresholds: Thresholds, out: str) -> str:
    """Write the static page to ``out``; returns the path written."""
    page = page_html()
    data = b"<script>window.LOSSBEAT_STATUS = " + render_json(static_document(log, runs, thresholds)) + b";</script>\n"
    if _MARKER not in page:  # the page's own script: the data go just before it
        raise RuntimeError("status_page.html: the page's script tag was not found")
    Path(out).write_bytes(page.replace(_MARKER, data + _MARKER, 1))
    return out
