"""What a restore says once it has passed every check: a world-size change, a device change and
other software versions. The run goes on in each case; the log (and, for the first two, the
history) says what a user comparing it with an unbroken run must know."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import adapter

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .restore import Plan


def world_size_changed(mgr: "CheckpointManager", doc: dict[str, Any], change: dict[str, Any]) -> None:
    """Said once by rank 0 in the history, and by every rank in its log."""
    saved, now = change["saved"], change["now"]
    mgr.log(f"world size changed from {saved} to {now}: weights, m, v, optimizer and scheduler "
            "resume exactly; per-rank RNGs and loop state "
            + (f"of ranks < {saved} resume, the others start fresh" if now > saved
               else "of the dropped ranks are discarded"))
    if mgr.rank == 0:
        mgr.run.history.event("world_size_change", doc.get("step", 0), **change)


def device_changed(mgr: "CheckpointManager", doc: dict[str, Any], plan: "Plan") -> None:
    """An accepted device change: its RNG pieces are skipped, listed in ``fresh``, said in the
    log and recorded in the history as a ``device_change`` event."""
    pieces = [f"rng.{piece}" for piece, _, _ in plan.moved]
    saved = next((there for piece, there, _ in plan.moved if piece == "torch_cuda"), plan.moved[0][1])
    now = next((here for piece, _, here in plan.moved if piece == "torch_cuda"), plan.moved[0][2])
    if plan.rng is not None:
        plan.rng_skip.update(piece for piece, _, _ in plan.moved)
        plan.fresh += [f"{p} (device change)" for p in pieces]
    mgr.log(f"device changed from {saved} to {now}: weights, m, v, optimizer, scheduler and loop state "
            f"resume; not restored (this process's own state goes on; not bit-exact): {', '.join(pieces)}")
    if mgr.rank == 0:
        mgr.run.history.event("device_change", doc.get("step", 0), saved=saved, now=now, not_restored=pieces)


def versions_changed(mgr: "CheckpointManager", doc: dict[str, Any]) -> None:
    """Other software than the generation was saved with (torch, numpy, Python, ckptfmt): the
    values resume exactly, but the next steps may not be bit-identical to an unbroken run's
    (kernels and RNG streams can change between versions). Said, never refused: a long run
    outlives its software."""
    saved, now = doc.get("versions"), adapter.versions()
    if not isinstance(saved, dict):
        return
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    if changed:
        mgr.log(f"resuming under other versions than the checkpoint's ({', '.join(changed)}): the run "
                "goes on from the same values; bit-identity with an unbroken run is not promised")
