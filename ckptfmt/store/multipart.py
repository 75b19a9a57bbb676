"""One object uploaded to S3 in parts ckptfmt cuts itself, so the store vouches for what it received.

S3 answers each ``UploadPart`` with an ETag that is the MD5 of the bytes it received (for objects
stored unencrypted or with SSE-S3, S3's default, and on moto's server and most S3 compatibles),
and the completed object's ETag is the MD5 of those MD5s with ``-N``, N the number of parts. A
part whose ETag is the MD5 of the bytes ckptfmt sent was received whole; an object whose ETag is
then the one those parts make is exactly those parts, in order: the store computed that checksum
itself, so a commit can confirm the object by one ``HEAD`` (its size and ETag) instead of reading
it back (``store.confirm``). Where a store's ETags are not MD5s (SSE-KMS, some compatibles) the
upload still completes; it just vouches for nothing (``checksum`` None) and the commit reads the
object back, as before.

The object is made create-only (``If-None-Match: *`` on the ``PutObject`` and on the
``CompleteMultipartUpload``): S3 and moto's server refuse it where an object of that name is
(``PreconditionFailed``), so a writer never replaces an object another wrote, not even one whose
lease was taken over while it stalled (spec/RUN.md §4.1). A run's writer removes what an
interrupted save left before it writes the same names (``StoreRun``: the sweep at restore, the
leftover of a step before its save), so a create-only write never meets its own leftovers; one
that does (a retry after a reply was lost) fails the save, and the next save removes it.

Parts are ``BLOCK`` bytes (the last one shorter); up to ``PARALLEL_PARTS`` are sent at once, each
on a daemon thread of its own that hashes it (MD5) and sends it, so a save's upload overlaps the
writer that fills the next part, and a process told to stop (Ctrl-C) while a store does not
answer is not held at exit by a part still waiting for it. An object smaller than one part is one
``PutObject``.
"""
from __future__ import annotations

import hashlib
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from ..errors import SaveError
from .connect import call_deadline

BLOCK = 16 << 20        # part size (S3's minimum is 5 MiB, but for the last part)
PARALLEL_PARTS = 4      # parts in flight at once: memory up to (PARALLEL_PARTS + 1) * BLOCK


def md5(data: "bytes | bytearray") -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def etag_of(md5s: list[bytes]) -> str:
    """The ETag S3 gives an object completed from parts with these MD5 digests.

    >>> etag_of([md5(b"")])
    '59adb24ef3cdbe0297f05b395827453f-1'
    """
    return f"{md5(b''.join(md5s)).hex()}-{len(md5s)}"


EXISTS = ("is on the store already (written create-only, never over an object: another writer's, or a "
          "leftover the next save removes); not overwritten")


def unquoted(etag: str | None) -> str:
    """An ETag as S3 sends it (``"..."``), without its quotes."""
    return (etag or "").strip('"')


class S3Upload:
    """``ObjectStore.open_part`` on S3: ``write`` buffers and sends each full part,
    ``commit`` sends the last one and completes the object (``checksum``: its ETag when every
    part's ETag was the MD5 of what was sent, else None); leaving the ``with`` block without
    ``commit`` aborts the multipart upload, so nothing is published."""

    def __init__(self, fs: Any, path: str, translated: Any):
        self.fs, self.translated = fs, translated
        self.bucket, _, self.key = path.partition("/")
        self.offset = 0
        self.checksum: str | None = None
        self._part = bytearray()
        self._sent: list[Future] = []
        self._in_flight: deque[Future] = deque()     # sent, not yet looked at, oldest first
        self._upload_id: str | None = None
        self._done = False

    def __enter__(self) -> "S3Upload":
        return self

    def write(self, data: "bytes | memoryview") -> None:
        view = memoryview(data).cast("B")
        self.offset += view.nbytes
        while view.nbytes:
            take = min(view.nbytes, BLOCK - len(self._part))
            self._part += view[:take]
            view = view[take:]
            if len(self._part) == BLOCK:
                self._send()

    def _send(self) -> None:
        """Hand the full part to the pool; wait for the oldest when enough are in flight."""
        with self.translated("upload failed"):
            if self._upload_id is None:
                self._upload_id = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket,
                                                  Key=self.key)["UploadId"]
            number, part, self._part = len(self._sent) + 1, self._part, bytearray()
            self._sent.append(self._start(number, part))
            self._in_flight.append(self._sent[-1])
            while self._in_flight and self._in_flight[0].done():    # a failed part fails the write now
                self._in_flight.popleft().result()
            if len(self._in_flight) >= PARALLEL_PARTS:
                self._in_flight.popleft().result()

    def _start(self, number: int, part: bytearray) -> Future:
        """Part ``number`` hashed and sent on a daemon thread; its ``Future``."""
        sent: Future = Future()

        def send() -> None:
            try:
                sent.set_result(self._upload_part(number, part))
            except BaseException as exc:  # noqa: BLE001 (raised where the caller asks for the result)
                sent.set_exception(exc)
        sent.set_running_or_notify_cancel()
        threading.Thread(target=send, name=f"ckptfmt-part-{number}", daemon=True).start()
        return sent

    def _upload_part(self, number: int, part: bytearray) -> tuple[dict[str, Any], bytes, bool]:
        digest = md5(part)
        answer = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                 PartNumber=number, Body=part)
        return {"PartNumber": number, "ETag": answer["ETag"]}, digest, unquoted(answer["ETag"]) == digest.hex()

    def commit(self) -> None:
        with self.translated("upload failed"):
            if self._upload_id is None:
                digest = md5(self._part).hex()     # one PutObject: its ETag is the MD5 itself
                answer = self._created("put_object", Body=self._part)
                self.checksum = digest if unquoted(answer.get("ETag")) == digest else None
            else:
                if self._part:
                    self._send()
                parts = [f.result() for f in self._sent]
                answer = self._created("complete_multipart_upload", UploadId=self._upload_id,
                                       MultipartUpload={"Parts": [p[0] for p in parts]})
                expected = etag_of([p[1] for p in parts])
                vouched = all(p[2] for p in parts) and unquoted(answer.get("ETag")) == expected
                self.checksum = expected if vouched else None
        self._done = True

    def _created(self, call: str, **how: Any) -> dict[str, Any]:
        """The call that makes the object, create-only; ``SaveError`` (``EXISTS``) where one is."""
        try:
            return self.fs.call_s3(call, Bucket=self.bucket, Key=self.key, IfNoneMatch="*", **how,
                                   timeout=call_deadline())     # a stalled store: cancelled, not waited out
        except FileExistsError:                  # s3fs's name for S3's PreconditionFailed (412)
            raise SaveError(f"s3://{self.bucket}/{self.key}", EXISTS) from None

    def __exit__(self, kind: "type[BaseException] | None", failed: BaseException | None, *exc: object) -> None:
        """Uncommitted: the multipart upload aborted, no part waited for; not on Ctrl-C or a
        SystemExit, nor after a store that gave no answer in time, which must not be waited for
        again (the unfinished upload is the next writer's to abort, ``ObjectStore.abort_unfinished``)."""
        if kind is not None and (not issubclass(kind, Exception) or getattr(failed, "unanswered", False)):
            return
        try:
            if not self._done and self._upload_id is not None:
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                UploadId=self._upload_id)
        except Exception:  # noqa: BLE001 (best effort: the parts of an unfinished upload stay invisible)
            pass
