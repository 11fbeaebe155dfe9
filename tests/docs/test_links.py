"""The README and the pages under docs/: every relative link reaches a file that exists, and every
``#anchor`` a heading of that file (GitHub's anchors); the README opens with its two set-up commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks, inline code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``: lower case, punctuation dropped, spaces as
    hyphens, ``-1``, ``-2``... for repeats."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for line in prose(path.read_text(encoding="utf-8")) for m in LINK.finditer(line)]


def test_the_slugs_are_githubs() -> None:
    assert "quick-start-the-seeds-first-tool-exactly" in anchors(REPO / "README.md")
    assert "httpsse-api" in anchors(REPO / "README.md")
    assert "mcp-over-http-mcp" in anchors(REPO / "docs" / "http-and-mcp.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    found = links(page)
    assert found or page.name == "ARCHITECTURE.md", f"{page.name}: no links found (is the pattern broken?)"
    broken = []
    for target in found:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_the_readme_links_every_docs_page() -> None:
    linked = {
        (REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md") if t.startswith("docs/")
    }
    assert set(PAGES[1:]) <= linked


def test_the_readme_opens_with_its_two_set_up_commands() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first is not None and text.index("```sh") < text.index("\n## ")
    commands = [
        line.split("#")[0].strip() for line in first.group(1).splitlines() if line.split("#")[0].strip()
    ]
    assert commands == ["make demo", "make test"]


def test_the_readmes_contents_list_every_section() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    contents = text[text.index("## Contents") : text.index("\n## ", text.index("## Contents") + 1)]
    listed = {m.group(1) for m in re.finditer(r"\]\(#([^)]+)\)", contents)}
    sections = {a for a in anchors(REPO / "README.md") if a not in ("hermes-gateway", "contents")}
    top = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^## (.*)$", text, re.M)
    }
    assert top - {"contents"} <= listed <= sections
