"""The companion file of a generation: tensors the seed layout cannot hold.

``step_NNNNNN.extra.safetensors`` beside ``step_NNNNNN.bin`` holds, for example, a model's
persistent buffers (BatchNorm running statistics and counters) and tensor state of the training
loop's own objects. It is a safetensors file (any safetensors reader opens it), written durably
*before* the manifest, which lists it under ``companion`` with its size and blake3: the
manifest stays the one commit marker of the generation, and a generation whose companion is
missing, truncated or altered is not valid (spec/FORMAT.md §4.6).

>>> import os, tempfile, numpy as np
>>> bin_path = os.path.join(tempfile.mkdtemp(), "step_000007.bin")
>>> entry = write(bin_path, 7, {"bn.running_mean": np.zeros(3, "<f4")})
>>> entry["file"], check(bin_path, entry, deep=True)
('step_000007.extra.safetensors', None)
>>> read(bin_path, entry).tensor("bn.running_mean").tolist()
[0.0, 0.0, 0.0]
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from . import atomic, fingerprint, tensorfile
from .errors import FingerprintMismatchError, ManifestMismatchError, SaveError

SUFFIX = ".extra.safetensors"
FIELD = "companion"          # the manifest field that lists it


def path_for(bin_path: "str | os.PathLike[str]") -> Path:
    """``step_000100.bin`` -> ``step_000100.extra.safetensors``."""
    p = Path(bin_path)
    return p.with_name(p.name[:-len(p.suffix)] + SUFFIX if p.suffix else p.name + SUFFIX)


def code_of(array: np.ndarray) -> str:
    """The safetensors dtype code of a numpy array (bfloat16 travels as its uint16 bits with
    the code given by the caller)."""
    code = tensorfile.CODES.get(_little(array).dtype)
    if code is None:
        raise TypeError(f"no safetensors dtype for {array.dtype}")
    return code


def _little(array: np.ndarray) -> np.ndarray:
    """The array in little-endian byte order (safetensors' order), values unchanged."""
    return array.astype(array.dtype.newbyteorder("<")) if array.dtype.byteorder == ">" else array


def write(bin_path: "str | os.PathLike[str]", step: int,
          tensors: Mapping[str, "np.ndarray | tuple[str, np.ndarray]"]) -> dict[str, Any]:
    """Durably write the companion of ``bin_path``; returns its manifest entry.

    Each value is an array, or ``(code, array)`` where the code must be given (``"BF16"`` with
    the uint16 bits of bfloat16 values).
    """
    path = path_for(bin_path)
    digest = tensorfile.write(str(path), _rows(tensors), _metadata(step))
    return {"file": path.name, "size": path.stat().st_size, "blake3": digest}


def pieces(step: int, tensors: Mapping[str, "np.ndarray | tuple[str, np.ndarray]"]) -> Iterator[memoryview]:
    """The companion file ``write`` makes, as pieces in file order (what a store's writer sends)."""
    return (piece for piece, _ in tensorfile.encode(_rows(tensors), _metadata(step)))


def _rows(tensors: Mapping[str, "np.ndarray | tuple[str, np.ndarray]"]) -> list[tuple[str, str, list[int], np.ndarray]]:
    rows = []
    for name, value in tensors.items():
        code, array = value if isinstance(value, tuple) else (code_of(value), value)
        shape = list(np.shape(array))          # before ascontiguousarray, which makes 0-d 1-d
        rows.append((name, code, shape, np.ascontiguousarray(_little(np.asarray(array)))))
    return rows


def _metadata(step: int) -> dict[str, str]:
    return {"format": "ckptfmt-companion", "step": str(step)}


def check(bin_path: "str | os.PathLike[str]", entry: Mapping[str, Any], *, deep: bool) -> str | None:
    """None when the companion named by ``entry`` is there with its size (and, ``deep``, its
    blake3); else the reason the generation is not valid."""
    problem = _problem(bin_path, entry, deep)
    return None if problem is None else problem.problem


def require(bin_path: "str | os.PathLike[str]", entry: Mapping[str, Any], *, deep: bool) -> None:
    """``check`` as an exception: ``FingerprintMismatchError`` for a hash mismatch,
    ``ManifestMismatchError`` for anything else."""
    problem = _problem(bin_path, entry, deep)
    if problem is not None:
        raise problem


def _problem(bin_path: "str | os.PathLike[str]", entry: Mapping[str, Any],
             deep: bool) -> "FingerprintMismatchError | ManifestMismatchError | None":
    """The error the companion's state amounts to, or None: the class is chosen where the
    problem is found, never read back from the message's words."""
    path = path_for(bin_path)
    if not isinstance(entry, Mapping) or entry.get("file") != path.name:
        return ManifestMismatchError(str(path), f"manifest's companion entry does not name {path.name}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return ManifestMismatchError(str(path), f"companion {path.name} is missing")
    if size != entry.get("size"):
        return ManifestMismatchError(str(path), f"companion {path.name}: expected {entry.get('size')} bytes, got {size}")
    if deep:
        digest = fingerprint.of_file(path)
        if digest != entry.get("blake3"):
            return FingerprintMismatchError(str(path), f"companion {path.name}: "
                                            + fingerprint.mismatch(entry.get("blake3"), digest))
    return None


def read(bin_path: "str | os.PathLike[str]", entry: Mapping[str, Any]) -> tensorfile.TensorFile:
    """The companion's tensors (``tensor(name)`` views); its size is checked first."""
    require(bin_path, entry, deep=False)
    return tensorfile.TensorFile(str(path_for(bin_path)))


def copy(bin_path: "str | os.PathLike[str]", dest_bin: "str | os.PathLike[str]",
         doc: Mapping[str, Any], progress=None) -> dict[str, Any] | None:
    """Copy the companion of ``bin_path`` beside ``dest_bin`` (durably, hashed while copied and
    refused if the hash is not the manifest's); its row (file, size, blake3), None without one."""
    entry = doc.get(FIELD) if doc else None
    if entry is None:
        return None
    src, dst = path_for(bin_path), path_for(dest_bin)
    digest = atomic.copy_verified(src, dst, entry["blake3"], progress)
    return {"file": dst.name, "size": dst.stat().st_size, "blake3": digest}


def remove_stale(bin_path: "str | os.PathLike[str]") -> None:
    """Remove a companion no manifest lists any more (an overwritten generation had one)."""
    try:
        os.unlink(path_for(bin_path))
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SaveError(str(path_for(bin_path)), f"cannot remove: {exc.strerror or exc}") from exc
