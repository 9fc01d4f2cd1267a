"""The README a newcomer reads in five minutes, and the docs/ it sends them to.

Every relative link of README.md, docs/*.md, deploy/README.md and SECURITY.md names a file or
folder of the repository, and every ``#anchor`` into a Markdown file names one of its headings;
the README stays short, keeps the two set-up commands, and links every document of docs/; every
setting of ``MonitorConfig`` is documented in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCUMENTS = [README, REPO / "SECURITY.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _prose(markdown: str) -> str:
    """``markdown`` without its fenced code blocks (a ``# comment`` there is no heading)."""
    return _FENCE.sub("", markdown)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown`` (lower case, punctuation but
    ``-`` and ``_`` dropped, spaces as ``-``)."""
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", _prose(markdown), flags=re.M)
    }


def relative_links(path: Path) -> list[str]:
    return [
        target
        for target in _LINK.findall(_prose(path.read_text(encoding="utf-8")))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)
    ]  # http:, https:, mailto:


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(document):
    broken = []
    for target in relative_links(document):
        file_part, _, anchor = target.partition("#")
        resolved = (document.parent / file_part).resolve() if file_part else document
        if not resolved.exists():
            broken.append(f"{target}: no such file")
            continue
        if REPO not in resolved.parents and resolved != REPO:
            broken.append(f"{target}: outside the repository")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, f"{document.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [gone](missing.md) [web](https://example.com)\n```\n[in code](not-a-link.md)\n```\n",
        encoding="utf-8",
    )
    assert relative_links(page) == ["#title", "missing.md"]
    assert github_anchors("## Sharded models: call `observe(model=...)`, never `if rank == 0:`\n") == {
        "sharded-models-call-observemodel-never-if-rank--0"
    }


def test_readme_is_short_and_keeps_the_two_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", text, flags=re.M), f"README.md lost `{command}`"
    assert "start_exporter(" in text and "monitor.observe(" in text


def test_readme_links_every_document_of_docs():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in relative_links(README)}
    missing = [
        p.relative_to(REPO).as_posix() for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked
    ]
    assert not missing, f"README.md does not link {missing} (the 'where everything else is documented' table)"


def test_every_monitor_setting_is_documented():
    from lossbeat import MonitorConfig

    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    missing = [f.name for f in dataclasses.fields(MonitorConfig) if f.name not in documented]
    assert not missing, f"docs/configuration.md does not document MonitorConfig.{missing}"


# A label that only an issue tracker or a review resolves ("issue N §n", "review Mn", "(Mn)"):
# the reason itself belongs beside the code, or in docs/decisions.md.
_LABEL = re.compile(r"issue [0-9]+|review [A-Z]?[0-9]+|\((M|C|m)[0-9]+\)", flags=re.I)
_DECISION_LINK = re.compile(r"docs/decisions\.md#([\w-]+)")


def _sources() -> list[Path]:
    """The code, tests, scripts, thresholds and deployment files the repository ships or runs
    (not the dated logs: benchmarks' notes and results, the changelog, the real logs' data)."""
    text = {".py", ".yaml", ".yml", ".sbatch", ".md", ".html", ".sh", ""}
    files = [p for top in ("exporter", "scripts", "deploy", ".ci") for p in (REPO / top).rglob("*")]
    files += [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").glob("*.py"), REPO / "Makefile"]
    return sorted(p for p in files if p.is_file() and p.suffix in text and "__pycache__" not in p.parts)


def test_no_reference_to_an_issue_or_review_label():
    found = [
        f"{path.relative_to(REPO).as_posix()}:{number}: {line.strip()}"
        for path in _sources()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _LABEL.search(line)
    ]
    assert not found, "say the reason, or link docs/decisions.md:\n" + "\n".join(found)


def test_every_link_into_the_decisions_names_an_entry():
    anchors = github_anchors((REPO / "docs" / "decisions.md").read_text(encoding="utf-8"))
    broken = [
        f"{path.relative_to(REPO).as_posix()}: #{anchor}"
        for path in _sources()
        for anchor in _DECISION_LINK.findall(path.read_text(encoding="utf-8"))
        if anchor not in anchors
    ]
    assert not broken, broken
