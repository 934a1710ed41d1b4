"""README and docs/: every relative link resolves, anchors included; the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 250
# Files that code and other docs cite by name: they must exist.
REQUIRED_DOCS = (
    "configuration.md",
    "events.md",
    "routing.md",
    "worker.md",
    "admin-api.md",
    "envoy.md",
    "performance.md",
    "troubleshooting.md",
    "COMPOSE.md",
    "LOADTEST.md",
)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The Markdown without fenced blocks and code spans (links there are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(_prose(text))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = 0
        while (candidate := slug if n == 0 else f"{slug}-{n}") in out:
            n += 1
        out.add(candidate)
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Relative links in ``path`` whose file, or anchor in it, does not exist."""
    text = path.read_text(encoding="utf-8")
    broken = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(root)}")
        elif (
            anchor
            and dest.suffix == ".md"
            and anchor not in anchors(dest.read_text(encoding="utf-8"))
        ):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


def test_the_checker_finds_what_it_should(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## The `x_y` rule: exact\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#the-x_y-rule-exact) [ok](#here) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](a.md#nowhere) ![img](pic.png)\n"
        "`[not a link](nope.md)`\n```\n[nor this](nope2.md)\n```\n## Here\n",
        encoding="utf-8",
    )
    found = broken_links(page, tmp_path)
    assert [f.split(":")[0] for f in found] == ["missing.md", "a.md#nowhere", "pic.png"]


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_readme_is_the_front_door() -> None:
    text = README.read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to docs/"
    assert "`make test`" in text and "`make demo`" in text
    linked = {Path(t.partition("#")[0]).name for t in links(text)}
    missing = [name for name in REQUIRED_DOCS if name not in linked]
    assert missing == [], f"README.md does not link {missing}"


def test_cited_docs_exist() -> None:
    assert [n for n in REQUIRED_DOCS if not (ROOT / "docs" / n).is_file()] == []
