"""``inspect`` as data: header, fingerprint status, manifest summary, per-region statistics."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import companion, fsio, generation, kinds
from .. import format as fmt
from .. import manifest as mf
from .. import reader
from ..errors import CheckpointError, NoValidGenerationError
from ..run import ReadLease, Run, ls_run
from ..run.storerun import open_run
from .anyfile import describe, manifest_of, open_source
from .loose import empty_directory
from .stats import region_stats

__all__ = ["inspect_file", "inspect_other", "inspect_path", "inspect_run", "inspect_run_url", "inspect_stored"]

MANIFEST_SUMMARY = ("created", "metrics", "config", "optimizer", "scheduler", "versions", "code", "data",
                    "state", "provenance")


def inspect_path(path: "str | os.PathLike[str]", *, tensors: bool = False) -> dict[str, Any]:
    """``inspect`` of a file or directory of any kind (``ckptfmt.kinds``): a run, a seed
    ``.bin``, or any other kind through ``inspect_other``; ``data["kind"]`` names it.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.inspect import inspect_path
        >>> os.makedirs("looked-at", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("looked-at", 10, z, z, z)
        >>> inspect_path("looked-at/step_000010.bin")["kind"], inspect_path("looked-at")["latest"]["step"]
        ('bin', 10)
    """
    kind = kinds.require(kinds.sniff(path), "inspect", path)
    if kind.name in ("run", "lightning"):        # a Lightning checkpoint is a run of one generation
        return inspect_run(path, tensors=tensors)
    if kind.name in ("hf-run", "hf-checkpoint"):     # a Trainer's output or checkpoint-N directory
        from .hfrun import inspect_hf  # lazy: one more kind, read only when given
        return inspect_hf(path, inspect_other)
    if kind.name == "lightning-dir":                 # ModelCheckpoint's directory of checkpoints
        from .lightningdir import inspect_lightning_dir  # lazy: as above
        return inspect_lightning_dir(path, inspect_run)
    if kind.name == "bin":
        return inspect_file(path, tensors=tensors)
    return inspect_other(os.fspath(path), kind, tensors=tensors)


def inspect_other(path: str, kind: kinds.Kind, *, tensors: bool = False) -> dict[str, Any]:
    """Kind, step, parameters, dtypes and per-region statistics of a file that is not a seed
    ``.bin``, read as convert reads it (``anyfile.open_source``).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt import kinds
        >>> from ckptfmt.tools.convert import convert
        >>> from ckptfmt.tools.inspect import inspect_other
        >>> w = np.arange(4, dtype=np.float32)
        >>> _ = ckptfmt.save("step_000011.bin", 11, w, w, w)
        >>> _ = convert("step_000011.bin", "eleven.safetensors")
        >>> info = inspect_other("eleven.safetensors", kinds.sniff("eleven.safetensors"))
        >>> info["kind"], info["step"], info["regions"]["weights"]["max"]
        ('safetensors', 11, 3.0)
    """
    src = open_source(path, kind)
    size = generation.at(manifest_of(path)).size if kind.name == "shards" else fsio.tree_size(path)
    out: dict[str, Any] = {"path": path, "kind": kind.name, "label": kind.label, "step": src.step,
                           "n_params": src.n_params, "size": size, **describe(src)}
    out["regions"] = {r: region_stats(getattr(src, r)).to_dict() for r in fmt.REGIONS
                      if getattr(src, r) is not None}
    if tensors and src.layout:            # moments in the optimizer's order belong to no one parameter
        named = ["weights"] if src.extra.get("moments") else list(out["regions"])
        out["tensors"] = {row["name"]: {r: region_stats(getattr(src, r)[_span(row)]).to_dict()
                                        for r in named} for row in src.layout}
    return out


def _span(row: dict[str, Any]) -> slice:
    count = 1
    for d in row["shape"]:
        count *= d
    return slice(row["offset"], row["offset"] + count)


def inspect_file(path: "str | os.PathLike[str]", *, tensors: bool = False) -> dict[str, Any]:
    """A seed ``.bin``. Raises ``CheckpointError`` for a damaged file; a bad manifest is
    reported, not fatal.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.inspect import inspect_file
        >>> w = np.arange(4, dtype=np.float32)
        >>> _ = ckptfmt.save("step_000010.bin", 10, w, w, w)
        >>> info = inspect_file("step_000010.bin")
        >>> info["step"], info["size"], info["regions"]["weights"]["mean"]
        (10, 56, 1.5)
    """
    path = os.fspath(path)
    ck = reader.open(path, manifest="ignore", check_name=False)
    with ck:
        out: dict[str, Any] = {"path": path, "kind": "bin", "step": ck.step, "n_params": ck.n_params,
                               "size": ck.size}
        doc, problem = _manifest(path, ck)
        with ThreadPoolExecutor(1) as pool:
            digest = pool.submit(ck.fingerprint)
            out["regions"] = {r: region_stats(getattr(ck, r)).to_dict() for r in fmt.REGIONS}
            if tensors and doc and doc.get("layout"):
                ck.manifest = doc
                out["tensors"] = {name: {r: region_stats(ck.tensor(name, r).ravel()).to_dict()
                                         for r in fmt.REGIONS} for name in ck.names()}
            out["blake3"] = digest.result()
    out["fingerprint"] = _fingerprint(doc, problem, out["blake3"])
    if doc is not None and companion.FIELD in doc:
        problem = companion.check(path, doc[companion.FIELD], deep=True)
        out["companion"] = doc[companion.FIELD]
        out["fingerprint"] = "mismatch" if problem else out["fingerprint"]
    if problem:
        out["manifest_problem"] = problem
    if doc:
        out["manifest"] = _summary(doc, str(mf.path_for(path)))
    return out


def _summary(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """What ``inspect`` shows of a manifest: its fields of ``MANIFEST_SUMMARY``, the layout's
    size, and its seal (``where`` names the manifest)."""
    summary = {k: doc[k] for k in MANIFEST_SUMMARY if k in doc}
    return {**summary, "layout_tensors": len(doc.get("layout") or []), "seal": mf.self_checked(where, doc) or "self-checked"}


def inspect_stored(gen: generation.Generation, *, tensors: bool = False, opened: Any = None) -> dict[str, Any]:
    """A committed generation in a store (object storage), read into memory with every part
    hashed against its manifest as it arrives (``Generation.open``): what ``inspect_file`` says
    of a local ``.bin`` (``fingerprint`` verified: nothing unverified is read), and of a sharded
    one its kind ``shards``. ``CheckpointError`` for one whose bytes are not its manifest's.
    ``opened``: the generation read already (``Run.open_at``), not downloaded again.

    Examples:
        ```python
        from ckptfmt.run.storerun import StoreRun
        from ckptfmt.tools.inspect import inspect_stored

        run = StoreRun("s3://bucket/runs/a")
        info = inspect_stored(run.latest())          # every part hashed as it arrives
        print(info["step"], info["fingerprint"])
        ```
    """
    store = gen.store
    with opened or gen.open() as ck:
        doc = ck.manifest
        out: dict[str, Any] = {"path": store.where(gen.path.name), "kind": gen.kind, "step": ck.step,
                               "n_params": ck.n_params, "size": sum(p.size for p in generation.recorded_parts(doc, gen.step))
                               if gen.sharded else ck.size}
        out["regions"] = {r: region_stats(getattr(ck, r)).to_dict() for r in fmt.REGIONS}
        if tensors and doc.get("layout") and not gen.sharded:
            out["tensors"] = {name: {r: region_stats(ck.tensor(name, r).ravel()).to_dict() for r in fmt.REGIONS}
                              for name in ck.names()}
    if gen.sharded:
        out.update(label="a sharded generation", origin="ckptfmt", shards=len(doc["shards"]), recorded_blake3=doc["blake3"])
    else:
        out.update(blake3=doc["blake3"], fingerprint="verified")
    if companion.FIELD in doc:
        out["companion"] = doc[companion.FIELD]
    out["manifest"] = _summary(doc, store.where(gen.manifest.name))
    return out


def _fingerprint(doc: dict | None, problem: str | None, digest: str) -> str:
    """'verified' or 'mismatch' against a readable manifest; 'unverified' for a bare file;
    'unchecked' when the manifest cannot be read or describes other bytes (nothing to compare
    with, which is not the same as a mismatch)."""
    if problem is not None:
        return "unchecked"
    if doc is None:
        return "unverified"
    return "verified" if doc["blake3"] == digest else "mismatch"


def _manifest(path: str, ck: reader.Checkpoint) -> tuple[dict | None, str | None]:
    try:
        return mf.beside(path, size=ck.size, step=ck.step, n_params=ck.n_params), None
    except CheckpointError as exc:
        return None, str(exc)


def inspect_run(path: "str | os.PathLike[str]", *, tensors: bool = False) -> dict[str, Any]:
    """``ls`` of a run plus ``inspect`` of its newest valid generation (or why there is none);
    that generation is leased while it is read, so a live trainer's retention keeps it.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.inspect import inspect_run
        >>> os.makedirs("inspected", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (10, 20):
        ...     _ = ckptfmt.save_generation("inspected", step, z, z, z)
        >>> info = inspect_run("inspected")
        >>> [g["step"] for g in info["generations"]], info["latest"]["step"]
        ([10, 20], 20)
    """
    data = ls_run(path)
    with ReadLease(path, purpose="inspect") as lease:
        gens = lease.listing.generations
        committed = [g for g in gens if g.committed]
        among = committed or ([] if data.get("lock") else gens)   # a live first save is no generation yet
        try:
            gen = Run(path).latest(allow_bare=True, among=among) if among else None
        except NoValidGenerationError as exc:
            gen, data["latest_problem"] = None, str(exc)
        if gen is None and "latest_problem" not in data:
            _no_generation(data, path, tensors)
        lease.narrow([gen.step] if gen else [])
        data["latest"] = inspect_path(gen.path, tensors=tensors) if gen else None
    return data


def inspect_run_url(url: str, *, tensors: bool = False) -> dict[str, Any]:
    """``inspect URL`` of a run on object storage: its generations as ``ls URL`` lists them and
    its newest valid generation inspected (``inspect_stored``), leased while it is read, or
    ``latest_problem``: why there is none. A ModelCheckpoint dirpath (spec/RUN.md §11.10): its
    checkpoints listed, and the newest committed one inspected so.

    Examples:
        A run on object storage (the extra named ``remote``; credentials from the environment):

        ```python
        from ckptfmt.tools.inspect import inspect_run_url

        info = inspect_run_url("s3://bucket/runs/a")
        print([g["step"] for g in info["generations"]], info["latest"]["step"])
        ```
    """
    from .remote_check import checkpoint_names, ls_url  # lazy: object storage only when a URL is given
    if names := checkpoint_names(url):
        inner = inspect_run_url(f"{url.rstrip('/')}/{names[-1]}", tensors=tensors)
        return {**ls_url(url), **{k: inner[k] for k in ("latest", "latest_problem") if k in inner}}
    run = open_run(url)
    data = ls_url(url)
    with run.reading("inspect") as lease:
        committed = [g for g in lease.listing.generations if g.committed]
        try:
            gen = run.latest(among=committed, deep=True) if committed else None
        except NoValidGenerationError as exc:
            gen, data["latest_problem"] = None, str(exc)
        if gen is None and "latest_problem" not in data:
            data["latest_problem"] = f"{run.where}: no committed generation"
        lease.narrow([gen.step] if gen else [])
        data["latest"] = inspect_stored(gen, tensors=tensors, opened=run.open_at(run.name_of(gen))) if gen else None
    return data


def _no_generation(data: dict[str, Any], path: "str | os.PathLike[str]", tensors: bool) -> None:
    """A directory without any generation, as validate judges it (``loose.empty_directory``):
    training says so, files of other kinds are inspected each by its kind (a file that cannot be
    read says why in ``problem``), anything else says why there is nothing."""
    case, said = empty_directory(path, data.get("lock"))
    if case == "files":
        data["files"] = [_inspect_loose(file, kind, tensors) for file, kind in said]
    elif case == "training":
        data["training"] = said
    else:
        data["latest_problem"] = said


def _inspect_loose(path: str, kind: kinds.Kind, tensors: bool) -> dict[str, Any]:
    try:
        return inspect_path(path, tensors=tensors)
    except CheckpointError as exc:
        return {"path": path, "kind": kind.name, "label": kind.label, "problem": str(exc)}


