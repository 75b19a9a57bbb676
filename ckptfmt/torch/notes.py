"""What a restore says: once it has passed every check, a world-size change, a device change and
other software versions (the run goes on in each case; the log, and for the first two the
history, says what a user comparing it with an unbroken run must know); and, when the layout is
refused, the wrapper prefix that explains it.

Each function takes only what it says through: ``log(message)``, the manager's log, and
``event(kind, step, **fields)``, which records a history event (on rank 0 only).
"""
from __future__ import annotations

from typing import Any, Callable

from ..run import resuming
from . import adapter

Say = Callable[..., None]

WRAPPERS = {"module.": "a DataParallel/DDP wrapper", "_orig_mod.": "a torch.compile wrapper"}


def world_size_changed(log: Say, event: Say, step: int, change: dict[str, Any]) -> None:
    """Said once in the history (rank 0), and by every rank in its log."""
    saved, now = change["saved"], change["now"]
    log(f"world size changed from {saved} to {now}: weights, m, v, optimizer and scheduler "
        "resume exactly; per-rank RNGs and loop state "
        + (f"of ranks < {saved} resume, the others start fresh" if now > saved
           else "of the dropped ranks are discarded"))
    event("world_size_change", step, **change)


def device_changed(log: Say, event: Say, step: int, moved: list[tuple[str, str, str]]) -> None:
    """An accepted device change (``moved``: ``rng.device_changes``): its RNG pieces are not
    restored; said in the log and recorded in the history as a ``device_change`` event."""
    pieces = [f"rng.{piece}" for piece, _, _ in moved]
    saved = next((there for piece, there, _ in moved if piece == "torch_cuda"), moved[0][1])
    now = next((here for piece, _, here in moved if piece == "torch_cuda"), moved[0][2])
    log(f"device changed from {saved} to {now}: weights, m, v, optimizer, scheduler and loop state "
        f"resume; not restored (this process's own state goes on; not bit-exact): {', '.join(pieces)}")
    event("device_change", step, saved=saved, now=now, not_restored=pieces)


def versions_changed(log: Say, doc: dict[str, Any]) -> None:
    """Other software than the generation was saved with, said (``resuming.versions_changed``)."""
    resuming.versions_changed(log, doc, adapter.versions())


def wrapper_hint(saved: list[str], live: list[str]) -> str:
    """'; ' and why parameter names differ when only a wrapper's prefix does ('module.' of
    DataParallel/DDP, '_orig_mod.' of torch.compile) and the fix; '' otherwise.

    >>> wrapper_hint(["module.0.weight"], ["0.weight"])
    "; every name in the checkpoint starts with 'module.' (a DataParallel/DDP wrapper), the model's do not: pass the wrapped model, not model.module"
    >>> wrapper_hint(["0.weight"], ["_orig_mod.0.weight"])
    "; every name of the model starts with '_orig_mod.' (a torch.compile wrapper), the checkpoint's do not: pass model._orig_mod"
    """
    there, here = _prefix(saved), _prefix(live)
    if there == here or [n[len(there):] for n in saved] != [n[len(here):] for n in live]:
        return ""
    if there.endswith(here):
        extra = there[:len(there) - len(here)]
        return (f"; every name in the checkpoint starts with {extra!r} ({_what(extra)}), the model's do "
                f"not: pass the wrapped model, not model.{extra[:-1]}")
    if here.endswith(there):
        extra = here[:len(here) - len(there)]
        return (f"; every name of the model starts with {extra!r} ({_what(extra)}), the checkpoint's do "
                f"not: pass model.{extra[:-1]}")
    return (f"; the checkpoint's names start with {there!r} ({_what(there)}), the model's with {here!r} "
            f"({_what(here)}): wrap the model as it was wrapped when saved")


def _prefix(names: list[str]) -> str:
    """The wrapper prefixes ('module.', '_orig_mod.', nested) every one of ``names`` starts with."""
    prefix = ""
    while names:
        more = next((w for w in WRAPPERS if all(n.startswith(prefix + w) for n in names)), None)
        if more is None:
            break
        prefix += more
    return prefix


def _what(prefix: str) -> str:
    """'a DataParallel/DDP wrapper of a torch.compile wrapper' for 'module._orig_mod.'."""
    parts = [w for w in prefix.split(".") if w]
    return " of ".join(WRAPPERS[p + "."] for p in parts) if parts else "no wrapper"
