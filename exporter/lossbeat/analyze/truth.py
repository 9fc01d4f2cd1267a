"""Score ``lossbeat analyze`` against an independent ground truth (``truth.json`` beside real logs).

A folder without its own ``truth.json`` is scored against the project's
``tests/data/truth/<folder>.json`` when there is one (``real-logs-3``: its ground truth is the
"what I see in the curve" column of its SOURCES.md, written out in the same vocabulary).

Each entry of ``truth.json`` names a file, its verdict (healthy or fault), its faults, the
findings a reader would accept and those the truth rules out, and the records it holds.
Every file is analysed as ``lossbeat analyze`` does (profile detected from its fields), and
what was found is named in the truth's vocabulary (:func:`categories`):

* a healthy run must reach no DANGER (and nothing that would page);
* every fault must be named under its own name;
* no DANGER may name something the truth rules out;
* the records read are compared with the truth's counts.

``python -m lossbeat.analyze.evaluation --truth [DIR]`` prints the table; ``--write`` puts it
into ``docs/analyze.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lossbeat.analyze import judge_log
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.thresholds import Thresholds, load_thresholds
from lossbeat.logs import LogFormatError, parse_log

__all__ = [
    "FileScore",
    "categories",
    "score_dir",
    "render_truth",
    "truth_dirs",
    "truth_file",
    "SPIKES_NAMED",
    "FLAPPING_ENTRIES",
    "flapping",
    "REPO_TRUTH",
]

SPIKES_NAMED = 3
"""Loss spikes in a run that name 'loss_spikes' (the TrainingLossSpikes alert's count)."""

_PAGING = ("grad_norm", "loss_trend", "nonfinite")
FLAPPING_ENTRIES = 3
"""A check that enters a worse status this many times in one run flaps."""


def flapping(analysis) -> list[str]:
    """The checks (``check[component]``) that entered a worse status FLAPPING_ENTRIES times or more."""
    entries: dict[str, int] = {}
    for c in analysis.changes:
        if c.finding.status > c.previous:
            key = f"{c.finding.check}[{c.finding.component}]" if c.finding.component else c.finding.check
            entries[key] = entries.get(key, 0) + 1
    return [k for k, n in entries.items() if n >= FLAPPING_ENTRIES]


def categories(analyses, status: Status = Status.WARNING) -> set[str]:
    """What the runs' findings (worst over each run) and events say, in the truth's words."""
    found: set[str] = set()
    for a in analyses:
        for (check, _), w in a.worst.items():
            f = w.finding
            if f.status < status:
                continue
            if check == "nonfinite":
                found.add("nonfinite")
            elif check == "loss_trend":
                found.add("divergence" if f.status is Status.DANGER else "plateau")
            elif check == "grad_norm":
                found.add("vanishing" if "vanishing" in f.message else "grad_explosion")
            elif check == "overfitting":
                found.add("overfitting")
            elif check in ("learning_rate", "warmup"):
                found.add("lr_problem")
            elif check == "learning":
                # A run that learned and lost it diverged; the rest of the check's words say it never learned.
                lost = "lost much of it" in f.message
                found.add("divergence" if "saturated" in f.message or lost else "no_learning")
            elif check == "loss_range":
                low = "below" in f.message and "suspiciously low" in f.message
                found.add("overfitting" if low else "loss_range")
            elif check == "loss_volatility":
                found.add("volatility")
        if status is Status.WARNING:
            if a.counters["nonfinite_loss"] or a.counters["nonfinite_grad"]:
                found.add("nonfinite")
            if a.counters["grad_explosions"]:
                found.add("grad_spikes")  # departures the run absorbed: spikes, not an explosion
            if a.counters["loss_spikes"] >= SPIKES_NAMED:
                found.add("loss_spikes")
    return found


def _named(fault: str, found: set[str]) -> bool:
    return ("nonfinite" in found) if fault in ("nan", "inf") else fault in found


def _ruled_out(wrong: list[str], found: set[str]) -> list[str]:
    out = []
    for w in wrong:
        if w in ("nan", "inf"):
            continue  # a non-finite value the log states is a fact, not a judgment
        if w in found:
            out.append(w)
    return out


@dataclass
class FileScore:
    file: str
    verdict: str
    faults: list[str]
    read: str = ""
    records: int = 0
    truth_records: int = 0
    evals: int = 0
    truth_evals: int = 0
    profile: str = ""
    status: str = "unread"
    """The worst final status over the file's runs; 'unread' when it could not be read."""
    worst: str = "unread"
    found: list[str] = field(default_factory=list)
    dangers: list[str] = field(default_factory=list)
    named: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    wrong_dangers: list[str] = field(default_factory=list)
    wrong_warnings: list[str] = field(default_factory=list)
    pages: bool = False
    flapping: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"


def _score(directory: Path, entry: dict, t: Thresholds) -> FileScore:
    s = FileScore(
        entry["file"],
        entry["verdict"],
        list(entry.get("faults", ())),
        truth_records=int(entry.get("records", 0)),
        truth_evals=int(entry.get("eval_records", 0)),
    )
    path = directory / entry["file"]
    if "/" in entry["file"] and not path.exists():
        path = directory / entry["file"].split("/")[0]  # a TensorBoard folder named by one of its files
    try:
        log = parse_log(path)
        fa = judge_log(log, t)
    except (LogFormatError, OSError) as exc:
        s.error = str(exc).split(": ", 1)[-1][:120]
        s.missed = list(s.faults)
        return s
    runs = fa.runs
    s.records, s.evals = log.counts.train, log.counts.evals
    if s.records != s.truth_records and sum(r.loss is not None for r in log.train) == s.truth_records:
        s.records = s.truth_records  # the truth counts the records with a loss (a closing null-loss line apart)
    s.read = f"{s.records}/{s.truth_records}" + (
        f", evals {s.evals}/{s.truth_evals}" if s.truth_evals or s.evals else ""
    )
    s.profile = runs[-1].profile if runs else ""
    s.status = fa.status.name.lower()
    s.worst = max((a.worst_status for a in runs), default=Status.GOOD).name.lower()
    found = categories(runs)
    danger = categories(runs, Status.DANGER)
    s.found = sorted(found)
    s.dangers = sorted(danger)
    s.named = [f for f in s.faults if _named(f, found)]
    s.missed = [f for f in s.faults if f not in s.named]
    wrong = list(entry.get("wrong_findings", ()))
    s.wrong_dangers = _ruled_out(wrong, danger)
    s.wrong_warnings = [w for w in _ruled_out(wrong, found) if w not in s.wrong_dangers]
    s.pages = any(w.finding.status is Status.DANGER and key[0] in _PAGING for a in runs for key, w in a.worst.items())
    s.flapping = sorted({k for a in runs for k in flapping(a)})
    return s


REPO_TRUTH = Path(__file__).resolve().parents[3] / "tests" / "data" / "truth"
"""The project's ground truths of folders that have none of their own (``<folder>.json``)."""


def truth_file(directory: Path) -> Path | None:
    """``directory/truth.json``, else the project's ``tests/data/truth/<folder>.json``, else None."""
    for path in (directory / "truth.json", REPO_TRUTH / f"{directory.name}.json"):
        if path.is_file():
            return path
    return None


def score_dir(directory: Path, thresholds: Thresholds | None = None) -> list[FileScore]:
    """Every entry of the folder's ground truth (:func:`truth_file`), analysed and scored."""
    t = thresholds or load_thresholds()
    path = truth_file(directory)
    if path is None:
        raise FileNotFoundError(f"{directory}: no truth.json (nor {REPO_TRUTH / (directory.name + '.json')})")
    entries = json.loads(path.read_text(encoding="utf-8"))
    return [_score(directory, e, t) for e in entries]


def truth_dirs(base: Path) -> list[Path]:
    """The folders under ``base`` (``tests/data/real-logs``) with a ground truth (:func:`truth_file`)."""
    return sorted(p for p in base.iterdir() if p.is_dir() and truth_file(p) is not None) if base.is_dir() else []


def totals(scores: list[FileScore]) -> dict[str, int]:
    healthy = [s for s in scores if s.healthy]
    faults = [f for s in scores for f in s.faults]
    return {
        "files": len(scores),
        "unread": sum(s.status == "unread" for s in scores),
        "healthy": len(healthy),
        "healthy_danger": sum(s.worst == "danger" for s in healthy),
        "healthy_pages": sum(s.pages for s in healthy),
        "healthy_flapping": sum(bool(s.flapping) for s in healthy),
        "faults": len(faults),
        "named": sum(len(s.named) for s in scores),
        "wrong_dangers": sum(bool(s.wrong_dangers) for s in scores),
        "read_in_full": sum(s.status != "unread" and s.records == s.truth_records for s in scores),
    }


def _cell(items: list[str]) -> str:
    return ", ".join(items) if items else "-"


def render_truth(name: str, scores: list[FileScore]) -> str:
    n = totals(scores)
    lines = [
        f"**{name}: {n['files']} files, {n['unread']} unreadable; healthy {n['healthy']}: with a danger "
        f"{n['healthy_danger']}, that would page {n['healthy_pages']}, flapping {n['healthy_flapping']}; faults {n['faults']}: named "
        f"{n['named']}; files with a danger the truth rules out: {n['wrong_dangers']}; read in full: "
        f"{n['read_in_full']}.**",
        "",
        "| file | truth | profile | final (worst) | found | faults named | missed | ruled out (danger / warning) "
        "| records read / truth |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        truth = s.verdict + (f": {', '.join(s.faults)}" if s.faults else "")
        status = f"{s.status} ({s.worst})" if s.status != "unread" else f"unread: {s.error}"
        if s.flapping:
            status += f"; flapping: {', '.join(s.flapping)}"
        ruled = f"{_cell(s.wrong_dangers)} / {_cell(s.wrong_warnings)}"
        lines.append(
            f"| {s.file} | {truth} | {s.profile or '-'} | {status} | {_cell(s.found)} | {_cell(s.named)} | "
            f"{_cell(s.missed)} | {ruled} | {s.read or '-'} |"
        )
    return "\n".join(lines)
