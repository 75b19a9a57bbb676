"""Reader (spec §8): ``open(path) -> Checkpoint`` with read-only views over one mmap.

Opening is O(1) in the file size: one ``fstat``, one 8-byte ``pread``, one ``mmap``. Header
values are checked against the real size, as Python ints, before any view is made.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import stat
import threading
from typing import Any, Iterator

import numpy as np

from . import companion, fingerprint, fsio, tensorfile
from . import format as fmt
from . import manifest as mf
from .errors import (BadHeaderError, BadNameError, FingerprintMismatchError, NotACheckpointError,
                     TrailingDataError, TruncatedError)


def check_header(path: str, step: int, n_params: int, size: int) -> None:
    """Raise the typed error for a header that disagrees with the file (spec §8.1, in order)."""
    if step < 0:
        raise BadHeaderError(path, f"negative step {step} at offset 0", offset=0, got=step)
    if n_params < 0:
        raise BadHeaderError(path, f"negative n_params {n_params} at offset 4", offset=4, got=n_params)
    expected = fmt.file_size(n_params)
    if size < expected and not plausibly_torn(size, expected):
        raise TruncatedError(path, f"truncated, or not a ckptfmt checkpoint: header promises "
                                   f"{expected:,} bytes, file has {size:,}", offset=size,
                             expected=expected, got=size)
    if size < expected:
        raise TruncatedError(path, "truncated", offset=size, expected=expected, got=size, unit="bytes")
    if size > expected:
        raise TrailingDataError(path, f"trailing data at offset {expected}", offset=expected,
                                expected=expected, got=size, unit="bytes")


TORN_FRACTION = 16   # spec §8.1: a file under 1/16 of what its header promises is more likely not ours


def plausibly_torn(size: int, expected: int) -> bool:
    """Could a file of ``size`` bytes be a torn write of a checkpoint of ``expected`` bytes?

    A torn write leaves a prefix of the real file; but a text file renamed ``.bin`` also reads
    as a header that promises gigabytes. Far short of the promise (under 1/16), both readings
    are named in the message; close to it, the file is called truncated.

    >>> plausibly_torn(120, 128), plausibly_torn(135, 23_379_187_004)
    (True, False)
    """
    return size * TORN_FRACTION >= expected


def read_header(path: "str | os.PathLike[str]", fd: int | None = None) -> tuple[int, int, int]:
    """(step, n_params, size) of a file whose header agrees with its size.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> z = np.zeros(3, np.float32)
        >>> _ = ckptfmt.save("step_000009.bin", 9, z, z, z)
        >>> ckptfmt.read_header("step_000009.bin")            # 8 + 12 * 3 bytes
        (9, 3, 44)
    """
    path = os.fspath(path)
    own = fd is None
    if own:
        fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size < fmt.HEADER_SIZE:
            raise NotACheckpointError(path, "not a ckptfmt checkpoint: too short for the 8-byte header", offset=size,
                                      expected=fmt.HEADER_SIZE, got=size, unit="bytes", at_least=True)
        step, n = fmt.unpack_header(os.pread(fd, fmt.HEADER_SIZE, 0))
        check_header(path, step, n, size)
        return step, n, size
    finally:
        if own:
            os.close(fd)


def _open_regular(path: str) -> int:
    """Open read-only without following into FIFOs or devices (they would hang or lie)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:                 # a socket cannot be opened at all (ENXIO): name what it is
        if e.errno != errno.ENXIO or not stat.S_ISSOCK(os.stat(path).st_mode):
            raise
        raise NotACheckpointError(path, "not a regular file (a socket), expected a step_NNNNNN.bin file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else f"not a regular file ({fsio.special(mode)})"
        raise NotACheckpointError(path, f"{kind}, expected a step_NNNNNN.bin file")
    return fd


class Checkpoint:
    """An open checkpoint: ``step``, ``n_params``, ``weights``/``m``/``v`` views, ``manifest``.

    The views are read-only and zero-copy (one mmap), so opening costs the same for 1 KB and
    12 GB; ``copy_on_write=True`` gives writable views that never touch the file.

    Examples:
        >>> import ckptfmt, numpy as np, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "step_000003.bin")
        >>> w = np.arange(4, dtype="<f4")
        >>> layout = [{"name": "a", "shape": [2, 2], "offset": 0}]
        >>> _ = ckptfmt.save(path, 3, w, w / 10, w / 100, manifest={"layout": layout})
        >>> ck = ckptfmt.open(path)
        >>> ck.step, ck.n_params, ck.weights.flags.writeable, ck.verified_status
        (3, 4, False, 'committed')
        >>> [name for name, _ in ck.tensors()], ck.names()
        (['a'], ['a'])
        >>> ck.tensor("a", region="m").tolist()
        [[0.0, 0.10000000149011612], [0.20000000298023224, 0.30000001192092896]]
        >>> ck.verify(); ck.close()
    """

    def __init__(self, path: str, step: int, n_params: int, size: int, buffer: Any,
                 manifest: dict[str, Any] | None, mm: mmap.mmap | None):
        self.path = path
        self.step = step
        self.n_params = n_params
        self.size = size
        self.manifest = manifest
        self._mmap = mm
        self._buffer = buffer
        self.held: "tensorfile.TensorFile | None" = None   # a companion read already (from a store)
        self.verified = False                                # every part hashed already
        self.weights, self.m, self.v = (self.region(r) for r in fmt.REGIONS)

    def region(self, name: str) -> np.ndarray:
        """The flat read-only float32 view of ``weights``, ``m`` or ``v``."""
        return np.frombuffer(self._buffer, dtype=fmt.DTYPE, count=self.n_params,
                             offset=fmt.region_offset(name, self.n_params))

    @property
    def verified_status(self) -> str:
        """'unverified' for a bare file; 'committed' when a manifest matched (hash not checked)."""
        return "unverified" if self.manifest is None else "committed"

    @property
    def layout(self) -> list[dict[str, Any]] | None:
        """The manifest's parameter layout (name, shape, offset per tensor), if it has one."""
        return None if self.manifest is None else self.manifest.get("layout")

    def names(self) -> list[str]:
        """Parameter names in file order (empty without a layout)."""
        return [entry["name"] for entry in self.layout or []]

    def tensor(self, name: str, region: str = "weights") -> np.ndarray:
        """The view of one parameter, shaped as the layout says; a tied name (the manifest's
        ``aliases``: ``lm_head.weight`` stored once as ``wte.weight``) gives its tensor."""
        name = mf.aliases_of(self.manifest or {}).get(name, name)
        for entry in self.layout or []:
            if entry["name"] == name:
                count = math.prod(entry["shape"])
                flat = getattr(self, region)[entry["offset"]:entry["offset"] + count]
                return flat.reshape(entry["shape"])
        raise KeyError(f"{self.path}: no parameter named {name!r} in the layout")

    def tensors(self, region: str = "weights") -> Iterator[tuple[str, np.ndarray]]:
        """(name, shaped view) of every parameter of ``region``, in file order."""
        for name in self.names():
            yield name, self.tensor(name, region)

    def buffer(self) -> memoryview:
        """The whole file as bytes, without a copy."""
        return memoryview(self._buffer)

    def release(self, offset: int, length: int) -> None:
        """Drop our mapping of a byte range already processed (the page cache keeps the data),
        so streaming over a 1.4 GB file does not grow the process's RSS to 1.4 GB."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = (offset // page) * page
        end = ((offset + length) // page) * page
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def fingerprint(self, progress=None, behind: "ReleaseBehind | None" = None,
                    lane: int | None = None) -> str:
        """blake3 of the whole file; mapped pages are released as they are hashed (or, given
        ``behind`` and this reader's ``lane``, once every reader of the pass has passed them),
        so hashing a 1.4 GB file does not leave 1.4 GB resident in this process."""
        behind = behind or ReleaseBehind(self)
        lane = behind.lane() if lane is None else lane

        def done(nbytes: int, state=[0]) -> None:
            state[0] += nbytes
            behind.advance(lane, state[0])
            if progress is not None:
                progress(nbytes)
        try:
            return fingerprint.of_buffer(memoryview(self._buffer), done)
        finally:
            behind.advance(lane, self.size)

    def verify(self) -> None:
        """Check the content hash against the manifest; a bare file has nothing to check."""
        if self.manifest is None or self.verified:
            return
        digest = self.fingerprint()
        if digest != self.manifest["blake3"]:
            raise FingerprintMismatchError(self.path, fingerprint.mismatch(self.manifest["blake3"], digest),
                                           expected=self.manifest["blake3"], got=digest)
        if companion.FIELD in self.manifest:
            companion.require(self.path, self.manifest[companion.FIELD], deep=True)

    def companion(self) -> "tensorfile.TensorFile | None":
        """The generation's companion file (buffers and state tensors), None when it has
        none; its size is checked here, its blake3 by ``verify``."""
        if self.held is not None:
            return self.held
        if self.manifest is None or companion.FIELD not in self.manifest:
            return None
        return companion.read(self.path, self.manifest[companion.FIELD])

    def close(self) -> None:
        """Drop our references; the map closes when the last view is gone."""
        self.weights = self.m = self.v = None  # type: ignore[assignment]
        self._buffer = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view: the map lives until that view is released
            self._mmap = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, step={self.step}, n_params={self.n_params})"


class ReleaseBehind:
    """Releases a mapping's pages once every reader of one pass has gone past them (a hash
    thread and a copy or scan in file order), so neither re-faults what the other dropped.

    Pages go in batches of ``BATCH`` bytes: one ``madvise`` per tensor cost a fifth of a 154 MB
    load (benchmarks/README.md); per 32 MiB it costs next to nothing. A reader more than
    ``WINDOW`` bytes ahead of the slowest waits for it, so the pages mapped at once (and the
    process's RSS) stay bounded however the two readers' speeds differ. Every reader must end
    with ``advance(lane, ck.size)``, also when it fails, or the others would wait for it.
    """

    BATCH = 32 << 20
    WINDOW = 64 << 20

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self.positions: list[int] = []
        self.released = 0
        self._cond = threading.Condition()

    def lane(self) -> int:
        """Register a reader starting at offset 0; returns its lane for ``advance``."""
        with self._cond:
            self.positions.append(0)
            return len(self.positions) - 1

    def advance(self, lane: int, offset: int) -> None:
        """Reader ``lane`` is done with every byte below ``offset`` (``ck.size``: finished)."""
        with self._cond:
            self.positions[lane] = offset
            safe = min(self.positions)
            if safe - self.released >= self.BATCH or (safe >= self.ck.size and safe > self.released):
                self.ck.release(self.released, safe - self.released)
                self.released = safe
            self._cond.notify_all()
            while offset < self.ck.size and offset - min(self.positions) > self.WINDOW:
                self._cond.wait()


def open(path: "str | os.PathLike[str]", *, manifest: str = "auto", verify: bool = False,
         copy_on_write: bool = False, check_name: bool = True) -> Checkpoint:
    """Open a checkpoint in O(1): header check, one mmap, three views.

    manifest: 'auto' reads ``X.json`` beside the file when present (and refuses one that does not
    match), 'require' refuses a bare file, 'ignore' never looks. verify: hash the file and compare
    with the manifest (reads every byte). copy_on_write: map privately so the views are writable
    without touching the file (what ``torch.from_numpy`` needs to stay silent).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> w = np.arange(3, dtype=np.float32)
        >>> _ = ckptfmt.save("step_000005.bin", 5, w, w, w)
        >>> ck = ckptfmt.open("step_000005.bin", verify=True)    # every byte hashed against the manifest
        >>> ck.step, ck.n_params, ck.weights.tolist()
        (5, 3, [0.0, 1.0, 2.0])
        >>> ck.close()
    """
    path = os.fspath(path)
    fd = _open_regular(path)
    try:
        step, n, size = read_header(path, fd)
        doc = _load_manifest(path, manifest, size=size, step=step, n_params=n)
        if check_name:
            _check_name(path, step)
        access = mmap.ACCESS_COPY if copy_on_write else mmap.ACCESS_READ
        mm = mmap.mmap(fd, size, access=access)
    finally:
        os.close(fd)
    ckpt = Checkpoint(path, step, n, size, mm, doc, mm)
    if verify:
        try:
            if doc is None:
                raise mf.ManifestError(path, "cannot verify: no manifest beside the file (a bare, unverified file)")
            ckpt.verify()
        except BaseException:
            ckpt.close()      # the map is not left to whoever keeps the error (and its frames)
            raise
    return ckpt


def _check_name(path: str, step: int) -> None:
    parsed = fmt.parse_name(os.path.basename(path))
    if parsed is not None and parsed[0] != step:
        raise BadNameError(path, f"name says step {parsed[0]}, header says step {step}",
                           expected=parsed[0], got=step)


def _load_manifest(path: str, mode: str, **facts: int) -> dict[str, Any] | None:
    if mode == "ignore":
        return None
    doc = mf.beside(path, **facts)
    if doc is None and mode == "require":
        raise mf.ManifestError(str(mf.path_for(path)), "missing: the generation is not committed")
    return doc


def from_bytes(data: bytes, path: str = "<bytes>") -> Checkpoint:
    """Parse a checkpoint held in memory (tests, fuzzing); same checks as ``open``."""
    if len(data) < fmt.HEADER_SIZE:
        raise NotACheckpointError(path, "not a ckptfmt checkpoint: too short for the 8-byte header", offset=len(data),
                                  expected=fmt.HEADER_SIZE, got=len(data), unit="bytes", at_least=True)
    step, n = fmt.unpack_header(data)
    check_header(path, step, n, len(data))
    return Checkpoint(path, step, n, len(data), data, None, None)

