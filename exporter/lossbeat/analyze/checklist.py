"""``lossbeat checklist``: the article's daily checklist (section 6.1), item by item.

Eight items in the article's order, each a tick, a cross or a question mark (not
judged: not in this log, or not enough data yet), with the value behind it:

1. loss in its usual range          5. LR following its schedule
2. loss still falling               6. no NaN/Inf
3. loss volatility normal           7. memory use stable
4. grad norm within its band        8. training speed normal

For a finished log (``lossbeat checklist FILE``: the parsers and checks of ``lossbeat
analyze``) or a live job (``--prometheus URL --job NAME``: the exporter's own judgments,
``training_health_status``, and the firing alerts, read through Prometheus' HTTP API).
Exit status: 0 when no item fails, 1 when one does, 2 when the input cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Iterable

from lossbeat.diagnosis.findings import Finding, Status
from lossbeat.diagnosis.patterns import classify

__all__ = ["ITEMS", "Item", "from_findings", "from_prometheus", "add_arguments", "run"]

# (item, the checks that judge it, the alerts that fail it) in the article's order.
ITEMS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("loss in its usual range", ("loss_range",), ("TrainingLossOutOfRange",)),
    ("loss still falling", ("loss_trend",), ("TrainingLossPlateau", "TrainingLossDiverging")),
    ("loss volatility normal", ("loss_volatility",), ("TrainingLossVolatile", "TrainingLossSpikes")),
    ("grad norm within its band", ("grad_norm",), ("TrainingGradientExplosion", "TrainingGradientVanishing")),
    ("LR following its schedule", ("lr_schedule", "learning_rate"), ("TrainingLearningRateSuspect",)),
    ("no NaN/Inf", ("nonfinite",), ("TrainingLossNaN", "TrainingGradientNonFinite", "TrainingLossScaleCollapsed")),
    ("memory use stable", ("memory",), ("TrainingMemoryGrowing", "TrainingMemoryNearLimit")),
    ("training speed normal", ("throughput",), ("TrainingThroughputDropped", "TrainingStalled")),
)
_MARKS = {True: "\u2713", False: "\u2717", None: "?"}


@dataclass(frozen=True)
class Item:
    number: int
    name: str
    ok: bool | None
    """True: passes; False: fails; None: not judged."""
    value: str
    """What was seen, with the numbers."""


def from_findings(findings: Iterable[Finding]) -> list[Item]:
    """The eight items from a diagnosis (the run's total loss; components are not items)."""
    by_check = {f.check: f for f in findings if not f.component}
    items = []
    for number, (name, checks, _alerts) in enumerate(ITEMS, 1):
        judged = [by_check[c] for c in checks if c in by_check and by_check[c].known]
        if not judged:
            seen = next((by_check[c] for c in checks if c in by_check), None)
            items.append(Item(number, name, None, seen.message if seen else "not in this log"))
            continue
        worst = max(judged, key=lambda f: f.status)
        items.append(Item(number, name, worst.status is Status.GOOD, worst.message))
    return items


def _query(base: str, promql: str, timeout: float) -> list[dict]:
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus answered {body.get('status')}: {body.get('error', '')}")
    return body["data"]["result"]


def _scalar(results: list[dict]) -> float | None:
    values = [float(r["value"][1]) for r in results]
    return values[0] if values else None


def from_prometheus(base: str, job: str, timeout: float = 10.0) -> list[Item]:
    """The eight items for ``job`` from a live Prometheus: the worst ``training_health_status``
    of each item's checks across the job's ranks, failed too by the item's firing alerts."""
    sel = f'job="{_escape(job)}"'
    status = {
        r["metric"].get("check", ""): int(float(r["value"][1]))
        for r in _query(base, f'max by (check) (training_health_status{{{sel},component=""}})', timeout)
    }
    if not status:
        raise LookupError(f"no lossbeat series for job {job!r} at {base} (is it scraped?)")
    firing: dict[str, int] = {}
    for r in _query(base, f'count by (alertname) (ALERTS{{{sel},alertstate="firing"}})', timeout):
        firing[r["metric"]["alertname"]] = int(float(r["value"][1]))
    values = _live_values(base, sel, timeout)
    items = []
    for number, (name, checks, alerts) in enumerate(ITEMS, 1):
        judged = [status[c] for c in checks if c in status]
        fired = [a for a in alerts if a in firing]
        if fired:
            ok: bool | None = False
        elif judged:
            ok = max(judged) == Status.GOOD
        else:
            ok = None
        value = values.get(number, "no value")
        if fired:
            value += "; firing: " + ", ".join(fired)
        items.append(Item(number, name, ok, value))
    return items


def _live_values(base: str, sel: str, timeout: float) -> dict[int, str]:
    """The number behind each item, for a person reading the list (the job's worst rank)."""
    queries = {
        1: ("mean loss {:.4g}", f"avg(avg_over_time(training_loss{{{sel}}}[5m]))"),
        2: ("trend ratio {:+.3f} (positive: falling)", f"min(training_loss_trend_ratio{{{sel}}})"),
        3: ("loss CV {:.3f}", f"max(training_loss_cv{{{sel}}})"),
        4: ("grad norm {:.3g}", f"max(training_grad_norm{{{sel}}})"),
        5: ("learning rate {:.3g}", f"max(training_learning_rate{{{sel}}})"),
        6: (
            "{:.0f} non-finite steps in the last hour",
            f"sum(increase(training_nonfinite_loss_total{{{sel}}}[1h]) or increase(training_nonfinite_grad_total{{{sel}}}[1h]))",
        ),
        7: (
            "peak memory {:.0%} of the limit",
            f"max(training_memory_peak_bytes{{{sel}}} / training_memory_limit_bytes{{{sel}}})",
        ),
        8: ("{:.3g} steps/s", f"avg(rate(training_steps_total{{{sel}}}[5m]))"),
    }
    out = {}
    for number, (fmt, promql) in queries.items():
        value = _scalar(_query(base, promql, timeout))
        out[number] = fmt.format(value) if value is not None and math.isfinite(value) else "no value"
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def format_items(items: list[Item], title: str, pattern: str = "") -> str:
    lines = [title]
    if pattern:
        lines.append(f"  pattern: {pattern}")
    for item in items:
        lines.append(f"  {_MARKS[item.ok]} {item.number}. {item.name:<27} {item.value}")
    failed = sum(item.ok is False for item in items)
    lines.append(
        f"  {8 - failed - sum(item.ok is None for item in items)} passed, {failed} failed, "
        f"{sum(item.ok is None for item in items)} not judged"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="?", metavar="FILE", help="a finished run's log (any format `analyze` reads)")
    parser.add_argument("--prometheus", metavar="URL", help="a live job: the Prometheus that scrapes it")
    parser.add_argument("--job", metavar="NAME", help="with --prometheus: the job label of the run")
    parser.add_argument("--thresholds", metavar="F", help="thresholds YAML overlaid on the packaged defaults")
    parser.add_argument("--profile", metavar="P", help="task profile for a log file")
    parser.add_argument("--json", action="store_true", help="print JSON: the items and the pattern")


def _file_items(args: argparse.Namespace) -> tuple[list[Item], str, str]:
    from lossbeat.analyze import analyze_file
    from lossbeat.diagnosis.thresholds import load_thresholds

    analysis = analyze_file(args.path, load_thresholds(args.thresholds, profile=args.profile))
    pattern = classify(analysis.findings)
    words = f"{pattern.number}, {pattern.name.replace('_', ' ')}: {pattern.meaning}" if pattern else ""
    return from_findings(analysis.findings), f"lossbeat checklist: {args.path}", words


def _live_items(args: argparse.Namespace) -> tuple[list[Item], str, str]:
    items = from_prometheus(args.prometheus, args.job)
    sel = f'job="{_escape(args.job)}"'
    current = _query(args.prometheus, f"max by (pattern) (training_loss_pattern{{{sel}}}) == 1", 10.0)
    words = ", ".join(sorted(r["metric"]["pattern"].replace("_", " ") for r in current))
    return items, f"lossbeat checklist: job {args.job} at {args.prometheus}", words


def run(args: argparse.Namespace) -> int:
    if (args.path is None) == (args.prometheus is None):
        print("lossbeat checklist: give a log FILE or --prometheus URL --job NAME", file=sys.stderr)
        return 2
    if args.prometheus is not None and not args.job:
        print("lossbeat checklist: --prometheus needs --job NAME", file=sys.stderr)
        return 2
    try:
        items, title, pattern = (_file_items if args.path else _live_items)(args)
    except (OSError, ValueError, LookupError, RuntimeError, urllib.error.URLError) as exc:
        where = args.path or args.prometheus
        print(f"lossbeat checklist: {where}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            json.dump(
                {
                    "source": args.path or f"{args.prometheus} job={args.job}",
                    "pattern": pattern,
                    "items": [asdict(i) for i in items],
                },
                sys.stdout,
                indent=2,
            )
            print()
        else:
            print(format_items(items, title, pattern))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader left; that is not an error
        sys.stdout = None  # type: ignore[assignment]  # no flush error at exit
    return 1 if any(item.ok is False for item in items) else 0
