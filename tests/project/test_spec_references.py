"""Every section reference resolves: ``FORMAT §N`` and ``RUN §N`` (spelt ``spec/FORMAT.md §N``,
``RUN.md §N`` or ``FORMAT §N``, with the ``§M`` that follow it in a list: ``RUN §2.0.2, §10.8``,
``RUN §1-§5``), ``spec §N`` (the format specification, as the core's code cites it) and, inside
spec/FORMAT.md and spec/RUN.md, a bare ``§N`` (that document's own section), in the library's
code and messages, docs/, README.md, spec/, the examples, the benchmarks and the scripts. A
section renumbered, or moved out of spec/ without its references, fails here naming the file,
the line and the reference."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ID = r"\d+(?:\.\d+)*"
LIST = r"((?:\s*(?:,|and|or|-|to)\s*§\s*" + ID + r")*)"
NAMED = re.compile(r"(?<![\w/.-])(?:spec/)?(FORMAT|RUN)(?:\.md)?\s*§\s*(" + ID + r")" + LIST)
SPEC = re.compile(r"(?<![\w/.-])spec\s*§\s*(" + ID + r")" + LIST)
BARE = re.compile(r"§\s*(" + ID + r")")


def sections(text: str) -> set[str]:
    """The sections a spec has: ``## 5. Title`` and paragraphs that begin ``5.9.`` / ``2.0.1.``."""
    return set(re.findall(r"^## (\d+)\. ", text, re.M)) | set(re.findall(r"^(\d+(?:\.\d+)+)\.\s", text, re.M))


def references(text: str, own: str | None = None) -> list[tuple[int, str, str, str]]:
    """(line, document, section, the reference as written) for each reference in ``text``;
    ``own``: the document whose bare ``§N`` the text holds (a spec's own sections)."""
    found, covered = [], []
    for pattern, doc in ((NAMED, None), (SPEC, "FORMAT")):
        for m in pattern.finditer(text):
            target = doc or m.group(1)
            first = m.group(2) if doc is None else m.group(1)
            rest = m.group(3) if doc is None else m.group(2)
            line = text.count("\n", 0, m.start()) + 1
            for section in [first, *re.findall(ID, rest)]:
                found.append((line, target, section, " ".join(m.group(0).split())))
            covered.append(m.span())
    if own:
        for m in BARE.finditer(text):
            if not any(a <= m.start() < b for a, b in covered):
                found.append((text.count("\n", 0, m.start()) + 1, own, m.group(1), m.group(0)))
    return found


def sources() -> list[Path]:
    globs = ("ckptfmt/**/*.py", "docs/**/*.md", "spec/*.md", "examples/*.py", "benchmarks/**/*.py",
             "benchmarks/**/*.md", "scripts/*")
    return [ROOT / "README.md", *(p for g in globs for p in sorted(ROOT.glob(g)) if p.is_file())]


def unresolved() -> tuple[int, list[str]]:
    have = {doc: sections((ROOT / "spec" / f"{doc}.md").read_text()) for doc in ("FORMAT", "RUN")}
    count, bad = 0, []
    for path in sources():
        own = path.stem if path.parent == ROOT / "spec" and path.stem in have else None
        for line, doc, section, written in references(path.read_text(), own):
            count += 1
            if section not in have[doc]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {written!r}: {doc} has no section {section}")
    return count, bad


def test_every_format_and_run_section_reference_resolves():
    count, bad = unresolved()
    assert count > 500, f"only {count} references found: the patterns no longer match how they are written"
    assert not bad, "\n".join(bad)


def test_a_reference_to_no_section_is_found_in_each_spelling():
    """Not vacuous: each spelling, a list's later members, a reference broken over a line, and a
    spec's bare reference to itself are read, and the ones naming no section are caught."""
    text = ("see spec/RUN.md §5.3 and FORMAT §4.7, §99.1; RUN.md\n§2.0.2 or RUN §1-§42; "
            "(spec §8.1); RFC 8878 §3.1.2 is not ours; FORMAT.md §5.9.2.")
    got = [(doc, section) for _, doc, section, _ in references(text)]
    assert got == [("RUN", "5.3"), ("FORMAT", "4.7"), ("FORMAT", "99.1"), ("RUN", "2.0.2"), ("RUN", "1"),
                   ("RUN", "42"), ("FORMAT", "5.9.2"), ("FORMAT", "8.1")], got
    have = {"FORMAT": sections((ROOT / "spec" / "FORMAT.md").read_text()),
            "RUN": sections((ROOT / "spec" / "RUN.md").read_text())}
    assert [(d, s) for d, s in got if s not in have[d]] == [("FORMAT", "99.1"), ("RUN", "42")]
    bare = references("the lock (§4) and the tiers (§13.9, §77)", own="RUN")
    assert [(d, s) for _, d, s, _ in bare] == [("RUN", "4"), ("RUN", "13.9"), ("RUN", "77")]


def test_the_format_spec_names_every_error_class():
    """FORMAT §7.2 lists one subclass per failure: every class of ``ckptfmt.errors.__all__`` is
    named there, so a class added to the code without the spec fails here."""
    from ckptfmt import errors
    text = (ROOT / "spec" / "FORMAT.md").read_text()
    listing = text[text.index("\n7.2. "):text.index("\n7.3. ")]
    missing = [name for name in errors.__all__ if name != "CheckpointError" and f"`{name}`" not in listing]
    assert not missing, f"spec/FORMAT.md §7.2 does not name: {missing}"
