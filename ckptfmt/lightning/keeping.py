"""What the ``Checkpointing`` callback adds to Lightning's checkpoint directory, without Lightning
(spec/RUN.md §11.8): the run layer's retention over the checkpoint directories there (``prune``:
one ``Policy``, one ``plan``, the same guards; at a URL ``dirpath`` over its checkpoint prefixes,
each a one-generation run on the store), the rule the callback's session runs after each
commit; the ``.loss.json`` history, the signal flags and the mirror are the session's
(``run.session``).

>>> import tempfile
>>> prune(tempfile.mkdtemp(), Policy(keep_last=1))
[]
"""
from __future__ import annotations

import os
from typing import Iterable

from .. import fsio, kinds
from ..run import Run
from ..run.generations import manifest_of, non_finite
from ..run.retention import Policy, candidate_for, find_guards, guarded
from ..store import DIRECTORY
from . import files, stored

__all__ = ["Policy", "prune", "checkpoints"]


def checkpoints(dirpath: "str | os.PathLike[str]") -> list[tuple[str, Run]]:
    """The plugin's checkpoint directories in ``dirpath`` (not links: ``save_last="link"``), as
    one-generation runs, oldest step first; at a URL, its checkpoint prefixes (``stored``)."""
    if fsio.is_url(str(dirpath)):
        return _at_url(str(dirpath))
    found = []
    for name in sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []:
        path = os.path.join(dirpath, name)
        if name.startswith("."):
            continue                      # a save in flight (its temp directory) or ours being removed
        if not os.path.islink(path) and os.path.isdir(path) and kinds.generation_in(path) is not None:
            found.append((path, Run(path)))
    return sorted(found, key=lambda pr: (pr[1].generations()[-1].step, os.path.getmtime(pr[0])))


def _at_url(url: str) -> list[tuple[str, Run]]:
    """The folders under ``url`` whose newest committed generation is a Lightning checkpoint's,
    as one-generation runs on the store (``StoreRun``), oldest step first."""
    from ..run.storerun import StoreRun
    from ..store.objects import ObjectStore     # fsspec only when a URL is given
    folder, found = ObjectStore(url), []
    for entry in folder.entries():
        if entry.kind != DIRECTORY or entry.name.startswith("."):
            continue
        run = StoreRun(folder.under(entry.name))
        committed = [g for g in run.generations() if g.committed]
        if committed and stored.lightning(committed[-1].read_manifest()):
            found.append((folder.where(entry.name), run))
    return sorted(found, key=lambda pr: (pr[1].generations()[-1].step, pr[0]))


def _same(path: str) -> str:
    return path if fsio.is_url(path) else os.path.abspath(path)


def names(dirpath: "str | os.PathLike[str]") -> list[str]:
    """The names in ``dirpath``: a local directory's entries, a URL's objects and folders."""
    if fsio.is_url(str(dirpath)):
        from ..store.objects import ObjectStore     # fsspec only when a URL is given
        return [e.name for e in ObjectStore(str(dirpath)).entries()]
    return os.listdir(dirpath) if os.path.isdir(dirpath) else []


def prune(dirpath: "str | os.PathLike[str]", policy: Policy, *, keep: Iterable[str] = ()) -> list[str]:
    """Remove the checkpoint directories in ``dirpath`` that ``policy`` does not keep (RUN §5.1),
    under the guards of §5.2 and §5.4: the newest valid one (hashed first: verify before
    delete) and the newest valid finite one are kept, whatever the rules say; so is every path
    in ``keep`` (``last.ckpt``, ModelCheckpoint's best). Returns the removed paths."""
    found = checkpoints(dirpath)
    if not found or policy.keep_all:       # nothing to delete: nothing to hash
        return []
    newest = [run.generations()[-1] for _, run in found]
    judges = {id(gen): run.judge(deep=True) for gen, (_, run) in zip(newest, found)}   # hashed: verify before delete
    guards = find_guards(reversed(newest), check=lambda g: judges[id(g)](g), non_finite=non_finite)
    chosen = guarded(policy, [candidate_for(policy, g.step, lambda g=g: manifest_of(g)) for g in newest], guards)
    doomed, keep = set(chosen.doomed), {_same(p) for p in keep if p}
    removed = []
    for path, run in found:
        if run.generations()[-1].step in doomed and _same(path) not in keep:
            (stored.remove if fsio.is_url(path) else files.remove)(path)
            removed.append(path)
    return removed
