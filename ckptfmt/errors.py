"""One exception hierarchy (spec/FORMAT.md §7). Every failure of ckptfmt is a ``CheckpointError``.

OS errors on reading stay OS errors; failures of a save are ``SaveError`` with the OS error as
its cause, so callers can tell "the file is bad" from "the disk refused". Each subclass says
whether it means "the check ran and found a defect" or "it could not run"
(``could_not_run``): the CLI turns the first into exit 1 and the second into exit 2.

Examples:
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

    What to do: catch it to handle any failure about a checkpoint; its class (below) says which.

    Examples:
        Every failure of ckptfmt is one; ``could_not_run`` says which exit code the CLI gives it:

        >>> import ckptfmt
        >>> _ = open("notes.txt", "w").write("hi")
        >>> try:
        ...     ckptfmt.open("notes.txt")
        ... except ckptfmt.CheckpointError as exc:
        ...     print(type(exc).__name__, exc.path, exc.could_not_run)
        NotACheckpointError notes.txt False
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
    """The input is not a checkpoint at all (too short for a header, a directory, a FIFO).

    What to do: check the path: it names no checkpoint of any kind ckptfmt knows.

    Examples:
        >>> import ckptfmt
        >>> _ = open("hello.txt", "w").write("hi")
        >>> ckptfmt.open("hello.txt")
        Traceback (most recent call last):
        ckptfmt.errors.NotACheckpointError: hello.txt: not a ckptfmt checkpoint: too short for the 8-byte header: expected at least 8 bytes, got 2
    """


class BadHeaderError(CheckpointError):
    """A header value is impossible (negative step or n_params).

    What to do: the file is damaged; resume from another generation (``ckptfmt ls RUN`` lists
    them).

    Examples:
        >>> import struct, ckptfmt
        >>> _ = open("negative.bin", "wb").write(struct.pack("<ii", 1, -2))    # n_params -2
        >>> ckptfmt.open("negative.bin")
        Traceback (most recent call last):
        ckptfmt.errors.BadHeaderError: negative.bin: negative n_params -2 at offset 4
    """


class TruncatedError(CheckpointError):
    """The file is shorter than its header says: a torn or incomplete write.

    What to do: a write was cut short or the file was copied in part: use another copy, or an
    earlier generation (a resume passes over a torn one by itself).

    Examples:
        >>> import struct, ckptfmt
        >>> _ = open("torn.bin", "wb").write(struct.pack("<ii", 1, 2) + bytes(8))    # 2 params need 32 bytes
        >>> ckptfmt.open("torn.bin")
        Traceback (most recent call last):
        ckptfmt.errors.TruncatedError: torn.bin: truncated: expected 32 bytes, got 16
    """


class TrailingDataError(CheckpointError):
    """The file is longer than its header says.

    What to do: bytes were appended after the write; use another copy or an earlier generation.

    Examples:
        >>> import struct, ckptfmt
        >>> _ = open("long.bin", "wb").write(struct.pack("<ii", 1, 1) + bytes(16))  # 1 param needs 20 bytes
        >>> ckptfmt.open("long.bin")
        Traceback (most recent call last):
        ckptfmt.errors.TrailingDataError: long.bin: trailing data at offset 20: expected 20 bytes, got 24
    """


class BadNameError(CheckpointError):
    """A name does not follow step_NNNNNN.bin, or disagrees with the header's step.

    What to do: rename the ``.bin`` and its ``.json`` together to ``step_NNNNNN`` with the step
    its header holds (``ckptfmt inspect`` shows it); a ``.bin`` renamed alone reads as a bare,
    unverified file.

    Examples:
        A run's generation named otherwise than its header says is refused by name (its subclass
        ``StepNameMismatchError`` when a save or a conversion is asked to write one):

        >>> import numpy as np, ckptfmt
        >>> z = np.zeros(2, np.float32)
        >>> ckptfmt.save("step_000002.bin", 1, z, z, z)
        Traceback (most recent call last):
        ckptfmt.errors.StepNameMismatchError: step_000002.bin: name says step 2, the header would say 1: expected step_000001.bin
    """


class StepNameMismatchError(BadNameError):
    """A destination named ``step_N.bin`` for a checkpoint of another step (``convert ck.pt
    run/step_000300.bin`` of a file at step 3): a usage problem, nothing is written (CLI exit 2).

    What to do: name the destination ``step_N.bin`` with the checkpoint's own step
    (``ckptfmt inspect`` of the source shows it).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> z = np.zeros(2, np.float32)
        >>> try:
        ...     ckptfmt.save("step_000300.bin", 3, z, z, z)
        ... except ckptfmt.errors.StepNameMismatchError as exc:
        ...     print(exc.could_not_run, "-", exc)
        True - step_000300.bin: name says step 300, the header would say 3: expected step_000003.bin
    """

    could_not_run = True


class ManifestError(CheckpointError):
    """The manifest cannot be read or does not follow the schema.

    What to do: the generation is damaged; resume from another one, or copy the ``.bin`` away
    from its ``.json`` and ``ckptfmt validate`` the copy (unverified: nothing vouches for it).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> os.makedirs("garbled", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("garbled/step_000001.bin", 1, z, z, z)
        >>> _ = open("garbled/step_000001.json", "w").write("{not json")
        >>> ckptfmt.open("garbled/step_000001.bin")
        Traceback (most recent call last):
        ckptfmt.errors.ManifestError: garbled/step_000001.json: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)
    """


class ManifestMismatchError(ManifestError):
    """The manifest is well formed but describes another file (size, step, n_params, name).

    What to do: the manifest belongs to another file; put the two files of one generation side
    by side again, or use another generation.

    Examples:
        >>> import os, shutil, numpy as np, ckptfmt
        >>> os.makedirs("swapped", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (1, 2):
        ...     _ = ckptfmt.save_generation("swapped", step, z, z, z)
        >>> _ = shutil.copy("swapped/step_000002.json", "swapped/step_000001.json")   # another file's manifest
        >>> ckptfmt.open("swapped/step_000001.bin")
        Traceback (most recent call last):
        ckptfmt.errors.ManifestMismatchError: swapped/step_000001.json: file: manifest says 'step_000002.bin', step_000001.bin has 'step_000001.bin'
    """


class ManifestSealError(ManifestError):
    """The manifest does not match its own seal (spec §4.7): a flipped bit or an edit after it was
    written. The generation is damaged, whatever the fields now say.

    What to do: treat the generation as damaged: resume from another one; never edit a manifest
    by hand.

    Examples:
        >>> import json, os, numpy as np, ckptfmt
        >>> os.makedirs("edited", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("edited/step_000001.bin", 1, z, z, z)
        >>> doc = json.load(open("edited/step_000001.json"))
        >>> doc["note"] = "added by hand"
        >>> _ = open("edited/step_000001.json", "w").write(json.dumps(doc))
        >>> ckptfmt.open("edited/step_000001.bin")
        Traceback (most recent call last):
        ckptfmt.errors.ManifestSealError: edited/step_000001.json: field 'note' is not covered by the manifest's seal: the manifest was damaged or edited after it was written
    """


class UnsupportedVersionError(ManifestError):
    """The manifest's ``format_version`` is newer than this ckptfmt: the file may be fine, this
    reader cannot judge it (CLI exit 2; upgrade ckptfmt).

    What to do: upgrade ckptfmt to the version that wrote the file.

    Examples:
        A manifest a newer ckptfmt wrote (here made by hand, sealed as a writer seals it):

        >>> import json, os, numpy as np, ckptfmt
        >>> from ckptfmt import manifest
        >>> os.makedirs("newer", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("newer/step_000001.bin", 1, z, z, z)
        >>> doc = json.load(open("newer/step_000001.json"))
        >>> doc["format_version"] = 99
        >>> del doc["seal"]
        >>> manifest.write("newer/step_000001.json", doc)
        >>> ckptfmt.open("newer/step_000001.bin")
        Traceback (most recent call last):
        ckptfmt.errors.UnsupportedVersionError: newer/step_000001.json: format_version 99 is newer than this ckptfmt understands (1)
    """

    could_not_run = True


class FingerprintMismatchError(CheckpointError):
    """The blake3 of the file is not the one its manifest committed.

    What to do: the bytes changed after the commit: use another copy (a mirror, an export) or an
    earlier generation.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> os.makedirs("flipped", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("flipped/step_000001.bin", 1, z, z, z)
        >>> data = bytearray(open("flipped/step_000001.bin", "rb").read())
        >>> data[-1] ^= 1                                            # one bit of v
        >>> _ = open("flipped/step_000001.bin", "wb").write(data)
        >>> ckptfmt.open("flipped/step_000001.bin", verify=True)
        Traceback (most recent call last):
        ckptfmt.errors.FingerprintMismatchError: flipped/step_000001.bin: blake3 mismatch: manifest says 556b9717..., file hashes to e6022faea...
    """


class IncompleteResumeStateError(CheckpointError):
    """A resume needs a component the manifest does not hold; the component is named.

    What to do: a piece the checkpoint has and the loop lacks: give the manager that piece; a
    piece the loop has and the checkpoint lacks (the RNGs of a converted file):
    ``restore(strict=False)`` starts it fresh and lists it; ``ct.load`` of a file whose manifest
    has no layout: convert it again from its source, or load it with the tool that wrote it.

    Examples:
        A generation saved without a piece the resume is given (here a scheduler) is refused by name,
        unless the restore may start that piece fresh:

        ```python
        mgr = CheckpointManager("runs/a", model, opt, sched)
        try:
            step = mgr.restore()
        except IncompleteResumeStateError as exc:      # "...: the checkpoint lacks scheduler (...)"
            step = mgr.restore(strict=False)           # the scheduler starts fresh: listed in mgr.fresh
        ```
    """


class ConfigMismatchError(CheckpointError):
    """A run was started with a config that differs from the one it was trained with.

    What to do: the reference trainer: resume with the config the run was trained with, or start
    a new run for the new one; a scheduler or GradScaler of another kind: build the loop as it
    was saved, or ``restore(strict=False)`` to start that piece fresh; a step that does not go
    forward: go on from the step ``restore()`` returned.

    Examples:
        The reference trainer started on a run with another config than it trained with (exit 1, each
        field named):

        ```bash
        ckptfmt train --run runs/a --config tiny --steps 20
        ckptfmt train --run runs/a --config tiny --steps 30 --seed 1    # refused: seed differs
        ```
    """


class StateRefusedError(ConfigMismatchError):
    """A loop object's ``load_state_dict`` raised on the state the checkpoint holds for it; the
    restore put back every object it had loaded, and copied no tensor (a failed restore changes
    nothing). The piece and the object's own error are named.

    What to do: fix the named object so it accepts its saved state, or leave it out of
    ``state=`` and restore with ``strict=False``.

    Examples:
        An object given in ``state=`` whose ``load_state_dict`` raises on what the run saved for it:

        ```python
        mgr = CheckpointManager("runs/a", model, opt, state={"data": sampler})
        try:
            mgr.restore()
        except StateRefusedError as exc:     # names "data" and the sampler's own error
            print(exc)                       # nothing was loaded: the model and optimizer are as they were
        ```
    """


class DeviceChangeError(ConfigMismatchError):
    """A run saved on one device type (CPU, CUDA) is resumed on another: the RNG states of the
    old device cannot be restored, so the run would not continue bit-exactly. Refused unless
    asked for (``restore(allow_device_change=True)``, ``ckptfmt train --allow-device-change``).

    What to do: resume on the device type the run was saved on, or pass
    ``allow_device_change=True`` (``--allow-device-change``) and give up bit-exactness.

    Examples:
        A CUDA run resumed on a CPU-only machine:

        ```python
        try:
            step = mgr.restore()
        except DeviceChangeError:
            step = mgr.restore(allow_device_change=True)    # goes on, not bit-exactly; recorded
        ```
    """


class LayoutMismatchError(CheckpointError):
    """The checkpoint's parameters (names, shapes) are not the model's; their order may differ:
    each parameter is read by its name.

    What to do: build the model the run was trained with: the same parameter names and shapes
    (in any order). Names that differ by a wrapper's prefix (``module.``, ``_orig_mod.``): give
    the model as it was saved, wrapped or ``model.module`` (the manager's restore names which).

    Examples:
        A generation loaded into a model of another shape:

        ```python
        import torch
        import ckptfmt.torch as ct

        model = torch.nn.Linear(4, 2)
        ct.save("step_000001.bin", model, torch.optim.AdamW(model.parameters()), step=1)
        bigger = torch.nn.Linear(8, 2)
        ct.load("step_000001.bin", bigger, torch.optim.AdamW(bigger.parameters()))   # LayoutMismatchError
        ```
    """


class OptimizerMismatchError(CheckpointError):
    """The checkpoint's optimizer state does not fit the optimizer (type, param groups).

    What to do: build the optimizer (type, param groups) the run was saved with.

    Examples:
        A generation saved with AdamW resumed into an SGD with momentum, or with other param groups:

        ```python
        model = torch.nn.Linear(4, 2)
        ct.save("step_000001.bin", model, torch.optim.AdamW(model.parameters()), step=1)
        ct.load("step_000001.bin", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        ```
    """


class UnsupportedOptimizerError(OptimizerMismatchError):
    """The optimizer keeps state the seed layout cannot hold (only Adam, AdamW and SGD fit).

    What to do: use Adam or AdamW (without amsgrad), or SGD, or save with another tool.

    Examples:
        An optimizer whose state the seed layout cannot hold, refused before the first step:

        ```python
        model = torch.nn.Linear(4, 2)
        CheckpointManager("runs/a", model, torch.optim.Adagrad(model.parameters()))   # refused, named
        ```
    """


class NoValidGenerationError(CheckpointError):
    """A run has generations but none of them is committed and valid.

    What to do: ``ckptfmt ls --deep RUN`` hashes each generation and names why it is damaged
    (a plain ``ls`` reads names and sizes only); resume from a mirror or an export, or start
    afresh.

    Examples:
        >>> import os, warnings, numpy as np, ckptfmt
        >>> from ckptfmt.run import Run
        >>> os.makedirs("damaged", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("damaged", 1, z, z, z)
        >>> data = bytearray(open("damaged/step_000001.bin", "rb").read())
        >>> data[-1] ^= 1
        >>> _ = open("damaged/step_000001.bin", "wb").write(data)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")          # the warning that names the skipped generation
        ...     Run("damaged").latest(deep=True)
        Traceback (most recent call last):
        ckptfmt.errors.NoValidGenerationError: damaged: no valid generation: step 1: blake3 mismatch: ...
    """


class GenerationNotFoundError(CheckpointError):
    """The run has no committed generation where one was asked for (a step, or any at all).

    What to do: ``ckptfmt ls RUN`` lists the committed steps; ask for one of them.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import fork
        >>> os.makedirs("parent", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("parent", 10, z, z, z)
        >>> fork("parent", 99, "child")
        Traceback (most recent call last):
        ckptfmt.errors.GenerationNotFoundError: parent: no committed generation at step 99
    """


class EmptyRunError(CheckpointError):
    """A run holds nothing the operation needs (``plot`` of a run without a loss history):
    nothing was written (CLI exit 2).

    What to do: point the command at a run that holds what it needs (a loss history for
    ``plot``).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.plot import plot
        >>> os.makedirs("quiet", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("quiet", 10, z, z, z)       # a generation, no loss history
        >>> plot(["quiet"], "quiet.png")
        Traceback (most recent call last):
        ckptfmt.errors.EmptyRunError: quiet: no loss history to plot (.loss.json is missing or empty)
    """

    could_not_run = True


class RunLockedError(CheckpointError):
    """Another live process holds the run's writer lock.

    What to do: wait for the named process to finish or stop it (SIGTERM saves and exits 0); in
    your own program, ``close()`` the earlier manager. A dead holder's lock is free by itself.

    Examples:
        >>> import os
        >>> from ckptfmt.run import RunLock
        >>> os.makedirs("held", exist_ok=True)
        >>> first = RunLock("held")
        >>> _ = first.acquire()
        >>> RunLock("held").acquire()
        Traceback (most recent call last):
        ckptfmt.errors.RunLockedError: held: locked by writer pid ... (this process: an earlier writer on this run was never closed...
        >>> first.release()
    """

    could_not_run = True


class HistoryCorruptError(CheckpointError):
    """The loss history is damaged in the middle, not just torn at its tail.

    What to do: keep the file for inspection; the message says where it is damaged. The
    generations are not affected: ``ckptfmt ls --deep RUN`` hashes each of them.

    Examples:
        >>> import os
        >>> from ckptfmt.tools.plot import plot
        >>> os.makedirs("nan-run", exist_ok=True)
        >>> print('{"step": 1, "loss": "high"}', file=open("nan-run/.loss.json", "w"), flush=True)
        >>> plot(["nan-run"], "nan-run.png")
        Traceback (most recent call last):
        ckptfmt.errors.HistoryCorruptError: ...step 1 has a loss that is not a number...
    """


class SidecarError(CheckpointError):
    """A run's sidecar file (pins, samples, bandit state, pivot record) is not valid JSON.

    What to do: the message names the file; repair its JSON or remove it (pins and pivot records
    are lost with it).

    Examples:
        >>> from ckptfmt.run import read_json
        >>> _ = open(".pins.json", "w").write("{")
        >>> read_json(".pins.json")
        Traceback (most recent call last):
        ckptfmt.errors.SidecarError: .pins.json: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)
    """


class StorageError(CheckpointError):
    """The storage refused a write beside the generations (a full disk, a quota, an I/O error
    at the run lock, the loss history, a sidecar): names the file and the operation; ``errno``
    is the OS error's and ``__cause__`` the OS error itself. Nothing of the failed write is left
    (CLI exit 2: the command could not run; free space and run it again).

    What to do: free space or fix the permissions on the named file, then run again.

    Examples:
        A full disk under the run directory, met while its history is appended:

        ```python
        try:
            History("runs/a/.loss.json").append({"step": 7, "loss": 0.5})
        except StorageError as exc:     # "runs/a/.loss.json: append failed: No space left on device"
            print(exc.operation, exc.errno)      # nothing half-written is left; free space and go on
        ```
    """

    could_not_run = True

    def __init__(self, path: "str | os.PathLike[str]", operation: str, cause: OSError):
        super().__init__(path, f"{operation} failed: {cause.strerror or cause}")
        self.operation, self.errno = operation, cause.errno


class HistoryWriteError(StorageError):
    """An append to (or the fsync of) the loss history ``.loss.json`` failed: the record is not
    in the history (a part written is cut off again); no checkpoint failed.

    What to do: free space on the run's disk; the training may go on, the record is lost.

    Examples:
        ```python
        try:
            History("runs/a/.loss.json").append({"step": 7, "loss": 0.5})
        except HistoryWriteError as exc:     # a full disk: the record is not in the history
            print(exc)
        ```
    """


class SidecarWriteError(StorageError):
    """A sidecar (``.samples.json``, ``.state.json``, pins, pivot record) could not be replaced:
    the previous one is intact; no checkpoint failed.

    What to do: free space on the run's disk, then retry the command.

    Examples:
        ```python
        try:
            Run("runs/a").pin(4000)            # .pins.json replaced
        except SidecarWriteError as exc:     # a full disk: the previous .pins.json is intact
            print(exc)
        ```
    """


class RankDisagreementError(CheckpointError):
    """The ranks of a torch.distributed job could not agree on a decision (what to resume).

    What to do: check that every rank sees the same run directory and the same files, then
    restart the job.

    Examples:
        Under torchrun, ranks that cannot agree on the generation to resume:

        ```python
        try:
            step = mgr.restore()                # every rank
        except RankDisagreementError as exc:    # the same one line on every rank
            raise SystemExit(str(exc))
        ```
    """


class SaveError(CheckpointError):
    """A durable save failed; the previous generations are untouched. ``__cause__`` is the OS error.

    When the OS refused (a missing or read-only destination, a full disk), the command could not
    run (CLI exit 2); a save refused for what it was given (a copy whose hash is not the
    source's) is a defect found (exit 1).

    What to do: read the cause (a full disk, a read-only directory); free space or fix the path
    and save again. Earlier generations are intact.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> z = np.zeros(2, np.float32)
        >>> try:
        ...     ckptfmt.save("no-such-dir/step_000001.bin", 1, z, z, z)
        ... except ckptfmt.errors.SaveError as exc:
        ...     print(exc.could_not_run, "-", exc)                   # the OS refused: CLI exit 2
        True - no-such-dir/step_000001.bin: cannot create temp file: No such file or directory
    """

    @property
    def could_not_run(self) -> bool:  # type: ignore[override]
        return isinstance(self.__cause__, OSError)


class RegionError(SaveError, TypeError):
    """A region given to ``ckptfmt.save`` is not what the seed layout holds: an array of another
    dtype (float64, int32, big-endian float32), a Python list or tuple of numbers, a tensor, a
    scalar. Refused by name before the first byte is written (nothing appears at the path); also
    a ``TypeError``, as the writer raised before it was named.

    What to do: pass a NumPy float32 array (``np.asarray(x, np.float32)``) for each region.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> w = np.zeros(2)                                          # float64
        >>> ckptfmt.save("step_000001.bin", 1, w, w, w)
        Traceback (most recent call last):
        ckptfmt.errors.RegionError: step_000001.bin: weights is a float64 array; the seed layout holds float32 (np.asarray(x, dtype=np.float32) if rounding is intended)
    """


class ConvertError(CheckpointError):
    """A conversion could not be done or did not round-trip.

    What to do: the message names the step that failed; nothing was committed at the
    destination.

    Examples:
        Its subclasses say why; each names the file:

        >>> import ckptfmt
        >>> from ckptfmt.tools.convert import convert
        >>> _ = open("words.txt", "w").write("hello world")
        >>> try:
        ...     convert("words.txt", "words.bin")
        ... except ckptfmt.errors.ConvertError as exc:
        ...     print(type(exc).__name__, exc.could_not_run)
        UnsupportedKindError True
    """


class UnsupportedFormatError(ConvertError):
    """What was asked cannot be converted: an unknown format or extension, a directory where a
    file is needed, a file not written by ckptfmt, or options the target cannot hold
    (``--weights-only`` into a ``.bin``, bfloat16 into ``.npz``). Nothing is written (CLI exit 2).

    What to do: check ``ckptfmt convert --help`` for the formats and options each target takes.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import convert
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("step_000004.bin", 4, z, z, z)
        >>> convert("step_000004.bin", "step_000004.xyz")
        Traceback (most recent call last):
        ckptfmt.errors.UnsupportedConversionError: step_000004.xyz: unknown format: expected .bin, .safetensors, .pt, .npz, .zst or .ckz (or pass --to)
    """

    could_not_run = True


class UnsupportedConversionError(UnsupportedFormatError):
    """The conversion asked for cannot run as asked (CLI exit 2): a target extension that
    disagrees with ``--to``, an option that does nothing for the target, or a foreign file
    whose contents cannot be mapped onto the seed layout (named in the message).

    What to do: drop the option or match the extension to ``--to``, as the message says.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import convert
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("step_000006.bin", 6, z, z, z)
        >>> convert("step_000006.bin", "six.bin", to="torch")
        Traceback (most recent call last):
        ckptfmt.errors.UnsupportedConversionError: six.bin: extension disagrees with --to torch: a torch target is named *.pt or *.pth or *.ckpt
    """


class UnsupportedKindError(UnsupportedFormatError):
    """The file is of no kind ckptfmt knows ("unknown kind"), or of a kind the command cannot do
    anything with (``diff`` of a run directory, ``convert`` of a sharded safetensors index); the
    message names the kind and the file (spec/FORMAT.md §8.6). Nothing is written (CLI exit 2).

    What to do: ``ckptfmt inspect PATH`` says what the file is; give the command a file it
    takes.

    Examples:
        >>> from ckptfmt.tools.convert import convert
        >>> _ = open("prose.txt", "w").write("hello world")
        >>> convert("prose.txt", "prose.bin")
        Traceback (most recent call last):
        ckptfmt.errors.UnsupportedKindError: prose.txt: unknown kind (unknown format): neither its content nor its name is one ckptfmt knows ...
    """


class TensorFileError(ConvertError):
    """A safetensors-format file (a generation's companion file, a converted checkpoint) is
    malformed: bad header length, header not JSON, a tensor entry or byte range that is wrong.

    What to do: the file is damaged; use another copy or an earlier generation.

    Examples:
        A Hugging Face sharded checkpoint whose index names a shard that is not beside it:

        ```bash
        ckptfmt convert model.safetensors.index.json run/step_000000.bin
        # ckptfmt: model.safetensors.index.json: weight map names shard 'model-00002-of-00002.safetensors', which is not a file beside it
        ```
    """


class ExportError(CheckpointError):
    """An export could not be completed or did not verify at its destination.

    What to do: a failed export removes what it wrote; only a crash leaves DEST with its
    ``EXPORT-INCOMPLETE`` marker: remove DEST and export again.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.export import export
        >>> os.makedirs("to-export", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("to-export", 10, z, z, z)
        >>> export("to-export", "exported", steps=[5])
        Traceback (most recent call last):
        ckptfmt.errors.ExportError: to-export: no committed generation at step(s) [5]
    """


class DestinationExistsError(CheckpointError):
    """A destination that must be new already exists; nothing was written (CLI exit 2).

    What to do: choose a new destination, or remove the old one first.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import convert
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("step_000008.bin", 8, z, z, z)
        >>> convert("step_000008.bin", "step_000008.bin")
        Traceback (most recent call last):
        ckptfmt.errors.DestinationExistsError: step_000008.bin: exists already; refusing to overwrite
    """

    could_not_run = True


class MissingDependencyError(CheckpointError):
    """An optional dependency (torch, matplotlib, safetensors) is not installed (CLI exit 2).

    What to do: install the extra the message names (``pip install -e '.[torch]'`` from a
    checkout).

    Examples:
        Where torch is not installed, a ``.pt`` conversion (or ``ckptfmt.torch``) says which extra:

        ```bash
        ckptfmt convert ck.pt run/step_000300.bin
        # ckptfmt: ck.pt: a .pt file needs torch: pip install 'ckptfmt[torch]'      (exit 2)
        ```
    """

    could_not_run = True


class UnsupportedSetupError(CheckpointError):
    """What was asked is not supported in this setup (CLI exit 2): a float64 parameter or an
    optimizer tensor outside the model, a non-Adam optimizer or a non-float32 model under
    torchrun, resuming a generation that newer ones of the same run follow.

    What to do: change the setup the message names (the model's dtype, the optimizer), or save
    in one process.

    Examples:
        Refused before a training step, naming the setup:

        ```python
        model = torch.nn.Linear(4, 2).double()                        # float64 parameters
        CheckpointManager("runs/a", model, torch.optim.AdamW(model.parameters()))   # UnsupportedSetupError
        ```
    """

    could_not_run = True


class DeviceUnavailableError(CheckpointError):
    """The device asked for (``--device cuda``) is not available on this machine (CLI exit 2).

    What to do: run on a machine with that device, or leave ``--device`` at its default.

    Examples:
        ```bash
        ckptfmt train --run runs/a --config tiny --device cuda     # on a machine without CUDA: exit 2
        # ckptfmt: --device cuda: no CUDA device is available
        ```
    """

    could_not_run = True


class RemoteError(CheckpointError):
    """Object storage could not be used as asked (CLI exit 2): an unreachable endpoint, a
    missing bucket, denied access, a transfer that failed after its retries, or bytes that did
    not read back as they were sent. Nothing at the destination was committed by the failed step.
    ``unanswered``: the store gave no answer within its timeouts (a stalled or unreachable
    server): a cleanup call after it would only wait as long again, so none is made.

    What to do: check the endpoint, the bucket and the credentials, then run again; the message
    names the store and the operation.

    Examples:
        A bucket that does not exist, met before a training step (exit 2, nothing written):

        ```python
        try:
            CheckpointManager("s3://no-such-bucket/runs/a", model, opt)
        except RemoteError as exc:
            print(exc.could_not_run, exc)
        ```
    """

    could_not_run = True
    unanswered = False


def parse_json(data: "bytes | str", error: type, path: str, what: str = "not valid JSON", **options: Any) -> Any:
    """JSON from a file that may be hostile: any parse failure, nesting too deep for the parser
    (a RecursionError) included, is ``error(path, "WHAT: why")``, one line and never a traceback.
    ``options`` go to ``json.loads`` (``parse_constant``, ``object_pairs_hook``).

    Examples:
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
