"""One exception hierarchy (spec/FORMAT.md §7). Every failure of ckptfmt is a ``CheckpointError``.

OS errors on reading stay OS errors; failures of a save are ``SaveError`` with the OS error as
its cause, so callers can tell "the file is bad" from "the disk refused". Each subclass says
whether it means "the check ran and found a defect" or "it could not run"
(``could_not_run``): the CLI turns the first into exit 1 and the second into exit 2.

>>> str(TruncatedError("a.bin", "truncated at offset 4", offset=4, expected=8, got=4, unit="bytes"))
'a.bin: truncated at offset 4: expected 8 bytes, got 4'
>>> MissingDependencyError("x.pt", ".pt needs torch: pip install 'ckptfmt[torch]'").could_not_run
True
"""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["CheckpointError", "NotACheckpointError", "BadHeaderError", "TruncatedError",
           "TrailingDataError", "BadNameError", "ManifestError", "ManifestMismatchError", "ManifestSealError",
           "UnsupportedVersionError", "FingerprintMismatchError", "IncompleteResumeStateError", "ConfigMismatchError",
           "StateRefusedError", "DeviceChangeError", "LayoutMismatchError", "OptimizerMismatchError", "UnsupportedOptimizerError", "NoValidGenerationError",
           "GenerationNotFoundError", "EmptyRunError", "RunLockedError", "HistoryCorruptError", "SidecarError",
           "RankDisagreementError", "SaveError", "RegionError", "ConvertError", "UnsupportedFormatError",
           "UnsupportedConversionError", "UnsupportedKindError", "TensorFileError", "ExportError",
           "DestinationExistsError", "MissingDependencyError", "UnsupportedSetupError",
           "DeviceUnavailableError", "RemoteError", "StepNameMismatchError", "StorageError",
           "HistoryWriteError", "SidecarWriteError"]


class CheckpointError(ValueError):
    """Root of every ckptfmt error: carries the path and, where known, offset/expected/got.

    With ``unit`` (or ``at_least``), the message ends in "expected X unit, got Y", rendered
    here from the fields, so every such message reads the same way.
    """

    could_not_run = False    # True: CLI exit 2 (could not run); False: exit 1 (a defect found)

    def __init__(self, path: "str | os.PathLike[str] | None", problem: str, *,
                 offset: int | None = None, expected: object = None, got: object = None,
                 unit: str | None = None, at_least: bool = False):
        self.path = os.fspath(path) if path is not None else None
        self.problem = problem
        self.offset = offset
        self.expected = expected
        self.got = got
        if unit is not None:
            bound = "at least " if at_least else ""
            self.problem = f"{problem}: expected {bound}{expected} {unit}, got {got}"
        super().__init__(f"{self.path}: {self.problem}" if self.path else self.problem)


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


class StepNameMismatchError(BadNameError):
    """A destination named ``step_N.bin`` for a checkpoint of another step (``convert ck.pt
    run/step_000300.bin`` of a file at step 3): a usage problem, nothing is written (CLI exit 2)."""

    could_not_run = True


class ManifestError(CheckpointError):
    """The manifest cannot be read or does not follow the schema."""


class ManifestMismatchError(ManifestError):
    """The manifest is well formed but describes another file (size, step, n_params, name)."""


class ManifestSealError(ManifestError):
    """The manifest does not match its own seal (spec §4.7): a flipped bit or an edit after it was
    written. The generation is damaged, whatever the fields now say."""


class UnsupportedVersionError(ManifestError):
    """The manifest's ``format_version`` is newer than this ckptfmt: the file may be fine, this
    reader cannot judge it (CLI exit 2; upgrade ckptfmt)."""

    could_not_run = True


class FingerprintMismatchError(CheckpointError):
    """The blake3 of the file is not the one its manifest committed."""


class IncompleteResumeStateError(CheckpointError):
    """A resume needs a component the manifest does not hold; the component is named."""


class ConfigMismatchError(CheckpointError):
    """A run was started with a config that differs from the one it was trained with."""


class StateRefusedError(ConfigMismatchError):
    """A loop object's ``load_state_dict`` raised on the state the checkpoint holds for it; the
    restore put back every object it had loaded, and copied no tensor (a failed restore changes
    nothing). The piece and the object's own error are named."""


class DeviceChangeError(ConfigMismatchError):
    """A run saved on one device type (CPU, CUDA) is resumed on another: the RNG states of the
    old device cannot be restored, so the run would not continue bit-exactly. Refused unless
    asked for (``restore(allow_device_change=True)``, ``ckptfmt train --allow-device-change``)."""


class LayoutMismatchError(CheckpointError):
    """The checkpoint's parameters (names, order, shapes) are not the model's."""


class OptimizerMismatchError(CheckpointError):
    """The checkpoint's optimizer state does not fit the optimizer (type, param groups)."""


class UnsupportedOptimizerError(OptimizerMismatchError):
    """The optimizer keeps state the seed layout cannot hold (only Adam, AdamW and SGD fit)."""


class NoValidGenerationError(CheckpointError):
    """A run has generations but none of them is committed and valid."""


class GenerationNotFoundError(CheckpointError):
    """The run has no committed generation where one was asked for (a step, or any at all)."""


class EmptyRunError(CheckpointError):
    """A run holds nothing the operation needs (``plot`` of a run without a loss history):
    nothing was written (CLI exit 2)."""

    could_not_run = True


class RunLockedError(CheckpointError):
    """Another live process holds the run's writer lock."""

    could_not_run = True


class HistoryCorruptError(CheckpointError):
    """The loss history is damaged in the middle, not just torn at its tail."""


class SidecarError(CheckpointError):
    """A run's sidecar file (pins, samples, bandit state, pivot record) is not valid JSON."""


class StorageError(CheckpointError):
    """The storage refused a write beside the generations (a full disk, a quota, an I/O error
    at the run lock, the loss history, a sidecar): names the file and the operation; ``errno``
    is the OS error's and ``__cause__`` the OS error itself. Nothing of the failed write is left
    (CLI exit 2: the command could not run; free space and run it again)."""

    could_not_run = True

    def __init__(self, path: "str | os.PathLike[str]", operation: str, cause: OSError):
        super().__init__(path, f"{operation} failed: {cause.strerror or cause}")
        self.operation, self.errno = operation, cause.errno


class HistoryWriteError(StorageError):
    """An append to (or the fsync of) the loss history ``.loss.json`` failed: the record is not
    in the history (a part written is cut off again); no checkpoint failed."""


class SidecarWriteError(StorageError):
    """A sidecar (``.samples.json``, ``.state.json``, pins, pivot record) could not be replaced:
    the previous one is intact; no checkpoint failed."""


class RankDisagreementError(CheckpointError):
    """The ranks of a torch.distributed job could not agree on a decision (what to resume)."""


class SaveError(CheckpointError):
    """A durable save failed; the previous generations are untouched. ``__cause__`` is the OS error.

    When the OS refused (a missing or read-only destination, a full disk), the command could not
    run (CLI exit 2); a save refused for what it was given (a copy whose hash is not the
    source's) is a defect found (exit 1).
    """

    @property
    def could_not_run(self) -> bool:  # type: ignore[override]
        return isinstance(self.__cause__, OSError)


class RegionError(SaveError, TypeError):
    """A region given to ``ckptfmt.save`` is not what the seed layout holds: an array of another
    dtype (float64, int32, big-endian float32), a Python list or tuple of numbers, a tensor, a
    scalar. Refused by name before the first byte is written (nothing appears at the path); also
    a ``TypeError``, as the writer raised before it was named."""


class ConvertError(CheckpointError):
    """A conversion could not be done or did not round-trip."""


class UnsupportedFormatError(ConvertError):
    """What was asked cannot be converted: an unknown format or extension, a directory where a
    file is needed, a file not written by ckptfmt, or options the target cannot hold
    (``--weights-only`` into a ``.bin``, bfloat16 into ``.npz``). Nothing is written (CLI exit 2)."""

    could_not_run = True


class UnsupportedConversionError(UnsupportedFormatError):
    """The conversion asked for cannot run as asked (CLI exit 2): a target extension that
    disagrees with ``--to``, an option that does nothing for the target, or a foreign file
    whose contents cannot be mapped onto the seed layout (named in the message)."""


class UnsupportedKindError(UnsupportedFormatError):
    """The file is of no kind ckptfmt knows ("unknown kind"), or of a kind the command cannot do
    anything with (``diff`` of a run directory, ``convert`` of a sharded safetensors index); the
    message names the kind and the file (spec/FORMAT.md §8.6). Nothing is written (CLI exit 2)."""


class TensorFileError(ConvertError):
    """A safetensors-format file (a generation's companion file, a converted checkpoint) is
    malformed: bad header length, header not JSON, a tensor entry or byte range that is wrong."""


class ExportError(CheckpointError):
    """An export could not be completed or did not verify at its destination."""


class DestinationExistsError(CheckpointError):
    """A destination that must be new already exists; nothing was written (CLI exit 2)."""

    could_not_run = True


class MissingDependencyError(CheckpointError):
    """An optional dependency (torch, matplotlib, safetensors) is not installed (CLI exit 2)."""

    could_not_run = True


class UnsupportedSetupError(CheckpointError):
    """What was asked is not supported in this setup (CLI exit 2): a float64 parameter or an
    optimizer tensor outside the model, a non-Adam optimizer or a non-float32 model under
    torchrun, resuming a generation that newer ones of the same run follow."""

    could_not_run = True


class DeviceUnavailableError(CheckpointError):
    """The device asked for (``--device cuda``) is not available on this machine (CLI exit 2)."""

    could_not_run = True


class RemoteError(CheckpointError):
    """Object storage could not be used as asked (CLI exit 2): an unreachable endpoint, a
    missing bucket, denied access, a transfer that failed after its retries, or bytes that did
    not read back as they were sent. Nothing at the destination was committed by the failed step.
    ``unanswered``: the store gave no answer within its timeouts (a stalled or unreachable
    server): a cleanup call after it would only wait as long again, so none is made."""

    could_not_run = True
    unanswered = False


def parse_json(data: "bytes | str", error: type, path: str, what: str = "not valid JSON", **options: Any) -> Any:
    """JSON from a file that may be hostile: any parse failure, nesting too deep for the parser
    (a RecursionError) included, is ``error(path, "WHAT: why")``, one line and never a traceback.
    ``options`` go to ``json.loads`` (``parse_constant``, ``object_pairs_hook``).

    >>> parse_json(b"[" * 100000 + b"]" * 100000, ManifestError, "m.json")
    Traceback (most recent call last):
    ckptfmt.errors.ManifestError: m.json: not valid JSON: nested too deeply
    """
    try:
        return json.loads(data, **options)
    except ValueError as exc:            # UnicodeDecodeError and JSONDecodeError too
        raise error(path, f"{what}: {exc}") from None
    except RecursionError:
        raise error(path, f"{what}: nested too deeply") from None
