"""Opening an object store's client (spec/RUN.md §10): a URL's fsspec filesystem (s3fs for
``s3://``, the optional extra ``ckptfmt[remote]``; gcsfs, adlfs and the others installed on
their own), every request to S3 bounded in time (``CKPTFMT_STORE_TIMEOUT``; gcsfs and adlfs keep
their own timeouts), and the URL in the
form that is printed and recorded (no credentials).

fsspec and s3fs are the optional extra ``ckptfmt[remote]``, imported inside ``open_fs`` only.
"""
from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import MissingDependencyError, RemoteError, UnsupportedSetupError

EXTRA = "pip install 'ckptfmt[remote]'"
TIMEOUT_ENV = "CKPTFMT_STORE_TIMEOUT"
TIMEOUT = 20.0               # seconds one request may wait for a connection, or for the server's next bytes
ATTEMPTS = 3                 # botocore's tries of one call: a stalled store fails it in ATTEMPTS x timeout


def request_timeout(url: str = "") -> float:
    """Seconds one store request waits for a connection or for the server's next bytes before
    it is given up (``CKPTFMT_STORE_TIMEOUT``, default 20): a call that gets no answer fails
    after ``ATTEMPTS`` such waits and the backoffs between them, instead of hanging on a stalled
    server. A value that is not a positive number is refused in one line."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        wait = float(text) if text else TIMEOUT
    except ValueError:
        wait = -1.0
    if not 0 < wait < float("inf"):
        raise UnsupportedSetupError(TIMEOUT_ENV, f"{text!r} is not a number of seconds above 0"
                                    + (f" (opening {redact(url)})" if url else ""))
    return wait


def call_deadline() -> float:
    """Seconds one call may take in all (``ATTEMPTS`` waits of a connection and of an answer,
    and the backoffs between them): fsspec cancels a call still running then. A PUT to a
    stalled server can outwait the per-request timeouts (seen with a small object)."""
    return ATTEMPTS * 2 * request_timeout() + 5


def redact(url: str) -> str:
    """The URL without user:password and without a trailing slash, the form that is recorded
    and printed (``s3://b/runs/x/`` is the same destination as ``s3://b/runs/x``).

    >>> redact("s3://key:secret@bucket/runs/x/"), redact("file:///")
    ('s3://bucket/runs/x', 'file:///')
    """
    parts = urlsplit(url)
    url = urlunsplit(parts._replace(netloc=parts.hostname or "")) if "@" in parts.netloc else url
    head, sep, rest = url.partition("://")
    return f"{head}{sep}{rest.rstrip('/')}" if rest.rstrip("/") else url


def open_fs(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, root path) for ``url``; exit 2 naming the extra when it is missing."""
    try:
        import fsspec  # lazy: the optional extra ckptfmt[remote]
    except ImportError:
        raise MissingDependencyError(redact(url), f"object storage needs fsspec and s3fs: {EXTRA}") from None
    options: dict[str, Any] = {"skip_instance_cache": True}
    if urlsplit(url).scheme in ("s3", "s3a"):
        # every request bounded (a stalled server fails the call, spec/RUN.md §2.0.1); botocore's
        # standard mode retries a timeout, a dropped connection or a throttle with backoff
        wait = request_timeout(url)
        options.update(use_listings_cache=False, config_kwargs={
            "connect_timeout": wait, "read_timeout": wait, "retries": {"total_max_attempts": ATTEMPTS, "mode": "standard"}})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise MissingDependencyError(redact(url), _missing(urlsplit(url).scheme, exc)) from None
    except ValueError as exc:
        raise RemoteError(redact(url), f"unsupported URL: {exc}") from None
    if hasattr(fs, "retries"):
        fs.retries = 1   # s3fs's own loop of retries off: botocore's attempts are the only ones
    return fs, root.rstrip("/")


# The fsspec filesystem each scheme needs, where ckptfmt[remote] (s3fs) does not bring it.
BACKENDS = {"gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "adl": "adlfs"}


def _missing(scheme: str, exc: ImportError) -> str:
    """What to install for ``scheme``: s3fs comes with the extra; another scheme's filesystem
    (gcsfs for gs://, adlfs for az://, or what fsspec itself named) is installed on its own.

    >>> _missing("gs", ImportError())
    "gs:// URLs need fsspec's gcsfs: pip install gcsfs"
    """
    if scheme in ("s3", "s3a"):
        return f"object storage needs fsspec and s3fs: {EXTRA}"
    package = BACKENDS.get(scheme) or getattr(exc, "name", None) or f"the fsspec filesystem of {scheme}://"
    return f"{scheme}:// URLs need fsspec's {package}: pip install {package}"
