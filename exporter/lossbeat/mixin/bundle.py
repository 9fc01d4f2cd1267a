"""``lossbeat generate``: the whole monitoring set for one thresholds file, in one folder.

Everything a deployment needs, for the user's own numbers, from an installed package::

    DIR/rules.yml                                  Prometheus alert and recording rules
    DIR/rules-{shard,global}.yml                   the same in two stages (deploy/sharding/)
    DIR/tests/*.yml                                promtool unit tests of those rules
    DIR/alertmanager.yml                           routing: critical pages, warning tickets
    DIR/runbooks.md                                one section per alert (host it; see --runbook-url-base)
    DIR/grafana/lossbeat-{overview,layers,cluster}.json  the three Grafana dashboards
    DIR/kubernetes/prometheusrule.yaml             the rules as a PrometheusRule
    DIR/kubernetes/grafana-dashboards-configmap.yaml

It never writes into the package or the repository: ``--output-dir`` is required.
"""

from __future__ import annotations

import argparse
import sys

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.mixin import dashboards, rules
from lossbeat.mixin.generated import add_generator_arguments, shipped_text, sync_files, thresholds_for

__all__ = ["bundle_files", "add_arguments", "run"]


def bundle_files(thresholds: Thresholds) -> dict[str, str]:
    """Every file of the set, keyed by its path in the output folder."""
    files = {**rules.output_files(thresholds), **dashboards.output_files(thresholds)}
    for name in ("alertmanager.yml", "runbooks.md"):
        files[name] = shipped_text(name)
    return dict(sorted(files.items()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_generator_arguments(parser, checkout=False)


def run(args: argparse.Namespace) -> int:
    thresholds = thresholds_for(args, "lossbeat generate")
    if thresholds is None:
        return 2
    if args.output_dir is None:
        print("lossbeat generate: pass --output-dir DIR (the folder to write into)", file=sys.stderr)
        return 2
    files = {args.output_dir / path: text for path, text in bundle_files(thresholds).items()}
    code = sync_files(files, check=args.check, command="lossbeat generate")
    if code == 0 and not args.check:
        print(
            f"lossbeat generate: {len(files)} files in {args.output_dir} "
            f"(runbook links: {thresholds.alerts.runbook_url}#<alert>)"
        )
    return code
