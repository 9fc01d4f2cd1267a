"""Render an :class:`Analysis` as text (one block per file) or as a JSON-ready dict."""

from __future__ import annotations

from typing import Any

from ..diagnosis import Finding, Status
from .replay import EVENT_KINDS, Analysis

__all__ = ["format_text", "to_dict"]

_MARKS = {Status.GOOD: "ok  ", Status.WARNING: "WARN", Status.DANGER: "DANG"}
_STEPS_SHOWN = 8


def _where(f: Finding) -> str:
    return f"{f.check}[{f.component}]" if f.component else f.check


def _steps(steps: list[int], total: int) -> str:
    shown = ", ".join(str(s) for s in steps[:_STEPS_SHOWN])
    return f" (steps {shown}{', ...' if total > _STEPS_SHOWN else ''})" if steps else ""


def format_text(a: Analysis) -> str:
    span = f"steps {a.first_step}-{a.last_step}" if a.first_step is not None else "no steps"
    groups = f" in {len(a.eval_groups)} groups ({', '.join(a.eval_groups)})" if len([g for g in a.eval_groups if g]) else ""
    lines = [
        f"== {a.path} [{a.format}]",
        f"   {a.train_records} train records ({span}), {a.eval_records} eval records{groups}",
    ]
    lines += [f"   note: {n}" for n in a.notes]
    lines.append(f"   final diagnosis (step {a.last_step}):")
    for f in a.findings:
        if f.known:
            lines.append(f"     {_MARKS[f.status]} {_where(f):<24} {f.message}")
            if f.fix and f.status is not Status.GOOD:
                lines.append(f"          fix: {f.fix}")
    final = {(f.check, f.component): f.status for f in a.findings}
    earlier = [w for key, w in a.worst.items() if w.finding.status > final.get(key, Status.GOOD)]
    if earlier:
        lines.append("   worse earlier in the run:")
        for w in earlier:
            lines.append(f"     {_MARKS[w.finding.status]} {_where(w.finding):<24} at step {w.step}: {w.finding.message}")
    lines.append("   events: " + ", ".join(
        f"{k} {a.counters[k]}{_steps(a.event_steps[k], a.counters[k])}" for k in EVENT_KINDS
    ))
    return "\n".join(lines)


def _finding(f: Finding) -> dict[str, Any]:
    return {"check": f.check, "component": f.component, "status": f.status.name.lower(),
            "message": f.message, "fix": f.fix, "known": f.known}


def to_dict(a: Analysis) -> dict[str, Any]:
    return {
        "path": a.path,
        "format": a.format,
        "train_records": a.train_records,
        "missing_losses": a.missing_losses,
        "eval_records": a.eval_records,
        "eval_groups": list(a.eval_groups),
        "first_step": a.first_step,
        "last_step": a.last_step,
        "status": a.status.name.lower(),
        "worst_status": a.worst_status.name.lower(),
        "events": dict(a.counters),
        "event_steps": {k: list(v) for k, v in a.event_steps.items()},
        "findings": [_finding(f) for f in a.findings],
        "worst": [dict(_finding(w.finding), step=w.step) for w in a.worst.values()],
        "notes": list(a.notes),
    }
