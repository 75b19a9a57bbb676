"""The ``Checkpointing`` callback's ``mirror=URL`` (spec/RUN.md §11.8), without Lightning: the
checkpoint directories in ModelCheckpoint's ``dirpath`` mirrored to ``URL/NAME`` (each a run of
one generation, as ``ckptfmt mirror`` sends a run: payload, read-back, manifest last) by one
background thread (``tools.mirror_thread.BackgroundMirror`` running ``tools.mirror.mirror_runs``).

A pass first links each checkpoint directory's files into ``dirpath/.ckptfmt-mirror/NAME``
(hard links: no bytes copied, and a checkpoint that Lightning replaces or removes meanwhile
stays whole there until the pass is done), holding the plugin's ``lock`` so that no directory
is linked halfway through its replacement; then it uploads from those links without the lock.
The plugin wakes the thread after each commit and removal and closes it at ``teardown``.

>>> import tempfile, threading
>>> d, there = tempfile.mkdtemp(), tempfile.mkdtemp()
>>> m = Mirroring(d, f"file://{there}/ckpt", lock=threading.Lock())
>>> m.close()["failed"], os.listdir(d)
(False, [])
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

from .. import kinds
from ..errors import UnsupportedSetupError
from ..tools.mirror import mirror_runs
from ..tools.mirror_thread import BackgroundMirror
from ..store.objects import ObjectStore, is_url

__all__ = ["AREA", "Mirroring", "check_url", "snapshot"]

AREA = ".ckptfmt-mirror"          # in dirpath: the links a pass uploads from (a dot name: never a checkpoint)
RETRIES = 2                       # a failed last pass at teardown is tried again this often (1 s, then 2 s later)
NO_LINKS = (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS)


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
        self.log = log or (lambda message: warnings.warn(message, stacklevel=2))
        self.seen: set[str] = set()
        self.confirmed: dict[str, list[tuple[str, bytes]]] = {}    # name -> its manifests when confirmed there
        self.report: dict[str, Any] | None = None
        self._bg = BackgroundMirror(self.dirpath, url, log=self.log, mirror_pass=self._pass)
        self.wake()

    def wake(self) -> None:
        """A checkpoint was committed or removed: a pass soon (the caller does not wait)."""
        self._bg.on_commit()

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
        removed; what the mirror did. Never raises: what is not at the URL is logged."""
        report = self.report = self._bg.close(retries=RETRIES)
        shutil.rmtree(os.path.join(self.dirpath, AREA), ignore_errors=True)
        behind = (report["last"] or {}).get("behind", [])
        if report["failed"] or behind:
            self.log(f"mirror to {report['url']} is behind {self.dirpath}" + (f" ({', '.join(behind)})" if behind else "")
                     + f" after {report['passes']} pass(es): {report['errors'][-1] if report['errors'] else 'see above'}")
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
