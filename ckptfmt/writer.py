"""Writer (spec §5): stream header + weights + m + v through the durable write, hashing as it
writes on a second thread, then commit the manifest.

Regions are float32 arrays, any contiguous buffer, or an iterable of those (concatenated), so
a model's parameters can be written tensor by tensor with no full staging copy.
"""
from __future__ import annotations

import operator
import os
import re
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from . import atomic, companion, fingerprint
from . import facts as valfacts
from . import format as fmt
from . import manifest as mf
from .errors import ManifestError, RegionError, SaveError, StepNameMismatchError

CHUNK = 8 << 20      # bytes handed to write() and the hasher at a time
Region = Any         # np.ndarray | buffer | Iterable of those


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote, as ``save`` returns it once the generation is committed.

    Attributes:
        path: the ``.bin`` written.
        manifest_path: its manifest, the commit marker (None: saved with ``write_manifest=False``).
        step: the step in the header.
        n_params: the parameter count in the header (each region's length).
        size: the file's size in bytes, ``8 + 12 * n_params``.
        blake3: the blake3 of every byte of the file (what ``b3sum`` prints), as the manifest records it.
        seconds: how long the call took, from its start to the commit.
        facts: the value facts the manifest records (each region finite, v non-negative;
            spec §5.9); None when ``value_facts=False``.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> z = np.zeros(2, np.float32)
        >>> r = ckptfmt.save("step_000001.bin", 1, z, z, z)
        >>> r.step, r.n_params, r.size, len(r.blake3)
        (1, 2, 32, 64)
    """

    path: str
    manifest_path: str | None
    step: int
    n_params: int
    size: int
    blake3: str
    seconds: float
    facts: dict[str, Any] | None = None   # the value facts recorded (spec §5.9); None if skipped


FLOAT32_HINT = "the seed layout holds float32 (np.asarray(x, dtype=np.float32) if rounding is intended)"


def as_bytes(buf: Any, what: str, path: str | None = None) -> memoryview:
    """A flat byte view of a float32 array or a raw buffer; refuses other dtypes, and anything
    that is not a contiguous buffer, naming the region (``RegionError``, also a ``TypeError``).

    >>> as_bytes(np.zeros(2), "weights", "a.bin")
    Traceback (most recent call last):
    ckptfmt.errors.RegionError: a.bin: weights is a float64 array; the seed layout holds float32 (np.asarray(x, dtype=np.float32) if rounding is intended)
    """
    if isinstance(buf, np.ndarray):
        if buf.dtype != fmt.DTYPE:
            if buf.dtype.kind == "f" and buf.dtype.itemsize == fmt.ITEM:
                raise RegionError(path, f"{what} is a big-endian float32 array; the seed layout holds "
                                        "little-endian float32 (x.astype('<f4'))")
            raise RegionError(path, f"{what} is a {buf.dtype} array; {FLOAT32_HINT}")
        buf = np.ascontiguousarray(buf)
    try:
        view = memoryview(buf)
    except TypeError:
        raise RegionError(path, f"{what} is a {_type_name(buf)}, not a float32 array or buffer; "
                                f"{FLOAT32_HINT}") from None
    if not view.c_contiguous:
        raise RegionError(path, f"{what}: buffer is not contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes % fmt.ITEM:
        raise RegionError(path, f"{what}: {view.nbytes} bytes is not a whole number of float32")
    return view


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _is_buffer(value: Any) -> bool:
    if isinstance(value, (np.ndarray, bytes, bytearray, memoryview)):
        return True
    if isinstance(value, np.generic):          # a numpy scalar has the buffer protocol, but is one number
        return False
    try:
        memoryview(value).release()
    except TypeError:
        return False
    return True


def _pieces(region: Region, what: str, path: str | None = None) -> tuple[int, Iterable[memoryview]]:
    """(element count or -1 if only known by streaming, iterable of byte views).

    What is clearly not a region is refused here, before anything is written: an array of
    another dtype, a list or tuple of numbers (not of buffers), a torch tensor, a scalar, a
    string, a mapping. A generator's pieces are checked as they are pulled."""
    if isinstance(region, np.ndarray) or hasattr(region, "__buffer__") or isinstance(
            region, (bytes, bytearray, memoryview)):
        view = as_bytes(region, what, path)
        return view.nbytes // fmt.ITEM, [view]
    if isinstance(region, (list, tuple)):
        odd = next((piece for piece in region if not _is_buffer(piece)), None)
        if odd is not None:
            raise RegionError(path, f"{what} is a {type(region).__name__} of {_type_name(odd)}; {FLOAT32_HINT}")
        views = [as_bytes(piece, what if len(region) == 1 else f"{what}[{i}]", path)
                 for i, piece in enumerate(region)]
        return sum(v.nbytes for v in views) // fmt.ITEM, views
    if type(region).__module__.split(".")[0] == "torch":
        raise RegionError(path, f"{what} is a {_type_name(region)}; ckptfmt.save takes float32 numpy arrays "
                                "or buffers (t.detach().cpu().numpy(), or ckptfmt.torch.save for a model)")
    if isinstance(region, (str, dict, set, frozenset, np.generic)) or not hasattr(region, "__iter__"):
        raise RegionError(path, f"{what} is a {_type_name(region)}, not a float32 array, buffer or "
                                f"iterable of them; {FLOAT32_HINT}")
    return -1, (as_bytes(piece, what, path) for piece in region)


def _chunks(views: Iterable[memoryview]) -> Iterator[memoryview]:
    for view in views:
        for start in range(0, view.nbytes, CHUNK):
            yield view[start:start + CHUNK]


def save(path: "str | os.PathLike[str]", step: int, weights: Region, m: Region, v: Region, *,
         manifest: dict[str, Any] | None = None, n_params: int | None = None,
         write_manifest: bool = True, overwrite: bool = False,
         extra_tensors: dict[str, Any] | None = None, value_facts: bool = True,
         before_commit: Callable[[dict[str, Any]], None] | None = None) -> SaveResult:
    """Durably write ``step_NNNNNN.bin`` and commit its manifest; returns what was written.

    ``n_params`` is required only when regions are generators. An existing file is refused
    unless ``overwrite`` (a committed generation is never overwritten by accident).
    ``extra_tensors`` (name -> array, or (safetensors code, array)) go to the generation's
    companion file, written after the ``.bin`` and before the manifest that lists it.

    Every argument is checked before the first byte is written (the regions: float32 arrays or
    buffers, lists of them, or iterators of them; a float64 array or a list of numbers is a
    ``RegionError`` naming the region; then ``check_arguments``), and a
    save that fails after its ``.bin`` was written removes it again, so a refused or failed
    save never leaves an orphan that would block the retry.
    ``value_facts`` records whether each region is finite (and v non-negative) in the manifest,
    computed on the hashing thread over the bytes as they are written (spec §5.9); a ``facts``
    field passed in ``manifest`` is never kept, since it was computed over other bytes.
    ``before_commit(doc)`` is called with the sealed manifest after every other part is durable
    and before the manifest is written (a run records the root it is about to commit); what it
    raises fails the save, uncommitted.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> w = np.arange(4, dtype=np.float32)
        >>> r = ckptfmt.save("step_000007.bin", 7, w, w / 10, w / 100)
        >>> r.path, r.manifest_path, r.size, r.facts["weights"]["finite"]
        ('step_000007.bin', 'step_000007.json', 56, True)
        >>> ckptfmt.save("step_000007.bin", 7, w, w, w)
        Traceback (most recent call last):
        ckptfmt.errors.SaveError: step_000007.bin: exists already; refusing to overwrite a checkpoint
    """
    started = time.perf_counter()
    path = os.fspath(path)
    step, n, sources = prepare(path, step, weights, m, v, n_params, manifest if write_manifest else None)
    if not overwrite and os.path.lexists(path):
        raise SaveError(path, atomic.EXISTS)
    facts = valfacts.ValueFacts() if value_facts else None
    digest = _write_hashed(path, fmt.pack_header(step, n), sources, n, facts, exclusive=not overwrite)
    manifest = {k: v for k, v in (manifest or {}).items() if k != valfacts.FIELD}
    if facts is not None:
        manifest[valfacts.FIELD] = facts.to_dict()
    try:
        mpath = _commit(path, step, n, digest, manifest, write_manifest, overwrite, extra_tensors, before_commit)
    except BaseException:
        if not overwrite:           # ours alone: nothing of a refused commit stays behind
            _remove_quietly(path, companion.path_for(path))
        raise
    return SaveResult(path, mpath, step, n, fmt.file_size(n), digest, time.perf_counter() - started,
                      manifest.get(valfacts.FIELD))


def prepare(path: str, step: Any, weights: Region, m: Region, v: Region, n_params: int | None,
            manifest: dict[str, Any] | None) -> tuple[int, int, tuple]:
    """(step, n_params, the regions' chunk sources), every argument checked as ``save`` says,
    before a byte is written; ``path`` names the generation in messages."""
    counts, sources = zip(*(_pieces(r, name, path) for r, name in zip((weights, m, v), fmt.REGIONS)))
    n = _agree_on_n(path, counts, None if n_params is None else _integer(path, "n_params", n_params, fmt.MAX_N))
    return check_arguments(path, step, n, manifest), n, sources


def _remove_quietly(*paths: "str | os.PathLike[str]") -> None:
    """Best effort: the error that failed the save is the one to report, not a failed cleanup
    (what stays is an uncommitted leftover, which readers skip and ``gc`` sweeps)."""
    for p in paths:
        try:
            atomic.remove(p)
        except (OSError, SaveError):
            pass


def _commit(path: str, step: int, n: int, digest: str, manifest: dict[str, Any] | None,
            write_manifest: bool, overwrite: bool, extra_tensors: dict[str, Any] | None,
            before_commit: Callable[[dict[str, Any]], None] | None = None) -> str | None:
    """After the ``.bin``: the companion file (if any), then the manifest, the commit point;
    ``before_commit`` is shown the sealed manifest just before it is written."""
    if extra_tensors:
        manifest = {**(manifest or {}), companion.FIELD: companion.write(path, step, extra_tensors)}
    elif overwrite:
        companion.remove_stale(path)   # the generation it belonged to was uncommitted above
    if not write_manifest:
        return None
    mpath = mf.path_for(path)
    doc = mf.sealed(mf.build(file=os.path.basename(path), size=fmt.file_size(n), step=step,
                             n_params=n, digest=digest, extra=manifest))
    if before_commit is not None:
        before_commit(doc)
    mf.write(mpath, doc)
    return str(mpath)


_STEP_NAME = re.compile(r"^step_(\d+)\.bin$")


def check_arguments(path: str, step: Any, n: int, manifest: dict[str, Any] | None) -> int:
    """Refuse, before anything is written, what would make the save fail half-way or write a
    generation ``open``/``validate`` reject; returns the step as a Python int.

    The step is an integer in 0..2^31-1 (numpy integers are taken, ``True`` is not); a name
    ``step_N.bin`` must be the canonical name of that step (spec §3.4); a layout must tile
    exactly ``n`` parameters (§4.2); the manifest's extra fields must be strict JSON (§4.1).

    >>> check_arguments("step_000007.bin", __import__("numpy").int64(7), 4, None)
    7
    >>> check_arguments("step_000008.bin", 7, 4, None)
    Traceback (most recent call last):
    ckptfmt.errors.StepNameMismatchError: step_000008.bin: name says step 8, the header would say 7: expected step_000007.bin
    """
    if path.endswith(".json"):
        raise SaveError(path, "a checkpoint path must not end in .json (that is its manifest)")
    step = _integer(path, "step", step, fmt.MAX_STEP)
    name = os.path.basename(path)
    named = _STEP_NAME.match(name)
    if named and name != fmt.checkpoint_name(step):
        said = int(named.group(1))
        why = f"name says step {said}, the header would say {step}" if said != step else \
            f"{name} is not the canonical name of step {step} (six digits at least, spec §3.4)"
        raise StepNameMismatchError(path, f"{why}: expected {fmt.checkpoint_name(step)}",
                                    expected=fmt.checkpoint_name(step), got=name)
    if manifest is not None:
        if not isinstance(manifest, dict):
            raise ManifestError(path, f"manifest extras must be a dict, got {type(manifest).__name__}")
        if "layout" in manifest:
            mf.check_layout(path, manifest["layout"], n)
        try:
            mf.dumps(mf.build(file=name, size=fmt.file_size(n), step=step, n_params=n,
                              digest="0" * 64, extra=manifest))
        except (TypeError, ValueError) as exc:
            raise ManifestError(path, f"manifest extras are not strict JSON: {exc}") from None
    return step


def _integer(path: str, what: str, value: Any, high: int) -> int:
    """``value`` as a Python int in 0..high; numpy integers pass, bool and float do not."""
    if isinstance(value, (bool, float)) or not hasattr(value, "__index__"):
        raise SaveError(path, f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if not 0 <= number <= high:
        raise SaveError(path, f"{what} must be in 0..{high}, got {number}")
    return number


def _agree_on_n(path: str, counts: tuple[int, ...], n_params: int | None) -> int:
    known = {c for c in counts if c >= 0}
    if n_params is not None:
        known.add(n_params)
    if len({c for c in counts if c >= 0}) > 1:
        raise SaveError(path, f"weights, m and v must have the same length, got {counts}")
    if len(known) > 1:
        raise SaveError(path, f"n_params={n_params} but the regions hold {max(counts)} values each")
    if not known:
        raise SaveError(path, f"the length of weights, m and v is unknown, got {counts} (pass n_params= for "
                              "streamed regions)")
    return known.pop()


def _write_hashed(path: str, header: bytes, sources: tuple, n: int,
                  facts: valfacts.ValueFacts | None = None, exclusive: bool = False) -> str:
    """Write every chunk while a second thread hashes it (and folds it into ``facts``), in order.

    Buffer contract (spec/FORMAT.md §5.7.1): a buffer a region iterator yields is read by the
    writer and the hasher until the writer asks that iterator for its next piece; by then every
    byte of every earlier piece has been written and hashed, so the producer may refill any
    buffer it yielded before (the CUDA staging pair, or one scratch buffer). Within one piece,
    and across pieces of a list or array (which nobody can refill), hashing chunk k overlaps
    writing chunk k+1. The value facts are folded in by the hashing task itself, so they cover
    exactly the bytes hashed, under the same contract (spec §5.9).
    """
    if os.path.exists(path):  # overwrite: uncommit the old generation before replacing it
        atomic.remove(mf.path_for(path))
    with atomic.AtomicWriter(path, exclusive=exclusive) as out:
        digest = stream_hashed(out, path, header, sources, n, facts)
        out.commit()
    return digest


def stream_hashed(out: Any, path: str, header: bytes, sources: tuple, n: int,
                  facts: valfacts.ValueFacts | None = None) -> str:
    """``_write_hashed`` into ``out``, any sink with ``write`` and ``offset`` (a local temp file,
    a store's upload), left uncommitted: the blake3 of what went in, ``path`` naming it."""
    hasher = fingerprint.hasher(1)
    expected = fmt.file_size(n)
    with ThreadPoolExecutor(1, "ckptfmt-hash") as pool:
        pending: deque[Future] = deque()

        def drain(keep: int = 0) -> None:
            while len(pending) > keep:
                pending.popleft().result()

        for region, chunk in _chunks_with_header(header, sources, drain):
            drain(keep=1)
            pending.append(pool.submit(_digest, hasher, facts, region, chunk))
            out.write(chunk)
        drain()
        if out.offset != expected:
            raise SaveError(path, f"regions hold {out.offset - fmt.HEADER_SIZE} bytes, header "
                                  f"promises {expected - fmt.HEADER_SIZE}", expected=expected, got=out.offset)
    return hasher.hexdigest()


def _digest(hasher: Any, facts: valfacts.ValueFacts | None, region: str | None,
            chunk: memoryview) -> None:
    """The hashing thread's task: the blake3 of a chunk and, for a region, its value facts."""
    hasher.update(chunk)
    if facts is not None and region is not None:
        facts.add_bytes(region, chunk)


def _chunks_with_header(header: bytes, sources: tuple,
                        drain: Callable[[], None]) -> Iterator[tuple[str | None, memoryview]]:
    """(region name, chunk) in file order; the header's region is None."""
    yield None, memoryview(header)
    for region, views in zip(fmt.REGIONS, sources):
        for chunk in _chunks(views if isinstance(views, list) else _pulled(views, drain)):
            yield region, chunk


def _pulled(views: Iterable[memoryview], drain: Callable[[], None]) -> Iterator[memoryview]:
    """Resume a producer only once nothing it yielded is still being hashed (the contract)."""
    it = iter(views)
    while True:
        drain()
        try:
            view = next(it)
        except StopIteration:
            return
        yield view


def save_generation(directory: "str | os.PathLike[str]", step: int, weights: Region, m: Region,
                    v: Region, **kwargs: Any) -> SaveResult:
    """``save`` under the canonical name ``step_NNNNNN.bin`` in ``directory``.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> os.makedirs("runs/a", exist_ok=True)
        >>> z = np.zeros(4, np.float32)
        >>> ckptfmt.save_generation("runs/a", 100, z, z, z).path
        'runs/a/step_000100.bin'
    """
    return save(Path(directory) / fmt.checkpoint_name(step), step, weights, m, v, **kwargs)
