"""mkdocs hooks of the docs site (mkdocs.yml ``hooks:``): the normative specs on the site, and
every section reference linked to its section.

spec/ holds the normative contracts (FORMAT.md, RUN.md, RELIABILITY.md) and stays where the code
cites it; a reference page holds a line ``<!-- spec: RUN -->`` that this hook replaces with the
file's text (its own title left out), so the site never holds a second copy to drift. Each
numbered section there gets an anchor, ``#sec-5.3`` for "5.3." and "## 5.", and every
``FORMAT §N`` / ``RUN §N`` on any page (spelt ``spec/RUN.md §N`` or ``RUN.md §N`` too, with the
``§M`` that follow it in a list, and inside a spec its bare ``§N``) becomes a link to that
anchor. A spec's link to a site page, written ``../docs/PAGE`` from spec/ (so that it works in
the repository too), is made relative to the reference page that shows it. A line
``<!-- errors table -->`` becomes the table of ``ckptfmt.errors``: each class, its base, the exit
code the command line gives it (from its ``could_not_run``), the first paragraph of its docstring
and its ``What to do:`` paragraph, so the page cannot drift from the code. Code (fenced or inline)
and text already inside a link are left as they are. A reference to a section that does not exist is a link to a missing anchor, which ``mkdocs build --strict``
refuses; tests/project/test_spec_references.py checks the same references in the code too.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"FORMAT": "reference/format.md", "RUN": "reference/run-directory.md",
         "RELIABILITY": "reference/reliability.md"}
INCLUDE = re.compile(r"^<!-- spec: (FORMAT|RUN|RELIABILITY) -->$", re.M)
ID = r"\d+(?:\.\d+)*"
NAMED = re.compile(r"(?<![\w/.-])((?:spec/)?(FORMAT|RUN)(?:\.md)?\s*§\s*(" + ID + r"))")
MORE = re.compile(r"^(\s*(?:,|and|or|-|to)\s*)(§\s*(" + ID + r"))")
BARE = re.compile(r"(?<![\w.])(§\s*(" + ID + r"))")
# a line that ends where a reference's section numbers begin on the next line: "RUN.md" or "§5,"
CARRY = re.compile(r"(?<![\w/.-])(?:spec/)?(FORMAT|RUN)(?:\.md)?(?:\s*§\s*" + ID
                   + r"(?:\s*(?:,|and|or|-|to)\s*§\s*" + ID + r")*\s*(?:,|and|or|-|to))?\s*$")
# what is left alone on a line: inline code, a link or an image (its text and its target)
OPAQUE = re.compile(r"(`+)[^`]*?\1|!?\[[^\]]*\]\([^)]*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
# a spec's link to a page of the site, written from spec/ (``](../docs/how-to/x.md)``, which works
# in the repository), as the reference page under docs/reference/ that shows the spec reaches it
SITE_LINK = re.compile(r"\]\(\.\./docs/")


def on_page_markdown(markdown, page, config, files):
    """The spec included where a page asks for it, then the section references linked."""
    own = next((doc for doc, uri in PAGES.items() if uri == page.file.src_uri), None)
    markdown = INCLUDE.sub(lambda m: spec_text(m.group(1)), markdown)
    markdown = markdown.replace("<!-- errors table -->", errors_table())
    return link_references(markdown, page.file.src_uri, own)


def spec_text(doc: str) -> str:
    """spec/DOC.md without its title line, each numbered section given its anchor."""
    lines = (ROOT / "spec" / f"{doc}.md").read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    out, fenced = [], False
    for line in lines:
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^## (\d+)\. .*$", line)):
            line = f"{line} {{ #sec-{m.group(1)} }}"
        elif not fenced and (m := re.match(r"^(\d+(?:\.\d+)+)\.\s", line)):
            line = f'<a id="sec-{m.group(1)}"></a>{line}'
        if not fenced:
            line = SITE_LINK.sub("](../", line)
        out.append(line)
    return "\n".join(out)


def errors_table() -> str:
    """Every class of ``ckptfmt.errors.__all__``: its base, its exit code, what it means."""
    import inspect

    from ckptfmt import errors

    rows = ["| class | is a | exit | what it means | what to do |", "|---|---|---|---|---|"]
    for name in errors.__all__:
        cls = getattr(errors, name)
        flag = inspect.getattr_static(cls, "could_not_run")
        code = ("1, or 2 when its cause is an OS error (a missing or read-only destination, a full disk)"
                if isinstance(flag, property) else "2" if flag else "1")
        base = cls.__mro__[1].__name__
        paragraphs = [cell(p) for p in (inspect.getdoc(cls) or "").split("\n\n")]
        advice = next((p.removeprefix("What to do: ") for p in paragraphs if p.startswith("What to do: ")), "")
        rows.append(f"| [`{name}`](api/errors.md#ckptfmt.errors.{name}) | `{base}` | {code} | {paragraphs[0]} "
                    f"| {advice[:1].upper()}{advice[1:]} |")
    return "\n".join(rows)


def cell(paragraph: str) -> str:
    """A docstring paragraph as one Markdown table cell."""
    return paragraph.replace("\n", " ").replace("|", "\\|")


def link_references(markdown: str, src_uri: str, own: str | None) -> str:
    out, fenced, carry = [], False, None
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        if fenced or FENCE.match(line):
            out.append(line)
            carry = None
            continue
        pieces, at = [], 0
        for m in OPAQUE.finditer(line):
            pieces.append(_link_text(line[at:m.start()], src_uri, own, carry if at == 0 else None))
            pieces.append(m.group(0))
            at = m.end()
        pieces.append(_link_text(line[at:], src_uri, own, carry if at == 0 else None))
        out.append("".join(pieces))
        carry = (m := CARRY.search(line)) and m.group(1)
    return "\n".join(out)


def _target(doc: str, section: str, src_uri: str) -> str:
    page = PAGES[doc]
    if page == src_uri:
        return f"#sec-{section}"
    return f"{posixpath.relpath(page, posixpath.dirname(src_uri) or '.')}#sec-{section}"


def _link_text(text: str, src_uri: str, own: str | None, carry: str | None) -> str:
    """The references in a stretch of plain text, linked; ``carry``: the document whose name
    ended the line before, which a ``§N`` at this stretch's start belongs to."""
    out, at = [], 0
    while True:
        named = NAMED.search(text, at)
        bare = BARE.search(text, at)
        lead = carry if bare and at == 0 and not text[:bare.start()].strip() else None
        if not (lead or own in ("FORMAT", "RUN")):
            bare = None
        if named and (not bare or named.start() <= bare.start()):
            m, doc, words, section = named, named.group(2), named.group(1), named.group(3)
        elif bare:
            m, doc, words, section = bare, lead or own, bare.group(1), bare.group(2)
        else:
            out.append(text[at:])
            return "".join(out)
        out.append(text[at:m.start()])
        out.append(f"[{words}]({_target(doc, section, src_uri)})")
        at = m.end()
        while more := MORE.match(text[at:]):
            out.append(more.group(1))
            out.append(f"[{more.group(2)}]({_target(doc, more.group(3), src_uri)})")
            at += more.end()
