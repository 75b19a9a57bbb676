"""Where a URL leads: the fsspec filesystem that serves its scheme (s3fs for ``s3://``, the
optional extra ``ckptfmt[remote]``; gcsfs, adlfs and the others installed on their own) and the
form of the URL that is printed and recorded (no credentials)."""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import MissingDependencyError, RemoteError

EXTRA = "pip install 'ckptfmt[remote]'"


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
        # retries with backoff on transient errors (botocore's standard mode), short connects
        options.update(use_listings_cache=False, config_kwargs={
            "connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise MissingDependencyError(redact(url), _missing(urlsplit(url).scheme, exc)) from None
    except ValueError as exc:
        raise RemoteError(redact(url), f"unsupported URL: {exc}") from None
    if hasattr(fs, "retries"):
        fs.retries = 2   # s3fs's own retries of a failed call, on top of botocore's attempts
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
