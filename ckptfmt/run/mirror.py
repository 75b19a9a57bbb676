"""Mirror a run's committed generations to object storage, verified there (spec/RUN.md §10).

Per generation: the .bin (or every shard) streamed up and hashed while sent, then the companion
file, then every uploaded object is read back and its blake3 compared, and only then the
manifest: the commit marker is the last object written, so an interrupted upload never leaves a
destination generation a reader would take as committed. Then the sidecars a resume needs and
an index of their digests, then retention at the destination (the pure policy of
``run.retention``, deleting only once the newer generations are committed there).
``mirror_runs`` mirrors several runs under one prefix (the Lightning callback's checkpoint
directories, spec/RUN.md §11.8), each by ``mirror``.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Callable, Iterable, Mapping

from .. import facts, fingerprint
from .. import format as fmt
from .. import manifest as mf
from ..errors import (CheckpointError, FingerprintMismatchError, ManifestError, RemoteError, SaveError,
                      UnsupportedSetupError)
from ..generation import Generation, by_step, list_dir
from ..store import DIRECTORY, confirm
from ..store.objects import ObjectStore, Progress
from . import history as hist
from . import mirrors
from .directory import Run
from .generations import manifest_of, non_finite
from .lease import ReadLease
from .retention import Candidate, Guards, Policy, candidate_for, find_guards, guarded
from .sidecars import PINS, PIVOT, POLICY, SAMPLES, STATE
from .storelock import leased
from .storerun import MIRROR_INDEX, StoreRun
from ..warn import warn

__all__ = ["INDEX", "SIDECARS", "mirror", "mirror_runs"]

SIDECARS = (hist.NAME, PINS, PIVOT, STATE, SAMPLES, POLICY)   # what a resume reads besides the generation, and
                                                              # the policy its writer ran with (for ls there)
INDEX = MIRROR_INDEX                                   # at the destination: the sidecars' digests


def mirror(run_dir: "str | os.PathLike[str]", url: str, *, retention: Policy | None = None,
           recheck: bool = True, progress: Progress = None) -> dict[str, Any]:
    """One pass: upload every committed local generation the destination lacks (or holds
    damaged), then the sidecars, then apply ``retention`` there (None: keep every generation;
    the same plan as local ``gc``, spec/RUN.md §10.5). ``recheck`` reads back the
    generations already at the destination too (a damaged one is replaced); without it they
    are trusted when their manifest and sizes match.

    The pass holds a read lease (spec/RUN.md §5.3) on the generations it has still to upload,
    so local retention (``gc``, the trainer's, the manager's) keeps them until they are
    confirmed at the destination; each is released from the lease once it is."""
    run, remote = Run(run_dir), destination(run_dir, url)
    started = time.perf_counter()
    with ReadLease(run.path, purpose=f"mirror to {remote.url}") as lease:
        judge = run.judge()                 # the run's own generations only (roots: the history)
        local = {g.step: g for g in lease.listing.generations if g.committed and judge(g) is None}
        there = by_step(remote)
        policy = None if retention is None or retention.keep_all else retention   # None: nothing to delete
        guards = find_guards((local[s] for s in sorted(local, reverse=True)), check=lambda g: None,  # judged above
                             non_finite=non_finite)
        skip = _doomed(_candidates(policy, local, there, remote), policy, run.pins(), guards)
        lease.narrow(s for s in local if s not in skip)
        kept_out = sorted(s for s in local if s in skip)           # not lag, for ls (RUN.md §10.6)
        if mirrors.read(run.path)["destinations"].get(remote.url, {}).get("kept_out", []) != kept_out:
            mirrors.record(run.path, remote.url, kept_out=kept_out)
        result = _upload_missing(run, remote, {s: g for s, g in local.items() if s not in skip}, there,
                                 recheck, progress, lease)
    sidecars = _upload_sidecars(run, remote, recheck)
    deleted = _prune(remote, policy, run.pins()) if policy is not None else []
    if deleted:
        mirrors.record(run.path, remote.url, deleted=deleted)
    return {"run": str(run.path), "url": remote.url, **result, "sidecars": sidecars, "deleted": deleted,
            "at_destination": [s for s, g in by_step(remote).items() if g.committed],
            "seconds": round(time.perf_counter() - started, 3)}


def _upload_missing(run: Run, remote: ObjectStore, local: dict[int, Generation], there: dict[int, Generation],
                    recheck: bool, progress: Progress, lease: ReadLease) -> dict[str, list]:
    """Upload each generation not (intact) at the destination, oldest first; record each one
    confirmed there and release it from the lease."""
    out: dict[str, list] = {"uploaded": [], "present": [], "replaced": [], "refused": []}
    pending = set(local)
    for step, gen in local.items():
        doc = mf.read(gen.manifest)
        if there.get(step) is not None and there[step].committed:
            if _matches(remote, there[step], doc, gen, recheck):
                out["present"].append(step)
                mirrors.record(run.path, remote.url, confirmed={step: doc["blake3"]})
                pending.discard(step)
                lease.narrow(pending)
                continue
            out["replaced"].append(step)
        if there.get(step) is not None:
            there[step].remove()                 # manifest first: uncommitted at once
        try:
            out["uploaded"].append(_upload_generation(remote, gen, doc, progress))
        except FingerprintMismatchError as exc:           # the local bytes are damaged: never sent
            warn(f"{exc}; generation {step} not mirrored")
            out["refused"].append(step)
        else:
            mirrors.record(run.path, remote.url, confirmed={step: doc["blake3"]})
        pending.discard(step)
        lease.narrow(pending)
    return out


def _candidates(policy: Policy | None, local: dict[int, Generation], there: dict[int, Generation],
                remote: ObjectStore) -> list[Candidate]:
    """What retention knows of every committed generation, local or at the destination: the
    manifest's metrics and commit time where a rule reads them (the local manifest, else the
    destination's)."""
    steps = sorted(set(local) | {s for s, g in there.items() if g.committed})
    if policy is None:
        return [Candidate(s) for s in steps]
    return [candidate_for(policy, s, lambda s=s: manifest_of(local[s]) if s in local else _remote_doc(remote, s))
            for s in steps]


def _remote_doc(remote: ObjectStore, step: int) -> dict[str, Any] | None:
    """The destination's manifest of ``step``, None where it cannot be read as one."""
    try:
        return remote.read_manifest(step)[0]
    except (RemoteError, ManifestError):
        return None


def _doomed(candidates: list[Candidate], policy: Policy | None, pins: list[int], guards: Guards) -> set[int]:
    """Steps retention at the destination would delete: the one retention plan (``run.retention``)
    under ``guards``, the newest valid and the newest finite generation (spec/RUN.md §5.4)."""
    if policy is None:
        return set()
    return set(guarded(policy, candidates, guards, pinned=pins).doomed)


def _diverged(doc: dict[str, Any] | None) -> dict[str, int]:
    """What a destination's manifest records as non-finite (empty: finite or unknown)."""
    try:
        return facts.diverged(doc) if doc is not None else {}
    except (ValueError, KeyError, TypeError):
        return {}


def _matches(remote: ObjectStore, there: Generation, doc: dict[str, Any], gen: Generation,
             recheck: bool) -> bool:
    """Whether the destination's committed generation is this one, intact: same manifest bytes,
    every payload object present with its size (and, ``recheck``, its blake3 read back)."""
    try:
        if remote.read_bytes(fmt.manifest_name(gen.step)) != gen.manifest.read_bytes():
            return False
        for part in gen.parts(doc, manifest=False):
            if remote.size(part.name) != part.path.stat().st_size:
                return False
            if recheck and remote.digest(part.name)[0] != part.blake3:
                return False
    except CheckpointError as exc:
        if isinstance(exc, RemoteError) and "not found" not in exc.problem:
            raise
        return False
    return True


def _upload_generation(remote: ObjectStore, gen: Generation, doc: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Payload up (hashed while sent), confirmed there (``store.confirm``: the ETag the store
    computed, else read back), then the manifest, read back."""
    files = gen.parts(doc, manifest=False)
    sent = [remote.upload(part.path, part.name, part.blake3, progress) for part in files]
    try:
        confirm(remote, sent)
    except SaveError as exc:          # the destination could not keep what was sent: exit 2
        raise RemoteError(exc.path, f"{exc.problem} there; the generation stays uncommitted") from None
    marker = fmt.manifest_name(gen.step)
    data = gen.manifest.read_bytes()
    remote.put_bytes(marker, data)
    if remote.read_bytes(marker) != data:
        remote.remove(marker)
        raise RemoteError(remote.where(marker), "the manifest did not read back as sent; removed")
    return {"step": gen.step, "files": len(files) + 1, "bytes": sum(w.size for w in sent) + len(data),
            "blake3": doc["blake3"]}


def _upload_sidecars(run: Run, remote: ObjectStore, recheck: bool) -> dict[str, dict[str, Any]]:
    """Each sidecar as one snapshot (it may grow while we read), read back, then the index of
    their digests, which ``restore`` verifies them against. A sidecar gone locally (a pivot
    archived it) is deleted at the destination too. Without ``recheck``, a sidecar whose digest
    the destination's index already holds (and whose size matches there) is not sent again."""
    index, before = {}, {} if recheck else _index_there(remote)
    for name in SIDECARS:
        try:
            data = (run.path / name).read_bytes()
        except FileNotFoundError:
            remote.remove(name)
            continue
        digest = fingerprint.of_bytes(data)
        if before.get(name) == {"size": len(data), "blake3": digest} and remote.size(name) == len(data):
            index[name] = before[name]
            continue
        remote.put_bytes(name, data)
        if fingerprint.of_bytes(remote.read_bytes(name)) != digest:
            raise RemoteError(remote.where(name), "did not read back as sent")
        index[name] = {"size": len(data), "blake3": digest}
    remote.put_bytes(INDEX, (json.dumps({"sidecars": index, "updated": round(time.time(), 3)},
                                        indent=1, sort_keys=True) + "\n").encode())
    return index


def _index_there(remote: ObjectStore) -> dict[str, Any]:
    """The sidecar digests the destination's index holds ({} when it has none or it is bad)."""
    try:
        index = json.loads(remote.read_bytes(INDEX))["sidecars"]
    except (RemoteError, ValueError, KeyError, TypeError):
        return {}
    return index if isinstance(index, dict) else {}


def _prune(remote: ObjectStore, policy: Policy, pins: list[int]) -> list[int]:
    """Retention at the destination over its committed generations; the newest valid one (checked
    there as a run on a store checks it for retention, ``StoreRun.retention_deep``: its manifest, each part's
    size and a ``.bin``'s header) and the newest finite one are protected, as locally, and so is
    a step a reader's unexpired lease there holds (``run.storelock.leased``: an import in progress)."""
    there = {s: g for s, g in by_step(remote).items() if g.committed}
    doc = functools.lru_cache(maxsize=None)(lambda step: _remote_doc(remote, step))   # each read once, if at all
    candidates = [candidate_for(policy, s, lambda s=s: doc(s)) for s in sorted(there)]
    guards = find_guards((there[s] for s in sorted(there, reverse=True)), non_finite=lambda g: _diverged(doc(g.step)),
                         check=lambda g: g.check(deep=StoreRun.retention_deep, doc=doc(g.step)))
    doomed = _doomed(candidates, policy, pins, guards) - leased(remote)   # readers' claims there
    for step in sorted(doomed):
        there[step].remove()
    return sorted(doomed)


def mirror_runs(runs: Mapping[str, "str | os.PathLike[str]"], url: str, *, recheck: bool = True,
                owned: Callable[[str], bool] = lambda name: False, trusted: Iterable[str] = (),
                progress: Progress = None) -> dict[str, Any]:
    """One pass over several runs under one prefix (a Lightning ``dirpath``, spec/RUN.md §11.8):
    each ``runs[NAME]`` to ``URL/NAME`` by ``mirror`` (upload, read-back, manifest last); once a
    run's committed generations are all confirmed there, every other generation at ``URL/NAME``
    is removed (a run replaced in place, ``last.ckpt``, holds its one generation there too).
    Then, only if every run was confirmed (a damaged local run holds deletions back), each
    ``URL/NAME`` not in ``runs`` for which ``owned(NAME)`` holds a run there is removed,
    manifests first. ``trusted``: names the caller saw confirmed unchanged, not visited again.
    ``behind``: the names not confirmed; ``removed``: the names removed."""
    base, trusted = url.rstrip("/"), set(trusted)
    out: dict[str, Any] = {"url": ObjectStore(base).url, "runs": {}, "behind": [], "removed": []}
    for name, path in sorted((n, p) for n, p in runs.items() if n not in trusted):
        result = out["runs"][name] = mirror(path, f"{base}/{name}", recheck=recheck, progress=progress)
        local = {g.step for g in list_dir(path).generations if g.committed}
        if local and local <= set(result["present"]) | {u["step"] for u in result["uploaded"]}:
            _keep_only(ObjectStore(f"{base}/{name}"), local)
        else:
            out["behind"].append(name)
    if not out["behind"]:
        top = ObjectStore(base)
        out["removed"] = [name for name in _names(top) if name not in runs and owned(name)
                          and _remove_run(top, base, name)]
    return out


def _keep_only(remote: ObjectStore, steps: set[int]) -> None:
    """Remove every generation at the destination but ``steps`` (committed or leftovers)."""
    for step, gen in by_step(remote).items():
        if step not in steps:
            gen.remove()


def _names(remote: ObjectStore) -> list[str]:
    """The folders (prefixes) directly under the destination."""
    return [e.name for e in remote.entries() if e.kind == DIRECTORY]


def _remove_run(top: ObjectStore, base: str, name: str) -> bool:
    """Remove the run at ``base/NAME`` (``top`` is ``base``): each generation's manifest first,
    then the rest; a folder holding neither a generation nor a mirror's index is not a run
    and stays (False)."""
    remote = ObjectStore(f"{base}/{name}")
    gens = by_step(remote)
    if not gens and not remote.exists(INDEX):
        return False
    for step, gen in gens.items():
        gen.remove()
    top.remove(name, recursive=True)
    return True


def destination(run_dir: "str | os.PathLike[str]", url: str) -> ObjectStore:
    """The URL as a destination for ``run_dir``, or ``UnsupportedSetupError`` (exit 2; a watch
    stops on it, as it does not on a network failure): the URL's own form (``ObjectStore``), and not
    the run directory itself (its retention would delete the run's own generations, past leases
    and the run lock)."""
    remote = ObjectStore(url)
    if remote.local and os.path.realpath(remote.root or "/") == os.path.realpath(run_dir):
        raise UnsupportedSetupError(remote.url, f"is the run directory {run_dir} itself; mirror to another place")
    return remote


def watch(run_dir: "str | os.PathLike[str]", url: str, *, interval: float = 10.0,
          should_stop: Callable[[], bool] = lambda: False, report: Callable[[dict[str, Any]], None] = lambda d: None,
          passes: int | None = None, **options: Any) -> dict[str, Any]:
    """Mirror pass after pass until ``should_stop()`` (the CLI's SIGTERM/SIGINT) or ``passes``.

    The first pass reads back what the destination holds (``recheck``); later ones only look for
    new generations. A pass that fails on the network is reported and retried at the next
    interval (the trainer may restart, the endpoint may come back); the run directory is listed
    afresh each pass, so the watch survives the trainer's restarts; one started before the run
    directory exists waits for it (the object-storage how-to starts it beside the trainer). ``report`` gets each
    pass's result, ``{"error": message}``, or once ``{"waiting": message}``."""
    done, failed, first_recheck, waiting = 0, 0, options.pop("recheck", True), False
    destination(run_dir, url)                # refused at once, not retried (nor waited on)
    while not should_stop():
        if not os.path.lexists(run_dir):       # started before the trainer made it: wait for it
            if not waiting:
                report({"waiting": f"{run_dir}: no run directory yet; the first pass runs when it appears"})
            waiting = True
        else:
            try:
                report(mirror(run_dir, url, recheck=first_recheck if done == 0 else False, **options))
            except RemoteError as exc:
                failed += 1
                report({"error": str(exc)})
            done += 1
            if passes is not None and done >= passes:
                break
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline and not should_stop():
            time.sleep(min(0.2, interval))
    return {"passes": done, "failed_passes": failed}
