"""The metrics a training loop reported, as the history and the manifest hold them (spec/RUN.md
§3.1, spec/FORMAT.md §4 ``metrics``): the newest value of each at or before a generation's step.

>>> book = MetricsBook()
>>> book.record(100, {"loss": 2.5, "val_loss": float("nan"), "source": "web"})
>>> book.record(200, {"loss": np.float32(2.0)})
>>> book.at(200)
{'loss': {'value': 2.0, 'step': 200}, 'val_loss': {'value': {'__float__': 'nan'}, 'step': 100}}
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from .history import encode_float

__all__ = ["MetricsBook", "history_value", "manifest_value"]

NON_FINITE = ("nan", "inf", "-inf")     # how the history writes them (a loop may pass them on)


def plain(value: Any) -> Any:
    """Integers as ``int``, floats (one-element tensors, NumPy scalars) as ``float``; others as given.
    A tensor is known by its ``numel()`` (the run layer imports no framework)."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) or (callable(getattr(value, "numel", None)) and value.numel() == 1):
        return float(value)
    return value


def history_value(value: Any) -> Any:
    """A metric as ``.loss.json`` holds it: integers stay integers, floats are floats with
    NaN/inf as strings (RUN.md §3.1)."""
    value = plain(value)
    return encode_float(value) if isinstance(value, float) else value


def manifest_value(value: Any) -> int | float | dict[str, str] | None:
    """A metric as the manifest holds it: a number, non-finite as ``{"__float__": "nan"}``
    (FORMAT.md §4.1); None for what is no number (a string, a list: not recorded there)."""
    value = plain(value)
    if isinstance(value, str) and value in NON_FINITE:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else {"__float__": repr(value)}


class MetricsBook:
    """The newest value of each numeric metric and the step it was reported at."""

    def __init__(self) -> None:
        self._newest: dict[str, tuple[int, Any]] = {}
        self._unreported_said = False         # a policy's metric not reported: said once

    def say_unreported(self, manifest: Mapping[str, Any], names: list[str], log: Callable[[str], None]) -> None:
        """Once: a metric the policies name (``names``) that the generation does not record (not
        reported yet, e.g. before the first evaluation, or misspelled: nothing else would say so)."""
        recorded = manifest.get("metrics") or {}
        missing = sorted({m for m in names if m not in recorded})
        if missing and not self._unreported_said:
            self._unreported_said = True
            log(f"metric {', '.join(missing)} not reported to step() yet (reported: "
                f"{', '.join(sorted(recorded)) or 'none'}); until it is, retention keeps generations "
                "as 'no <metric>' and no save is made on its best")

    def record(self, step: int, values: Mapping[str, Any]) -> None:
        """Note the numeric ``values`` reported at ``step`` (others are not for the manifest)."""
        for name, value in values.items():
            encoded = manifest_value(value)
            if encoded is not None:
                self._newest[name] = (step, encoded)

    def seed(self, recorded: Mapping[str, Any]) -> None:
        """Start from what a restored generation's manifest recorded (``at``'s form)."""
        for name, entry in recorded.items():
            if isinstance(entry, dict) and isinstance(entry.get("step"), int) and "value" in entry:
                self._newest[name] = (entry["step"], entry["value"])

    def value(self, name: str) -> Any:
        """The newest value of ``name`` as a float (NaN and inf included), None if none was reported."""
        if name not in self._newest:
            return None
        value = self._newest[name][1]
        return float(value["__float__"]) if isinstance(value, dict) else value

    def at(self, step: int) -> dict[str, dict[str, Any]]:
        """``{name: {"value", "step"}}`` of the metrics reported at or before ``step``."""
        return {name: {"value": value, "step": at} for name, (at, value) in self._newest.items() if at <= step}
