"""The small language of the promtool rule tests: input series, expected alerts, scenarios, and a
builder that derives test values and durations from the thresholds (see :mod:`lossbeat.mixin.rule_tests`).

Each alert gets a bad series (it fires, with the exact labels and annotations),
a healthy series and a series just inside the threshold (both silent). Test
values derive from the thresholds (e.g. explosion * 1.5 and * 0.99), so a
threshold change regenerates tests that still hold.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from lossbeat.diagnosis.thresholds import Thresholds
from lossbeat.mixin.alert_rules import AlertRule, alert_rules, duration_seconds, number

__all__ = ["Series", "Expect", "Scenario", "render_template", "run", "ramp"]

JOB, INSTANCE = "train", "127.0.0.1:8470"
OTHER_INSTANCE = "gpu-b:8470"  # a concurrent run under the same job label


def _target(rank: str = "0", instance: str = INSTANCE, **extra: str) -> dict[str, str]:
    return {"job": JOB, "instance": instance, "rank": rank, **extra}


def _fmt(value: float) -> str:
    return "NaN" if math.isnan(value) else number(value)


def run(value: float, samples: int) -> str:
    """``samples`` samples of ``value`` in promtool's expanding notation."""
    return f"{_fmt(value)}+0x{samples - 1}"


def ramp(start: float, step: float, samples: int) -> str:
    """``samples`` samples from ``start``, changing by ``step`` each interval."""
    return f"{_fmt(start)}{'-' if step < 0 else '+'}{_fmt(abs(step))}x{samples - 1}"


@dataclass
class Series:
    metric: str
    labels: dict[str, str]
    values: list[str]
    """Runs in promtool notation (see :func:`run`, :func:`ramp`, ``"stale"``)."""

    def to_doc(self) -> dict:
        body = ",".join(f'{k}="{v}"' for k, v in self.labels.items())
        return {"series": f"{self.metric}{{{body}}}", "values": " ".join(self.values)}


@dataclass
class Expect:
    rule: AlertRule
    labels: dict[str, str]
    """Labels of the expression's result, before the rule's labels."""
    value: float


@dataclass
class Scenario:
    name: str
    series: list[Series]
    checks: list[tuple[float, str, list[Expect]]] = field(default_factory=list)
    """(eval time in seconds, alert name, the alerts expected to fire)."""


_LABEL = re.compile(r"\{\{ \$labels\.(\w+) \}\}")
_VALUE = re.compile(r'\{\{ \$value \| printf "(%[.0-9]*[fge])" \}\}')


def render_template(template: str, labels: dict[str, str], value: float) -> str:
    """Render the subset of Go templating the alert annotations use, as Prometheus does."""

    def value_text(match: re.Match) -> str:
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return match.group(1) % value

    text = _VALUE.sub(value_text, _LABEL.sub(lambda m: labels.get(m.group(1), ""), template))
    if "{{" in text:
        raise ValueError(f"template: unsupported construct left in {text!r}")
    return text


def _expected(expect: Expect, runbook_base: str) -> dict:
    """promtool's ``exp_alerts`` entry: the rule's own labels and annotations, rendered."""
    rule = expect.rule.to_rule(runbook_base)
    # Prometheus drops labels with empty values (a total loss's component="").
    labels = {k: v for k, v in {**expect.labels, **rule["labels"]}.items() if v != ""}
    annotations = {k: render_template(v, labels, expect.value) for k, v in rule["annotations"].items()}
    return {"exp_labels": labels, "exp_annotations": annotations}


class _Builder:
    """Scenario helpers bound to the thresholds and the test interval."""

    def __init__(self, t: Thresholds, interval: int):
        self.t = t
        self.i = interval
        self.rules = alert_rules(t)

    def rule(self, name: str, **labels: str) -> AlertRule:
        for rule in self.rules:
            if rule.name == name and all(rule.labels.get(k) == v for k, v in labels.items()):
                return rule
        raise KeyError(f"alert {name} with labels {labels}")

    def steps(self, duration: str) -> int:
        return int(duration_seconds(duration) // self.i)

    def hold(self, metric: str, labels: dict, value: float, samples: int) -> Series:
        return Series(metric, labels, [run(value, samples)])

    def jump(self, metric: str, labels: dict, window: str, to: float, after: int = 8) -> tuple[Series, float]:
        """A counter flat at 0 for a full window, then at ``to``; and the eval time
        at which ``increase(...[window])`` is exactly ``to``."""
        n = self.steps(window)
        series = Series(metric, labels, [run(0, n + 1), run(to, after)])
        return series, (n + 1) * self.i

    def after_for(self, duration: str, start: float = 0) -> float:
        return start + duration_seconds(duration) + self.i

    def first_scrape(
        self, metric: str, labels: dict, value: float, window: str, absent: int = 3
    ) -> tuple[Series, float, float]:
        """A counter whose first sample, after ``absent`` intervals, is already ``value``
        (events before the first scrape); the first eval time and the last one inside ``window``."""
        n = self.steps(window)
        series = Series(metric, labels, [f"_x{absent}", run(value, n + 4)])
        first = absent * self.i
        return series, first, first + (n - 1) * self.i
