"""The one background mirror (spec/RUN.md §10.13, §11.8): mirror passes on a thread, so that a
training loop never waits for the network.

``BackgroundMirror(run, url)`` mirrors a run directory (``run.mirror.mirror``): its
``on_commit`` fits the ``CheckpointManager``'s ``on_commit`` hook, waking the thread and
returning at once. The thread runs mirror passes while there is something new; ``close()`` runs
a last pass that catches up and ends the thread. A pass that fails is logged and retried at the
next commit. ``mirror_pass`` replaces the pass.

``Mirroring(dirpath, url, lock=...)`` mirrors a directory of runs the same way (the Lightning
callback's ``mirror=URL``: the checkpoint directories in ModelCheckpoint's ``dirpath``, each a
run of one generation, to ``URL/NAME``, each as ``ckptfmt mirror`` sends a run: payload,
read-back, manifest last; ``run.mirror.mirror_runs``). Its pass first links each checkpoint
directory's files into ``dirpath/.ckptfmt-mirror/NAME`` (hard links: no bytes copied, and a
checkpoint that its writer replaces or removes meanwhile stays whole there until the pass is
done), holding the writer's ``lock`` so that no directory is linked halfway through its
replacement; then it uploads from those links without the lock. It is the ``Mirror`` of the
callback's session (``run.session``): the plugin wakes it after each commit and removal, the
session after each commit's retention (``on_commit``), and the session closes it when the fit
is torn down.

>>> import tempfile; run, there = tempfile.mkdtemp(), tempfile.mkdtemp()
>>> bg = BackgroundMirror(run, f"file://{there}/mirror")
>>> bg.close()["passes"], bg.lag()
(1, [])
>>> d = tempfile.mkdtemp()
>>> m = Mirroring(d, f"file://{there}/ckpt", lock=threading.Lock())
>>> m.close()["failed"], os.listdir(d)
(False, [])
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .. import kinds
from ..errors import CheckpointError, UnsupportedSetupError
from ..generation import list_dir
from ..store.objects import ObjectStore, is_url
from ..store.connect import redact
from . import mirrors
from .mirror import mirror, mirror_runs
from .retention import Policy
from ..warn import warn

__all__ = ["AREA", "BackgroundMirror", "Mirroring", "check_url", "snapshot"]

AREA = ".ckptfmt-mirror"          # in dirpath: the links a pass uploads from (a dot name: never a checkpoint)
RETRIES = 2                       # a failed last pass at teardown is tried again this often (1 s, then 2 s later)
NO_LINKS = (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS)


class BackgroundMirror:
    """One thread that mirrors ``run_dir`` to ``url`` whenever woken."""

    def __init__(self, run_dir: "str | os.PathLike[str]", url: str, *, retention: "Policy | None" = None,
                 log: Callable[[str], None] | None = None, mirror_pass: Callable[..., dict[str, Any]] = mirror):
        self.run_dir, self.url, self.mirror_pass = run_dir, url, mirror_pass
        self.options = {"retention": retention} if retention is not None else {}
        self.log = log or (lambda message: warn(message))
        self.passes, self.errors, self.last, self.failed = 0, [], None, False
        self._retries, self._backoff = 0, 1.0
        self._wake, self._closing = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptfmt-mirror", daemon=True)
        self._thread.start()

    def on_commit(self, step: int | None = None, manifest: Any = None) -> None:
        """The manager's ``on_commit`` hook: wake the thread and return at once."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            closing = self._closing.is_set()
            try:    # the first pass reads back what the destination holds; later ones trust it
                self.last = self.mirror_pass(self.run_dir, self.url, recheck=self.passes == 0, **self.options)
                self.failed = False
            except (CheckpointError, OSError) as exc:
                self.errors.append(str(exc))
                self.failed = True
                self.log(f"mirror to {self.url} failed, retried at the next commit: {exc}")
            self.passes += 1
            if closing and self.failed and self._retries > 0:     # close(retries=): once more, later
                self._retries -= 1
                time.sleep(self._backoff)
                self._backoff *= 2
                self._wake.set()
            elif closing:
                return

    def lag(self) -> list[int]:
        """Committed local steps not yet confirmed at the destination (the local record)."""
        committed = [g.step for g in list_dir(self.run_dir).generations if g.committed]
        rows = [r for r in mirrors.lag(self.run_dir, committed) if r["url"] == redact(self.url)]
        return rows[0]["behind"] if rows else committed

    def stop(self) -> None:
        """End the thread after a last pass, without waiting for it (its owner is gone)."""
        self._closing.set()
        self._wake.set()

    def close(self, timeout: float | None = None, *, retries: int = 0, backoff: float = 1.0) -> dict[str, Any]:
        """A last pass that catches up (a failed one tried again ``retries`` times, after
        ``backoff`` seconds, doubling), then the thread ends; what the mirror did."""
        self._retries, self._backoff = retries, backoff
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        return {"url": redact(self.url), "passes": self.passes, "errors": self.errors, "last": self.last,
                "failed": self.failed}


def check_url(url: str) -> ObjectStore:
    """The URL as a destination, or refused in one line (not a URL; the extra missing)."""
    if not is_url(url):
        raise UnsupportedSetupError(url, "mirror= needs a URL (s3://bucket/prefix, file:///path)")
    return ObjectStore(url)


class Mirroring:
    """Mirror the checkpoint directories (``NAME`` ending in ``extension``) of ``dirpath`` to
    ``URL/NAME`` on a background thread, from the first pass (started at once: what a resumed
    run's directory already holds) until ``close``. ``wake`` returns at once. Only names this
    object saw locally are ever removed at the URL."""

    def __init__(self, dirpath: "str | os.PathLike[str]", url: str, *, lock: threading.Lock,
                 extension: str = ".ckpt", log: Callable[[str], None] | None = None):
        remote = check_url(url)
        if remote.local and _within(remote.root or "/", dirpath):
            raise UnsupportedSetupError(remote.url, f"lies in the checkpoint directory {dirpath}; mirror to another place")
        self.dirpath, self.url, self.lock, self.extension = os.fspath(dirpath), url, lock, extension
        self.log = log or (lambda message: warn(message))
        self.seen: set[str] = set()
        self.confirmed: dict[str, list[tuple[str, bytes]]] = {}    # name -> its manifests when confirmed there
        self.report: dict[str, Any] | None = None
        self._bg = BackgroundMirror(self.dirpath, url, log=self.log, mirror_pass=self._pass)
        self.wake()

    def wake(self) -> None:
        """A checkpoint was committed or removed: a pass soon (the caller does not wait)."""
        self._bg.on_commit()

    def on_commit(self, step: int | None = None, manifest: Any = None) -> None:
        """The session's call after a commit and its retention: a pass soon."""
        self.wake()

    def _pass(self, dirpath: str, url: str, *, recheck: bool) -> dict[str, Any]:
        """Link, then mirror what changed since the last pass (the first pass: everything,
        read back there); only names seen here are removed at the URL."""
        with self.lock:
            runs = snapshot(dirpath, self.extension)
        self.seen.update(runs)
        markers = {name: _markers(path) for name, path in runs.items()}
        trusted = [] if recheck else [n for n, m in markers.items() if self.confirmed.get(n) == m]
        result = mirror_runs(runs, url, recheck=recheck, owned=self.seen.__contains__, trusted=trusted)
        self.seen.difference_update(result["removed"])
        self.confirmed = {n: m for n, m in markers.items() if n not in result["behind"]}
        return result

    def close(self) -> dict[str, Any]:
        """A last pass (retried ``RETRIES`` times if it fails), the thread ended, the links
        removed; what the mirror did. Never raises. A last pass that failed is the session's to
        say (``failed``, its error); checkpoints a pass that went through held back (bytes that
        do not hash to their manifest) are said here, by name."""
        report = self.report = self._bg.close(retries=RETRIES)
        shutil.rmtree(os.path.join(self.dirpath, AREA), ignore_errors=True)
        behind = (report["last"] or {}).get("behind", [])
        if behind and not report["failed"]:
            self.log(f"mirror to {report['url']} is behind {self.dirpath} ({', '.join(behind)}) after "
                     f"{report['passes']} pass(es): see above")
        return report


def _within(path: str, dirpath: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` is ``dirpath`` or lies under it (after symlinks)."""
    a, b = os.path.realpath(path), os.path.realpath(dirpath)
    return os.path.commonpath([a, b]) == b


def snapshot(dirpath: "str | os.PathLike[str]", extension: str = ".ckpt") -> dict[str, str]:
    """NAME -> ``dirpath/.ckptfmt-mirror/NAME``: hard links of the files of each checkpoint
    directory in ``dirpath`` (a ``save_last="link"`` link followed), made afresh; a directory
    removed meanwhile is left out. Where the filesystem has no hard links, the files are copied."""
    area = os.path.join(dirpath, AREA)
    shutil.rmtree(area, ignore_errors=True)
    names = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []
    runs = {}
    for name in names:
        path = os.path.join(dirpath, name)
        if name.startswith(".") or not name.endswith(extension) or not os.path.isdir(path) \
                or kinds.generation_in(path) is None:
            continue
        try:
            _link_files(path, os.path.join(area, name))
        except FileNotFoundError:
            continue                  # removed meanwhile (retention, top-k): gone at the URL next
        runs[name] = os.path.join(area, name)
    return runs


def _markers(path: str) -> list[tuple[str, bytes]]:
    """The manifests (commit markers) in a checkpoint directory, by name, with their bytes."""
    return sorted((e.name, Path(e.path).read_bytes()) for e in os.scandir(path)
                  if e.name.startswith("step_") and e.name.endswith(".json"))


def _link_files(src: str, dst: str) -> None:
    os.makedirs(dst)
    for entry in os.scandir(src):
        if entry.is_file(follow_symlinks=False):
            target = os.path.join(dst, entry.name)
            try:
                os.link(entry.path, target)
            except OSError as exc:
                if exc.errno not in NO_LINKS:
                    raise
                shutil.copy2(entry.path, target)
