"""The ``lossbeat`` command: one subcommand per module, imported only when used.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Iterable

__all__ = ["main"]

# name -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("lossbeat.demo", "train a small language model on CPU with the exporter live"),
    "rules": ("lossbeat.mixin.rules", "generate Prometheus alert and recording rules from the thresholds file"),
    "dashboards": ("lossbeat.mixin.dashboards", "generate the Grafana dashboards from the thresholds file"),
    "generate": (
        "lossbeat.mixin.bundle",
        "write rules, rule tests, Alertmanager config, runbooks and dashboards into a folder",
    ),
    "stack": ("lossbeat.stack.local", "start or stop a local Prometheus + Alertmanager on loopback"),
    "analyze": ("lossbeat.analyze", "diagnose a finished run from its log files"),
    "checklist": ("lossbeat.analyze.checklist", "the article's daily checklist for a live job or a finished log"),
    "watch": ("lossbeat.watch", "follow a live training log and serve it as a monitored run (no code change)"),
    "targets": ("lossbeat.exposition.registration", "list or prune the file_sd entries ranks registered themselves"),
}


def build_parser(commands: "Iterable[str] | None" = None) -> argparse.ArgumentParser:
    """The ``lossbeat`` parser. Only the subcommands in ``commands`` (all when None) import
    their module and take their arguments; the others are listed, for ``--help``. ``main``
    imports only the one it runs: ``lossbeat rules`` never pays for torch (``demo`` does)."""
    parser = argparse.ArgumentParser(prog="lossbeat", description="Training-health monitor for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = set(SUBCOMMANDS if commands is None else commands)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name not in wanted:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # not built yet in this checkout
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The subcommand is the first argument (the top-level parser has no option but --help).
    command = [argv[0]] if argv and argv[0] in SUBCOMMANDS else []
    # What follows a lone "--" is a command line a subcommand runs (``lossbeat watch LOG -- CMD ...``).
    argv, after = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = build_parser(command).parse_args(argv)
    args.command_line = after
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
