"""Sharded generations (spec/FORMAT.md §11): the flat weights, m and v arrays split into
contiguous 1-D ranges, one per rank, each written as a seed-layout file of its own.

    RUN/step_000100.json                    the commit marker, listing every shard
    RUN/step_000100.shards/00000-of-00002.bin   [step][n_0][w 0..n_0][m ...][v ...]
    RUN/step_000100.shards/00001-of-00002.bin   [step][n_1][w n_0..n][m ...][v ...]

Every shard is readable by the seed's 10-line reader; models above 2^31-1 parameters fit
because each shard's n stays below it. The manifest's ``blake3`` is the blake3 of the shard
digests in rank order (a root over the set); each shard's own digest is listed beside its range.
Reading a range touches only the shards that overlap it, so W ranks can load what W' ranks saved
without any rank materialising the whole model.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from . import atomic, companion, fingerprint, reader, writer
from . import facts as valfacts
from . import format as fmt
from . import manifest as mf
from .errors import (CheckpointError, FingerprintMismatchError, ManifestError, ManifestMismatchError,
                     UnsupportedConversionError)

SUFFIX = ".shards"


def partition(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank`` in a balanced contiguous split of n elements.

    >>> [partition(10, 3, r) for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_name(rank: int, world: int) -> str:
    return f"{rank:05d}-of-{world:05d}.bin"


def shards_dir(run_dir: "str | os.PathLike[str]", step: int) -> Path:
    return Path(run_dir) / (fmt.stem(step) + SUFFIX)


def root_digest(rows: list[dict[str, Any]]) -> str:
    return fingerprint.of_bytes(b"".join(bytes.fromhex(r["blake3"]) for r in rows))


def save_shard(run_dir: "str | os.PathLike[str]", step: int, rank: int, world: int, start: int, stop: int,
               weights: Any, m: Any, v: Any) -> dict[str, Any]:
    """Durably write one rank's shard; returns the row rank 0 puts in the manifest (with the
    shard's value facts, spec §5.9)."""
    directory = shards_dir(run_dir, step)
    atomic.make_durable_dir(directory)
    path = directory / shard_name(rank, world)
    result = writer.save(path, step, weights, m, v, n_params=stop - start, write_manifest=False, overwrite=True)
    return {"file": path.name, "rank": rank, "start": start, "stop": stop, "size": result.size,
            "blake3": result.blake3, valfacts.FIELD: result.facts}


def commit(run_dir: "str | os.PathLike[str]", step: int, rows: list[dict[str, Any]],
           manifest: dict[str, Any] | None = None,
           before_commit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Write the manifest once every shard is durable; refuses an incomplete or holed set.
    ``before_commit``: shown the sealed manifest just before it is written (``writer.save``)."""
    path = Path(run_dir) / fmt.manifest_name(step)
    doc = mf.sealed(manifest_for(run_dir, step, rows, manifest))
    if before_commit is not None:
        before_commit(doc)
    mf.write(path, doc)
    return path


def manifest_for(run_dir: "str | os.PathLike[str]", step: int, rows: list[dict[str, Any]],
                 manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of a sharded generation from its shards' rows; refuses an incomplete or
    holed set. The generation's ``facts`` are the combination of its shards' (none if any shard
    has none)."""
    rows = sorted(rows, key=lambda r: r["rank"])
    check_rows(str(shards_dir(run_dir, step)), rows)
    rows = [{k: v for k, v in r.items() if not (k == valfacts.FIELD and v is None)} for r in rows]
    extra = {k: v for k, v in (manifest or {}).items() if k != valfacts.FIELD}
    extra.update(shards=rows, world_size=len(rows))
    combined = valfacts.combine([r.get(valfacts.FIELD) for r in rows])
    if combined is not None:
        extra[valfacts.FIELD] = combined
    return mf.build(file=shards_dir(run_dir, step).name, size=sum(r["size"] for r in rows), step=step,
                    n_params=rows[-1]["stop"], digest=root_digest(rows), extra=extra)


ROW = {"file": str, "rank": int, "start": int, "stop": int, "size": int, "blake3": str}


def check_rows(where: str, rows: list[dict[str, Any]]) -> None:
    """The shard list must tile 0..n in rank order. It comes from a manifest, so each row's
    fields are checked to be there with their types before any is used."""
    if not rows:
        raise ManifestError(where, "the shard list is empty")
    cursor = 0
    for i, row in enumerate(rows):
        if not (isinstance(row, dict) and all(isinstance(row.get(k), t) and not isinstance(row[k], bool)
                                              for k, t in ROW.items()) and mf.is_digest(row["blake3"])):
            raise ManifestError(where, f"shard {i}: expected an object with {', '.join(ROW)} "
                                       "(blake3 a 64-digit hex digest)")
        if row["rank"] != i or row["start"] != cursor or row["stop"] < row["start"]:
            raise ManifestError(where, f"shard {i}: expected rank {i} starting at {cursor}, got "
                                       f"rank {row['rank']} at {row['start']}")
        if row["file"] != shard_name(i, len(rows)):
            raise ManifestError(where, f"shard {i}: unexpected file name {row['file']!r}")
        if row["stop"] - row["start"] > fmt.MAX_N:
            raise ManifestError(where, f"shard {i} holds more than 2^31-1 parameters")
        cursor = row["stop"]


def is_sharded(doc: dict[str, Any]) -> bool:
    return isinstance(doc.get("shards"), list)


class ShardedCheckpoint:
    """An open sharded generation: ``read(region, start, stop)`` copies one global range."""

    def __init__(self, manifest_path: "str | os.PathLike[str]", *, verify: bool = False,
                 held: "tuple[dict[str, Any], dict[str, bytes], Any] | None" = None):
        """The sharded generation whose manifest is ``manifest_path``, each shard mapped (hashed
        when ``verify``); ``held``: one read from a store instead, (its manifest, each shard's
        bytes by file name, its companion's ``TensorFile`` or None), every part hashed already
        against the manifest (``Generation.open``); ``manifest_path`` then names it in messages."""
        self.manifest_path = Path(manifest_path)
        self.manifest = doc = mf.read(self.manifest_path) if held is None else held[0]
        if not is_sharded(doc):
            raise ManifestError(str(manifest_path), "not a sharded generation (no 'shards' list)")
        self.path = str(self.manifest_path.with_suffix(SUFFIX)) if held is None else str(manifest_path)[:-5] + SUFFIX
        self.step, self.n_params = doc["step"], doc["n_params"]
        rows = doc["shards"]
        check_rows(self.path, rows)
        if rows[-1]["stop"] != self.n_params or root_digest(rows) != doc["blake3"] or \
                sum(r["size"] for r in rows) != doc["size"]:
            raise ManifestMismatchError(str(manifest_path), "shard list does not add up to the manifest")
        self.rows = rows
        self._regions: dict[str, np.ndarray] = {}
        self.shards: list[reader.Checkpoint] = []
        self.held = None if held is None else held[2]
        if companion.FIELD in doc and held is None:     # rank 0's companion file: buffers, shared state tensors
            companion.require(self.path, doc[companion.FIELD], deep=verify)
        try:
            for row in rows:
                self.shards.append(self._open_shard(row, verify, None if held is None else held[1][row["file"]]))
        except BaseException:
            self.close()
            raise

    def companion(self) -> "Any | None":
        """The generation's companion file (``tensorfile.TensorFile``), None without one."""
        if self.held is not None or companion.FIELD not in self.manifest:
            return self.held
        return companion.read(self.path, self.manifest[companion.FIELD])

    def _open_shard(self, row: dict[str, Any], verify: bool, data: bytes | None = None) -> reader.Checkpoint:
        path = f"{self.path}/{row['file']}"
        ck = reader.open(path, manifest="ignore", check_name=False) if data is None else reader.from_bytes(data, path)
        if (ck.step, ck.n_params, ck.size) != (self.step, row["stop"] - row["start"], row["size"]):
            ck.close()
            raise ManifestMismatchError(self.path, f"shard {row['file']}: header/size ({ck.step}, {ck.n_params}, "
                                                   f"{ck.size}) is not the manifest's ({self.step}, "
                                                   f"{row['stop'] - row['start']}, {row['size']})")
        if verify:
            digest = ck.fingerprint()
            if digest != row["blake3"]:
                ck.close()
                raise FingerprintMismatchError(self.path, fingerprint.mismatch(row["blake3"], digest, f"shard {row['file']}"),
                                               expected=row["blake3"], got=digest)
        return ck

    @property
    def layout(self) -> list[dict[str, Any]] | None:
        return self.manifest.get("layout")

    def pieces(self, region: str, start: int, stop: int) -> Iterator[np.ndarray]:
        """Views (no copy) of the shards' parts that cover [start, stop), in order."""
        for row, ck in zip(self.rows, self.shards):
            lo, hi = max(start, row["start"]), min(stop, row["stop"])
            if lo < hi:
                yield getattr(ck, region)[lo - row["start"]:hi - row["start"]]

    def read(self, region: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(stop - start, dtype=fmt.DTYPE) if out is None else out
        cursor = 0
        for piece in self.pieces(region, start, stop):
            out[cursor:cursor + piece.size] = piece
            cursor += piece.size
        return out

    def region(self, name: str) -> np.ndarray:
        """The whole region assembled once (a full replica needs it; ranges use ``read``)."""
        if name not in self._regions:
            self._regions[name] = self.read(name, 0, self.n_params)
        return self._regions[name]

    @property
    def weights(self) -> np.ndarray:
        return self.region("weights")

    @property
    def m(self) -> np.ndarray:
        return self.region("m")

    @property
    def v(self) -> np.ndarray:
        return self.region("v")

    def close(self) -> None:
        for ck in self.shards:
            ck.close()
        self.shards = []
        self._regions = {}

    def __enter__(self) -> "ShardedCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bin_digest(manifest_path: "str | os.PathLike[str] | ShardedCheckpoint") -> str:
    """The blake3 of the ``.bin`` holding the same generation (header, then weights, m and v
    whole: what ``consolidate`` writes, and what a ``.bin``'s manifest records), without writing
    it. One pass over the shards feeds both that digest and each shard's own, which must be its
    row's (``FingerprintMismatchError``), so what is digested is the committed data. A generation
    above 2^31-1 parameters, which no ``.bin`` holds, has its header packed as two int64.
    ``manifest_path`` may be the generation opened already (one read from a store)."""
    opened = manifest_path if isinstance(manifest_path, ShardedCheckpoint) else ShardedCheckpoint(manifest_path)
    with opened as sc:
        whole = fingerprint.hasher(0)
        whole.update(fmt.pack_header(sc.step, sc.n_params) if sc.n_params <= fmt.MAX_N
                     else struct.pack("<qq", sc.step, sc.n_params))
        own = [fingerprint.hasher(0) for _ in sc.shards]
        for ck, h in zip(sc.shards, own):
            _feed(ck, 0, fmt.HEADER_SIZE, h)
        for region in fmt.REGIONS:                   # the .bin's order: every shard's range of a region
            for ck, h in zip(sc.shards, own):
                _feed(ck, fmt.region_offset(region, ck.n_params), fmt.ITEM * ck.n_params, h, whole)
        for row, h in zip(sc.rows, own):
            if h.hexdigest() != row["blake3"]:
                raise FingerprintMismatchError(sc.path, fingerprint.mismatch(
                    row["blake3"], h.hexdigest(), f"shard {row['file']}"), expected=row["blake3"], got=h.hexdigest())
        return whole.hexdigest()


def _feed(ck: reader.Checkpoint, offset: int, length: int, *hashers: Any) -> None:
    """Hash bytes [offset, offset + length) of an open shard into each hasher, chunk by chunk,
    dropping each chunk's mapped pages once hashed."""
    view = ck.buffer()
    try:
        for lo in range(offset, offset + length, fingerprint.CHUNK):
            hi = min(lo + fingerprint.CHUNK, offset + length)
            for h in hashers:
                h.update(view[lo:hi])
            ck.release(lo, hi - lo)
    finally:
        view.release()


def check(manifest_path: Path, *, deep: bool = False) -> str | None:
    """None when the sharded generation is committed and valid, else why not."""
    try:
        with ShardedCheckpoint(manifest_path, verify=deep):
            return None
    except CheckpointError as exc:      # a shard's own problem names the shard
        return exc.problem if Path(exc.path or manifest_path) == Path(manifest_path) else f"{exc.path}: {exc.problem}"
    except OSError as exc:
        return f"{exc.filename or 'a shard'}: unreadable: {exc.strerror or exc}"


def split(src: "str | os.PathLike[str]", run_dir: "str | os.PathLike[str]", world: int) -> Path:
    """Split one .bin into ``world`` shards plus a manifest in ``run_dir``; at most one shard
    per parameter. A split that fails or is interrupted removes the shards it wrote (a crash
    leaves them uncommitted: no manifest)."""
    ck = reader.open(src, check_name=False)
    with ck:
        if world > max(ck.n_params, 1):
            raise UnsupportedConversionError(str(src), f"{world} shards for {ck.n_params} parameters: at most "
                                                       "one shard per parameter")
        made = atomic.missing_dirs(run_dir)
        atomic.make_durable_dir(Path(run_dir))
        directory = shards_dir(run_dir, ck.step)
        existed = directory.exists()
        try:
            rows = []
            for rank in range(world):
                lo, hi = partition(ck.n_params, world, rank)
                rows.append(save_shard(run_dir, ck.step, rank, world, lo, hi, ck.weights[lo:hi], ck.m[lo:hi],
                                       ck.v[lo:hi]))
            extra = {k: v for k, v in (ck.manifest or {}).items() if k not in mf.REQUIRED}
            if companion.FIELD in extra:        # the generation's other file goes with it, verified
                extra[companion.FIELD] = companion.copy(src, directory, ck.manifest)
            return commit(run_dir, ck.step, rows, extra)
        except BaseException:
            if not existed:
                shutil.rmtree(directory, ignore_errors=True)
                atomic.remove(companion.path_for(directory))
            atomic.remove_dirs(made)
            raise


def consolidate(manifest_path: "str | os.PathLike[str]", dst: "str | os.PathLike[str]") -> writer.SaveResult:
    """Join a sharded generation into one .bin, streaming shard by shard (verified first)."""
    with ShardedCheckpoint(manifest_path, verify=True) as sc:
        extra = {k: v for k, v in sc.manifest.items() if k not in mf.REQUIRED and k not in ("shards", "world_size")}
        extra["consolidated_from"] = {"world_size": len(sc.rows), "root_blake3": sc.manifest["blake3"]}
        if companion.FIELD in extra:         # beside the joined .bin, under its name, verified
            extra[companion.FIELD] = companion.copy(sc.path, dst, sc.manifest)
        regions = [list(sc.pieces(r, 0, sc.n_params)) for r in fmt.REGIONS]
        try:
            return writer.save(dst, sc.step, *regions, manifest=extra, n_params=sc.n_params)
        except BaseException:
            if companion.FIELD in extra:
                atomic.remove(companion.path_for(dst))
            raise
