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
    leaves it valid), its code is stable for machines, its message one line for people."""

    level: str       # 'defect' (exit 1), 'unsupported' (could not judge it: exit 2), 'warning'
                     # (reported, still valid) or 'info' (a fact)
    code: str        # stable machine name, e.g. 'truncated', 'fingerprint_mismatch'
    message: str     # one line naming the file and the problem


@dataclass
class Report:
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
    """'TruncatedError' -> 'truncated' (stable codes for --json consumers)."""
    name = type(exc).__name__.removesuffix("Error")
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
