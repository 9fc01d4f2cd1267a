"""Generated files: where the generators write them, and writing them or reporting drift (``--check``).

A generator writes into a folder the user names (``--output-dir``). Only the repository's own
regeneration (``--checkout``, what ``make generate`` runs) writes the checked-in files.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from importlib import resources
from pathlib import Path
from typing import Iterable, Mapping

from lossbeat.diagnosis.thresholds import Thresholds, ThresholdsError, load_thresholds

__all__ = [
    "sync_files",
    "add_generator_arguments",
    "thresholds_for",
    "with_runbook_base",
    "output_root",
    "shipped_text",
    "SHIPPED_FILES",
]

REPO_ROOT = Path(__file__).resolve().parents[3]
# Hand-written files the package carries (exporter/lossbeat/shipped/ links to them in the checkout).
SHIPPED_FILES = ("alertmanager.yml", "runbooks.md")


def shipped_text(name: str) -> str:
    """The text of a hand-written file shipped in the package: ``alertmanager.yml`` or ``runbooks.md``."""
    if name not in SHIPPED_FILES:
        raise ValueError(f"name: expected one of {', '.join(SHIPPED_FILES)}, got {name!r}")
    return resources.files("lossbeat").joinpath("shipped").joinpath(name).read_text(encoding="utf-8")


def add_generator_arguments(parser: argparse.ArgumentParser, *, checkout: bool = True) -> None:
    """The options the generators share (``lossbeat rules``, ``dashboards``, ``generate``)."""
    parser.add_argument(
        "--thresholds", metavar="PATH", type=Path, help="thresholds file overriding the packaged defaults"
    )
    parser.add_argument("--output-dir", metavar="DIR", type=Path, help="folder to write into (created if missing)")
    parser.add_argument(
        "--runbook-url-base",
        metavar="URL",
        help="where your copy of runbooks.md is served; each alert links URL#alertname "
        "(default: the thresholds' alerts.runbook_url)",
    )
    if checkout:
        parser.add_argument(
            "--checkout",
            action="store_true",
            help="write the checked-in files of the checkout this package was installed from (what `make generate` runs)",
        )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 with a diff when the files differ from what would be generated",
    )


def thresholds_for(args: argparse.Namespace, command: str) -> Thresholds | None:
    """The thresholds a generator renders, with ``--runbook-url-base`` applied; None, with the
    error on stderr, when they are invalid."""
    try:
        thresholds = load_thresholds(args.thresholds)
    except ThresholdsError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return None
    base = getattr(args, "runbook_url_base", None)
    if base is None:
        return thresholds
    try:
        return with_runbook_base(thresholds, base)
    except ValueError as exc:
        print(f"{command}: --runbook-url-base: {exc}", file=sys.stderr)
        return None


def with_runbook_base(thresholds: Thresholds, base: str) -> Thresholds:
    """``thresholds`` whose alerts link ``base#alertname``; ValueError unless ``base`` is an
    http(s) URL without an anchor."""
    if not isinstance(base, str) or not base.startswith(("http://", "https://")) or "#" in base:
        raise ValueError(f"expected an http(s) URL without #anchor, got {base!r}")
    return dataclasses.replace(thresholds, alerts=dataclasses.replace(thresholds.alerts, runbook_url=base))


def output_root(args: argparse.Namespace, command: str, checkout_root: Path = REPO_ROOT) -> Path | None:
    """Where a generator writes: ``--output-dir``, or the checkout with ``--checkout``; None, with
    the error on stderr, when neither (or both) is given, so nothing is ever written by surprise."""
    # --check alone reads the checked-in files: it writes nothing, so it is safe by default.
    checkout = getattr(args, "checkout", False) or (args.check and args.output_dir is None)
    if getattr(args, "checkout", False) and args.output_dir is not None:
        print(f"{command}: pass either --output-dir or --checkout, not both", file=sys.stderr)
        return None
    if checkout:
        if not (checkout_root / "README.md").is_file():
            print(f"{command}: no repository checkout at {checkout_root}; pass --output-dir DIR", file=sys.stderr)
            return None
        return checkout_root
    if args.output_dir is None:
        print(
            f"{command}: pass --output-dir DIR (the folder to write into; the repository's "
            "checked-in files: `make generate`)",
            file=sys.stderr,
        )
        return None
    return args.output_dir


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
                sys.stdout.writelines(
                    difflib.unified_diff(
                        current.splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        fromfile=f"{path} (checked in)",
                        tofile=f"{path} (generated)",
                    )
                )
        for path in stale:
            drift = True
            print(f"{path}: generated file no longer generated from the thresholds")
        if drift:
            print(
                f"{command}: generated files are out of date; rerun without --check to rewrite them "
                "(this repository's: `make generate`)",
                file=sys.stderr,
            )
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
