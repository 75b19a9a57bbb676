"""What a validation returns (spec §8.4): a ``Report`` of ``Finding``s, as data the CLI prints
or emits as JSON, with the levels that decide the exit code (``defect``: 1, ``unsupported``: 2).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CheckpointError
from ..generation import LOST_PAYLOAD        # the core's wording: one rule, one message

__all__ = ["DEFECT", "INCOMPLETE", "INFO", "LOST_PAYLOAD", "UNSUPPORTED", "WARNING", "Finding", "Report", "error_code"]

DEFECT, WARNING, UNSUPPORTED, INFO = "defect", "warning", "unsupported", "info"
INCOMPLETE = "EXPORT-INCOMPLETE"     # written first into an export or import destination, removed last


@dataclass
class Finding:
    """One thing a validation found (FORMAT §8.4), as data: its level says what it does to the
    verdict (a defect fails it, exit 1; what could not be judged is exit 2; a warning or a fact
    leaves it valid), its code is stable for machines, its message one line for people.

    Attributes:
        level: ``defect`` (fails the verdict: exit 1), ``unsupported`` (could not be judged:
            exit 2), ``warning`` (reported, still valid) or ``info`` (a fact).
        code: a stable machine name for what was found (``truncated``, ``fingerprint_mismatch``).
        message: one line naming the file and the problem.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> os.makedirs("bitflip", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("bitflip/step_000001.bin", 1, z, z, z)
        >>> data = bytearray(open("bitflip/step_000001.bin", "rb").read())
        >>> data[-1] ^= 1
        >>> _ = open("bitflip/step_000001.bin", "wb").write(data)
        >>> finding = ckptfmt.validate("bitflip/step_000001.bin").findings[0]
        >>> finding.level, finding.code
        ('defect', 'fingerprint_mismatch')
    """

    level: str       # 'defect' (exit 1), 'unsupported' (could not judge it: exit 2), 'warning'
                     # (reported, still valid) or 'info' (a fact)
    code: str        # stable machine name, e.g. 'truncated', 'fingerprint_mismatch'
    message: str     # one line naming the file and the problem


@dataclass
class Report:
    """The verdict of a validation (``ckptfmt.validate``), as data: the library never prints or
    exits; the command line turns it into text, ``--json`` and an exit code.

    Attributes:
        path: the file or run directory checked.
        kind: ``file`` (one checkpoint of any kind) or ``run`` (a run directory).
        status: the one word of the verdict: ``verified`` (every byte hashed against its
            manifest), ``committed`` (checked without hashing), ``unverified`` (no digest to
            check against), ``damaged``, ``diverged`` (non-finite values), ``unsupported``
            (this ckptfmt cannot judge it) or ``no checkpoint``.
        step: the checkpoint's step (of a file; None for a run).
        n_params: its parameter count (of a file; None for a run).
        findings: each ``Finding``, defects, warnings and facts, in the order found.
        details: what was checked, for ``--json``: a file's ``blake3`` and how its
            ``values`` were judged, a run's ``generations`` (step and status each),
            ``diverged`` steps and ``history_records``.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> os.makedirs("reported", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("reported", 10, z, z, z)
        >>> report = ckptfmt.validate("reported/step_000010.bin")
        >>> report.ok, report.kind, report.status, report.step, report.n_params, report.findings
        (True, 'file', 'verified', 10, 2, [])
        >>> report.details["values"]            # the values' facts read from the manifest, not scanned
        'recorded'
    """

    path: str
    kind: str = "file"
    status: str = "unverified"   # verified | unverified | committed | damaged | diverged | unsupported | no checkpoint
    step: int | None = None
    n_params: int | None = None
    findings: list[Finding] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No defect found and nothing that could not be judged (warnings allowed)."""
        return not any(f.level in (DEFECT, UNSUPPORTED) for f in self.findings)

    @property
    def could_not_run(self) -> bool:
        """Part of the check could not run (a manifest newer than this ckptfmt): CLI exit 2."""
        return any(f.level == UNSUPPORTED for f in self.findings)

    def defect(self, code: str, message: str) -> None:
        """Record a defect: the thing checked is not usable as it is (CLI exit 1)."""
        self.findings.append(Finding(DEFECT, code, message))
        self.status = "damaged"

    def failed(self, exc: CheckpointError) -> None:
        """Record a library error: a defect, or, when the error means this reader cannot judge
        the input (``could_not_run``), an 'unsupported' finding."""
        if exc.could_not_run:
            self.findings.append(Finding(UNSUPPORTED, error_code(exc), str(exc)))
            self.status = "unsupported"
        else:
            self.defect(error_code(exc), str(exc))

    def warn(self, code: str, message: str) -> None:
        """Record a warning: worth knowing, not a defect."""
        self.findings.append(Finding(WARNING, code, message))

    def note(self, code: str, message: str) -> None:
        """Record a fact that is neither a defect nor a worry (a live writer's save in progress)."""
        self.findings.append(Finding(INFO, code, message))

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able fields (``--json``)."""
        out = asdict(self)
        out["ok"] = self.ok
        return out


def error_code(exc: CheckpointError) -> str:
    """'TruncatedError' -> 'truncated' (stable codes for --json consumers).

    Examples:
        >>> from ckptfmt.errors import TruncatedError
        >>> from ckptfmt.tools.report import error_code
        >>> error_code(TruncatedError("a.bin", "truncated"))
        'truncated'
    """
    name = type(exc).__name__.removesuffix("Error")
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
