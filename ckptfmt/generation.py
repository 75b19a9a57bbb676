"""A generation: what one commit of a run holds, whatever its shape (spec/RUN.md §1-§2).

A generation is ``step_NNNNNN.bin`` + ``step_NNNNNN.json``, or a sharded generation's
``step_NNNNNN.shards/`` + manifest; either may have a companion ``step_NNNNNN.extra.safetensors``.
It is committed when its manifest (the commit marker) and its payload exist and agree.

Every command and tier sees a generation through this type: its ``parts()`` (each file with the
size and blake3 its manifest records), ``open``, ``check``, ``copy_to`` and ``remove``. Which
shape it has matters only in here. One listing (``list_store``) makes it from the entries of any
store (``ckptfmt.store``): a local directory (``list_dir``), or a mirror's prefix in object
storage (``store.objects.ObjectStore``, ``by_step``); there its parts are names, its sizes the listing's,
and it is removed through the store in the same order.

>>> import tempfile, numpy as np
>>> from ckptfmt import writer
>>> run = tempfile.mkdtemp()
>>> _ = writer.save(f"{run}/step_000003.bin", 3, np.ones(2, "<f4"), np.zeros(2, "<f4"), np.zeros(2, "<f4"))
>>> gen = list_dir(run).generations[0]
>>> gen.step, gen.committed, gen.check(deep=True), [p.name for p in gen.parts()]
(3, True, None, ['step_000003.bin', 'step_000003.json'])
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any, Callable

from . import atomic, companion, fingerprint, reader, shards, tensorfile
from .store import DIRECTORY, FILE, Entry, Store
from .store.local import LocalStore
from . import format as fmt
from . import manifest as mf
from .errors import CheckpointError, FingerprintMismatchError, ManifestError, NoValidGenerationError, RemoteError, UnsupportedSetupError  # noqa: E501


# A manifest whose payload is gone, locally or at a mirror: damage, never a leftover, because every
# writer puts the manifest last and every remover (retention, a mirror's) takes it first (RUN §2.3)
LOST_PAYLOAD = "manifest without its payload: the payload was lost after the commit (a writer puts the " \
               "manifest last and removes it first)"


@dataclass(frozen=True)
class Part:
    """One file of a generation: ``name`` relative to the run directory, the ``size`` and
    ``blake3`` its manifest records (None where nothing records one: the manifest itself, which
    its seal covers, and a bare ``.bin`` of a run without manifests); ``path`` where it is local."""
    name: str
    role: str                    # "generation" (the .bin), "shard", "companion" or "manifest"
    size: int | None = None
    blake3: str | None = None
    path: Path | None = None


def recorded_parts(doc: dict[str, Any], step: int) -> list[Part]:
    """The files a generation's manifest commits, in write order: the .bin (or each shard), then
    the companion; not the manifest itself. Names are rebuilt from the step and checked against
    the manifest's, so a manifest can never point outside its run (``ManifestError``)."""
    where = fmt.manifest_name(step)
    if shards.is_sharded(doc):
        directory = fmt.stem(step) + shards.SUFFIX
        out = []
        for row in doc["shards"]:
            name = shards.shard_name(row["rank"], len(doc["shards"]))
            if row.get("file") != name:
                raise ManifestError(where, f"a shard row names {row.get('file')!r}, expected {name!r}")
            out.append(Part(f"{directory}/{name}", "shard", row["size"], row["blake3"]))
    else:
        if doc["file"] != fmt.checkpoint_name(step):
            raise ManifestError(where, f"names {doc['file']!r}, expected {fmt.checkpoint_name(step)!r}")
        out = [Part(doc["file"], "generation", doc["size"], doc["blake3"])]
    extra = doc.get(companion.FIELD)
    if extra is not None:
        name = fmt.stem(step) + companion.SUFFIX
        if not isinstance(extra, dict) or extra.get("file") != name:
            raise ManifestError(where, f"companion entry does not name {name}")
        out.append(Part(name, "companion", extra.get("size"), extra["blake3"]))
    return out


@dataclass
class Generation:
    """One step's files in a store: each part its local path (a local directory's) or its name
    (another store's), None where the part is not there.

    Attributes:
        step: the step its names carry.
        bin: the ``step_NNNNNN.bin`` of an unsharded generation.
        manifest: ``step_NNNNNN.json``, the commit marker: without it the generation is not committed.
        shards: the ``step_NNNNNN.shards/`` directory of a sharded generation.
        companion: ``step_NNNNNN.extra.safetensors`` (buffers, state tensors), where there is one.
        store: where it lives (None: a local directory, the parts' own paths).
        sizes: each file's size as another store listed it (empty for a local directory).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import list_dir
        >>> os.makedirs("gen", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("gen", 10, z, z, z)
        >>> g = list_dir("gen").generations[0]
        >>> g.step, str(g.bin), str(g.manifest), g.committed, g.sharded
        (10, 'gen/step_000010.bin', 'gen/step_000010.json', True, False)
    """
    step: int
    bin: PurePath | None = None
    manifest: PurePath | None = None
    shards: PurePath | None = None      # step_NNNNNN.shards/ of a sharded generation
    companion: PurePath | None = None   # step_NNNNNN.extra.safetensors (buffers, state tensors)
    store: Store | None = field(default=None, compare=False, repr=False)
    sizes: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def committed(self) -> bool:
        """Both halves exist: the manifest (the commit marker) and the .bin or shards."""
        return self.manifest is not None and self.payload is not None

    @property
    def sharded(self) -> bool:
        """Its payload is a ``step_N.shards`` directory of shard files, not one ``.bin``."""
        return self.bin is None and self.shards is not None

    @property
    def kind(self) -> str:
        """The name, in the kinds registry (``ckptfmt.kinds``), of what its ``path`` is: ``bin``
        or ``shards`` (a sharded generation's manifest)."""
        return "shards" if self.sharded else "bin"

    @property
    def payload(self) -> Path | None:
        """The .bin, or the shard directory of a sharded generation."""
        return self.bin if self.bin is not None else self.shards

    @property
    def path(self) -> Path | None:
        """The one path that stands for the generation where a file is asked for (inspect,
        validate, diff, convert take it): the .bin, or a sharded generation's manifest."""
        return self.manifest if self.sharded else self.bin

    @property
    def any_part(self) -> Path | None:
        """A part that is there, for messages and ages: payload, manifest or companion."""
        return self.payload or self.manifest or self.companion

    @property
    def size(self) -> int | None:
        """Bytes on disk of the .bin and its companion (or of all shards and the companion),
        None for a lone manifest."""
        if self.payload is None:
            return None
        if not self.local:               # what the store's listing said (a prefix's shards: not sized)
            return None if self.bin is None else sum(self.sizes.get(p.name, 0) for p in (self.bin, self.companion)
                                                     if p is not None)
        extra = self.companion.stat().st_size if self.companion else 0
        if self.bin is not None:
            return self.bin.stat().st_size + extra
        return sum(e.stat().st_size for e in self.shards.iterdir() if e.is_file()) + extra

    @property
    def local(self) -> bool:
        """Its parts are local paths (a run directory, the RAM tier), not names in another store."""
        return self.store is None or isinstance(self.store, LocalStore)

    def check(self, *, deep: bool = False, doc: dict[str, Any] | None = None) -> str | None:
        """None when the generation is committed and valid, else the reason it is not (the
        reader's own words, so a rule has one wording). In another store than a local directory
        (``_check_in_store``): its manifest, every recorded part's size, a ``.bin``'s header,
        and with ``deep`` each part's blake3 read back (``doc``: its manifest, read already); a
        store that cannot be reached raises ``RemoteError``."""
        if self.manifest is not None and self.payload is not None and not self.local:
            return self._check_in_store(deep, doc)
        if self.sharded and self.manifest is not None:
            return shards.check(self.manifest, deep=deep)
        if self.sharded:
            return "not committed: shards without a manifest"
        if self.bin is None:
            return LOST_PAYLOAD
        if self.manifest is None:
            return "not committed: no manifest"
        return opens(self.bin, manifest="require", verify=deep)

    def _check_in_store(self, deep: bool, doc: dict[str, Any] | None = None) -> str | None:
        store = self.store
        try:
            if doc is None:
                doc = self.read_manifest()
            if doc["step"] != self.step:
                return f"manifest says step {doc['step']}"
            for part in recorded_parts(doc, self.step):
                size = store.size(part.name)
                if size is None:
                    return f"{part.name} is missing"
                if size != part.size:
                    return f"{part.name}: expected {part.size} bytes, got {size}"
                if part.role in ("generation", "shard") and (problem := _header_problem(store, part, self.step, size)):
                    return problem
                if deep and (got := store.digest(part.name)[0]) != part.blake3:
                    return f"{part.name}: {fingerprint.mismatch(part.blake3, got, 'object')}"
        except RemoteError:
            raise
        except CheckpointError as exc:
            return exc.problem
        return None

    def leftover(self) -> tuple[Path, str] | None:
        """An uncommitted generation that no manifest ever committed: (its part, what it is: the
        leftover of an interrupted save); None when it is committed, or a manifest lost its
        payload (damage: ``check`` says ``LOST_PAYLOAD``)."""
        if self.manifest is not None:
            return None
        if self.shards is not None and self.bin is None:
            return self.shards, "shards without a manifest (an interrupted sharded save)"
        if self.bin is not None:
            return self.bin, "no manifest: an uncommitted leftover of a crash"
        return self.companion, "companion file without its .bin and manifest (a leftover of an interrupted save)"

    def open(self, *, verify: bool = False) -> "reader.Checkpoint | shards.ShardedCheckpoint":
        """The committed generation's arrays (``weights``, ``m``, ``v``, ``manifest``), hashed
        first when ``verify``; raises ``CheckpointError`` for one that is not valid. A generation
        in another store (object storage) is read into memory, every part hashed against its
        manifest as it arrives (``verify`` or not: nothing is mapped to check later)."""
        if not self.local and self.committed:
            return self._read_in()
        self._here("opened")
        if self.sharded and self.manifest is not None:
            return shards.ShardedCheckpoint(self.manifest, verify=verify)
        if self.bin is None:
            raise _not_committed(self)
        return reader.open(self.bin, manifest="require", verify=verify)

    def _read_in(self) -> reader.Checkpoint:
        """The generation from its store, in memory: each recorded part refused unless its blake3 is the recorded one."""
        doc = self.read_manifest()
        if doc["step"] != self.step:
            raise ManifestError(self.store.where(self.manifest.name), f"manifest says step {doc['step']}")
        data = {}
        for part in recorded_parts(doc, self.step):
            data[part.name] = got = self.store.read_bytes(part.name)
            if (digest := fingerprint.of_bytes(got)) != part.blake3:
                raise FingerprintMismatchError(self.store.where(part.name), fingerprint.mismatch(part.blake3, digest, "object"))
        extra = doc.get(companion.FIELD)
        held = None if extra is None else tensorfile.TensorFile(self.store.where(extra["file"]), data[extra["file"]])
        if self.sharded:
            shard_bytes = {name.rsplit("/", 1)[1]: got for name, got in data.items() if "/" in name}
            return shards.ShardedCheckpoint(self.store.where(self.manifest.name), held=(doc, shard_bytes, held))
        ck = reader.from_bytes(data[self.bin.name], self.store.where(self.bin.name))
        ck.manifest, ck.verified, ck.held = doc, True, held
        return ck

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest, checked against its seal (None where there is none), read from its store."""
        if self.manifest is None:
            return None
        if self.local:
            return mf.read(self.manifest)
        return mf.parse(self.store.read_bytes(self.manifest.name), self.store.where(self.manifest.name))

    def _here(self, what: str) -> None:
        """Refuse a local-only operation on a generation in another store."""
        if not self.local:
            raise UnsupportedSetupError(self.store.where(fmt.stem(self.step)), f"a generation in object storage "
                                        f"is not {what} in place; ckptfmt import URL DEST brings it here")

    def parts(self, doc: dict[str, Any] | None = None, *, manifest: bool = True) -> list[Part]:
        """Every file of the generation, payload first and the manifest (the commit marker)
        last, each with what the manifest records of it (``recorded_parts``). ``doc``: the
        manifest, read already; ``manifest=False`` leaves the manifest out. Raises ``CheckpointError`` when the manifest cannot be read or
        names files that are not this generation's."""
        if self.payload is None or (self.sharded and self.manifest is None):
            raise _not_committed(self)
        if doc is None:
            doc = self.read_manifest()
        if doc is None:                  # a bare .bin: a run of the original trainer
            return [Part(self.bin.name, "generation", path=self._path(self.bin.name))]
        out = [replace(part, path=self._path(part.name)) for part in recorded_parts(doc, self.step)]
        return out + [Part(self.manifest.name, "manifest", path=self._path(self.manifest.name))] if manifest else out

    def present(self) -> list[Path]:
        """The parts of a local generation that are there now, whatever its manifest says (a
        node's RAM tier may hold only some shards of one): the ``.bin`` or each regular file in
        the shard directory, then the companion; never the manifest, nothing followed."""
        self._here("listed part by part")
        found = [self.bin] if self.bin is not None else []
        if self.shards is not None and self.shards.is_dir() and not self.shards.is_symlink():
            found += sorted(e for e in self.shards.iterdir() if e.is_file() and not e.is_symlink())
        return found + ([self.companion] if self.companion is not None else [])

    def _path(self, name: str) -> Path | None:
        """A part's local path (None in another store: its ``name`` is what the store takes)."""
        return self.payload.parent.joinpath(*name.split("/")) if self.local else None

    def copy_to(self, dest: "str | os.PathLike[str]", *, manifest: bool = True,
                progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        """Copy every part into directory ``dest`` under its own name, durably and hashed while
        copied; a part whose hash is not the recorded one is refused (``SaveError``), so a damaged
        generation is never copied on. The manifest goes last (``manifest=False``: not at all, for
        a caller that writes its own). From another store (object storage) each part is streamed
        here through the same check (``Store.download``). Returns a row per copied file: file,
        size, blake3, role."""
        store, dest = self.store or LocalStore(self.payload.parent), Path(dest)
        rows = []
        for part in self.parts(manifest=manifest):
            target = dest / part.name
            if part.role == "shard":
                atomic.make_durable_dir(target.parent)
            digest = store.download(part.name, target, part.blake3, progress)
            rows.append({"file": part.name, "size": target.stat().st_size, "blake3": digest, "role": part.role})
        return rows

    def remove(self) -> None:
        """Uncommit (manifest first), then remove the data through its store, whatever its
        shape: only entries of our own naming, and the shard directory (committed, or
        interrupted before its manifest) with what it holds."""
        store = self.store or LocalStore(self.any_part.parent)
        for part, recursive in ((self.manifest, False), (self.bin, False), (self.shards, True), (self.companion, False)):
            if part is not None:
                store.remove(part.name, recursive=recursive)


def _header_problem(store: Store, part: Part, step: int, size: int) -> str | None:
    """A ``.bin``'s or a shard's seed header in a store, from one ranged read: the size law and
    (a ``.bin``) the step its name says (spec/FORMAT.md §2), as ``reader.open`` words them."""
    name = part.name
    head = store.read_range(name, 0, fmt.HEADER_SIZE) if size >= fmt.HEADER_SIZE else b""
    if len(head) < fmt.HEADER_SIZE:
        return f"{name}: shorter than the header"
    got_step, n = fmt.unpack_header(head)
    if fmt.file_size(n) != size:
        return f"{name}: size law: expected {fmt.file_size(n)} bytes for n_params {n}, got {size}"
    if part.role == "generation" and got_step != step:
        return f"{name}: name says step {step}, header says step {got_step}"
    return None


def _not_committed(gen: Generation) -> CheckpointError:
    where = str(gen.any_part) if gen.local else gen.store.where(gen.any_part.name)
    return NoValidGenerationError(where, f"generation {gen.step} is not committed: "
                                  + (gen.check() or "incomplete"))


def opens(path: Path, **how: object) -> str | None:
    """None when ``reader.open`` accepts the file (its header, size, name and, as asked,
    manifest and hash), else why not: the reader's own message."""
    try:
        with reader.open(path, **how):
            return None
    except CheckpointError as exc:
        return exc.problem
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"


@dataclass
class Listing:
    """What a run directory holds, classified by name alone (RUN §2.3): nothing is opened.

    Attributes:
        generations: every step with a file of its own, in step order, committed or not.
        temps: the write protocol's temp files (``.ckptfmt-tmp.*``): a save in progress, or a
            killed one's leftover.
        foreign: each other entry that looks like a generation's and is not one, with why
            (a look-alike name, a directory or symlink where a file belongs).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import list_dir
        >>> os.makedirs("listed", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("listed", 10, z, z, z)
        >>> _ = open("listed/step_12.bin", "w").write("")               # a look-alike name
        >>> _ = open("listed/.ckptfmt-tmp.step_000020.bin.1.ab", "w").write("")   # a killed save's temp
        >>> listing = list_dir("listed")
        >>> [g.step for g in listing.generations], [p.name for p in listing.temps]
        ([10], ['.ckptfmt-tmp.step_000020.bin.1.ab'])
        >>> [(p.name, why) for p, why in listing.foreign]
        [('step_12.bin', 'look-alike name, not a canonical step_NNNNNN')]
    """
    generations: list[Generation] = field(default_factory=list)
    temps: list[PurePath] = field(default_factory=list)
    foreign: list[tuple[PurePath, str]] = field(default_factory=list)   # (entry, why skipped)


_ROLE = {"bin": "bin", "json": "manifest", "shards": "shards", "companion": "companion"}


def list_dir(path: "str | os.PathLike[str]") -> Listing:
    """Every generation of a local directory, classified without following symlinks or opening
    anything; temp files and look-alike or non-regular entries listed apart.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.generation import list_dir
        >>> os.makedirs("several", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (20, 10):
        ...     _ = ckptfmt.save_generation("several", step, z, z, z)
        >>> [g.step for g in list_dir("several").generations]        # in step order
        [10, 20]
    """
    return list_store(LocalStore(path))


def list_store(store: Store) -> Listing:
    """Every generation in ``store`` from one listing of its entries (``Store.entries``), each
    part where the store locates it; temp files and look-alike or non-regular entries apart."""
    gens: dict[int, Generation] = {}
    out = Listing()
    for entry in store.entries():
        name = entry.name
        if fmt.is_temp_name(name):
            out.temps.append(store.locate(name))
            continue
        parsed = fmt.parse_name(name)
        if parsed is None:
            if name.startswith("step_"):
                out.foreign.append((store.locate(name), "look-alike name, not a canonical step_NNNNNN"))
            continue
        step, kind = parsed
        if (kind == "shards") != (entry.kind == DIRECTORY) or entry.kind not in (FILE, DIRECTORY):
            out.foreign.append((store.locate(name), _misfit(kind, entry)))
            continue
        gen = gens.setdefault(step, Generation(step, store=store))
        setattr(gen, _ROLE[kind], store.locate(name))
        if entry.size is not None:
            gen.sizes[name] = entry.size
    out.generations = [gens[s] for s in sorted(gens)]
    return out


def at(path: "str | os.PathLike[str]") -> Generation:
    """The local generation a file of it names: its ``.bin``, its manifest, or a sharded
    generation's ``.shards`` directory; the parts beside it by its stem (``model.bin`` has
    ``model.json``), so a source outside a run directory, of any name, is one too (its step:
    the name's, else -1). Nothing is opened; ``open``/``check`` say what is wrong."""
    p = Path(path)
    base = p.with_name(p.name[:-len(p.suffix)]) if p.suffix in (".bin", ".json", shards.SUFFIX) else p
    parsed = fmt.parse_name(base.name + ".bin")
    bin_, sharded = base.with_name(base.name + ".bin"), base.with_name(base.name + shards.SUFFIX)
    manifest, extra = base.with_name(base.name + ".json"), base.with_name(base.name + companion.SUFFIX)
    return Generation(parsed[0] if parsed else -1, bin=bin_ if bin_.is_file() else None,
                      manifest=manifest if os.path.lexists(manifest) else None,
                      shards=sharded if sharded.is_dir() and not bin_.is_file() else None,
                      companion=extra if extra.is_file() else None)


def by_step(store: Store) -> dict[int, Generation]:
    """``list_store``'s generations by step, oldest first."""
    return {g.step: g for g in list_store(store).generations}


def _misfit(kind: str, entry: Entry) -> str:
    return "a .shards entry that is not a directory" if kind == "shards" else \
        "not a regular file (symlink, directory or device)"
