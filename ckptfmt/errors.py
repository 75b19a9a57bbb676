"""One exception hierarchy (spec §7). Every failure of a checkpoint is a ``CheckpointError``.

OS errors on reading stay OS errors; failures of a save are ``SaveError`` with the OS error as
its cause, so callers can tell "the file is bad" from "the disk refused".
"""
from __future__ import annotations

import os


class CheckpointError(ValueError):
    """Root of every ckptfmt error: carries the path and, where known, offset/expected/got."""

    def __init__(self, path: "str | os.PathLike[str] | None", problem: str, *,
                 offset: int | None = None, expected: object = None, got: object = None):
        self.path = os.fspath(path) if path is not None else None
        self.problem = problem
        self.offset = offset
        self.expected = expected
        self.got = got
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class NotACheckpointError(CheckpointError):
    """The input is not a checkpoint at all (too short for a header, a directory, a FIFO)."""


class BadHeaderError(CheckpointError):
    """A header value is impossible (negative step or n_params)."""


class TruncatedError(CheckpointError):
    """The file is shorter than its header says: a torn or incomplete write."""


class TrailingDataError(CheckpointError):
    """The file is longer than its header says."""


class BadNameError(CheckpointError):
    """A name does not follow step_NNNNNN.bin, or disagrees with the header's step."""


class ManifestError(CheckpointError):
    """The manifest cannot be read or does not follow the schema."""


class ManifestMismatchError(ManifestError):
    """The manifest is well formed but describes another file (size, step, n_params, name)."""


class FingerprintMismatchError(CheckpointError):
    """The blake3 of the file is not the one its manifest committed."""


class IncompleteResumeStateError(CheckpointError):
    """A resume needs a component the manifest does not hold; the component is named."""


class ConfigMismatchError(CheckpointError):
    """A run was started with a config that differs from the one it was trained with."""


class NoValidGenerationError(CheckpointError):
    """A run has generations but none of them is committed and valid."""


class RunLockedError(CheckpointError):
    """Another live process holds the run's writer lock."""


class HistoryCorruptError(CheckpointError):
    """The loss history is damaged in the middle, not just torn at its tail."""


class SaveError(CheckpointError):
    """A durable save failed; the previous generations are untouched. ``__cause__`` is the OS error."""


class ConvertError(CheckpointError):
    """A conversion could not be done or did not round-trip."""


class ExportError(CheckpointError):
    """An export could not be completed or did not verify at its destination."""


class DestinationExistsError(CheckpointError):
    """A destination that must be new already exists; nothing was written (CLI exit 2)."""
