"""What a file is, decided by its content (spec/FORMAT.md §8.6): one registry of kinds that
every command shares.

Each ``Kind`` has a name, a human label, a ``sniff`` of the first bytes (and, for a zip or a
small JSON document, its directory or its keys), the names that claim it, the name ``convert``
reads it under, and what each command does with it. The rule, in ``sniff``:

1. another format's magic bytes win (zstd frames, the byte-plane magic, a safetensors header,
   a zip holding ``*/data.pkl`` or ``.npy`` members, torch's legacy pickle magic), then the
   directories and JSON documents known by their keys;
2. otherwise the name claims a kind (``.bin`` or ``step_N``: a seed ``.bin``, so a torn
   ``step_N.bin`` stays a defect; ``.pt``, ``.safetensors``, ...), and so does a plausible seed
   header (``size == 8 + 12n``);
3. otherwise the file is of no kind ckptfmt knows (``UnsupportedKindError``, CLI exit 2).

Reading is O(1) in the file size: one ``stat``, 64 bytes, and at most a zip's directory or a
JSON document of a few MiB. A new kind (a Lightning checkpoint, a Hugging Face Trainer
directory) is one more entry in ``KINDS``.

>>> import os, tempfile
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "step_000003.bin")
>>> with open(p, "wb") as f: _ = f.write(fmt.pack_header(3, 1) + bytes(12))
>>> sniff(p).name, sniff(d).name
('bin', 'run')
>>> with open(p, "wb") as f: _ = f.write(b"CKPTZST\\x01...")
>>> sniff(p).label
'ckptfmt byte-plane file (.ckz)'
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import format as fmt
from . import fsio, hfdirs, seal
from .probe import Probe
from .errors import UnsupportedKindError

__all__ = ["KINDS", "COMMANDS", "Kind", "Probe", "by_name", "get", "require", "sniff", "generation_in",
           "resolve", "PLANES_MAGIC", "TORCH_LEGACY_MAGIC", "ZSTD_FRAME", "ZSTD_SKIPPABLE"]

ZSTD_SKIPPABLE = 0x184D2A5C   # ckptfmt's metadata frame (RFC 8878 §3.1.2), spec §10.4
ZSTD_FRAME = 0xFD2FB528       # an ordinary zstd frame (RFC 8878 §3.1.1)
PLANES_MAGIC = b"CKPTZST\x01"  # the byte-plane form, spec §10.5
TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"   # torch.save's pickled magic number (< 1.6)
ZIP_MAGIC = b"PK\x03\x04"
COMMANDS = ("inspect", "validate", "diff", "convert", "ls")
LIGHTNING = "lightning"       # the manifest field of a Lightning checkpoint's generation (RUN.md §11)
LIGHTNING_ENTRIES = 16        # a Lightning checkpoint directory holds one generation: a few entries


@dataclass(frozen=True)
class Kind:
    """One kind of file: ``sniff`` decides from content; ``claims`` are the name endings that
    make a file of this kind when no content decides; ``convert`` is the format name convert
    reads it as (None: it cannot); ``does`` says what each command does with it (a command not
    in it refuses the kind, exit 2)."""
    name: str
    label: str
    sniff: Callable[[Probe], bool]
    does: Mapping[str, str]
    convert: str | None = None
    claims: tuple[str, ...] = ()
    ours: bool = False            # written by ckptfmt (a digest of its own), else foreign or either
    needs: str | None = None      # the optional extra it needs ("torch")
    extra: Mapping[str, Any] = field(default_factory=dict)

    def can(self, command: str) -> bool:
        """True when ``command`` does something with this kind."""
        return command in self.does

    def claimed_by(self, name: str) -> bool:
        """True when the (lower-case) file name claims this kind."""
        return name.endswith(self.claims) if self.claims else False


def _le32(head: bytes) -> int | None:
    return struct.unpack("<I", head[:4])[0] if len(head) >= 4 else None


def _zst(p: Probe) -> bool:
    return p.is_file and _le32(p.head) in (ZSTD_SKIPPABLE, ZSTD_FRAME)


def _archive(p: Probe) -> bool:
    """A zstd frame whose first decompressed block is a POSIX tar header (``ustar`` at byte
    257): what ``export --archive`` writes. A ckptfmt ``.zst`` stream decompresses to a seed
    header instead."""
    return p.is_file and _le32(p.head) == ZSTD_FRAME and p.unpacked_head[257:262] == b"ustar"


def _planes(p: Probe) -> bool:
    return p.is_file and p.head.startswith(PLANES_MAGIC)


def _safetensors(p: Probe) -> bool:
    """8-byte LE header length, then ``{`` (a seed header never passes: its n_params would make
    the length larger than the file)."""
    if not p.is_file or len(p.head) < 9:
        return False
    length = struct.unpack("<Q", p.head[:8])[0]
    return 2 <= length <= p.size - 8 and p.head[8:9] == b"{"


def _torch_zip(p: Probe) -> bool:
    """A zip holding ``ARCHIVE/data.pkl`` (a zip whose directory is torn, not named .npz, too:
    torch is what writes zips that we are given)."""
    if not (p.is_file and p.head.startswith(ZIP_MAGIC)):
        return False
    names = p.zip_names
    if names is None:
        return not p.name.endswith(".npz")
    return any(n == "data.pkl" or n.endswith("/data.pkl") for n in names)


def _torch_legacy(p: Probe) -> bool:
    return p.is_file and p.head.startswith(TORCH_LEGACY_MAGIC)


def _npz(p: Probe) -> bool:
    names = p.zip_names if p.is_file and p.head.startswith(ZIP_MAGIC) else None
    return bool(names) and all(n.endswith(".npy") for n in names)


def _dcp(p: Probe) -> bool:
    return p.is_dir and os.path.isfile(os.path.join(p.path, ".metadata"))


def _ours(doc: dict[str, Any] | None) -> bool:
    return doc is not None and (doc.get("format") == "ckptfmt" or "format" in seal.sealed_names(doc))


def _has(doc: dict[str, Any], name: str, kind: type) -> bool:
    """The manifest holds field ``name`` of that type, or its seal says it was written with it."""
    return isinstance(doc.get(name), kind) or name in seal.sealed_names(doc)


def _beside(p: Probe, suffix: str) -> bool:
    """``p`` is a canonical ``step_N.json`` with its generation's ``step_N`` + ``suffix`` beside
    it: a manifest by its name and place, whatever its bytes say (a damaged one is still the
    manifest of that generation, and reading it names the damage)."""
    parsed = fmt.parse_name(p.name)
    if not (p.is_file and parsed is not None and parsed[1] == "json"):
        return False
    sibling = os.path.join(os.path.dirname(p.path), fmt.stem(parsed[0]) + suffix)
    return os.path.isdir(sibling) if suffix == ".shards" else os.path.isfile(sibling)


def _sharded(p: Probe) -> bool:
    """A sharded generation: its manifest (``shards`` rows, or by its name beside its
    ``step_N.shards``) or that directory."""
    if p.is_dir:
        return p.name.endswith(".shards")
    doc = p.document
    return (_ours(doc) and _has(doc, "shards", list)) or _beside(p, ".shards")


def _index(p: Probe) -> bool:
    """A weight map of safetensors shards (``pytorch_model.bin.index.json`` maps torch files)."""
    doc = p.document
    return doc is not None and isinstance(doc.get("weight_map"), dict) and not p.name.endswith(".bin.index.json")


def _manifest(p: Probe) -> bool:
    return _ours(p.document) or _beside(p, ".bin")


def generation_in(directory: "str | os.PathLike[str]") -> str | None:
    """The ``step_N.bin`` of a Lightning checkpoint directory (spec/RUN.md §11: the path
    Lightning chose, holding one generation whose manifest has a ``lightning`` field): its
    newest generation with a manifest; None for any other path. Reads one listing of at most
    ``LIGHTNING_ENTRIES`` entries and one manifest, so a large run directory costs little."""
    try:
        with os.scandir(directory) as entries:
            names = [e.name for _, e in zip(range(LIGHTNING_ENTRIES + 1), entries)]
    except OSError:
        return None
    steps = [parsed[0] for parsed in map(fmt.parse_name, names) if parsed is not None and parsed[1] == "json"]
    if not steps or len(names) > LIGHTNING_ENTRIES:
        return None
    try:
        doc = Probe(os.path.join(directory, fmt.manifest_name(max(steps)))).document
    except OSError:                     # removed since the listing (retention, top-k): not one now
        return None
    if not _ours(doc) or not _has(doc, LIGHTNING, dict):
        return None
    return os.path.join(os.fspath(directory), fmt.checkpoint_name(max(steps)))


def resolve(path: "str | os.PathLike[str]") -> "str | os.PathLike[str]":
    """The file a command reads for ``path``: a Lightning checkpoint directory's ``.bin``
    (``generation_in``), any other path as it is."""
    return (os.path.isdir(path) and generation_in(path)) or path


def _lightning(p: Probe) -> bool:
    return p.is_dir and generation_in(p.path) is not None


def _lightning_dir(p: Probe) -> bool:
    """A directory of Lightning checkpoint directories (ModelCheckpoint's ``dirpath``) and no
    generation of its own: one child ``*.ckpt`` directory that is a Lightning checkpoint decides.
    The listing is read once and stops at the first ``step_N`` name (a run directory); only
    ``*.ckpt`` children are opened, at most ``LIGHTNING_ENTRIES`` of them."""
    if not p.is_dir:
        return False
    candidates = []
    try:
        with os.scandir(p.path) as entries:
            for e in entries:
                if fmt.parse_name(e.name) is not None:
                    return False                  # a run directory's generations
                if e.name.endswith(".ckpt") and len(candidates) < LIGHTNING_ENTRIES:
                    candidates.append(e.path)
    except OSError:
        return False
    return any(os.path.isdir(c) and generation_in(c) is not None for c in candidates)


def _hf_run(p: Probe) -> bool:
    return p.is_dir and hfdirs.is_output(p.path)


def _hf_checkpoint(p: Probe) -> bool:
    return p.is_dir and hfdirs.is_checkpoint(p.path)


def _hf_model(p: Probe) -> bool:
    return p.is_dir and hfdirs.is_model(p.path)


def _run(p: Probe) -> bool:
    return p.is_dir


def _seed(p: Probe) -> bool:
    """A plausible seed header: the size law holds (spec §2, §8.1)."""
    if not p.is_file or len(p.head) < fmt.HEADER_SIZE:
        return False
    step, n = fmt.unpack_header(p.head[:fmt.HEADER_SIZE])
    return step >= 0 and n >= 0 and p.size == fmt.file_size(n)


OURS = {"inspect": "step, size, recorded blake3, per-region statistics",
        "validate": "decoded and checked against the blake3 it records (the source check of convert)",
        "diff": "its regions, by parameter name where a layout is known",
        "convert": "into any other form"}
FOREIGN = {"inspect": "tensors, parameter count, dtypes, step where known, per-region statistics",
           "validate": "structure and values (unverified: no digest of its own); ckptfmt's own form: its blake3",
           "diff": "mapped onto weights, m, v by parameter name (as convert maps it)",
           "convert": "into a .bin (then into any other form); ckptfmt's own form into any"}

KINDS: tuple[Kind, ...] = (
    Kind("planes", "ckptfmt byte-plane file (.ckz)", _planes, OURS, "planes", (".ckz",), ours=True),
    Kind("archive", "ckptfmt export archive (.tar.zst)", _archive,
         {"validate": "every member against the archive's export.json, read without unpacking"},
         None, (".tar.zst",), ours=True),
    Kind("zst", "ckptfmt zstd stream (.zst)", _zst, OURS, "zst", (".zst",), ours=True),
    Kind("safetensors", "safetensors file", _safetensors, FOREIGN, "safetensors", (".safetensors",)),
    Kind("npz", "NumPy .npz archive", _npz, FOREIGN | {"inspect": "its arrays", "validate": "structure; "
         "ckptfmt's own form: its blake3", "diff": "by name", "convert": "ours: any; foreign arrays: into a .bin"},
         "npz", (".npz",)),
    Kind("torch", "torch.save file (zip)", _torch_zip, FOREIGN, "pt", (".pt", ".pth", ".ckpt"), needs="torch"),
    Kind("torch-legacy", "torch.save file (legacy pickle)", _torch_legacy, FOREIGN, "pt", needs="torch"),
    Kind("dcp", "torch.distributed.checkpoint directory", _dcp,
         {"inspect": "step, parameters, per-region statistics; ckptfmt's: the blake3 it records",
          "validate": "ckptfmt's: its arrays as a .bin against the blake3 its embedded manifest records "
                      "(an older ckptfmt's records none); dcp.save's own: structure (unverified: no digest of its own)",
          "diff": "its regions", "convert": "into any form, through a .bin"}, "dcp", needs="torch"),
    Kind("shards", "sharded generation (step_N.json of shards)", _sharded,
         {"inspect": "step, shards, per-region statistics", "validate": "every shard against its row's blake3",
          "diff": "its regions, consolidated", "convert": "into any form, consolidated into a .bin first"}, "shards", (".shards",),
         ours=True),
    Kind("safetensors-index", "sharded safetensors (model.safetensors.index.json)", _index,
         {"inspect": "shards, tensors, parameter count, dtypes",
          "validate": "every shard's structure and the weight map (unverified: no digest of its own)",
          "diff": "its tensors mapped onto weights by name", "convert": "into a .bin (weights; m, v zero)"},
         "safetensors-index", (".safetensors.index.json",)),
    Kind("manifest", "generation manifest (step_N.json)", _manifest, {}, None),
    Kind("lightning", "Lightning checkpoint (a directory of one ckptfmt generation)", _lightning,
         {"inspect": "its generation, as a run", "validate": "its generation: structure, manifest, blake3, values",
          "diff": "its generation's regions", "convert": "its generation into any form",
          "ls": "its generation"}, "bin", ours=True),
    Kind("hf-run", "Hugging Face Trainer output directory (checkpoint-N directories)", _hf_run,
         {"inspect": "ls and the newest verified checkpoint", "validate": "every checkpoint-N",
          "ls": "checkpoints, status, metrics"}, None),
    Kind("lightning-dir", "Lightning ModelCheckpoint directory (checkpoint directories)", _lightning_dir,
         {"inspect": "ls and the newest valid checkpoint", "validate": "every checkpoint, as alone",
          "ls": "checkpoints, status, metrics"}, None),
    Kind("hf-checkpoint", "Hugging Face Trainer checkpoint directory (checkpoint-N)", _hf_checkpoint,
         {"inspect": "step, weights (model.safetensors), its ckptfmt commit record",
          "validate": "every file against the blake3 its commit record names; the weights' structure and values",
          "diff": "its weights and optimizer.pt's moments, as convert maps them", "ls": "as its output directory's checkpoint",
          "convert": "into a .bin: weights, and optimizer.pt's moments by the record's group names"}, "hf", ours=True),
    Kind("hf-model", "Hugging Face model directory (save_pretrained)", _hf_model, FOREIGN | {"convert": "into a .bin, whole (weights only) or refused"},
         "hf", needs="torch"),
    Kind("run", "run directory", _run,
         {"inspect": "ls and the newest valid generation", "validate": "every generation, sidecars, history",
          "ls": "generations, status, pins, leases"}, None),
    Kind("bin", "seed .bin checkpoint", _seed,
         {"inspect": "header, manifest, fingerprint, per-region statistics",
          "validate": "structure, name, manifest, blake3, values", "diff": "header, regions, companion",
          "convert": "into any form", "ls": "as a generation of its run"},
         "bin", (".bin",), ours=True),
)
_BY_NAME = {k.name: k for k in KINDS}


def get(name: str) -> Kind:
    """The registry entry called ``name``."""
    return _BY_NAME[name]


def _claims_seed(name: str) -> bool:
    """``.bin`` or a ``step_N`` name (without a known other suffix) claims a seed ``.bin``."""
    return name.endswith(".bin") or fmt.parse_name(name) is not None or \
        (name.startswith("step_") and name[5:].isdigit())


def sniff(path: "str | os.PathLike[str]") -> Kind:
    """The kind of ``path`` by the rule of the module docstring; ``UnsupportedKindError`` when
    none fits, ``OSError`` when the path cannot be read; a URL is refused (``fsio.refuse_url``)."""
    fsio.refuse_url(path, "a file or a directory")
    probe = Probe(path)
    if not (probe.is_file or probe.is_dir):
        raise UnsupportedKindError(probe.path, f"not a regular file ({fsio.special(os.stat(path).st_mode)}): "
                                               "ckptfmt reads only files and directories, never a pipe, socket "
                                               "or device (which could block for ever)")
    for kind in KINDS:
        if kind.sniff(probe):
            return kind
    for kind in KINDS:
        if kind.claimed_by(probe.name):
            return kind
    if _claims_seed(probe.name):
        return get("bin")
    raise UnsupportedKindError(probe.path, "unknown kind (unknown format): neither its content nor its name is "
                                           "one ckptfmt knows (a seed .bin, .zst, .ckz, safetensors, a torch.save "
                                           "file, .npz, a DCP or sharded directory)")


def by_name(path: "str | os.PathLike[str]") -> Kind | None:
    """The kind a (destination) name claims, content unseen; None when it claims none."""
    name = os.path.basename(os.fspath(path).rstrip("/")).lower()
    for kind in KINDS:
        if kind.claimed_by(name):
            return kind
    return get("bin") if _claims_seed(name) else None


def require(kind: Kind, command: str, path: "str | os.PathLike[str]") -> Kind:
    """``kind`` when ``command`` does something with it; else ``UnsupportedKindError`` (exit 2)
    naming the command, the kind and the file."""
    if not kind.can(command):
        hint = " (pass its step_N.bin)" if kind.name == "manifest" else \
            " (pass a file)" if kind.name == "run" else \
            " (ckptfmt validate checks it; ckptfmt import ARCHIVE DEST unpacks it)" if kind.name == "archive" else ""
        raise UnsupportedKindError(os.fspath(path), f"{command} cannot read a {kind.label}{hint}")
    return kind
