"""Checked-in generated files: write them, or report how they drifted (``--check``)."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Iterable, Mapping

from lossbeat.thresholds import Thresholds, ThresholdsError, load_thresholds

__all__ = ["sync_files", "add_generator_arguments", "thresholds_for"]


def add_generator_arguments(parser: argparse.ArgumentParser) -> None:
    """``--thresholds`` and ``--check``, shared by the generators (``lossbeat rules``, ``lossbeat dashboards``)."""
    parser.add_argument("--thresholds", metavar="PATH", type=Path,
                        help="thresholds file overriding the packaged defaults")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a diff when the files differ from what would be generated")


def thresholds_for(args: argparse.Namespace, command: str) -> Thresholds | None:
    """The thresholds a generator renders; None, with the error on stderr, when they are invalid."""
    try:
        return load_thresholds(args.thresholds)
    except ThresholdsError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return None


def sync_files(files: Mapping[Path, str], *, check: bool, command: str, stale: Iterable[Path] = ()) -> int:
    """Write ``files`` (path -> text) and delete ``stale`` ones; with ``check``, write nothing
    and return 1 with a unified diff on stdout when anything differs (messages go to stderr,
    so stdout is the diff alone). Returns the exit code."""
    stale = list(stale)
    if check:
        drift = False
        for path, text in files.items():
            current = path.read_text(encoding="utf-8") if path.is_file() else ""
            if current != text:
                drift = True
                sys.stdout.writelines(difflib.unified_diff(
                    current.splitlines(keepends=True), text.splitlines(keepends=True),
                    fromfile=f"{path} (checked in)", tofile=f"{path} (generated)",
                ))
        for path in stale:
            drift = True
            print(f"{path}: generated file no longer generated from the thresholds")
        if drift:
            print(f"{command}: generated files are out of date; run `python -m {command}`",
                  file=sys.stderr)
            return 1
        print(f"{command}: {len(files)} generated files up to date", file=sys.stderr)
        return 0
    for path, text in files.items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    for path in stale:
        path.unlink()
        print(f"removed {path}")
    return 0
