"""Leases on a store without ``flock`` (object storage): the run's one writer, by a
conditional create (spec/RUN.md §4.1), and readers' claims on the generations they read, which
retention there keeps (§5.3.1).

The lease is an object ``.writer.NNNNNNNNNN`` holding its holder (pid, host, purpose, a random
token) and when it expires. The newest number is the lease in force. ``acquire`` makes the next
number with ``Store.create`` (S3's ``If-None-Match: *``), so of two writers that try at once
exactly one gets it; it does so only while the newest lease has expired (or there is none). A
holder ``renew``s before its lease runs out (the heartbeat) and finds out there whether a newer
number was made meanwhile: then its lease was taken over after it expired, and it must stop
writing (``RunLockedError``). ``release`` removes the holder's own lease objects.

What holds: as long as the holder renews within ``ttl_s`` and the clocks of the machines that
share the store agree to well within ``ttl_s``, there is one writer. A holder stalled past its
expiry can be taken over; its next ``renew`` says so before it writes more. A lease whose
holder was a process of this host (the same host name and pid namespace) that no longer exists
is taken over at once, as the kernel releases a dead holder's ``flock``: a restart after a kill on the same machine
does not wait for the lease to run out. From another host or container a writer waits
(``acquire(wait=True)``) while the lease is not renewed, and takes it once it expired; a renewal
seen meanwhile is a live writer's, and refused. No reader waits on a lease;
an expired one is never removed by anyone but the next holder.

>>> import tempfile
>>> from ckptfmt.store.local import LocalStore
>>> store = LocalStore(tempfile.mkdtemp())
>>> first = StoreLock(store, purpose="trainer").acquire()
>>> try:
...     StoreLock(store, purpose="trainer").acquire()
... except RunLockedError as exc:
...     print(exc.problem.split(";")[0])
held by trainer pid ... until ...
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, Callable, Iterable

from ..errors import CheckpointError, RunLockedError
from ..store import Store, created
from ..warn import warn

__all__ = ["PREFIX", "READ_PREFIX", "Heartbeat", "StoreLock", "StoreReadLease", "holder", "leased"]

PREFIX = ".writer."
READ_PREFIX = ".lease."
_NAME = re.compile(r"\.writer\.([0-9]{10})")


class StoreLock:
    """The run's writer lease on ``store``; ``ttl_s``: how long one lasts unrenewed; ``clock``:
    seconds since the epoch (``time.time``, the clock every machine sharing the store reads)."""

    def __init__(self, store: Store, *, purpose: str = "writer", ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.time):
        self.store, self.purpose, self.ttl_s, self.clock = store, purpose, ttl_s, clock
        self.token = uuid.uuid4().hex
        self.number: int | None = None

    def _record(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace(), "boot": _boot(),
                           "purpose": self.purpose, "token": self.token, "expires": self.clock() + self.ttl_s}).encode()

    def _leases(self) -> list[int]:
        """The lease numbers on the store, oldest first."""
        found = (_NAME.fullmatch(e.name) for e in self.store.entries())
        return sorted(int(m.group(1)) for m in found if m)

    def _read(self, number: int) -> dict[str, Any]:
        try:
            doc = json.loads(self.store.read_bytes(_name(number)))
        except (OSError, ValueError):        # half there, or gone meanwhile: a holder that is no longer
            return {}
        return doc if isinstance(doc, dict) else {}

    def _owned(self) -> bool:
        """This holder's lease object is there and holds its token (a store that cannot be read
        raises: an unreachable store is not a lost lease)."""
        name = _name(self.number)
        if self.store.size(name) is None:
            return False
        try:
            doc = json.loads(self.store.read_bytes(name))
        except ValueError:
            return False
        return isinstance(doc, dict) and doc.get("token") == self.token

    def acquire(self, *, wait: bool = False) -> "StoreLock":
        """Take the lease, or ``RunLockedError`` naming the live holder (exit 2). ``wait``: a
        live-looking lease that its holder does not renew (a writer killed where its death cannot
        be seen from here: another machine, another container) is waited out until it expires,
        at most our TTL (a lease said to run longer is refused then), looking every sixth of it;
        one renewed meanwhile is a live writer's, refused. What a restarted job on a fresh
        container needs, where ``_dead_here`` cannot tell."""
        leases, seen, deadline = self._leases(), None, None
        while leases and _live(newest := self._read(leases[-1]), self.clock()):
            holder = (f"{newest.get('purpose', 'a writer')} pid {newest.get('pid', '?')} on {newest.get('host', '?')} "
                      f"until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(newest['expires']))}")
            if not wait or _alive_here(newest) or (seen is not None and newest["expires"] != seen) \
                    or (deadline is not None and self.clock() >= deadline):
                raise RunLockedError(self.store.where(), f"held by {holder}; one writer per run")
            if seen is None:             # a lease running further than our TTL is not waited out
                deadline = self.clock() + self.ttl_s * 7 / 6
                warn(f"{self.store.where()}: its writer lease is held by {holder} and not renewed from "
                              "where it can be seen (a writer stopped on another machine or container): "
                              "waiting for it to run out (renewed meanwhile, it is a live writer's: refused)")
            seen = newest["expires"]
            time.sleep(min(max(0.0, seen - self.clock()), self.ttl_s / 6) + 0.05)
            leases = self._leases()
        number = leases[-1] + 1 if leases else 1
        if not created(self.store, _name(number), self._record()):
            raise RunLockedError(self.store.where(), "another writer took the lease at the same moment; "
                                                     "one writer per run")
        self.number = number
        self._still_mine()                   # a store that ignores the condition: its bytes are ours
        for old in leases:                   # expired: the new holder clears them
            self.store.remove(_name(old))
        return self

    def renew(self) -> None:
        """Extend the lease (call well within ``ttl_s``); ``RunLockedError`` when a newer lease
        was taken meanwhile (this one had expired): stop writing."""
        self._still_mine()
        self.store.put_bytes(_name(self.number), self._record())
        self._still_mine()                   # taken over while renewing: never two writers after it

    def _still_mine(self) -> None:
        """``RunLockedError`` unless this lease is held and no newer one was made."""
        if self.number is None:
            raise RunLockedError(self.store.where(), "the writer lease is not held")
        leases = self._leases()
        newer = [n for n in leases if n > self.number]
        if not newer and not self._owned():
            raise RunLockedError(self.store.where(), "the writer lease expired and was taken over (its object "
                                 "is gone or another's); this writer stops")
        if newer:
            holder = self._read(newer[-1])
            raise RunLockedError(self.store.where(), f"the writer lease expired and was taken over by "
                                 f"{holder.get('purpose', 'a writer')} pid {holder.get('pid', '?')} on "
                                 f"{holder.get('host', '?')}; this writer stops")

    def release(self) -> None:
        """Give the lease up (its object removed, when no newer holder took it over)."""
        if self.number is not None and not [n for n in self._leases() if n > self.number]:
            self.store.remove(_name(self.number))
        self.number = None

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Heartbeat:
    """A held ``StoreLock`` renewed every third of its ``ttl_s`` on a daemon thread until
    ``release()``. A renewal that finds the lease taken over, or none that succeeded for a whole
    ``ttl_s`` (the store unreachable: another writer may take it over now), is kept, and
    ``check()`` raises it: the writer calls it before each commit and stops there."""

    def __init__(self, lock: StoreLock):
        self.lock, self.error = lock, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ckptfmt-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        renewed = self.lock.clock()
        while not self._stop.wait(self.lock.ttl_s / 3):
            try:
                self.lock.renew()
                renewed = self.lock.clock()
            except RunLockedError as exc:
                self.error = exc
                return
            except (CheckpointError, OSError) as exc:   # the store unreachable: tried again, until the lease is gone
                if self.lock.clock() - renewed > self.lock.ttl_s:
                    self.error = RunLockedError(self.lock.store.where(), f"the writer lease could not be "
                                                f"renewed for {self.lock.ttl_s:.0f} s ({exc}); this writer stops")
                    return

    def found(self) -> None:
        """What the heartbeat found (a takeover, a store out of reach), raised; no request."""
        if self.error is not None:
            raise self.error

    def check(self) -> None:
        """Before a commit: ``found``, then a look for a newer lease now (one listing), so a
        takeover is seen at the next commit whenever the last renewal was."""
        self.found()
        self.lock._still_mine()

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self.lock.release()


def _live(holder: dict[str, Any], now: float) -> bool:
    """The lease is in force: not expired, and its holder not known dead here."""
    return isinstance(holder.get("expires"), (int, float)) and holder["expires"] > now and _alive_here(holder) is not False


def _dead_here(holder: dict[str, Any]) -> bool:
    """The holder was a process of this host that is gone (killed, crashed): its lease need not
    run out before a restart here takes over, as a dead holder's ``flock`` is released."""
    return _alive_here(holder) is False


def _alive_here(holder: dict[str, Any]) -> bool | None:
    """Whether the holder's process is alive, where this process can tell (this host, boot and
    pid namespace; this process itself counts as alive); None where it cannot."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    if pid == os.getpid():
        return True
    if holder.get("pidns") is None or holder.get("pidns") != _pid_namespace() or holder.get("boot") != _boot():
        return None                      # another container's or machine's pids are not ours to look up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                      # alive, another user's
        return True
    return True


def _pid_namespace() -> int | None:
    """The inode of this process's pid namespace (Linux), so a pid is only looked up where it
    means the same process: two containers with one host name do not see each other's."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _boot() -> str | None:
    """This machine's boot id (Linux): a pid namespace's inode is the same on every machine for
    the initial one, so the two together say "this machine, this namespace"."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _name(number: int) -> str:
    return f"{PREFIX}{number:010d}"


class StoreReadLease:
    """A reader's claim on ``steps`` at ``store``: an object ``.lease.TOKEN`` naming them (with
    the reader and when the claim expires), written on entry and removed on exit; retention at
    the store (``leased``) keeps those steps meanwhile. Where the store refuses the object (a
    read-only bucket) the reader reads without one and ``problem`` says why."""

    def __init__(self, store: Store, steps: "list[int]", *, purpose: str = "reader", ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.time):
        self.store, self.steps, self.purpose, self.ttl_s, self.clock = store, sorted(steps), purpose, ttl_s, clock
        self.name = f"{READ_PREFIX}{uuid.uuid4().hex}"
        self.problem: str | None = None
        self.listing: Any = None            # what the reader listed (``StoreRun.reading``)

    def renew(self) -> None:
        """Write (again) the claim, to last ``ttl_s`` from now."""
        self.store.put_bytes(self.name, json.dumps({
            "steps": self.steps, "purpose": self.purpose, "pid": os.getpid(), "host": socket.gethostname(),
            "expires": self.clock() + self.ttl_s}).encode())

    def narrow(self, steps: "Iterable[int]") -> None:
        """Keep the claim only on ``steps`` (those the reader goes on to read), as ``ReadLease.narrow``."""
        keep = set(steps)
        self.steps = [s for s in self.steps if s in keep]
        if self.problem is None:
            self.renew()

    def __enter__(self) -> "StoreReadLease":
        try:
            self.renew()
        except CheckpointError as exc:        # a read-only store: read unleased, and say so
            self.problem = f"no read lease: {exc}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.problem is None:
            self.store.remove(self.name)


def holder(store: Store, clock: Callable[[], float] = time.time) -> dict[str, Any] | None:
    """The record of the writer lease in force at ``store`` (pid, host, purpose, expires), or
    None: no lease there, or the newest one expired or its holder known dead."""
    lock = StoreLock(store, clock=clock)
    leases = lock._leases()
    newest = lock._read(leases[-1]) if leases else {}
    return newest if newest and _live(newest, clock()) else None


def leased(store: Store, clock: Callable[[], float] = time.time) -> set[int]:
    """The steps the unexpired read leases at ``store`` hold (what its retention keeps)."""
    steps: set[int] = set()
    for entry in store.entries():
        if not entry.name.startswith(READ_PREFIX):
            continue
        try:
            doc = json.loads(store.read_bytes(entry.name))
        except (OSError, ValueError, CheckpointError):    # gone meanwhile, or half there
            continue
        if isinstance(doc, dict) and isinstance(doc.get("expires"), (int, float)) and doc["expires"] > clock():
            steps |= {s for s in doc.get("steps", []) if isinstance(s, int)}
    return steps
