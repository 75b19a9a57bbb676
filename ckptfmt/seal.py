"""The manifest's seal (spec/FORMAT.md §4.7): a blake3 of each of the manifest's own fields, and
one over those, so a flipped bit in the RNG states, the scheduler, the config or any other field
is damage that names the field, as one in the ``.bin`` is.

    "seal": {"blake3": "<64 hex>", "fields": {"config": "<64 hex>", ...}, "writer": "ckptfmt 0.1.0"}

Each field's digest is taken over a canonical form of its JSON value (one text for equal values,
whatever the whitespace, key order or number spelling of the file), so the seal is checked before
any field, the format version included, is believed; ``blake3`` covers the field digests and the
writer, so a flip in the record is damage too.

Released writers copy a seal they do not know into manifests they rewrite. A fork adds
``provenance``; a split into shards or a join of them re-points the payload fields (``file``,
``size``, ``blake3``, ``shards``, ``world_size``) at a new payload and a join adds
``consolidated_from``. Such a manifest is not damaged: the payload fields may differ from their
digests when ``file`` names the other form of the sealed payload (``step_N.bin`` for the sealed
``step_N.shards``, or the reverse: the payload's own digests bind them then), those two fields may
stand outside the seal, and the note says what is not self-checked. Any other difference is damage. A
manifest without a seal was written before it existed: "not self-checked". One flipped bit cannot
make a sealed manifest pass as such: in the name ``seal`` it leaves a record of the seal's shape
under another name, which is damage.

>>> doc = apply({"format": "ckptfmt", "step": 7, "lr": 1.0, "file": "step_000007.bin"})
>>> sorted(doc["seal"]["fields"])
['file', 'format', 'lr', 'step']
>>> check("m.json", doc) is None
True
>>> check("m.json", {**doc, "lr": 1}) is None         # the same JSON value, spelled otherwise
True
>>> check("m.json", {**doc, "step": 6})
Traceback (most recent call last):
ckptfmt.errors.ManifestSealError: m.json: field 'step' does not match the manifest's seal: the manifest was damaged or edited after it was written
"""
from __future__ import annotations

import json
import math
from typing import Any

import blake3

from .errors import ManifestSealError
from .version import __version__

FIELD = "seal"
PAYLOAD = frozenset({"file", "size", "blake3", "shards", "world_size"})   # re-pointed by a split or a join
LATER = frozenset({"provenance", "consolidated_from"})    # what a released writer adds to a copied seal
RECORD = ("blake3", "fields", "writer")
DOMAIN = b"ckptfmt manifest seal 1\n"
FIELD_DOMAIN = b"ckptfmt manifest field 1\n"
EXACT = 1 << 53                           # integral floats below this are written as integers
OLDER = "manifest not self-checked (written by an older ckptfmt)"
WRITER = f"ckptfmt {__version__}"


def canonical(value: Any) -> str:
    """The canonical text of a JSON value: objects by sorted keys, no whitespace, strings as
    ``json.dumps`` escapes them (ASCII), integers and integral floats below 2**53 as integers
    (``-0.0`` stays ``-0.0``), other floats as their shortest round-trip repr; NaN and infinities
    are refused.

    >>> canonical({"b": [1.0, 2.5, -0.0, 1e300], "a": "é", "c": None})
    '{"a":"\\\\u00e9","b":[1,2.5,-0.0,1e+300],"c":null}'
    """
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not JSON")
        if value == 0 and math.copysign(1.0, value) < 0:
            return "-0.0"                      # a zero's sign is kept: a flip that drops it is damage
        return str(int(value)) if value.is_integer() and abs(value) < EXACT else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("object keys must be strings")
        return "{" + ",".join(json.dumps(k) + ":" + canonical(value[k]) for k in sorted(value)) + "}"
    raise ValueError(f"{type(value).__name__} is not JSON")


def field_digest(value: Any) -> str:
    """The blake3 of one field's value, in its canonical text."""
    return blake3.blake3(FIELD_DOMAIN + canonical(value).encode("ascii")).hexdigest()


def record_digest(fields: dict[str, str], writer: str) -> str:
    """The seal's own blake3: over the field digests and the writer."""
    return blake3.blake3(DOMAIN + canonical({"fields": fields, "writer": writer}).encode("ascii")).hexdigest()


def apply(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with a fresh seal over every field it holds (an old seal is replaced)."""
    out = {k: v for k, v in doc.items() if k != FIELD}
    fields = {k: field_digest(v) for k, v in out.items()}
    out[FIELD] = {"blake3": record_digest(fields, WRITER), "fields": fields, "writer": WRITER}
    return out


def sealed_names(doc: dict[str, Any]) -> set[str]:
    """The field names a seal was made over, wherever a record of the seal's shape sits in
    ``doc``: what a file is may be decided by them too, so a flipped bit in a field's name
    (``shards``, ``format``, ``lightning``) leaves the file's kind as it was and the seal, checked
    when the file is read, names the damage, instead of the file passing as another kind."""
    names: set[str] = set()
    for value in doc.values():
        if isinstance(value, dict) and set(value) == set(RECORD) and isinstance(value["fields"], dict):
            names |= set(value["fields"])
    return names


def check(path: str, doc: dict[str, Any]) -> str | None:
    """Check ``doc``'s seal before any of its fields is used: ``ManifestSealError`` when it is
    damaged, a note when it is not (wholly) self-checked (no seal: an older writer; a copied seal
    around a rewrite by one), None when the seal covers every field."""
    record = doc.get(FIELD)
    if record is None:
        impostor = next((k for k, v in doc.items() if isinstance(v, dict) and set(v) == set(RECORD)), None)
        if impostor is not None:
            raise ManifestSealError(path, f"field {impostor!r} holds a manifest seal: the manifest was "
                                          f"damaged (its seal's name is '{FIELD}')")
        return OLDER
    fields = _record_fields(path, record)
    differ = [k for k, d in sorted(fields.items()) if k not in doc or _digest_of(path, k, doc[k]) != d]
    outside = sorted(k for k in doc if k != FIELD and k not in fields)
    repointed = "file" in differ and _repointed(doc.get("file"), fields.get("file"))
    damaged = [k for k in differ if not (repointed and k in PAYLOAD)]
    damaged += [k for k in outside if k not in LATER and not (repointed and k in PAYLOAD)]
    if damaged:
        how = "does not match" if damaged[0] in fields else "is not covered by"
        raise ManifestSealError(path, f"field {damaged[0]!r} {how} the manifest's seal: the manifest was "
                                      "damaged or edited after it was written")
    notes = [f"{', '.join(k for k in outside if k in LATER)}, added later"] if set(outside) & LATER else []
    if repointed:
        notes.append("its payload fields, rewritten for a new payload")
    if not notes:
        return None
    return (f"manifest self-checked but for {' and '.join(notes)} by a writer that did not know the seal "
            "(not covered)")


def _repointed(file: Any, sealed: str | None) -> bool:
    """``file`` is the other form of the payload the seal was made for (``step_N.bin`` where it
    sealed ``step_N.shards``, or the reverse): what a released split or join does, and what no
    flipped bit can (it would have to rename the payload and keep its step)."""
    if not isinstance(file, str):
        return False
    stem, dot, suffix = file.rpartition(".")
    other = {"bin": "shards", "shards": "bin"}.get(suffix) if dot else None
    return other is not None and field_digest(f"{stem}.{other}") == sealed


def _record_fields(path: str, record: Any) -> dict[str, str]:
    """The seal's field digests, once the record is well formed and its own digest holds."""
    if not (isinstance(record, dict) and set(record) == set(RECORD) and isinstance(record["blake3"], str)
            and isinstance(record["writer"], str) and isinstance(record["fields"], dict)
            and all(isinstance(d, str) for d in record["fields"].values())):
        raise ManifestSealError(path, f"field '{FIELD}' is malformed: expected an object with "
                                      f"{', '.join(RECORD)}")
    if record_digest(record["fields"], record["writer"]) != record["blake3"]:
        raise ManifestSealError(path, f"field '{FIELD}' does not match its own digest: the manifest was damaged")
    return record["fields"]


def _digest_of(path: str, name: str, value: Any) -> str:
    try:
        return field_digest(value)
    except ValueError as exc:
        raise ManifestSealError(path, f"field {name!r} cannot be sealed: {exc}") from None
