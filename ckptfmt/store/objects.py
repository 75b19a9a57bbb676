"""Object storage through fsspec (spec/RUN.md §10), a ``Store``: one place that (through
``connect.open_fs``) opens a URL, lists a run there, streams bytes up and down hashed as they pass, and turns the client's
exceptions into one-line ``RemoteError`` messages.

fsspec and s3fs are the optional extra ``ckptfmt[remote]``: they are imported inside
``connect.open_fs`` only, so the core and every other tool stay importable without them. Credentials
and endpoints come the standard way (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... and the
AWS config files, read by botocore); ckptfmt stores none of them.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Iterator

from .. import atomic, fingerprint
from ..fsio import is_url  # noqa: F401  (where the tools and the CLI ask for it)
from .. import format as fmt
from .. import manifest as mf
from ..errors import CheckpointError, FingerprintMismatchError, RemoteError, UnsupportedSetupError
from . import DIRECTORY, FILE, OTHER, Entry, Written, multipart
from .connect import call_deadline, open_fs, redact  # noqa: F401  (redact: where the tools ask for it)

CHUNK = 8 << 20              # bytes per read while streaming
BLOCK = multipart.BLOCK      # part size of an upload, range size of a read-back
PARALLEL_READS = 4           # concurrent ranged GETs while reading back
Progress = Callable[[int], None] | None


NO_ANSWER = "no answer in time"   # each request of the call timed out (CKPTFMT_STORE_TIMEOUT)

# The store did not take the credentials at all (as against denying what they asked for).
REFUSED = {"InvalidAccessKeyId": "the access key is not known there",
           "SignatureDoesNotMatch": "the secret key is not the access key's",
           "ExpiredToken": "the session token has expired", "InvalidToken": "the session token is not valid"}


def _reason(exc: BaseException) -> str:
    """A one-line reason from whatever the client stack raised (botocore, aiohttp, OSError)."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 6:
        chain.append(f"{type(seen).__name__} {seen}")
        seen = seen.__cause__ or seen.__context__
    text = " | ".join(chain)
    if re.search(r"NoSuchBucket|bucket does not exist", text, re.I):
        return "no such bucket"
    if isinstance(exc, FileNotFoundError):
        return "not found"
    if re.search(r"NoCredentials|Unable to locate credentials", text):
        return "no credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in ~/.aws)"
    for code, why in REFUSED.items():
        if code in text:
            return f"credentials refused: {why} ({code})"
    if re.search(r"AccessDenied|Forbidden|(?<![:\d])403(?!\d)", text):
        return "access denied"
    if re.search(r"ReadTimeout|ConnectTimeout|Connect timeout|TimeoutError|timed out", text, re.I):
        return f"{NO_ANSWER} ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__})"
    if re.search(r"Connect(ion)?(Error|Timeout|Refused)|Could not connect|Cannot connect|"
                 r"EndpointConnection|Name or service not known", text, re.I):
        return f"endpoint unreachable ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__})"
    if re.search(r"ConnectionClosed|ServerDisconnected|ConnectionReset|connection was closed", text, re.I):
        return f"connection lost ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__})"
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextmanager
def translated(where: str, what: str, *, denied: str = "") -> Iterator[None]:
    """Turn a client exception into ``RemoteError("{where}: {what}: {reason}")``; access denied
    to a write or a delete says that these credentials may not ``denied`` ("write", "delete")
    there (a read-only bucket or key: a writer's first write is its lease, so it stops before
    any work). Broad on purpose: botocore, aiobotocore and aiohttp share no base class that
    could be named here without importing them, and a traceback is never the answer
    (spec/FORMAT.md §7)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 (the remote boundary, see the docstring)
        reason = _reason(exc)
        if denied and reason == "access denied":
            reason = f"access denied: these credentials may not {denied} there"
        failed = RemoteError(where, f"{what}: {reason}")
        failed.unanswered = reason.startswith(NO_ANSWER)
        raise failed from None


def _kind(entry: dict[str, Any]) -> str:
    """An fsspec listing entry's kind: a prefix (``directory``), an object or regular file, or
    anything else (a link or a FIFO of a ``file://`` URL: never followed or opened)."""
    if entry.get("islink"):
        return OTHER
    return {"directory": DIRECTORY, "file": FILE}.get(entry.get("type"), OTHER)


class ObjectStore:
    """A run directory's mirror at ``url``: names are relative to it (``step_000100.bin``)."""

    def __init__(self, url: str):
        self.url = redact(url)
        self.fs, self.root = open_fs(url)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        if not self.local and (self.root.startswith("/") or "//" in self.root):
            # s3://b//x stores keys under "/x/" that a listing of the prefix never finds
            raise UnsupportedSetupError(self.url, "empty path segment ('//') in the URL; write it without one")

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def where(self, name: str = "") -> str:
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def locate(self, name: str) -> PurePosixPath:
        """A listed part is its name under the prefix (``store.Store``)."""
        return PurePosixPath(name)

    def entries(self) -> list[Entry]:
        """Every object and folder directly under the prefix (``store.Store``); an absent prefix
        is an empty run, an absent bucket an error."""
        with translated(self.where(), "cannot list"):
            try:
                found = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                self._bucket_exists()
                found = []
        out = [Entry(e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("size") if _kind(e) == FILE else None, _kind(e))
               for e in found]
        return sorted(out, key=lambda e: e.name)

    def _bucket_exists(self) -> None:
        if self.local:
            return
        bucket = self.root.split("/", 1)[0]
        if not self.fs.exists(bucket):
            raise RemoteError(self.where(), "no such bucket")

    def exists(self, name: str) -> bool:
        with translated(self.where(name), "cannot check"):
            return self.fs.exists(self.path(name))

    def size(self, name: str) -> int | None:
        with translated(self.where(name), "cannot stat"):
            try:
                return self.fs.info(self.path(name))["size"]
            except FileNotFoundError:
                return None

    def read_bytes(self, name: str) -> bytes:
        with translated(self.where(name), "cannot read"):
            return self.fs.cat_file(self.path(name))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """One ranged GET (a header's 8 bytes: never the whole object)."""
        with translated(self.where(name), "cannot read"):
            return self.fs.cat_file(self.path(name), start=start, end=end)

    def read_manifest(self, step: int) -> tuple[dict[str, Any], bytes]:
        """A manifest at the destination, its seal and schema checked as a local one's, and its bytes."""
        where = self.where(fmt.manifest_name(step))
        data = self.read_bytes(fmt.manifest_name(step))
        return mf.parse(data, where), data

    def put_bytes(self, name: str, data: bytes) -> None:
        """One small object (a manifest, a sidecar), written whole: S3 publishes a PUT at once."""
        self._parent(name)
        with translated(self.where(name), "upload failed", denied="write"):
            self.fs.pipe_file(self.path(name), data, **({} if self.local else {"timeout": call_deadline()}))

    def _parent(self, name: str) -> None:
        if self.local:   # object stores have no directories; a local target needs them
            self.fs.makedirs(self.path(name).rsplit("/", 1)[0], exist_ok=True)

    def upload(self, local: Path, name: str, expected: str | None, progress: Progress = None) -> Written:
        """Stream the local file ``local`` to ``name`` (``write``); a file whose bytes do not
        hash to ``expected`` is named and never published."""
        def chunks() -> Iterator[bytes]:
            with open(local, "rb") as src:
                while chunk := src.read(CHUNK):
                    yield chunk
        return self.write(name, chunks(), expected=expected, progress=progress, source=str(local))

    def write(self, name: str, chunks: Iterable[bytes], *, expected: str | None = None,
              progress: Progress = None, source: str | None = None) -> Written:
        """Stream ``chunks`` to ``name`` (multipart above ``BLOCK``), hashed while sent; an upload
        whose bytes do not hash to ``expected`` is aborted before S3 would publish it (the error
        names ``source``, the file it came from, else the object)."""
        h = fingerprint.hasher(0)
        with self.open_part(name) as out:
            for chunk in chunks:
                h.update(chunk)
                out.write(chunk)
                if progress is not None:
                    progress(len(chunk))
            if expected is not None and h.hexdigest() != expected:
                raise FingerprintMismatchError(source or self.where(name), f"hashes to {h.hexdigest()} while "
                                               f"sent, its manifest says {expected}; not uploaded")
            out.commit()
        return Written(name, out.offset, h.hexdigest(), out.checksum)

    def open_part(self, name: str) -> "Upload | multipart.S3Upload":
        """An upload of ``name`` to write chunk by chunk: on S3 in parts cut here, so the store's
        ETag vouches for the bytes (``multipart``); elsewhere through the fsspec file (``Upload``)."""
        if self.local or not hasattr(self.fs, "call_s3"):
            return Upload(self, name)
        self._parent(name)
        return multipart.S3Upload(self.fs, self.path(name), lambda what: translated(self.where(name), what, denied="write"))

    def checksum(self, name: str) -> str | None:
        """The object's checksum as the store computed it (S3: its ETag), None where it has none."""
        return self.stat(name)[1]

    def stat(self, name: str) -> tuple[int | None, str | None]:
        """(size, checksum) of the object from one ``HEAD``; (None, None) when it is not there."""
        with translated(self.where(name), "cannot stat"):
            try:
                info = self.fs.info(self.path(name))
            except FileNotFoundError:
                return None, None
        return info["size"], multipart.unquoted(info.get("ETag")) or None

    def under(self, prefix: str) -> "ObjectStore":
        """The files under ``prefix``, on the same client."""
        child = object.__new__(ObjectStore)
        child.__dict__.update(self.__dict__, url=self.where(prefix), root=self.path(prefix))
        return child

    def create(self, name: str, data: bytes) -> bool:
        """One small object made only where none is: S3's conditional PUT (``If-None-Match: *``,
        which s3fs sends for ``mode="create"``; moto's server honours it too), an exclusive
        create on a local target. False when the object is there already."""
        self._parent(name)
        with translated(self.where(name), "cannot create", denied="write"):
            try:
                self.fs.pipe_file(self.path(name), data, mode="create",
                                  **({} if self.local else {"timeout": call_deadline()}))
            except FileExistsError:
                return False
        return True

    def _discard(self, out: Any, name: str) -> None:
        """Abort an upload: S3 drops the parts of an uncompleted multipart upload (if the abort
        cannot reach it, the parts stay invisible until the bucket's lifecycle removes them); a
        local target's partial file is removed. The file object is then marked closed, because
        fsspec's ``__del__`` would otherwise flush the buffer and complete the upload, publishing
        a partial object at garbage collection."""
        try:
            if self.local:           # its file object writes in place (discard() refuses): close, remove
                out.close()
                self.fs.rm(self.path(name))
            elif hasattr(out, "discard"):
                out.discard()
        except Exception:  # noqa: BLE001 (best effort while another error propagates)
            pass
        finally:
            if not self.local:       # a local file object's ``closed`` is a read-only property
                out.closed = True

    def digest(self, name: str, progress: Progress = None) -> tuple[str, int]:
        """(blake3, size) of an object read back from the destination: ranged reads of
        ``BLOCK`` bytes, ``PARALLEL_READS`` at a time (concurrent GETs on S3), hashed in order."""
        h, done = fingerprint.hasher(0), 0
        path = self.path(name)
        with translated(self.where(name), "read-back failed"):
            size = self.fs.size(path)
            while done < size:
                starts = list(range(done, min(size, done + BLOCK * PARALLEL_READS), BLOCK))
                ends = [min(size, s + BLOCK) for s in starts]
                for chunk in self.fs.cat_ranges([path] * len(starts), starts, ends):
                    if isinstance(chunk, Exception):
                        raise chunk
                    h.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(len(chunk))
                if done < ends[-1]:
                    raise RemoteError(self.where(name), f"read back {done} bytes of {size}: the object shrank")
        return h.hexdigest(), done

    def download(self, name: str, local: Path, expected: str | None, progress: Progress = None) -> str:
        """Stream ``name`` into ``local`` through the durable write, hashed while received; a
        file whose bytes do not hash to ``expected`` is never published."""
        with translated(self.where(name), "download failed"):
            with self.fs.open(self.path(name), "rb", block_size=CHUNK, cache_type="none") as f, \
                    atomic.AtomicWriter(local) as out:
                h = fingerprint.hasher(0)
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
                if expected is not None and h.hexdigest() != expected:
                    raise FingerprintMismatchError(self.where(name), f"blake3 {h.hexdigest()}, "
                                                                     f"expected {expected}")
                out.commit()
        return h.hexdigest()

    def abort_unfinished(self) -> list[str]:
        """Abort every multipart upload under the prefix that was never completed (its writer
        killed mid-upload): S3 keeps their parts, invisible to listings and billed, until then.
        The names aborted; none on a store without multipart uploads. Only a writer holding the
        run's lease calls it (an upload in progress is that writer's own)."""
        if self.local or not hasattr(self.fs, "call_s3"):
            return []
        bucket, _, prefix = self.root.partition("/")
        aborted = []
        with translated(self.where(), "cannot list unfinished uploads"):
            for upload in self._unfinished(bucket, prefix + "/"):
                folders = upload["Key"][len(prefix) + 1:].split("/")[:-1]
                if folders and (len(folders) > 1 or not folders[0].endswith(".shards")):
                    continue             # a run under this one's prefix: not this run's upload
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted.append(upload["Key"][len(prefix) + 1:])
        return aborted

    def _unfinished(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        """Every unfinished multipart upload under ``prefix``, page after page (S3 answers at
        most 1,000 a call: the rest follow its ``NextKeyMarker`` and ``NextUploadIdMarker``)."""
        found: list[dict[str, Any]] = []
        ask: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            listed = self.fs.call_s3("list_multipart_uploads", **ask)
            found += listed.get("Uploads", [])
            if not listed.get("IsTruncated"):
                return found
            ask.update(KeyMarker=listed.get("NextKeyMarker", ""), UploadIdMarker=listed.get("NextUploadIdMarker", ""))

    def remove(self, name: str, *, recursive: bool = False) -> None:
        """``name`` deleted (with what is under it, ``recursive``): absent is no error, and a
        delete the store refuses raises."""
        with translated(self.where(name), "cannot delete", denied="delete"):
            if self.local or not hasattr(self.fs, "call_s3"):
                try:
                    self.fs.rm(self.path(name), recursive=recursive)
                except FileNotFoundError:
                    pass
                return
            found = self.fs.find(self.path(name)) if recursive else [self.path(name)]
            self._delete([self.fs.split_path(path)[1] for path in found])

    def _delete(self, keys: list[str]) -> None:
        """S3's DeleteObjects, its per-key errors raised: s3fs's ``rm`` drops them (a refused
        delete would pass for done, and retention report as deleted what is still there)."""
        bucket = self.root.split("/", 1)[0]
        for start in range(0, len(keys), 1000):
            objects = [{"Key": key} for key in keys[start:start + 1000]]
            out = self.fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
            for error in out.get("Errors", [])[:1]:
                raise PermissionError(f"An error occurred ({error.get('Code')}) deleting {error.get('Key')}: "
                                      f"{error.get('Message')}")


class Upload:
    """One object being uploaded (``ObjectStore.open_part``): ``write`` sends (multipart above
    ``BLOCK``), ``commit`` completes it; leaving the ``with`` block without ``commit`` aborts
    it (``_discard``), so a failed or refused write never publishes an object."""

    def __init__(self, store: ObjectStore, name: str):
        self.store, self.name, self.offset = store, name, 0
        self.checksum: str | None = None       # fsspec's file says nothing the store vouched for
        self._out: Any = None
        self._done = False

    def __enter__(self) -> "Upload":
        self.store._parent(self.name)
        with translated(self.store.where(self.name), "upload failed", denied="write"):
            self._out = self.store.fs.open(self.store.path(self.name), "wb", block_size=BLOCK)
        return self

    def write(self, data: "bytes | memoryview") -> None:
        with translated(self.store.where(self.name), "upload failed", denied="write"):
            self._out.write(data)
        self.offset += memoryview(data).nbytes

    def commit(self) -> None:
        with translated(self.store.where(self.name), "upload failed", denied="write"):
            self._out.close()
        self._done = True

    def __exit__(self, *exc: object) -> None:
        if not self._done and self._out is not None:
            self.store._discard(self._out, self.name)
