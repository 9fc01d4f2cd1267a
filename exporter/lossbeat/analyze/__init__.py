"""``lossbeat analyze PATH...``: diagnose finished runs from their log files.

Each file is parsed (:mod:`lossbeat.logs`, format auto-detected); each run in it
(a file may hold several: a restart, appended seeds) is replayed on its own through
the live monitor's History and checks (:mod:`.replay`) and reported: the final
findings, checks that were worse earlier in the run, and the event counts.

Exit status: 0 every file read and no run's final diagnosis reached ``--fail-on``
(default ``danger``); 1 the gate failed; 2 a file could not be read (wins over 1).
A closed stdout (``| head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from lossbeat.analyze.replay import Analysis, WorstFinding, replay
from lossbeat.analyze.report import file_to_dict, format_file
from lossbeat.diagnosis import Status
from lossbeat.diagnosis.profiles import Detection, detect_profile
from lossbeat.diagnosis.thresholds import Thresholds, ThresholdsError, load_thresholds
from lossbeat.logs import COLUMN_FORMATS, FORMATS, LogFormatError, ParsedLog, parse_log
from lossbeat.logs.columns import parse_column_map

__all__ = [
    "Analysis",
    "WorstFinding",
    "FileAnalysis",
    "analyze_file",
    "analyze_runs",
    "replay",
    "for_log",
    "judge_log",
    "add_arguments",
    "run",
    "EXIT_OK",
    "EXIT_GATE",
    "EXIT_UNREADABLE",
]

EXIT_OK, EXIT_GATE, EXIT_UNREADABLE = 0, 1, 2
_FAIL_ON = {"warning": Status.WARNING, "danger": Status.DANGER, "never": None}


@dataclass
class FileAnalysis:
    """One file: its parse (counts, notes) and one :class:`Analysis` per run in it."""

    log: ParsedLog
    runs: list[Analysis]

    @property
    def status(self) -> Status:
        """The worst final status over the file's runs."""
        return max((a.status for a in self.runs), default=Status.GOOD)


def for_log(log: ParsedLog, thresholds: Thresholds, given: bool = False) -> tuple[Thresholds, str]:
    """The thresholds to judge ``log`` with: the profile its fields name (RL, preference, seq2seq,
    classification) unless one was ``given``; and the sentence saying which and from what."""
    if given:
        return thresholds, Detection(None).describe(thresholds.profile.name, given=True)
    found = detect_profile(log.fields)
    if found.profile is not None and found.profile in thresholds.profiles:
        thresholds = thresholds.with_profile(found.profile)
    return thresholds, found.describe(thresholds.profile.name)


def judge_log(log: ParsedLog, thresholds: Thresholds, given: bool = False) -> FileAnalysis:
    """Each run of a parsed file, replayed with the profile :func:`for_log` chooses."""
    t, why = for_log(log, thresholds, given)
    runs = [replay(run, t) for run in log.runs]
    for a in runs:
        a.profile_reason = why
    return FileAnalysis(log, runs)


def analyze_runs(
    path: str | os.PathLike, thresholds: Thresholds | None = None, fmt: str | None = None, profile: str | None = None
) -> FileAnalysis:
    """Parse ``path`` and diagnose each run in it on its own. ``profile`` overrides the one the
    log's fields name."""
    log = parse_log(path, fmt)
    t = thresholds or load_thresholds()
    if profile is not None:
        t = t.with_profile(profile)
    return judge_log(log, t, given=profile is not None)


def analyze_file(path: str | os.PathLike, thresholds: Thresholds | None = None, fmt: str | None = None) -> Analysis:
    """Parse and diagnose one log file; the :class:`Analysis` of its last run (``analyze_runs`` has all)."""
    return analyze_runs(path, thresholds, fmt).runs[-1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="log files (or a directory of TensorBoard event files): " + ", ".join(FORMATS),
    )
    parser.add_argument("--format", choices=FORMATS, help="skip auto-detection")
    parser.add_argument(
        "--map",
        metavar="ROLE=COL,...",
        help="the columns of a table (CSV, JSON lines, printed key value records, MLflow, W&B, sb3, "
        "detectron2): loss=COL,step=COL,lr=COL,grad_norm=COL,eval=COL,epoch=COL override the choice by name",
    )
    parser.add_argument("--thresholds", metavar="F", help="thresholds YAML overlaid on the packaged defaults")
    parser.add_argument(
        "--profile",
        metavar="P",
        help="task profile (causal-lm, classification, seq2seq, regression, multi-task, preference, rl); "
        "default: the one the log's fields name (reward_std: rl, rewards/margins: preference, "
        "eval_wer: seq2seq, eval_accuracy: classification), else causal-lm",
    )
    parser.add_argument(
        "--plot",
        metavar="OUT.png",
        help="draw the curves and events (needs the plots extra); with several files, OUT-<file>.png each",
    )
    parser.add_argument(
        "--html",
        metavar="OUT.html",
        help="write the exporter's status page, static, for the log "
        "(curves, events, findings, segments); with several files, OUT-<file>.html each",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document (a list, one object per file)")
    parser.add_argument(
        "--fail-on",
        choices=tuple(_FAIL_ON),
        default="danger",
        help="exit 1 when a run's final diagnosis reaches this status (default: danger); "
        "exit 2 when a file cannot be read",
    )


def _plot_path(out: str, log_path: str, many: bool) -> str:
    if not many:
        return out
    p = Path(out)
    return str(p.with_name(f"{p.stem}-{Path(log_path).stem}{p.suffix or '.png'}"))


def _error(message: str) -> None:
    print(f"lossbeat analyze: {message}", file=sys.stderr, flush=True)


def _analyse(path: str, args: argparse.Namespace, thresholds: Thresholds) -> FileAnalysis | None:
    """One file, or None after a one-line error on stderr: never a traceback for a bad file."""
    try:
        log = parse_log(path, args.format, column_map=getattr(args, "map", None))
    except LogFormatError as exc:
        _error(str(exc))
        return None
    except MemoryError:
        _error(f"{path}: out of memory while reading")
        return None
    except Exception as exc:
        _error(f"{path}: could not read ({type(exc).__name__}: {exc}); please report this")
        return None
    try:
        return judge_log(log, thresholds, given=getattr(args, "profile", None) is not None)
    except Exception as exc:
        _error(f"{path}: analysis failed ({type(exc).__name__}: {exc}); please report this")
        return None


def run(args: argparse.Namespace) -> int:
    try:
        thresholds = load_thresholds(args.thresholds, profile=args.profile)
    except ThresholdsError as exc:
        _error(str(exc))
        return EXIT_UNREADABLE
    try:
        parse_column_map(getattr(args, "map", None))
    except ValueError as exc:
        _error(str(exc))
        return EXIT_UNREADABLE
    if getattr(args, "map", None) and args.format and args.format not in COLUMN_FORMATS:
        _error(
            f"--map: the {args.format} reader chooses its own columns (--map applies to {', '.join(COLUMN_FORMATS)})"
        )
        return EXIT_UNREADABLE
    gate = _FAIL_ON[getattr(args, "fail_on", "danger")]
    unreadable = failed = False
    results = []
    try:
        for path in args.paths:
            fa = _analyse(path, args, thresholds)
            if fa is None:
                unreadable = True
                continue
            if args.plot:
                from lossbeat.analyze.plot import plot_file  # matplotlib only when asked

                try:
                    written = plot_file(fa.log, fa.runs, thresholds, _plot_path(args.plot, path, len(args.paths) > 1))
                except (RuntimeError, OSError, ValueError) as exc:
                    _error(f"{path}: plot not written: {exc}")
                    unreadable = True
                else:
                    fa.runs[-1].notes.append(f"plot written to {written}")
            if getattr(args, "html", None):
                from lossbeat.analyze.html import write_html

                try:
                    written = write_html(fa.log, fa.runs, thresholds, _plot_path(args.html, path, len(args.paths) > 1))
                except OSError as exc:
                    _error(f"{path}: page not written: {exc}")
                    unreadable = True
                else:
                    fa.runs[-1].notes.append(f"page written to {written}")
            failed = failed or (gate is not None and fa.status >= gate)
            if args.json:
                results.append(file_to_dict(fa.log, fa.runs))
            else:
                print(format_file(fa.log, fa.runs), flush=True)
        if args.json:
            json.dump(results, sys.stdout, indent=2)
            print(flush=True)
    except BrokenPipeError:
        _quiet_stdout()  # the reader went away (| head): stop, say nothing
    except KeyboardInterrupt:
        return 130
    return EXIT_UNREADABLE if unreadable else EXIT_GATE if failed else EXIT_OK


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's flush at exit does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
