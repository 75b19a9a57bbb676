"""The hooks of a loop with pieces of its own (spec/RUN.md §8), as a session holds them.

>>> Hooks.given("CheckpointManager", {"log": print}).log is print
True
>>> Hooks.given("CheckpointManager", {"on_save": print})
Traceback (most recent call last):
...
TypeError: CheckpointManager: unknown argument(s) ['on_save']; hooks are ['manifest_fields', 'on_restore', 'upgrade', 'on_commit', 'log']
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Hooks"]


@dataclass(frozen=True)
class Hooks:
    """Each optional: ``manifest_fields(step) -> dict`` adds the loop's own fields to every
    manifest; ``on_restore(manifest, path)`` sees a generation's manifest before anything is
    restored (raise a ``CheckpointError`` to refuse it); ``upgrade(manifest) -> manifest`` views
    manifests the loop's earlier versions wrote; ``on_commit(step, manifest)`` runs after each
    commit and its retention (on the save thread with an asynchronous writer); ``log(message)``
    says what the session decided (default: ``warnings.warn``)."""

    manifest_fields: Callable[[int], Mapping[str, Any]] | None = None
    on_restore: Callable[[dict[str, Any], str], Any] | None = None
    upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    on_commit: Callable[[int, dict[str, Any]], Any] | None = None
    log: Callable[[str], Any] | None = None

    @classmethod
    def given(cls, owner: str, keywords: Mapping[str, Any]) -> "Hooks":
        """The hooks of ``owner``'s keyword arguments; one it does not know is refused by name."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(f"{owner}: unknown argument(s) {unknown}; hooks are {names}")
        return cls(**keywords)
