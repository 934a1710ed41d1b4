"""README and docs/: every relative link resolves, anchors included; the README stays short."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

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


# --- figures quoted from a results file --------------------------------------------------------
#
# A figure quoted in docs/ comes from a results file committed from the same run. Where the
# quote is mechanical, the doc marks it and these tests hold it to the file:
#
#   <!-- rows from F.md -->    the table below: every line is a line of docs/F.md
#   <!-- lines from F.md -->   the lines below, up to a blank line: each a line of docs/F.md
#   <!-- slo goodput per phase from F.json -->   the table below: per mode (first cell, bold,
#       "(...)" and trailing words after the mode's name aside), SLO goodput per phase at the
#       cells' decimals, and "w of n" judged windows within target, as in docs/F.json

_MARK = re.compile(r"^<!-- (rows|lines|slo goodput per phase) from ([\w.-]+) -->$", re.MULTILINE)
# Docs whose figures are held to their results files this way, and the marks each must keep
# (a mark deleted would silently stop the check).
QUOTING = {
    "performance.md": {("rows", "overload-results.md"), ("lines", "overload-results.md"),
                       ("rows", "bench-results.md"), ("lines", "bench-results.md"),
                       ("rows", "events-results.md"), ("lines", "events-results.md"),
                       ("lines", "storm-results.md"), ("rows", "stream-results.md")},
    "request-path.md": {("rows", "bench-results.md"), ("lines", "bench-results.md"),
                        ("rows", "bench-exact-results.md")},
    "transport.md": {("rows", "storm-results.md"), ("lines", "storm-results.md")},
    "replicas.md": {("rows", "replicas-results.md"), ("lines", "replicas-results.md")},
    "LOADTEST.md": {("rows", "overload-results.md"), ("lines", "overload-results.md"),
                    ("rows", "overload-llamacpp-results.md")},
    "classes.md": {("rows", "classes-results.md"), ("lines", "classes-results.md")},
    "worker.md": {("rows", "kv-lag-results.md"), ("lines", "kv-lag-results.md")},
    "vllm.md": {("rows", "vllm-dtype-results.md")},
    "latency-target.md": {("slo goodput per phase", "slo-results.json"),
                          ("lines", "slo-results.md"), ("rows", "slo-results.md"),
                          ("slo goodput per phase", "slo-earlier15-results.json"),
                          ("lines", "slo-earlier15-results.md"),
                          ("rows", "slo-earlier15-results.md"),
                          ("slo goodput per phase", "slo-earlier14-results.json"),
                          ("lines", "slo-earlier14-results.md"),
                          ("rows", "slo-earlier14-results.md"),
                          ("slo goodput per phase", "slo-earlier13-results.json"),
                          ("lines", "slo-earlier13-results.md"),
                          ("rows", "slo-earlier13-results.md"),
                          ("slo goodput per phase", "slo-earlier12-results.json"),
                          ("lines", "slo-earlier12-results.md"),
                          ("rows", "slo-earlier12-results.md"),
                          ("slo goodput per phase", "slo-earlier11-results.json"),
                          ("lines", "slo-earlier11-results.md"),
                          ("rows", "slo-earlier11-results.md"),
                          ("slo goodput per phase", "slo-unbalanced-results.json"),
                          ("lines", "slo-unbalanced-results.md"),
                          ("rows", "slo-unbalanced-results.md"),
                          ("slo goodput per phase", "slo-earlier10-results.json"),
                          ("lines", "slo-earlier10-results.md"),
                          ("rows", "slo-earlier10-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier17-results.json"),
                          ("lines", "slo-llamacpp-earlier17-results.md"),
                          ("rows", "slo-llamacpp-earlier17-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier16-results.json"),
                          ("lines", "slo-llamacpp-earlier16-results.md"),
                          ("rows", "slo-llamacpp-earlier16-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier15-results.json"),
                          ("lines", "slo-llamacpp-earlier15-results.md"),
                          ("rows", "slo-llamacpp-earlier15-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier14-results.json"),
                          ("lines", "slo-llamacpp-earlier14-results.md"),
                          ("rows", "slo-llamacpp-earlier14-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier13-results.json"),
                          ("lines", "slo-llamacpp-earlier13-results.md"),
                          ("rows", "slo-llamacpp-earlier13-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier12-results.json"),
                          ("lines", "slo-llamacpp-earlier12-results.md"),
                          ("rows", "slo-llamacpp-earlier12-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier15-results.json"),
                          ("lines", "slo-vllm-earlier15-results.md"),
                          ("rows", "slo-vllm-earlier15-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier14-results.json"),
                          ("lines", "slo-vllm-earlier14-results.md"),
                          ("rows", "slo-vllm-earlier14-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier13-results.json"),
                          ("lines", "slo-vllm-earlier13-results.md"),
                          ("rows", "slo-vllm-earlier13-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier12-results.json"),
                          ("lines", "slo-vllm-earlier12-results.md"),
                          ("rows", "slo-vllm-earlier12-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier11-results.json"),
                          ("lines", "slo-vllm-earlier11-results.md"),
                          ("rows", "slo-vllm-earlier11-results.md"),
                          ("slo goodput per phase", "slo-earlier9-results.json"),
                          ("lines", "slo-earlier9-results.md"),
                          ("rows", "slo-earlier9-results.md"),
                          ("slo goodput per phase", "slo-earlier8-results.json"),
                          ("lines", "slo-earlier8-results.md"),
                          ("rows", "slo-earlier8-results.md"),
                          ("slo goodput per phase", "slo-earlier7-results.json"),
                          ("lines", "slo-earlier7-results.md"),
                          ("rows", "slo-earlier7-results.md"),
                          ("slo goodput per phase", "slo-earlier6-results.json"),
                          ("lines", "slo-earlier6-results.md"),
                          ("rows", "slo-earlier6-results.md"),
                          ("slo goodput per phase", "slo-earlier5-results.json"),
                          ("lines", "slo-earlier5-results.md"),
                          ("rows", "slo-earlier5-results.md"),
                          ("slo goodput per phase", "slo-earlier4-results.json"),
                          ("lines", "slo-earlier4-results.md"),
                          ("rows", "slo-earlier4-results.md"),
                          ("slo goodput per phase", "slo-earlier3-results.json"),
                          ("lines", "slo-earlier3-results.md"),
                          ("slo goodput per phase", "slo-earlier1-results.json"),
                          ("lines", "slo-earlier1-results.md"),
                          ("slo goodput per phase", "slo-vllm-results.json"),
                          ("lines", "slo-vllm-results.md"),
                          ("rows", "slo-vllm-results.md"),
                          ("slo goodput per phase", "slo-waitpace-results.json"),
                          ("lines", "slo-waitpace-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-waitpace-results.json"),
                          ("lines", "slo-llamacpp-waitpace-results.md"),
                          ("slo goodput per phase", "slo-vllm-waitpace-results.json"),
                          ("lines", "slo-vllm-waitpace-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier10-results.json"),
                          ("lines", "slo-vllm-earlier10-results.md"),
                          ("rows", "slo-vllm-earlier10-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier9-results.json"),
                          ("lines", "slo-vllm-earlier9-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier8-results.json"),
                          ("lines", "slo-vllm-earlier8-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier7-results.json"),
                          ("lines", "slo-vllm-earlier7-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier6-results.json"),
                          ("lines", "slo-vllm-earlier6-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier5-results.json"),
                          ("lines", "slo-vllm-earlier5-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier4-results.json"),
                          ("lines", "slo-vllm-earlier4-results.md"),
                          ("slo goodput per phase", "slo-vllm-seed2-results.json"),
                          ("lines", "slo-vllm-seed2-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier3-results.json"),
                          ("lines", "slo-vllm-earlier3-results.md"),
                          ("slo goodput per phase", "slo-vllm-earlier1-results.json"),
                          ("slo goodput per phase", "slo-vllm-earlier2-results.json"),
                          ("slo goodput per phase", "slo-vllm-450ms-results.json"),
                          ("lines", "slo-vllm-450ms-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-results.json"),
                          ("lines", "slo-llamacpp-results.md"),
                          ("rows", "slo-llamacpp-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier11-results.json"),
                          ("lines", "slo-llamacpp-earlier11-results.md"),
                          ("rows", "slo-llamacpp-earlier11-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier10-results.json"),
                          ("lines", "slo-llamacpp-earlier10-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier9-results.json"),
                          ("lines", "slo-llamacpp-earlier9-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier8-results.json"),
                          ("lines", "slo-llamacpp-earlier8-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier7-results.json"),
                          ("lines", "slo-llamacpp-earlier7-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier6-results.json"),
                          ("lines", "slo-llamacpp-earlier6-results.md"),
                          ("rows", "slo-llamacpp-earlier6-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier5-results.json"),
                          ("lines", "slo-llamacpp-earlier5-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier3-results.json"),
                          ("lines", "slo-llamacpp-earlier3-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier4-results.json"),
                          ("lines", "slo-llamacpp-earlier4-results.md"),
                          ("slo goodput per phase", "slo-llamacpp-earlier1-results.json"),
                          ("slo goodput per phase", "slo-llamacpp-earlier2-results.json"),
                          ("lines", "slo-llamacpp-earlier2-results.md")},
}  # fmt: skip


def quoted_blocks(text: str) -> list[tuple[str, str, list[str]]]:
    """(kind, results file, the block's lines) for every mark in ``text``."""
    out = []
    for m in _MARK.finditer(text):
        lines = []
        for line in text[m.end() :].lstrip("\n").splitlines():
            if not line.strip() or (m.group(1) != "lines" and not line.startswith("|")):
                break
            lines.append(line)
        out.append((m.group(1), m.group(2), lines))
    return out


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def slo_table_errors(lines: list[str], results: dict[str, Any]) -> list[str]:
    """Where a per-phase SLO goodput table differs from the results JSON."""
    modes = {m["mode"]["name"]: m for m in results["modes"]}
    errors = []
    for row in lines[2:]:
        cells = _cells(row)
        label = re.sub(r"\s*\(.*?\)", "", cells[0].replace("**", "")).strip()
        mode = modes.get(label)
        if mode is None:
            errors.append(f"{cells[0]!r}: no mode {label!r} in {sorted(modes)}")
            continue
        phases = mode["phases"]
        if len(cells) != len(phases) + 2:
            errors.append(f"{label}: {len(cells) - 2} phase cells for {len(phases)} phases")
            continue
        for cell, phase in zip(cells[1:-1], phases, strict=True):
            decimals = len(cell.partition(".")[2])
            want = f"{phase['slo_goodput_rps']:.{decimals}f}"
            if cell != want:
                errors.append(f"{label}, {phase['load']:g}x: {cell} in the doc, {want} in the file")
        within = sum(p["windows_within"] for p in phases)
        judged = sum(p["windows_judged"] for p in phases)
        if cells[-1].replace("**", "") != f"{within} of {judged}":
            errors.append(f"{label}: windows {cells[-1]} in the doc, {within} of {judged}")
    return errors


def quote_errors(doc: Path) -> list[str]:
    """Every mismatch between the marked quotes of ``doc`` and their results files."""
    errors = []
    for kind, name, lines in quoted_blocks(doc.read_text(encoding="utf-8")):
        source = doc.parent / name
        if not source.is_file():
            errors.append(f"{kind} from {name}: no such file")
            continue
        if not lines:
            errors.append(f"{kind} from {name}: nothing quoted under the mark")
        elif kind == "slo goodput per phase":
            errors += [
                f"{name}: {e}" for e in slo_table_errors(lines, json.loads(source.read_text()))
            ]
        else:
            have = set(source.read_text(encoding="utf-8").splitlines())
            errors += [f"{name} has no line {line!r}" for line in lines if line not in have]
    return errors


@pytest.mark.parametrize("name", sorted(QUOTING))
def test_quoted_figures_are_those_of_the_results_file(name: str) -> None:
    doc = ROOT / "docs" / name
    marks = {(kind, src) for kind, src, _ in quoted_blocks(doc.read_text(encoding="utf-8"))}
    assert QUOTING[name] <= marks, f"{name} lost its marks {QUOTING[name] - marks}"
    assert quote_errors(doc) == []


def test_the_quote_checker_finds_what_it_should(tmp_path: Path) -> None:
    (tmp_path / "r.md").write_text("| a | b |\n|---|---|\n| 1 | 2 |\n- x: 0.50 s: met\n")
    (tmp_path / "r.json").write_text(json.dumps({"modes": [{
        "mode": {"name": "target"},
        "phases": [{"load": 1, "slo_goodput_rps": 7.6, "windows_within": 1, "windows_judged": 2},
                   {"load": 3, "slo_goodput_rps": 9.43, "windows_within": 3, "windows_judged": 3}],
    }]}))  # fmt: skip
    good = tmp_path / "good.md"
    good.write_text(
        "<!-- rows from r.md -->\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "<!-- lines from r.md -->\n- x: 0.50 s: met\n\n"
        "<!-- slo goodput per phase from r.json -->\n| mode | 1x | 3x | w |\n|---|---|---|---|\n"
        "| **target** (ceiling) | 7.6 | 9.43 | 4 of 5 |\n"
    )
    assert quote_errors(good) == []
    bad = tmp_path / "bad.md"
    bad.write_text(
        "<!-- rows from r.md -->\n| a | b |\n|---|---|\n| 1 | 3 |\n\n"
        "<!-- lines from r.md -->\n- x: 0.40 s: met\n\n"
        "<!-- slo goodput per phase from r.json -->\n| mode | 1x | 3x | w |\n|---|---|---|---|\n"
        "| target | 7.6 | 9.5 | 4 of 4 |\n| shipped | 1 | 2 | 0 of 0 |\n\n"
        "<!-- rows from gone.md -->\n| x |\n"
    )
    assert len(quote_errors(bad)) == 6, quote_errors(bad)
