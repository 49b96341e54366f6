"""The user docs stay guides: none over 500 lines, no issue numbers (history lives in ``benchmarks/results/``
and the commit messages), and every relative link and anchor leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
MAX_LINES = 500
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+|(?<![\w/&])#\d{1,4}\b", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def name(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_a_user_doc_is_at_most_500_lines(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name(page)}: {lines} lines; split it by what a user looks for"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_a_user_doc_names_no_issue_number(page: Path) -> None:
    text = FENCE.sub("", page.read_text())
    found = sorted({m.group(0) for m in ISSUE_NUMBER.finditer(text)})
    assert not found, f"{name(page)} names {found}: say why in words; history goes to benchmarks/results/"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here (no network)
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        exists = linked.exists()
        if not exists or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{name(page)}: broken links {broken}"
