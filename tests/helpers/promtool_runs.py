"""Which generated promtool unit tests a test needs to run for its own thresholds.

``promtool test rules`` over the whole generated set costs about 25 s of CPU, and the suite
generates it for several thresholds files. A test file's outcome depends only on its own
document and on the rules it evaluates: the recording rules and the alerts it names (no
alert expression reads another alert). tests/test_rules.py runs the checked-in set under
alerting/; a file identical to its checked-in twin, evaluated against the same rules, would
give the same result, so the others run only the files their thresholds changed.
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "alerting"


def _load(path: Path, renames: dict[str, str]) -> dict:
    text = path.read_text(encoding="utf-8")
    for old, new in renames.items():
        text = text.replace(old, new)
    return yaml.safe_load(text)


def _runbook_page(rules_file: Path) -> str:
    """The page the set's runbook links lead to (each link is the page, then ``#alert``)."""
    for group in yaml.safe_load(rules_file.read_text(encoding="utf-8"))["groups"]:
        for rule in group["rules"]:
            if "runbook_url" in rule.get("annotations", {}):
                return rule["annotations"]["runbook_url"].partition("#")[0]
    raise AssertionError(f"no runbook_url in {rules_file}")


def _rules(rules_file: Path, renames: dict[str, str] | None = None) -> tuple[list, dict[str, list]]:
    """(the recording rules, in order; alert name -> its rules), with each rule's group."""
    recording, alerts = [], {}
    for group in _load(rules_file, renames or {})["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                recording.append((group["name"], rule))
            else:
                alerts.setdefault(rule["alert"], []).append((group["name"], rule))
    return recording, alerts


def _alert_names(document: dict) -> set[str]:
    return {case["alertname"] for test in document.get("tests", []) for case in test.get("alert_rule_test", [])}


def changed_rule_tests(out: Path, reference: Path = CHECKED_IN, runbook_page: str | None = None) -> list[str]:
    """The test files under ``out/tests`` (relative to ``out``, sorted) whose document or
    evaluated rules differ from their twin under ``reference``; every file when the
    recording rules differ. ``runbook_page``: where ``out``'s runbook links lead
    (``--runbook-url-base``), read as the reference's page: to promtool a link is a string,
    expected in the document as the rules write it, so renaming it in both changes no result."""
    renames = {f"{runbook_page}#": f"{_runbook_page(reference / 'rules.yml')}#"} if runbook_page else {}
    recording, alerts = _rules(out / "rules.yml", renames)
    ref_recording, ref_alerts = _rules(reference / "rules.yml")
    changed = []
    for path in sorted((out / "tests").glob("*.yml")):
        twin = reference / "tests" / path.name
        document = _load(path, renames)
        same = (
            recording == ref_recording
            and twin.is_file()
            and document == yaml.safe_load(twin.read_text(encoding="utf-8"))
            and all(alerts.get(name) == ref_alerts.get(name) for name in _alert_names(document))
        )
        if not same:
            changed.append(path.relative_to(out).as_posix())
    return changed
