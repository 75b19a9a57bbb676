"""A generation written straight to a store (object storage; spec/RUN.md §2.0.2): the seed
writer's stream, sent instead of written to a local file, nothing staged on local disk.

The ``.bin`` goes up as one part (``Store.open_part``) while the writer's hashing thread
computes its blake3 and value facts over the bytes as sent, exactly as a local save does; the
companion (buffers, state tensors) as a second part; then ``store.commit`` confirms both on the
store by size and by the checksum the store computed (S3's ETag), else their blake3 read back, shows the run the sealed manifest
(``before_commit``: it records the root it commits) and writes the manifest last. A save that
fails or is refused removes what it sent: an upload never completed is never published, and a
part published before the failure goes again (what a kill leaves instead is an uncommitted
leftover, which readers skip and retention and ``gc`` remove).

>>> import tempfile, numpy as np
>>> from ckptfmt.store.local import LocalStore
>>> store = LocalStore(tempfile.mkdtemp())
>>> done = save(store, 5, np.ones(4, "<f4"), np.zeros(4, "<f4"), np.zeros(4, "<f4"))
>>> [e.name for e in store.entries()], done.size
(['step_000005.bin', 'step_000005.json'], 56)
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .. import companion, shards, writer
from .. import facts as valfacts
from .. import format as fmt
from .. import manifest as mf
from ..errors import RemoteError
from . import Store, Written, commit, confirm, put_manifest, written


def save(store: Store, step: int, weights: writer.Region, m: writer.Region, v: writer.Region, *,
         manifest: dict[str, Any] | None = None, n_params: int | None = None,
         extra_tensors: dict[str, Any] | None = None,
         before_commit: Callable[[dict[str, Any]], None] | None = None) -> writer.SaveResult:
    """``writer.save`` of generation ``step`` into ``store`` (its arguments and checks; value
    facts always recorded); its ``path`` and ``manifest_path`` are the parts as messages name
    them (the URL)."""
    started = time.perf_counter()
    where = store.where(fmt.checkpoint_name(step) if isinstance(step, int) and step >= 0 else "step.bin")
    step, n, sources = writer.prepare(where, step, weights, m, v, n_params, manifest)
    name, where = fmt.checkpoint_name(step), store.where(fmt.checkpoint_name(step))
    facts = valfacts.ValueFacts()
    parts: list[Written] = []
    data = b""
    try:
        with store.open_part(name) as out:
            digest = writer.stream_hashed(out, where, fmt.pack_header(step, n), sources, n, facts)
            out.commit()
        parts.append(written(name, out, digest))
        doc = {k: v for k, v in (manifest or {}).items() if k != valfacts.FIELD}
        doc[valfacts.FIELD] = facts.to_dict()
        if extra_tensors:
            extra = companion.path_for(name).name
            parts.append(store.write(extra, companion.pieces(step, extra_tensors)))
            doc[companion.FIELD] = {"file": extra, "size": parts[-1].size, "blake3": parts[-1].blake3}
        doc = mf.sealed(mf.build(file=name, size=fmt.file_size(n), step=step, n_params=n, digest=digest, extra=doc))
        data = mf.dumps(doc)
        commit(store, fmt.manifest_name(step), data, parts,
               before=None if before_commit is None else lambda: before_commit(doc))
    except BaseException as exc:
        remove_own(store, step, data, parts, exc)
        raise
    return writer.SaveResult(where, store.where(fmt.manifest_name(step)), step, n, fmt.file_size(n), digest,
                             time.perf_counter() - started, doc[valfacts.FIELD])


def save_shard(store: Store, step: int, rank: int, world: int, start: int, stop: int,
               weights: writer.Region, m: writer.Region, v: writer.Region) -> dict[str, Any]:
    """One rank's shard of a sharded generation (``shards.save_shard`` on a store): streamed up
    hashed, then confirmed by this rank (``store.confirm``), so rank 0 commits only
    parts every rank has confirmed; the manifest row (with the shard's value facts)."""
    file = shards.shard_name(rank, world)
    name = f"{fmt.stem(step)}{shards.SUFFIX}/{file}"
    where = store.where(name)
    step, n, sources = writer.prepare(where, step, weights, m, v, stop - start, None)
    facts = valfacts.ValueFacts()
    parts: list[Written] = []
    try:
        with store.open_part(name) as out:
            digest = writer.stream_hashed(out, where, fmt.pack_header(step, n), sources, n, facts)
            out.commit()
        parts.append(written(name, out, digest))
        confirm(store, parts)
    except BaseException as exc:
        remove_own(store, step, b"", parts, exc)
        raise
    return {"file": file, "rank": rank, "start": start, "stop": stop, "size": out.offset, "blake3": digest,
            valfacts.FIELD: facts.to_dict()}


def commit_shards(store: Store, step: int, rows: list[dict[str, Any]], manifest: dict[str, Any] | None = None,
                  before_commit: Callable[[dict[str, Any]], None] | None = None,
                  extra_tensors: dict[str, Any] | None = None) -> None:
    """Rank 0, once every rank confirmed its shard (``rows``): the companion (``extra_tensors``)
    sent and confirmed, then ``before_commit`` shown the sealed manifest, then the manifest."""
    doc = dict(manifest or {})
    if extra_tensors:
        name = f"{fmt.stem(step)}{companion.SUFFIX}"
        done = store.write(name, companion.pieces(step, extra_tensors))
        confirm(store, [done])
        doc[companion.FIELD] = {"file": name, "size": done.size, "blake3": done.blake3}
    doc = mf.sealed(shards.manifest_for("", step, rows, doc))
    if before_commit is not None:
        before_commit(doc)
    put_manifest(store, fmt.manifest_name(step), mf.dumps(doc))


def remove_own(store: Store, step: int, manifest: bytes, parts: "list[Written]",
               failed: BaseException | None = None) -> None:
    """What a failed save of ``step`` made, and only that: its manifest where the one there holds
    its bytes (a PUT whose reply was lost may have published it; removed first, so the rest is
    uncommitted at once), then each part whose upload it completed (``parts``) and that the store
    still says is the one it wrote (its checksum: S3's ETag). Nothing where the manifest there is
    another's: a writer whose lease was taken over while it stalled never removes what the new
    holder wrote (spec/RUN.md §4.1). Best effort: the error that failed the save is the one to
    report (what stays is an uncommitted leftover, which readers skip and the next writer
    sweeps). Not tried after a store that gave no answer in time (``RemoteError.unanswered``):
    each call would wait as long again."""
    if isinstance(failed, RemoteError) and failed.unanswered:
        return
    name = fmt.manifest_name(step)
    try:
        if store.size(name) is not None:
            if not manifest or store.read_bytes(name) != manifest:
                return
            store.remove(name)
        for part in parts:
            if part.checksum is None or store.stat(part.name)[1] == part.checksum:
                store.remove(part.name)
    except Exception:  # noqa: BLE001 (a cleanup while another error propagates)
        pass
