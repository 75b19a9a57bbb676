"""An audit fork into object storage (spec/RUN.md §6, §2.0.2): ``fork RUN URL --step S``.

The new run is written through the store's own write path, as a run written there by its
writer is: under the new run's writer lease (a prefix that holds anything already is refused),
each part of the generation streamed from its run (local or another store) with its blake3
computed as it is sent and compared with the one its manifest records (``Store.write``), the
history up to the step and the ``fork`` event with the root about to be committed written as a
segment (§3.7, §3.8), then every part confirmed on the store (``store.confirm``: its size and the
checksum the store computed, else its blake3 read back) and the manifest, with its provenance, written last (``store.commit``). A fork that fails removes what it
wrote, so the prefix is left as it was found.
"""
from __future__ import annotations

import time
from typing import Any

from .. import manifest as mf
from ..errors import DestinationExistsError
from ..generation import Generation, Part
from ..store import Store, Written, commit
from ..store.local import LocalStore
from . import history as hist
from . import roots, timeline
from .directory import Run
from .segments import DIRECTORY
from .storelock import PREFIX
from .storerun import StoreRun, open_run

CHUNK = 8 << 20        # bytes a part is read and sent in


def fork_to_store(run: Run, gen: Generation, url: str) -> dict[str, Any]:
    """Generation ``gen`` of ``run`` (judged valid by the caller, leased) as the first
    generation of a new run at ``url``, with the history up to its step and its provenance."""
    dest = open_run(url, create=True)                  # a mirror's destination is refused
    held = dest.writer_lock("fork")
    try:
        if any(not e.name.startswith(PREFIX) for e in dest.store.entries()):
            raise DestinationExistsError(dest.where, "holds objects already; refusing to fork into it")
        try:
            return _write(run, gen, dest)
        except BaseException:
            for name, recursive in ((gen.manifest.name, False), *((p.name, False) for p in gen.parts(manifest=False)),
                                    (DIRECTORY, True)):
                dest.store.remove(name, recursive=recursive)
            raise
    finally:
        held.release()


def _write(run: Run, gen: Generation, dest: StoreRun) -> dict[str, Any]:
    doc = gen.read_manifest()
    source = gen.store or LocalStore(gen.payload.parent)
    sent = [_send(source, dest.store, part) for part in gen.parts(doc, manifest=False)]
    doc["provenance"] = {"parent_run": run.origin, "parent_step": gen.step,
                         "parent_blake3": doc["blake3"], "forked_at": time.time()}
    sealed = mf.sealed(doc)
    upto = 0
    for rec in timeline.canonical(run.history.source):     # the canonical records of steps <= step
        if rec["step"] > gen.step:
            break
        dest.history.append(hist.strict(rec))
        upto += 1
    dest.history.event("fork", gen.step, parent_run=run.origin, root=roots.of(sealed))
    dest.history.sync()                                    # the root recorded before the commit (§3.7)
    commit(dest.store, gen.manifest.name, mf.dumps(sealed), sent)
    return {"dest": dest.where, "step": gen.step, "blake3": doc["blake3"], "history_records": upto}


def _send(source: Store, store: Store, part: Part) -> Written:
    """One part streamed from ``source`` to ``store``, refused unless it hashes to its recorded blake3."""
    size = source.size(part.name) or 0
    chunks = (source.read_range(part.name, start, min(start + CHUNK, size)) for start in range(0, size, CHUNK))
    return store.write(part.name, chunks, expected=part.blake3)
