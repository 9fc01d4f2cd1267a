"""The exporter's own status page: ``/`` (one self-contained HTML document) and the
``/status.json`` it polls, built from :class:`~lossbeat.exposition.state.MonitorState`
at request time, on the server's connection thread, never on the training thread.

The JSON is escaped for HTML (``<``, ``>``, ``&`` as ``\\u003c``...), holds no NaN or
Infinity (JSON has none: curves get ``null`` gaps, current values the strings ``"NaN"``,
``"Inf"``, ``"-Inf"``) and the page puts every string into the DOM with ``textContent``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from lossbeat.analyze.checklist import ITEMS as CHECKLIST_ITEMS
from lossbeat.diagnosis.patterns import PATTERNS
from lossbeat.exposition.moe import status_sections

if TYPE_CHECKING:
    from lossbeat.exposition.state import MonitorState

__all__ = [
    "StatusSource",
    "status_document",
    "page_html",
    "render_json",
    "heatmap_matrix",
    "level_norm",
    "STATUS_PATH",
    "STATUSES",
    "Q_LOW",
    "Q_STEP",
]

STATUS_PATH = "/status.json"
STATUSES = ("good", "warning", "danger")
COUNTERS = ("nonfinite_loss", "nonfinite_grad", "loss_spikes", "grad_explosions", "grad_scaler_overflows")
_PATTERN_TEXT = {p.name: p.meaning for p in PATTERNS}
_PAGE: bytes | None = None


def page_html() -> bytes:
    """The page (package data ``status_page.html``): static, the same for every run and rank."""
    global _PAGE
    if _PAGE is None:
        _PAGE = resources.files("lossbeat.exposition").joinpath("status_page.html").read_bytes()
    return _PAGE


def _scalar(x: float | None) -> float | str | None:
    """A current value: non-finite ones as strings (JSON has no NaN)."""
    if x is None:
        return None
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Inf" if x > 0 else "-Inf"
    return x


def _point(x: float | None) -> float | None:
    """A curve's point: a gap (null) where the value is absent or non-finite."""
    return x if x is not None and math.isfinite(x) else None


def _status_name(status: int) -> str:
    return STATUSES[status] if 0 <= status < len(STATUSES) else "danger"


def checklist(findings: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """The eight daily-checklist items: the worst status of each item's checks (total loss only);
    ``None`` when no check of the item has been judged yet."""
    worst: dict[str, int] = {}
    for check, component, status, _message, _fix, known in findings:
        if component == "" and known:
            worst[check] = max(worst.get(check, 0), int(status))
    items = []
    for number, (name, checks, _alerts) in enumerate(CHECKLIST_ITEMS, 1):
        seen = [worst[c] for c in checks if c in worst]
        items.append({"number": number, "name": name, "status": _status_name(max(seen)) if seen else None})
    return items


Q_LOW = -12.0
"""log10 of the smallest gradient norm the heatmap tells apart (level 1)."""
Q_STEP = 0.1
"""Decades per heatmap level (levels 1..255: 1e-12 to 2.5e13, 26 % apart); 0: no gradient or not finite."""


def _quantise(norms: Mapping[str, float]) -> tuple[tuple[str, ...], str]:
    """One step's layer norms as levels of an absolute log scale, two hex digits a layer.

    Absolute, so a step's column is encoded once and reused by every later request while it is
    in the window: a request encodes only the steps that arrived since the last one."""
    levels = bytearray(len(norms))
    log10, isfinite = math.log10, math.isfinite
    for i, v in enumerate(norms.values()):
        if v > 0 and isfinite(v):
            levels[i] = min(max(int((log10(v) - Q_LOW) / Q_STEP + 1.5), 1), 255)
    return tuple(norms), levels.hex()


def level_norm(level: int) -> float | None:
    """The gradient norm a heatmap level stands for (None for level 0)."""
    return None if level == 0 else 10 ** (Q_LOW + (level - 1) * Q_STEP)


def heatmap_matrix(layers: Mapping[str, Any]) -> list[list[float | None]]:
    """Decode ``/status.json``'s ``layers`` to rows (one per layer name) × steps (tests, tools)."""
    names, columns = layers["names"], layers["columns"]
    rows: list[list[float | None]] = [[None] * len(columns) for _ in names]
    for j, (hexes, set_index) in enumerate(zip(columns, layers["column_set"])):
        for position, row in enumerate(layers["sets"][set_index]):
            rows[row][j] = level_norm(int(hexes[2 * position : 2 * position + 2], 16))
    return rows


class _HeatmapCache:
    """The encoded columns of the steps in the window, keyed by their dict (swapped whole by
    the training thread, never mutated, so a column once encoded stays right)."""

    def __init__(self) -> None:
        self._columns: dict[int, tuple[Mapping[str, float], tuple[str, ...], str]] = {}
        self._lock = threading.Lock()

    def build(self, history: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, Any]:
        with self._lock:  # two requests at once: one encodes, the other reuses
            old, new = self._columns, {}
            for _, norms in history:
                entry = old.get(id(norms))
                if entry is None or entry[0] is not norms:  # the reference held keeps the id unique
                    entry = (norms, *_quantise(norms))
                new[id(norms)] = entry
            self._columns = new
        names: dict[str, int] = {}
        sets: dict[tuple[str, ...], int] = {}
        column_set = []
        for _, norms in history:
            keys = new[id(norms)][1]
            index = sets.get(keys)
            if index is None:  # a new set of layers (usually one for the whole window)
                index = sets[keys] = len(sets)
                for name in keys:
                    names.setdefault(name, len(names))
            column_set.append(index)
        return {
            "steps": [step for step, _ in history],
            "names": list(names),
            "columns": [new[id(norms)][2] for _, norms in history],
            "column_set": column_set,
            "sets": [[names[n] for n in keys] for keys in sets],
            "q_low": Q_LOW,
            "q_step": Q_STEP,
        }


def status_document(s: MonitorState, now: float | None = None, heatmap: _HeatmapCache | None = None) -> dict[str, Any]:
    """What ``/status.json`` serves: plain, JSON-safe data from the state (read, never written)."""
    now = time.time() if now is None else now
    recent = s.recent.snapshot()
    evals = s.evals.snapshot()
    layers = s.layer_history.snapshot()
    first_event = s.layer_first_event  # swapped whole
    findings = s.findings  # swapped whole
    pattern, since = s.pattern
    info = s.run_info
    return {
        "run": {
            "name": info.get("run", ""),
            "profile": info.get("profile", ""),
            "rank": s.rank,
            "world_size": info.get("world_size", ""),
            "version": info.get("version", ""),
            "step": None if s.step is None else int(s.step),
            "uptime_s": max(now - s.started, 0.0),
            "phase": s.phase[0],
            "completed": s.completed,
            "last_step_age_s": None if s.last_step_time is None else max(now - s.last_step_time, 0.0),
        },
        "current": {
            "loss": _scalar(s.loss),
            "eval_loss": _scalar(s.eval_loss),
            "grad_norm": _scalar(s.grad_norm),
            "grad_norm_baseline": _scalar(s.grad_norm_baseline),
            "grad_norm_ceiling": _scalar(s.grad_norm_ceiling),
            "learning_rate": _scalar(max(s.learning_rates.values())) if s.learning_rates else None,
            "first_nonfinite_layer": s.first_nonfinite_layer,
        },
        "findings": [
            {
                "check": check,
                "component": component,
                "status": _status_name(status) if known else "unknown",
                "message": message,
                "fix": fix,
            }
            for check, component, status, message, fix, known in findings
        ],
        "pattern": {"name": pattern, "since_step": since, "text": _PATTERN_TEXT.get(pattern or "", "")},
        "checklist": checklist(findings),
        "counters": {
            "steps": s.steps_total,
            "evals": s.evals_total,
            "exporter_errors": sum(s.errors.values()),
            **{name: getattr(s, f"{name}_total") for name in COUNTERS},
        },
        "last_event_step": {name: s.event_steps.get(name) for name in COUNTERS},
        "series": {
            "step": [r[0] for r in recent],
            "loss": [_point(r[1]) for r in recent],
            "grad_norm": [_point(r[2]) for r in recent],
            "grad_norm_baseline": [_point(r[3]) for r in recent],
            "learning_rate": [_point(r[4]) for r in recent],
        },
        "eval": {"step": [e[0] for e in evals], "loss": [_point(e[1]) for e in evals]},
        "layers": (heatmap or _HeatmapCache()).build(layers),
        # The window around the first non-finite or exploding step, once the latest one moved past it.
        "layers_first_event": (
            {"step": s.layer_first_event_step, **_HeatmapCache().build(first_event)}
            if first_event and (not layers or first_event[0][0] < layers[0][0])
            else None
        ),
        **status_sections(s),  # MoE routers, RL policy: when the run has them
    }


def render_json(document: Mapping[str, Any]) -> bytes:
    """Strict JSON (no NaN), with ``<``, ``>`` and ``&`` escaped: inert even inside HTML."""
    text = json.dumps(document, allow_nan=False, separators=(",", ":"), ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


class StatusSource:
    """What the endpoint serves at ``/`` and ``/status.json`` for one monitor's state.

    ``before``: applies device values that arrived since the training thread last looked
    (the collector's ``before_scrape``; never waits)."""

    def __init__(self, state: MonitorState, before: Callable[[], None] | None = None) -> None:
        self.state = state
        self._before = before
        self._heatmap = _HeatmapCache()

    def json(self) -> bytes:
        if self._before is not None:
            try:
                self._before()
            except Exception:  # counted; the page still shows what the state holds
                self.state.count_error("collect")
        return render_json(status_document(self.state, heatmap=self._heatmap))
