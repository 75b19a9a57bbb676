"""The manifest ``step_NNNNNN.json`` (spec §4): the commit marker and everything the seed
layout cannot hold. A generation is committed only when its manifest exists and matches.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from . import atomic, companion, seal
from . import facts as valfacts
from .errors import (IncompleteResumeStateError, ManifestError, ManifestMismatchError,
                     UnsupportedVersionError, parse_json)

FORMAT_ID = "ckptfmt"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20   # spec §4: bounded before parsing
REQUIRED = {"format": str, "format_version": int, "file": str, "size": int, "step": int,
            "n_params": int, "blake3": str}


def path_for(bin_path: "str | os.PathLike[str]") -> Path:
    """``step_000100.bin`` -> ``step_000100.json`` (any ``X.bin`` -> ``X.json``)."""
    return Path(bin_path).with_suffix(".json")


def build(*, file: str, size: int, step: int, n_params: int, digest: str,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    core = {"format": FORMAT_ID, "format_version": FORMAT_VERSION, "file": file, "size": size,
            "step": step, "n_params": n_params, "blake3": digest}
    merged = dict(extra or {})
    merged.update(core)  # core fields always describe the bytes written, never a caller's guess
    return merged


def sealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` as its file holds it once written: JSON values, sealed over what it holds
    now (§4.7; an old seal is replaced). NaN/inf are refused (they are not JSON)."""
    return seal.apply(json.loads(json.dumps(manifest, allow_nan=False)))


def dumps(manifest: dict[str, Any]) -> bytes:
    """The manifest's file: sealed, keys sorted, one field per line."""
    return (json.dumps(sealed(manifest), indent=1, sort_keys=True) + "\n").encode()


def write(path: "str | os.PathLike[str]", manifest: dict[str, Any]) -> None:
    atomic.write_bytes(path, dumps(manifest))


def read(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """Parse and schema-check a manifest; ``ManifestError`` names what is wrong."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    return parse(data, path)


def parse(data: bytes, path: str) -> dict[str, Any]:
    """A manifest's bytes (from a file or a mirror) as a checked document: its seal first (§4.7),
    then the schema. ``ManifestError`` names what is wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(path, f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(path, f"not valid JSON: {exc}") from None
    doc = parse_json(text, ManifestError, path, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    if not isinstance(doc, dict):
        raise ManifestError(path, f"expected a JSON object, got {type(doc).__name__}")
    seal.check(path, doc)
    check_schema(path, doc)
    return doc


def self_checked(path: str, doc: dict[str, Any]) -> str | None:
    """None when ``doc``'s seal covers all of it, else what is not covered and why (an older
    writer made it, or added fields to it). ``doc`` comes from ``read``: its seal held."""
    return seal.check(path, doc)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose names repeat is refused: parsers disagree on which value counts (the
    first, the last), so such a manifest would commit different facts to different readers."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate name {twice!r} in one object")
    return doc


def check_schema(path: str, doc: dict[str, Any]) -> None:
    for key, kind in REQUIRED.items():
        if key not in doc:
            raise ManifestError(path, f"missing field '{key}'")
        value = doc[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ManifestError(path, f"field '{key}': expected {kind.__name__}, got {value!r}")
    if doc["format"] != FORMAT_ID:
        raise ManifestError(path, f"format: expected '{FORMAT_ID}', got {doc['format']!r}")
    if doc["format_version"] > FORMAT_VERSION:
        raise UnsupportedVersionError(path, f"format_version {doc['format_version']} is newer than this "
                                  f"ckptfmt understands ({FORMAT_VERSION})")
    if "shards" in doc and "world_size" in doc and (not isinstance(doc["shards"], list)
                                                   or doc["world_size"] != len(doc["shards"])):
        raise ManifestError(path, f"world_size {doc['world_size']!r} is not the number of shards")
    if isinstance(doc.get("shards"), list) and isinstance(doc.get(valfacts.FIELD), dict):
        parts = [r.get(valfacts.FIELD) if isinstance(r, dict) else None for r in doc["shards"]]
        if all(isinstance(p, dict) for p in parts) and valfacts.combine(parts) != doc[valfacts.FIELD]:
            raise ManifestError(path, "the shards' facts do not add up to the generation's facts")  # sealed: binds each row's
    if os.path.basename(doc["file"]) != doc["file"]:
        raise ManifestError(path, f"field 'file' must be a bare name, got {doc['file']!r}")
    if not is_digest(doc["blake3"]):
        raise ManifestError(path, f"field 'blake3' is not a 64-digit hex digest: {doc['blake3']!r}")
    if "layout" in doc:
        check_layout(path, doc["layout"], doc["n_params"])


def is_digest(value: Any) -> bool:
    """A blake3 digest as manifests hold it: 64 lower-case hex digits (what ``b3sum`` prints)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_layout(path: str, layout: Any, n_params: int) -> None:
    """The layout must tile 0..n_params exactly: no holes, no overlaps, in order."""
    if not isinstance(layout, list):
        raise ManifestError(path, "layout must be a list")
    cursor = 0
    for i, entry in enumerate(layout):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("shape"), list) and isinstance(entry.get("offset"), int)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        for d in entry["shape"])):
            raise ManifestError(path, f"layout entry {i} must have name, shape and offset")
        if entry["offset"] != cursor:
            raise ManifestError(path, f"layout entry {i} ({entry['name']}): expected offset "
                                      f"{cursor}, got {entry['offset']}")
        cursor += math.prod(entry["shape"])
    if cursor != n_params:
        raise ManifestError(path, f"layout covers {cursor} parameters, n_params is {n_params}")


def check_matches(manifest_path: str, doc: dict[str, Any], bin_path: str, *,
                  size: int, step: int, n_params: int) -> None:
    """Fast consistency check of a manifest against the file it claims to describe."""
    for field, actual in (("file", os.path.basename(bin_path)), ("size", size),
                          ("step", step), ("n_params", n_params)):
        if doc[field] != actual:
            raise ManifestMismatchError(manifest_path, f"{field}: manifest says {doc[field]!r}, "
                                        f"{os.path.basename(bin_path)} has {actual!r}",
                                        expected=doc[field], got=actual)


def beside(bin_path: "str | os.PathLike[str]", *, size: int, step: int,
           n_params: int) -> dict[str, Any] | None:
    """The manifest beside ``bin_path`` when there is one and it describes that file, else None.

    The one check of "is the manifest beside this file, and does it match" that the reader,
    validation and inspection share: raises ``ManifestError`` when it cannot be read or breaks
    the schema, ``ManifestMismatchError`` when it describes other bytes (name, size, step,
    n_params). The blake3 is not checked here (that needs the whole file: ``verify``).
    """
    mpath = path_for(bin_path)
    if not mpath.exists():
        return None
    doc = read(mpath)
    check_matches(str(mpath), doc, os.fspath(bin_path), size=size, step=step, n_params=n_params)
    if companion.FIELD in doc:
        companion.require(bin_path, doc[companion.FIELD], deep=False)
    return doc


def json_fields(state: dict[str, Any]) -> dict[str, Any]:
    """The entries of a ``state_dict()`` (scheduler, GradScaler) that JSON holds as they are:
    None, bool, int, float, str and lists. Tensors and other objects are left out; a caller
    that needs them stores them elsewhere.

    >>> json_fields({"last_epoch": 3, "gamma": 0.5, "verbose": False, "fn": print})
    {'last_epoch': 3, 'gamma': 0.5, 'verbose': False}
    """
    return {k: v for k, v in state.items() if v is None or isinstance(v, (bool, int, float, str, list))}


def aliases_of(doc: dict[str, Any]) -> dict[str, str]:
    """Tied names -> the name their tensor is stored under: the manifest's ``aliases`` (written
    by every writer since the mapping knew them) or a foreign import's ``imported.aliases``."""
    found = doc.get("aliases")
    if not isinstance(found, dict):
        imported = doc.get("imported") if isinstance(doc.get("imported"), dict) else {}
        found = imported.get("aliases") if isinstance(imported.get("aliases"), dict) else {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def get_dotted(doc: dict[str, Any], dotted: str) -> Any:
    node: Any = doc
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


RESUME_OBJECTS = ("optimizer", "scheduler", "rng", "amp", "state", "config", "buffers")


def require_objects(path: "str | os.PathLike[str]", doc: dict[str, Any],
                    fields: tuple[str, ...] = RESUME_OBJECTS) -> None:
    """Refuse a manifest where one of ``fields`` is present but not a JSON object (null is
    absent): a resume reads into them, and would fail far from the cause."""
    for name in fields:
        if doc.get(name) is not None and not isinstance(doc[name], dict):
            raise ManifestError(os.fspath(path), f"field '{name}': expected an object, got {doc[name]!r:.40}")


def require(path: "str | os.PathLike[str]", doc: dict[str, Any], components: tuple[str, ...]) -> None:
    """Refuse a resume whose manifest lacks one of ``components`` (dotted paths), naming every
    missing one; never reset it silently."""
    missing = []
    for name in components:
        try:
            get_dotted(doc, name)
        except KeyError:
            missing.append(name)
    if missing:
        raise IncompleteResumeStateError(path, "cannot resume: manifest lacks "
                                         + ", ".join(missing), expected=list(components), got=missing)
