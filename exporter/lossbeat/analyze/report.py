"""Render analyses as text (one block per file, one section per run) or as JSON-ready dicts."""

from __future__ import annotations

from typing import Any

from lossbeat.analyze.replay import EVENT_KINDS, Analysis
from lossbeat.diagnosis import Finding, Status
from lossbeat.logs import ParsedLog

__all__ = ["format_text", "to_dict", "format_file", "file_to_dict"]

_MARKS = {Status.GOOD: "ok  ", Status.WARNING: "WARN", Status.DANGER: "DANG"}
_STEPS_SHOWN = 8


def _where(f: Finding) -> str:
    return f"{f.check}[{f.component}]" if f.component else f.check


def _steps(steps: list[int], total: int) -> str:
    shown = ", ".join(str(s) for s in steps[:_STEPS_SHOWN])
    return f" (steps {shown}{', ...' if total > _STEPS_SHOWN else ''})" if steps else ""


def format_text(a: Analysis, header: bool = True, skip_notes: frozenset[str] = frozenset(), indent: str = "   ") -> str:
    """One run's block; ``header`` False inside a file block (the file header says path and format)."""
    span = f"steps {a.first_step}-{a.last_step}" if a.first_step is not None else "no steps"
    groups = (
        f" in {len(a.eval_groups)} groups ({', '.join(a.eval_groups)})" if len([g for g in a.eval_groups if g]) else ""
    )
    lines = [f"== {a.path} [{a.format}]"] if header else []
    lines.append(f"{indent}{a.train_records} train records ({span}), {a.eval_records} eval records{groups}")
    if a.profile_reason:
        lines.append(f"{indent}judged as {a.profile_reason}")
    lines += [f"{indent}note: {n}" for n in a.notes if n not in skip_notes]
    pattern = a.pattern
    if pattern is not None:
        since = f", since step {a.pattern_since:,}" if a.pattern_since is not None else ""
        lines.append(
            f"{indent}the loss curve looks like pattern {pattern.number}, {pattern.name.replace('_', ' ')}"
            f"{since}: {pattern.meaning}"
        )
    lines.append(f"{indent}final diagnosis" + (f" (step {a.last_step}):" if a.last_step is not None else ":"))
    for f in a.findings:
        if f.known:
            lines.append(f"{indent}  {_MARKS[f.status]} {_where(f):<24} {f.message}")
            if f.fix and f.status is not Status.GOOD:
                lines.append(f"{indent}       fix: {f.fix}")
    final = {(f.check, f.component): f.status for f in a.findings}
    earlier = [w for key, w in a.worst.items() if w.finding.status > final.get(key, Status.GOOD)]
    if earlier:
        lines.append(f"{indent}worse earlier in the run:")
        for w in earlier:
            lines.append(
                f"{indent}  {_MARKS[w.finding.status]} {_where(w.finding):<24} at step {w.step}: {w.finding.message}"
            )
    lines.append(
        f"{indent}events: "
        + ", ".join(f"{k} {a.counters[k]}{_steps(a.event_steps[k], a.counters[k])}" for k in EVENT_KINDS)
    )
    return "\n".join(lines)


def format_file(log: ParsedLog, runs: list[Analysis]) -> str:
    """A file's block: the header and what was read once, then each run (a section per run when several)."""
    if len(runs) == 1:
        return format_text(runs[0])
    shared = frozenset(log.notes)
    lines = [f"== {log.path} [{log.format}]"]
    lines += [f"   note: {n}" for n in log.notes]
    for i, a in enumerate(runs):
        lines.append(f"   -- run {i + 1} of {len(runs)}: final status {a.status.name.lower()}")
        lines.append(format_text(a, header=False, skip_notes=shared, indent="      "))
    return "\n".join(lines)


def _finding(f: Finding) -> dict[str, Any]:
    return {
        "check": f.check,
        "component": f.component,
        "status": f.status.name.lower(),
        "message": f.message,
        "fix": f.fix,
        "known": f.known,
    }


def _pattern(a: Analysis) -> dict[str, Any] | None:
    """The loss curve's pattern (article section 1.3) from the final diagnosis."""
    pattern = a.pattern
    if pattern is None:
        return None
    return {"number": pattern.number, "name": pattern.name, "since_step": a.pattern_since}


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
        "profile": a.profile,
        "profile_reason": a.profile_reason,
        "pattern": _pattern(a),
        "worst_status": a.worst_status.name.lower(),
        "events": dict(a.counters),
        "event_steps": {k: list(v) for k, v in a.event_steps.items()},
        "findings": [_finding(f) for f in a.findings],
        "worst": [dict(_finding(w.finding), step=w.step) for w in a.worst.values()],
        "notes": list(a.notes),
    }


def file_to_dict(log: ParsedLog, runs: list[Analysis]) -> dict[str, Any]:
    """The last run's fields at the top level (a one-run file reads as before), plus ``read``
    (the parse counts), ``file_status`` (the worst final status over the runs) and ``runs``."""
    doc = to_dict(runs[-1])
    doc["notes"] = list(runs[-1].notes)
    doc["read"] = log.counts.to_dict()
    doc["file_status"] = max((a.status for a in runs), default=Status.GOOD).name.lower()
    doc["runs"] = [to_dict(a) for a in runs]
    return doc
