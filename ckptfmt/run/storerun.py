"""A run on a store: generations written straight to object storage (spec/RUN.md §2.0.2).

``StoreRun`` answers the calls of a run directory (``Run``: listing, latest-valid and its
judge, commit, pins, retention, sidecars, the writer lock) through a ``Store``, so a writer
(the checkpoint manager) drives either the same way. What differs is where each thing is
kept and what it costs:

- generations: parts streamed to the store (``store.writing.save``), each confirmed by size
  and the checksum the store computed (else blake3 read back), the manifest last (§2.0.1);
- the loss history: numbered segments (``segments.SegmentedHistory``, §3.8);
- sidecars (pins, the policy record): small objects, each replaced whole;
- the writer lock: the lease of ``storelock.StoreLock`` (a conditional create; renewed by a
  heartbeat thread, ``storelock.Heartbeat``), §4.1; readers' leases: ``storelock.leased``, and a
  reader's own (``reading``: ``export``, ``fork``, ``inspect``) a ``storelock.StoreReadLease``;
- what the file commands read and move (``copy_sidecar``: the history's segments joined;
  ``archive_sidecars``: a pivot's copy and removal), so they take a URL as they take a directory;
- retention checks the newest generations without reading them back (``retention_deep``):
  the writer confirmed each on the store when it committed it, and a deep check
  would download every kept generation at every save; restore, ``validate`` and ``import``
  verify what they read.

Nothing of it touches the local disk: the run has no local ``path`` (None). A RAM tier
(``memory_every``) is the one exception, as on a local run: its generations go to this
machine's tier directory, keyed by the run's ID (on a store the object ``.run-id.json``), and the
judge and restore take them where they are (spec/RUN.md §13).
"""
from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from .. import atomic, fingerprint, writer
from .. import manifest as mf
from .. import format as fmt
from ..errors import CheckpointError, GenerationNotFoundError, RemoteError, SidecarError, UnsupportedSetupError, parse_json
from ..fsio import is_url
from ..generation import Generation, Listing, by_step, list_store
from ..store import Store, writing
from .directory import Run
from .roots import of, recorded
from .history import NAME
from .segments import DIRECTORY, SegmentedHistory
from .sidecars import ARCHIVE
from .storelock import Heartbeat, StoreLock, StoreReadLease, leased


MIRROR_INDEX = ".mirror-index.json"      # what ckptfmt mirror writes at its destination (run.mirror.INDEX)


class StoreRun(Run):
    """A run whose every file is in ``store`` (``open_run`` makes one for a URL)."""

    retention_deep = False

    def __init__(self, store: Store):
        self.store = store
        self.path = None
        self.where = store.where()
        self.history = SegmentedHistory(store)
        self._vouched: dict[int, str] = {}
        self._read: tuple[int, Any] | None = None      # (step, its checkpoint) read whole by a judge
        self.held: Heartbeat | None = None

    def check_kind(self, create: bool) -> None:
        """A mirror's destination is written by ``ckptfmt mirror``, not a run's writer: refused
        (``import`` brings it here); without ``create`` (``gc``, ``pin``) a prefix that holds no
        run is refused too (an empty or mistyped one), as a missing run directory is."""
        names = [e.name for e in self.store.entries()]
        if MIRROR_INDEX in names:
            raise UnsupportedSetupError(self.where, "a mirror's destination (ckptfmt mirror writes it), not a run "
                                        "written there; ckptfmt import URL DEST brings it here")
        if not create and not any(n == DIRECTORY or n.startswith(".writer.") or fmt.parse_name(n) for n in names):
            raise RemoteError(self.where, "no run at this URL (an empty or mistyped prefix?)")

    def __fspath__(self) -> str:
        raise UnsupportedSetupError(self.where, "a run on object storage has no local path")

    @property
    def origin(self) -> str:
        return self.where

    def reading(self, purpose: str) -> StoreReadLease:
        """``Run.reading`` on the store: the lease object of §5.3.1 on the committed generations
        of one listing (a retention there keeps them; listed before the lease is written, as
        ``import`` does: a store has no lock to make the two one step)."""
        listing = self.listing()
        lease = StoreReadLease(self.store, [g.step for g in listing.generations if g.committed], purpose=purpose)
        lease.listing = listing
        return lease

    def judge(self, *, deep: bool = False, tier: str = "disk") -> Any:
        """``Run.judge``, deep for any generation this writer did not commit and confirm itself
        (retention's shallow look is trusted only for those, so a generation damaged on the store
        is never taken for the newest valid one). A committed generation on the store is judged by
        reading it whole, every part hashed against its manifest (``Generation.open``); with
        ``deep`` (a restore's choice) the last one read is kept for ``open_at``, so a restore
        downloads its generation once. A RAM-tier generation (a local directory) is hashed where
        it is, as on a local run."""
        looked, hashed = super().judge(deep=False, tier=tier), super().judge(deep=True, tier=tier)

        def reason(gen: Generation) -> str | None:
            if gen.step in self._vouched and not deep:
                return looked(gen)
            if not gen.committed or gen.local:
                return hashed(gen)
            return looked(gen) or self._read_whole(gen, keep=deep)
        return reason

    def _read_whole(self, gen: Generation, *, keep: bool) -> str | None:
        self._read = None
        try:
            read = gen.open()
        except CheckpointError as exc:
            return exc.problem
        if keep:
            self._read = (gen.step, read)
        return None

    def open_at(self, path: Any, *, verify: bool = False) -> Any:
        """``Run.open_at``; the generation on the store a judge read whole just before is not
        read again (a RAM-tier generation is opened where it is)."""
        gen = self.generation_at(path)
        read, self._read = self._read, None
        if read is not None and read[0] == gen.step and not gen.local:
            return read[1]
        return gen.open(verify=verify)

    def listing(self) -> Listing:
        return list_store(self.store)

    def name_of(self, gen: Generation) -> str:
        """Its URL; a generation of the RAM tier (a local directory): its path."""
        return str(gen.path) if gen.local else self.store.where(gen.path.name)

    def generation_at(self, path: Any) -> Generation:
        """A generation of this run by its URL (``name_of``); any other path: ``Run``'s."""
        prefix = self.store.where() + "/"
        if not (isinstance(path, str) and path.startswith(prefix)):
            return super().generation_at(path)
        parsed = fmt.parse_name(path[len(prefix):])
        found = by_step(self.store).get(parsed[0]) if parsed else None
        if found is None:
            raise GenerationNotFoundError(path, "no such generation in the run")
        return found

    def _history_roots(self, tier: str) -> dict[int, str]:
        return recorded(io.BytesIO(self.history.read_all()), tier=tier)

    def writer_lock(self, purpose: str, **how: Any) -> "Heartbeat":
        """The run's writer lease, taken and renewed by a heartbeat thread until ``release()``;
        each save asks what it found, and the look just before the manifest reads the store. A
        writer of generations waits out a lease its holder no longer renews (``StoreLock.acquire``:
        a restart on another machine or container); ``gc`` and ``pivot`` are refused at once."""
        wait = how.get("writes_generations", True)
        self.held = Heartbeat(StoreLock(self.store, purpose=purpose).acquire(wait=wait))
        self.history.guard = self.held.check
        return self.held

    def manifest_root(self, step: int) -> str | None:
        try:
            return of(mf.parse(self.store.read_bytes(fmt.manifest_name(step)), self.store.where(fmt.manifest_name(step))))
        except (CheckpointError, FileNotFoundError):
            return None

    def _write(self, gen: Generation | None, step: int, *regions: Any, **how: Any) -> writer.SaveResult:
        """Generation ``step`` streamed to the store; what is there of it already (a leftover,
        or a damaged generation) is removed first, its manifest first."""
        if self.held is not None:
            self.held.found()       # what the heartbeat found (no request): the look at the store is the manifest's
        self._read = None           # a generation read whole by a judge is not kept past a save
        if gen is not None:
            self.make_room(step, gen)
        return writing.save(self.store, step, *regions, **{**how, "before_commit": self._still_held(how.get("before_commit"))})

    def _still_held(self, before_commit: Any) -> Any:
        """``before_commit`` after a last look at the lease, just before the manifest is written."""
        def before(doc: dict[str, Any]) -> None:
            if self.held is not None:
                self.held.check()
            if before_commit is not None:
                before_commit(doc)
        return before

    def make_room(self, step: int, gen: Generation | None = None) -> None:
        """What is there of generation ``step`` already (a leftover, a damaged or diverged
        generation: ``gen``, else listed) removed, its manifest first, after a last look at the
        lease: parts and manifests go to the store create-only, and a writer whose lease was taken
        over while it stalled must not remove the new holder's save. Before a sharded save, rank 0
        calls it while the other ranks wait."""
        gen = gen if gen is not None else next((g for g in self.generations() if g.step == step), None)
        if gen is None:
            return
        if self.held is not None:
            self.held.check()
        gen.remove()

    def write_shard(self, step: int, rank: int, world: int, start: int, stop: int, *regions: Any) -> dict[str, Any]:
        """This rank's shard streamed to the store and confirmed there by this rank."""
        return writing.save_shard(self.store, step, rank, world, start, stop, *regions)

    def commit_shards(self, step: int, rows: list[dict[str, Any]], manifest: dict[str, Any] | None,
                      before_commit: Any = None, extra_tensors: dict[str, Any] | None = None) -> None:
        writing.commit_shards(self.store, step, rows, manifest, self._still_held(before_commit), extra_tensors)
        self.vouch(step)

    def leases(self, *, sweep: bool) -> Any:
        return contextlib.nullcontext(leased(self.store))

    def sweep_temps(self) -> list[str]:
        """What interrupted saves left (the lease holder calls it: the next writer, ``gc``): the
        parts of generations no manifest commits, and multipart uploads never completed (S3
        keeps their parts until they are aborted); the names removed."""
        removed = [self.store.where(name) for name in getattr(self.store, "abort_unfinished", list)()]
        for gen in self.generations():
            if gen.leftover() is not None:
                gen.remove()
                removed.append(self.store.where(gen.any_part.name))
        return removed

    def read_sidecar(self, name: str, default: Any = None) -> Any:
        if self.store.size(name) is None:
            return default
        return parse_json(self.store.read_bytes(name), SidecarError, self.store.where(name))

    def write_sidecar(self, name: str, value: Any) -> None:
        self.store.put_bytes(name, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())

    def copy_sidecar(self, name: str, dst: Any) -> str | None:
        """``Run.copy_sidecar`` from the store: the history is its segments joined (§3.8), each
        other sidecar one object (written whole)."""
        if name == NAME:
            data = self.history.read_all() if self.history.numbers() else None
        else:
            data = self.store.read_bytes(name) if self.store.size(name) is not None else None
        if data is None:
            return None
        atomic.write_bytes(dst, data)
        return fingerprint.of_bytes(data)

    def archive_sidecars(self, step: int, names: tuple[str, ...]) -> tuple[str, list[str]]:
        """``Run.archive_sidecars`` on the store: each sidecar there copied under
        ``ARCHIVE/step_N/`` (``step_N.2``, ... where taken), then removed."""
        try:
            taken = {e.name for e in self.store.under(ARCHIVE).entries()}
        except FileNotFoundError:
            taken = set()
        name, i = fmt.stem(step), 1
        while name in taken:
            i += 1
            name = f"{fmt.stem(step)}.{i}"
        moved = []
        for sidecar in names:
            if self.store.size(sidecar) is not None:
                self.store.put_bytes(f"{ARCHIVE}/{name}/{sidecar.lstrip('.')}", self.store.read_bytes(sidecar))
                self.store.remove(sidecar)
                moved.append(sidecar)
        return f"{ARCHIVE}/{name}", moved


def generation_url(url: str) -> tuple[str, str] | None:
    """(the run's URL, the name) where ``url`` names a generation's object or folder in a run
    (``.../step_000050.bin``, ``.json``, ``.shards``, a companion), else None.

    >>> generation_url("s3://b/r/step_000050.bin"), generation_url("s3://b/r")
    (('s3://b/r', 'step_000050.bin'), None)
    """
    base, _, name = url.rstrip("/").rpartition("/")
    return (base, name) if "://" in base and fmt.parse_name(name) else None


def refuse_generation_url(url: str) -> None:
    """A generation's URL where a run's is taken (``ls``, ``gc``, ``pin``, a writer): refused in one
    line naming it, as a local file is (not a run directory), never read as a prefix."""
    if (named := generation_url(url)) is not None:
        raise UnsupportedSetupError(url, f"names a generation's {named[1]}, not a run: the run is {named[0]}")


def open_run(target: Any, *, create: bool = False) -> Run:
    """The run ``target`` names: a ``Run`` as it is, a URL's ``StoreRun`` (object storage,
    through fsspec: the ``remote`` extra), else the local run directory."""
    if isinstance(target, Run):
        return target
    if isinstance(target, str) and is_url(target):
        refuse_generation_url(target)
        from ..store.objects import ObjectStore   # fsspec only when a URL is given
        run = StoreRun(ObjectStore(target))
        run.check_kind(create)
        return run
    return Run(target, create=create)
