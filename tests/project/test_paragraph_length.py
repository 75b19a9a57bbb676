"""No wall of text: each paragraph and list item of the README, the site's Markdown pages and
the specs stays short enough to read (the specs once held single paragraphs of 2,000 words; the
API pages' docstrings are not read here). A page that teaches (the README, tutorials, how-tos,
explanations, the glossary) keeps to 150 words a paragraph; the reference and the normative
specs, which state rules field by field, to 250; a benchmark page, whose method notes come from
the results, to 300. Code blocks, tables and HTML comments are not prose and are not counted."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCED = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
ITEM = re.compile(r"[ \t]*(?:[-*+]|\d+\.)[ \t]")


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph and list item: the lines between blank lines, a list
    split at each item's marker; code blocks, tables and HTML comments left out."""
    blank = lambda m: "\n" * m.group(0).count("\n")            # noqa: E731 (keeps line numbers)
    lines = re.sub(r"<!--.*?-->", blank, FENCED.sub(blank, text), flags=re.S).split("\n")
    found: list[tuple[int, list[str]]] = []
    fresh = True
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("|"):
            fresh = True
            continue
        if fresh or ITEM.match(line):
            found.append((number, []))
        found[-1][1].append(line)
        fresh = False
    return [(number, "\n".join(part)) for number, part in found]


def limit(path: Path) -> int:
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith(("spec/", "docs/reference/")):
        return 250
    if rel.startswith("docs/benchmarks/"):
        return 300
    return 150


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "spec").glob("*.md"))]


def walls_in(text: str, most: int) -> list[tuple[int, int]]:
    """(line, words) of each paragraph or list item over ``most`` words."""
    return [(line, len(item.split())) for line, item in paragraphs(text) if len(item.split()) > most]


def walls(path: Path, most: int) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {words} words (at most {most})"
            for line, words in walls_in(path.read_text(), most)]


def test_no_paragraph_or_list_item_is_a_wall_of_text():
    found = [wall for path in pages() for wall in walls(path, limit(path))]
    assert not found, "paragraphs to split (into shorter ones, a list or a table):\n" + "\n".join(found)


def test_a_wall_is_found_in_a_paragraph_and_in_a_list_item_but_not_in_code_or_a_table():
    """Not vacuous: a long paragraph and a long list item are found, with their lines; the same
    words in a code block, a table row or an HTML comment are not prose."""
    long = " ".join(["word"] * 40)
    text = (f"# Title\n\nshort one\n\n{long}\n\n- item one\n- {long}\n  {long}\n\n"
            f"```\n{long} {long}\n```\n\n| {long} {long} |\n\n<!-- {long} {long} -->\n")
    counts = [(line, len(item.split())) for line, item in paragraphs(text)]
    assert counts == [(1, 2), (3, 2), (5, 40), (7, 3), (8, 81)], counts
    assert walls_in(text, 50) == [(8, 81)]
