"""The command-line docs match the commands: docs/cli.md is every ``--help``, and the pages that
teach a command name each of its flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from lossbeat.cli import build_parser, reference_markdown

REPO = Path(__file__).resolve().parents[1]

PAGES = {
    "analyze": "docs/analyze.md",
    "watch": "docs/watch.md",
    "checklist": "docs/diagnosis.md",
    "stack": "docs/alerting.md",
    "generate": "docs/alerting.md",
    "rules": "docs/alerting.md",
    "dashboards": "docs/alerting.md",
    "demo": "docs/demo.md",
}
"""The page that teaches each command (docs/cli.md holds them all)."""


def options(command: str) -> list[str]:
    parser = build_parser([command])
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [
        flag
        for action in sub.choices[command]._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    ]


def test_the_reference_page_is_the_commands_help():
    assert (REPO / "docs/cli.md").read_text(encoding="utf-8") == reference_markdown(), (
        "docs/cli.md is out of date: run `make generate`"
    )


@pytest.mark.parametrize("command", sorted(PAGES))
def test_the_commands_page_names_every_flag(command):
    page = (REPO / PAGES[command]).read_text(encoding="utf-8")
    missing = [flag for flag in options(command) if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", page)]
    assert missing == [], f"{PAGES[command]} does not mention {missing} of `lossbeat {command}`"


def test_the_version_flag_prints_the_package_version(capsys):
    from lossbeat import __version__

    with pytest.raises(SystemExit) as exit_:
        build_parser([]).parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"lossbeat {__version__}"
