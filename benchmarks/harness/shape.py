"""Between a benchmark's own result document and the schema's records, both ways.

A benchmark builds its result as one nested document, shaped by what it measures (sizes, then
operations, then contenders). A ``Shape`` names the document's levels with templates: paths of
keys where each key is a literal (a wrapper such as ``sizes``, not recorded), ``{name}`` (any
key, recorded as the parameter ``name``) or ``{name=value}`` (only that key). A dict or list
found at a template's full path is one measurement set, one record: the path's parameters, the
node as its summary (a dict's ``samples`` list as its samples; with ``lists``, a list there is
the samples of a set whose repetitions record several figures each). Scalars
named in ``context`` (a model's size, a history's length) become parameters of every record
below the node that holds them, placed where they were found; whatever else a node holds beside
its measurement sets is a record of its own, with the node's parameters.

``unflatten`` puts the document back together from the records, so the tables are drawn from
the records by the same code that drew them from the documents, and the converter proves that
nothing of an old result is lost (``unflatten(flatten(doc)) == doc``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

Path = tuple[Any, ...]


class ShapeError(ValueError):
    """A document (or records) that its benchmark's shape cannot take apart or put together."""


def _segment(text: str) -> tuple[str | None, str | None]:
    """(parameter name, fixed key): a literal is (None, key); ``{name}`` (name, None)."""
    if text.startswith("{") and text.endswith("}"):
        name, eq, value = text[1:-1].partition("=")
        return name, (value if eq else None)
    return None, text


@dataclass(frozen=True)
class Shape:
    templates: tuple[tuple[str, ...], ...] = ()
    context: tuple[str, ...] = ()
    lists: bool = False                                  # a list at a template's end: that set's samples
    transform: Callable[[dict], dict] | None = None     # the benchmark's document -> the one flattened
    inverse: Callable[[dict], dict] | None = None       # and back
    parsed: tuple[tuple[tuple[str | None, str | None], ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parsed = tuple(tuple(_segment(s) for s in t) for t in self.templates)
        object.__setattr__(self, "parsed", parsed)
        names = {n for t in parsed for n, _ in t if n}
        if names & set(self.context):
            raise ShapeError(f"names both a level and a context: {sorted(names & set(self.context))}")

    # ------------------------------------------------------------ matching a path
    @staticmethod
    def _fits(template: tuple, path: Path) -> bool:
        if len(path) > len(template):
            return False
        for (name, fixed), key in zip(template, path):
            if fixed is not None and str(key) != fixed:
                return False
        return True

    def _following(self, path: Path, exact: bool) -> list[tuple]:
        return [t for t in self.parsed if self._fits(t, path) and (len(t) == len(path)) == exact]

    def name_at(self, path: Path, exact: bool = False) -> str | None:
        """The parameter the last key of ``path`` is recorded as (None: a literal wrapper), by the
        templates that end there (``exact``) or go on below it."""
        names = {t[len(path) - 1][0] for t in self._following(path, exact)}
        if len(names) != 1:
            raise ShapeError(f"{'/'.join(map(str, path))}: the templates disagree on its level ({names})")
        return names.pop()

    # ------------------------------------------------------------ document -> records
    def flatten(self, doc: dict) -> list[dict[str, Any]]:
        """The document's measurement sets: [{"parameters", "samples", "summary"}], in its order."""
        out: list[dict[str, Any]] = []
        self._walk(self.transform(doc) if self.transform else doc, (), {}, out)
        return out

    def _walk(self, node: dict, path: Path, params: dict, out: list) -> None:
        params = dict(params)
        own, children = {}, []
        for key, value in node.items():
            if key in self.context and not isinstance(value, (dict, list)):
                if path and self.name_at(path) is None:
                    raise ShapeError(f"{'/'.join(map(str, path))}: context {key!r} under a literal level")
                params[key] = value
                continue
            sub = path + (key,)
            if isinstance(value, dict) and self._following(sub, exact=False):
                children.append((self._walk, sub, value, False))
            elif (isinstance(value, dict) or self.lists and isinstance(value, list)) and self._following(sub, True):
                children.append((self._leaf, sub, value, True))
            else:
                own[key] = value
        if own:
            if path and self.name_at(path) is None:
                raise ShapeError(f"{'/'.join(map(str, path))}: values {sorted(own)} under a literal level")
            out.append({"parameters": params, "samples": None, "summary": own})
        for visit, sub, value, exact in children:
            name = self.name_at(sub, exact)
            visit(value, sub, {**params, name: sub[-1]} if name else params, out)

    @staticmethod
    def _leaf(value: Any, path: Path, params: dict, out: list) -> None:
        if isinstance(value, list):
            out.append({"parameters": params, "samples": value, "summary": None})
            return
        samples = value.get("samples") if isinstance(value.get("samples"), list) else None
        summary = {k: v for k, v in value.items() if not (k == "samples" and samples is not None)}
        out.append({"parameters": params, "samples": samples, "summary": summary})

    # ------------------------------------------------------------ records -> document
    def unflatten(self, records: list[dict[str, Any]]) -> dict:
        doc: dict = {}
        for rec in records:
            self._place(doc, rec)
        return self.inverse(doc) if self.inverse else doc

    def _path_of(self, params: dict) -> tuple[list, list[int], bool]:
        """The record's path (literal keys included), where each named parameter sits in it,
        and whether the path is a whole template (a measurement set) or a level's own values."""
        named = [(k, v) for k, v in params.items() if k not in self.context]
        for template in self.parsed:
            path, where = [], []
            for name, fixed in template:
                if len(where) == len(named):
                    break
                if name is None:
                    path.append(fixed)
                elif named[len(where)][0] == name and (fixed is None or str(named[len(where)][1]) == fixed):
                    where.append(len(path))
                    path.append(named[len(where) - 1][1])
                else:
                    break
            if len(where) == len(named):
                return path, where, len(path) == len(template)
        raise ShapeError(f"no template takes the parameters {list(params)}")

    def _place(self, doc: dict, rec: dict[str, Any]) -> None:
        params, summary, samples = rec["parameters"], rec["summary"], rec["samples"]
        path, where, leaf = self._path_of(params) if any(k not in self.context for k in params) else ([], [], False)
        seen = 0
        for key, value in params.items():                # a context value goes back where it was found
            if key in self.context:
                self._down(doc, path, where[seen - 1] + 1 if seen else 0)[key] = value
            else:
                seen += 1
        if leaf:
            value = samples if summary is None else {**summary, **({} if samples is None else {"samples": samples})}
            self._down(doc, path, len(path) - 1)[path[-1]] = value
        else:
            self._down(doc, path, len(path)).update(summary or {})

    @staticmethod
    def _down(doc: dict, path: list, depth: int) -> dict:
        node = doc
        for key in path[:depth]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ShapeError(f"{key!r} is both a measurement and a level")
        return node
