"""Kill points of a save on object storage, for the kill tests' writer processes (one process,
or each rank of a torchrun job): ``arm(phase, at)`` counts this process's store calls by the
phase of a save they belong to and SIGKILLs the process at the ``at``-th call of ``phase`` (the
``at``-th store call of any kind: phase "any"), before that call reaches the store.

The phases: "upload" a part of a generation's multipart upload as it goes up (on the upload's
sending thread: the kill leaves an unfinished upload), "complete" the completion of a part's upload
(a shard, a ``.bin``, a companion), "confirm" the commit's look at the checksum the store computed
of a part (its size and ETag, one HEAD; a read-back only where the store vouched for nothing), "manifest"
a generation's manifest PUT (create-only), "segment" a history segment's creation, "retention" a removal of a
generation's part (manifest first, then payload, then companion).

A writer process runs ``sys.path.insert(0, TESTS)`` and ``calls = killpoints.arm(phase, at)``
before its first save; ``calls["any"]`` is then how many store calls it made (``at`` 0: counted,
never killed). Parts are cut at S3's smallest size (5 MiB) in an armed process, so a model of a
few MB makes a multipart upload of two parts. ``kill``: what the kill point does instead of SIGKILL of this process (a torchrun
worker killing its whole job: ``killpoints.whole_job``).
"""
from __future__ import annotations

import os
import signal
from typing import Callable

PHASES = ("upload", "complete", "confirm", "manifest", "segment", "retention", "any")


def this_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def whole_job() -> None:
    """SIGKILL this worker's torchrun agent and every process under it (each worker runs in a
    session of its own: the agent's process group does not hold them), as a lost machine."""
    from torchrun import kill_tree
    kill_tree(os.getppid())
    this_process()


def arm(phase: str, at: int, kill: Callable[[], None] = this_process) -> dict[str, int]:
    """Hook the store's calls (class attributes of ``multipart.S3Upload``/``ObjectStore``: every
    store this process opens); the counts by phase, and "any"."""
    from ckptfmt.store import multipart, objects
    assert phase in PHASES or phase == "none", phase
    calls: dict[str, int] = {}

    def hooked(kind: str, function: Callable, where: Callable = lambda *a: True) -> Callable:
        def call(*args, **kwargs):
            if where(*args):
                calls[kind] = calls.get(kind, 0) + 1
                calls["any"] = calls.get("any", 0) + 1
                if at and calls.get(phase) == at:
                    kill()
            return function(*args, **kwargs)
        return call

    def generation(self, *args) -> bool:          # an upload of a generation's part
        return "/step_" in "/" + self.key

    multipart.BLOCK = 5 << 20            # S3's minimum part size: two parts for a .bin of 7 MB
    upload, store = multipart.S3Upload, objects.ObjectStore
    upload._upload_part = hooked("upload", upload._upload_part, generation)
    upload.commit = hooked("complete", upload.commit, generation)
    store.stat = hooked("confirm", store.stat)
    store.create = hooked("manifest", store.create, lambda self, name, *a: name.startswith("step_") and name.endswith(".json"))
    store.create = hooked("segment", store.create, lambda self, name, *a: name.endswith(".jsonl"))
    store.remove = hooked("retention", store.remove, lambda self, name, *a: name.startswith("step_"))
    return calls
