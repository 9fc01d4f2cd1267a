"""``lossbeat analyze PATH...``: diagnose finished runs from their log files.

Each file is parsed (:mod:`lossbeat.logs`, format auto-detected), replayed
through the live monitor's History and checks (:mod:`.replay`) and reported:
the final findings, checks that were worse earlier in the run, and the event
counts (non-finite values, loss spikes, grad-norm explosions).
Exit status: 0 when every file was analysed, 2 when one could not be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..logs import FORMATS, LogFormatError, ParsedLog, parse_log
from ..thresholds import Thresholds, ThresholdsError, load_thresholds
from .replay import Analysis, WorstFinding, replay
from .report import format_text, to_dict

__all__ = ["Analysis", "WorstFinding", "analyze_file", "replay", "add_arguments", "run"]


def analyze_file(path: str | os.PathLike, thresholds: Thresholds | None = None, fmt: str | None = None) -> Analysis:
    """Parse and diagnose one log file with ``thresholds`` (default: the packaged file)."""
    return replay(parse_log(path, fmt), thresholds or load_thresholds())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="log files: " + ", ".join(FORMATS))
    parser.add_argument("--format", choices=FORMATS, help="skip auto-detection")
    parser.add_argument("--thresholds", metavar="F", help="thresholds YAML overlaid on the packaged defaults")
    parser.add_argument("--profile", metavar="P", help="task profile (causal-lm, classification, regression, multi-task)")
    parser.add_argument("--plot", metavar="OUT.png", help="draw the curves and events (needs the plots extra); "
                        "with several files, OUT-<file>.png each")
    parser.add_argument("--json", action="store_true", help="print one JSON document (a list, one object per file)")


def _plot_path(out: str, log_path: str, many: bool) -> str:
    if not many:
        return out
    p = Path(out)
    return str(p.with_name(f"{p.stem}-{Path(log_path).stem}{p.suffix or '.png'}"))


def run(args: argparse.Namespace) -> int:
    try:
        thresholds = load_thresholds(args.thresholds, profile=args.profile)
    except ThresholdsError as exc:
        print(f"lossbeat analyze: {exc}", file=sys.stderr)
        return 2
    rc = 0
    results = []
    for path in args.paths:
        try:
            log: ParsedLog = parse_log(path, args.format)
        except (OSError, LogFormatError) as exc:
            print(f"lossbeat analyze: {exc}", file=sys.stderr)
            rc = 2
            continue
        analysis = replay(log, thresholds)
        if args.plot:
            from .plot import plot_run  # matplotlib only when asked

            try:
                written = plot_run(log, analysis, thresholds, _plot_path(args.plot, path, len(args.paths) > 1))
            except RuntimeError as exc:
                print(f"lossbeat analyze: {exc}", file=sys.stderr)
                return 2
            analysis.notes.append(f"plot written to {written}")
        if args.json:
            results.append(to_dict(analysis))
        else:
            print(format_text(analysis))
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    return rc
