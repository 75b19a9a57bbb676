"""``validate``, ``ls`` and ``inspect`` of a run at a URL (spec/RUN.md §10.9), through ranged
reads: ``inspect`` reads only the 8-byte header and the manifest; ``validate`` reads every
committed object back and compares its blake3 with the manifest (``deep=False``: headers and
sizes only). Returns data; the CLI prints it.

A URL that holds no generation itself but folders that do is a Lightning ModelCheckpoint
dirpath the ckptfmt plugin wrote to (spec/RUN.md §11.10): each checkpoint (``step=10.ckpt/``)
is validated, or listed, as a run of one generation, as a local ModelCheckpoint directory is.
"""
from __future__ import annotations

import errno
import io
import json
from typing import Any

from .. import format as fmt
from ..errors import CheckpointError, RemoteError, UnsupportedKindError
from ..run.mirror import INDEX, SIDECARS
from ..generation import Generation, by_step
from ..run import history as hist
from ..run import roots
from ..run.segments import SegmentedHistory
from ..run.storelock import holder
from ..run.storerun import generation_url, refuse_generation_url
from ..store import DIRECTORY
from ..store.objects import ObjectStore
from ..store.connect import redact
from .report import LOST_PAYLOAD

__all__ = ["check_mirrors", "checkpoint_names", "inspect_url", "ls_url", "validate_url"]


def ls_url(url: str) -> dict[str, Any]:
    """The generations at ``url`` from one listing: step, committed, size of the payload (at a
    ModelCheckpoint dirpath: each checkpoint's, named in its status); and ``tiers`` ``memory``,
    the RAM tier of a run written there with one (spec/RUN.md §13)."""
    from ..run.ops import memory_tier           # lazy: the run layer's view of the RAM tier
    from ..run.storerun import StoreRun
    refuse_generation_url(url)
    remote = ObjectStore(url)
    rows = []
    for name, store, gens in _runs(remote):
        rows += [{"step": s, "committed": g.committed, "size": g.sizes.get(g.bin.name) if g.bin else None,
                  "status": _named("committed" if g.committed else _uncommitted(g), name)} for s, g in gens.items()]
    out: dict[str, Any] = {"url": remote.url, "generations": rows}
    memory = memory_tier(StoreRun(remote), deep=False)
    if not rows and not (memory or {}).get("generations"):
        out.update(_nothing(remote))         # as ls of a local directory without one (RUN §2.5)
    return out if memory is None else {**out, "tiers": {"memory": memory}}


def _nothing(remote: ObjectStore) -> dict[str, str]:
    """A prefix without any generation, judged as ``ls`` judges a local directory: its writer's
    lease in force is a run training towards its first save (``training``), anything else
    NO CHECKPOINT (``problem``: exit 1), an empty or mistyped prefix included."""
    live = holder(remote)
    if live is not None:
        return {"training": f"no generation yet: training, pid {live.get('pid', '?')} on {live.get('host', '?')}"}
    return {"problem": f"{remote.url}: no generation at this URL (an empty or mistyped prefix?)"}


def _runs(remote: ObjectStore) -> list[tuple[str | None, ObjectStore, dict[int, Generation]]]:
    """(name, store, generations by step) of the run at ``remote`` (name None), or, where it
    holds no generation itself, of each folder under it that does (a ModelCheckpoint dirpath's
    checkpoints, by their step, then name); nothing where neither is there."""
    gens = by_step(remote)
    if gens:
        return [(None, remote, gens)]
    folders = [e.name for e in remote.entries() if e.kind == DIRECTORY and not e.name.startswith(".")]
    found = [(name, remote.under(name)) for name in folders]
    runs = [(name, store, gens) for name, store in found if (gens := by_step(store))]
    return sorted(runs, key=lambda run: (max(run[2]), run[0]))      # by newest step, as ls of a local one


def checkpoint_names(url: str) -> list[str]:
    """The checkpoints with a committed generation under ``url`` where it is a ModelCheckpoint
    dirpath (no generation of its own), newest step last; [] for a run."""
    runs = _runs(ObjectStore(url))
    return [name for name, _, gens in runs if name is not None and any(g.committed for g in gens.values())]


def _named(status: str, name: str | None) -> str:
    return status if name is None else f"{status} ({name})"


def _uncommitted(gen: Generation) -> str:
    return LOST_PAYLOAD if gen.manifest else "not committed: no manifest (an interrupted upload)"


def validate_url(url: str, *, deep: bool = True) -> dict[str, Any]:
    """Every generation and sidecar at ``url`` checked; ``ok`` is False when any committed one
    is damaged (uncommitted leftovers are warnings, as locally). A URL naming a generation's
    object (``URL/step_N.bin``) validates that generation (``validate_generation_url``)."""
    if (named := generation_url(url)) is not None:
        return validate_generation_url(url, *named, deep=deep)
    remote = ObjectStore(url)
    gens = []
    for name, store, found in _runs(remote):
        gens += _check_run(store, found, deep, name)
    sidecars = _check_sidecars(remote, deep)
    ok = all(g["ok"] for g in gens) and all(s["ok"] for s in sidecars)
    doc = {"url": remote.url, "ok": ok, "deep": deep, "generations": gens, "sidecars": sidecars}
    if not any(g["status"].split(" (")[0] in ("verified", "committed") or not g["ok"] for g in gens):
        # as a local directory without a generation (validate says NO CHECKPOINT, exit 1): an
        # empty or mistyped prefix is not a valid mirror
        doc.update(ok=False, problem="no committed generation at this URL (an empty or mistyped prefix?)")
    return doc


def validate_generation_url(url: str, base: str, name: str, *, deep: bool = True) -> dict[str, Any]:
    """``validate URL/step_N.bin`` (or a sharded generation's ``step_N.json``, its
    ``step_N.shards``): that generation of the run at ``base`` checked, as ``validate
    DIR/step_N.bin`` checks the file; one that is not there is exit 2 as a missing file, and a
    ``.bin``'s manifest or a companion alone is refused in one line (pass its ``.bin``), as locally."""
    step, kind = fmt.parse_name(name)
    remote = ObjectStore(base)
    gen = by_step(remote).get(step)
    held = {"bin": gen.bin, "json": gen.manifest, "shards": gen.shards, "companion": gen.companion} if gen else {}
    if held.get(kind) is None:
        raise FileNotFoundError(errno.ENOENT, "no such object in the run at the URL", url)
    if kind == "companion" or (kind == "json" and not gen.sharded):
        raise UnsupportedKindError(url, f"validate cannot read a generation's {'manifest' if kind == 'json' else 'companion'} "
                                        f"alone (pass its {fmt.checkpoint_name(step)})")
    rows = _check_run(remote, {step: gen}, deep, None)
    doc = {"url": redact(url), "ok": all(r["ok"] for r in rows), "deep": deep, "generations": rows, "sidecars": []}
    if not gen.committed and gen.bin is not None:      # parts without their manifest: nothing to validate
        doc.update(ok=False, problem=f"{rows[0]['status']}: no committed generation")
    return doc


def _check_run(remote: ObjectStore, found: dict[int, Generation], deep: bool, name: str | None) -> list[dict[str, Any]]:
    """A row per generation of the run at ``remote`` (``name``: the checkpoint's, in each status)."""
    gens = []
    committed = _recorded_roots(remote)
    for step, gen in found.items():
        if not gen.committed:
            gens.append({"step": step, "ok": not gen.manifest, "status": _named(_uncommitted(gen), name),
                         "warning": not gen.manifest})
            continue
        problem = _check_generation(remote, gen, deep, committed)
        gens.append({"step": step, "ok": problem is None,
                     "status": _named(problem or ("verified" if deep else "committed"), name)})
    return gens


def _recorded_roots(remote: ObjectStore) -> dict[int, str]:
    """The root digests the history there records (``roots.recorded``): a mirror's
    ``.loss.json``, a store run's segments (spec/RUN.md §3.8); none without either."""
    if remote.exists(hist.NAME):
        return roots.recorded(io.BytesIO(remote.read_bytes(hist.NAME)))
    return roots.recorded(io.BytesIO(SegmentedHistory(remote).read_all()))


def _check_generation(remote: ObjectStore, gen: Generation, deep: bool, committed: dict[int, str]) -> str | None:
    """None when the generation at the destination is whole (and, ``deep``, its bytes hash to
    the manifest's digests: ``Generation.check``) and is the one the mirrored history records
    (``committed``: its root digests), else the first problem found."""
    try:
        doc, _ = remote.read_manifest(gen.step)
    except RemoteError:
        raise
    except CheckpointError as exc:
        return exc.problem
    if doc.get("step") == gen.step and (swapped := roots.differs(gen.step, roots.of(doc), committed)):
        return swapped
    return gen.check(deep=deep, doc=doc)


def _check_sidecars(remote: ObjectStore, deep: bool) -> list[dict[str, Any]]:
    """Each sidecar the index lists, against its size (and, ``deep``, its blake3)."""
    if not remote.exists(INDEX):
        return []
    try:
        index = json.loads(remote.read_bytes(INDEX))["sidecars"]
    except (ValueError, KeyError, TypeError) as exc:
        return [{"file": INDEX, "ok": False, "status": f"not a mirror index: {exc}"}]
    rows = []
    for name in SIDECARS:
        if name not in index:
            continue
        row = index[name]
        size = remote.size(name)
        if size != row["size"]:
            status = "missing" if size is None else f"expected {row['size']} bytes, got {size}"
        elif deep and remote.digest(name)[0] != row["blake3"]:
            status = "blake3 mismatch with the mirror index"
        else:
            status = "verified" if deep else "present"
        rows.append({"file": name, "ok": status in ("verified", "present"), "status": status})
    return rows


def inspect_url(url: str) -> dict[str, Any]:
    """``URL/step_N.bin``: its header (one ranged read of 8 bytes) and its manifest's summary;
    the fingerprint is the manifest's, not recomputed (``validate URL`` reads the bytes)."""
    base, _, name = url.rstrip("/").rpartition("/")
    parsed = fmt.parse_name(name)
    if parsed is None or parsed[1] != "bin":
        raise RemoteError(url, "inspect of a URL takes a run or a generation's .bin (URL/step_NNNNNN.bin)")
    remote = ObjectStore(base)
    size = remote.size(name)
    if size is None:
        raise RemoteError(url, "not found")
    head = remote.read_range(name, 0, fmt.HEADER_SIZE) if size >= fmt.HEADER_SIZE else b""
    if len(head) < fmt.HEADER_SIZE:
        raise RemoteError(url, f"shorter than the {fmt.HEADER_SIZE}-byte header")
    step, n = fmt.unpack_header(head)
    problem = None if fmt.file_size(n) == size else f"size law: expected {fmt.file_size(n)} bytes, got {size}"
    out: dict[str, Any] = {"path": url, "step": step, "n_params": n, "size": size, "header_problem": problem}
    if remote.exists(fmt.manifest_name(parsed[0])):
        doc, _ = remote.read_manifest(parsed[0])
        out.update(blake3=doc["blake3"], fingerprint="from the manifest (not recomputed)",
                   manifest={k: doc[k] for k in ("created", "config", "optimizer", "versions", "provenance")
                             if k in doc} | {"layout_tensors": len(doc.get("layout") or [])})
    else:
        out.update(blake3=None, fingerprint="uncommitted: no manifest at the URL")
    return out


def check_mirrors(rows: list[dict[str, Any]], committed: list[int]) -> list[dict[str, Any]]:
    """``ls --remote``: each recorded destination listed now; ``behind`` becomes the local
    committed steps not committed there (the record said what was confirmed; this says what is
    there now, after another mirror, a deletion or a damaged upload)."""
    out = []
    for row in rows:
        there = [s for s, g in by_step(ObjectStore(row["url"])).items() if g.committed]
        out.append({**row, "at_destination": there, "behind": [s for s in committed if s not in there]})
    return out
