"""Device tensors to the writer through one save's staging pair, the copy of the next piece
overlapped with the writing and hashing of this one (spec/FORMAT.md §5.7.2).

A region of tensors is cut into pieces of at most ``capacity`` floats (small tensors share a
piece, a large one spans several). Each piece is copied into one of two host buffers by a copy
engine; the generator launches the copy of piece k+1 into the buffer the writer gave back (it
resumed us, so it has written and hashed it: §5.7.1), waits for piece k's copy, and yields
piece k. The CUDA calls live in ``CudaCopies`` alone; ``HostCopies`` is its CPU twin, driven by
the very same generator, and can complete its copies at launch, at wait or on a slow thread, so
the tests can show that no order of completion corrupts a buffer the writer holds.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Protocol

import numpy as np
import torch

from .. import writer

STAGING = writer.CHUNK     # bytes per staging buffer: one writer chunk, so a piece is one chunk
CAPACITY = STAGING // 4    # floats per staging buffer

Piece = Any    # np.ndarray (a zero-copy host view) or list[torch.Tensor] (segments to stage)


class CopyEngine(Protocol):
    """What the stager needs from a device: two host buffers and asynchronous copies into them."""

    def stages(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` must go through a staging buffer (it is not host memory)."""

    def buffer(self, count: int) -> torch.Tensor:
        """A float32 host buffer of ``count`` elements (pinned, for a CUDA engine)."""

    def launch(self, segments: list[torch.Tensor], into: torch.Tensor) -> Any:
        """Start copying ``segments`` end to end into ``into``; returns a ticket for ``wait``.
        The ticket keeps the segments (and any temporary they view) alive until waited on."""

    def wait(self, ticket: Any) -> None:
        """Block until the copy of ``ticket`` has landed in its buffer."""


class CudaCopies:
    """Copies on a side stream per device, each launch ordered after the compute stream's work
    (``side.wait_stream(current)``: the copy sees every kernel queued before it, the
    ``.contiguous()`` that made its source included), completion marked by an event."""

    def __init__(self) -> None:
        self._sides: dict[torch.device, Any] = {}

    def stages(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type != "cpu"

    def buffer(self, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=torch.float32, pin_memory=torch.cuda.is_available())

    def launch(self, segments: list[torch.Tensor], into: torch.Tensor) -> Any:
        device = segments[0].device
        if device.type != "cuda":            # another accelerator: a plain synchronous copy
            _fill(into, segments, non_blocking=False)
            return None, segments
        side = self._sides.get(device)
        if side is None:
            side = self._sides[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            _fill(into, segments, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return done, segments                # the sources stay referenced until the event

    def wait(self, ticket: Any) -> None:
        done, _ = ticket
        if done is not None:
            done.synchronize()


class HostCopies:
    """The CPU twin of ``CudaCopies``: every tensor is staged, and each copy completes
    ``at="launch"`` (at once: a launch into a buffer the writer holds shows in its bytes),
    ``at="wait"`` (only when waited on: a missing wait shows) or ``at="thread"`` (on a worker
    thread, ``delay_s`` late: a copy still running when its buffer is handed out shows)."""

    def __init__(self, at: str = "thread", delay_s: float = 0.0) -> None:
        if at not in ("launch", "wait", "thread"):
            raise ValueError(f"at must be launch, wait or thread, got {at!r}")
        self.at, self.delay_s = at, delay_s
        self.launched: list[int] = []         # data_ptr of each launch's buffer, in order
        self._pool = ThreadPoolExecutor(1, "ckptfmt-twin-copy") if at == "thread" else None
        self._lock = threading.Lock()

    def stages(self, tensor: torch.Tensor) -> bool:
        return True

    def buffer(self, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=torch.float32)

    def launch(self, segments: list[torch.Tensor], into: torch.Tensor) -> Any:
        with self._lock:
            self.launched.append(into.data_ptr())
        if self.at == "launch":
            _fill(into, segments, non_blocking=False)
            return None
        if self.at == "wait":
            return into, segments
        return self._pool.submit(self._slow_fill, into, segments)

    def _slow_fill(self, into: torch.Tensor, segments: list[torch.Tensor]) -> None:
        time.sleep(self.delay_s)
        _fill(into, segments, non_blocking=False)

    def wait(self, ticket: Any) -> None:
        if isinstance(ticket, Future):
            ticket.result()
        elif ticket is not None:
            _fill(*ticket, non_blocking=False)


def _fill(into: torch.Tensor, segments: list[torch.Tensor], *, non_blocking: bool) -> None:
    """Copy ``segments`` end to end into the start of ``into``."""
    offset = 0
    for segment in segments:
        into[offset:offset + segment.numel()].copy_(segment, non_blocking=non_blocking)
        offset += segment.numel()


class Stager:
    """One save's staging pair and copy engine. Its regions are pulled one after another, as the
    writer pulls weights, m and v; two at once (two saves or two threads sharing it) is refused."""

    def __init__(self, engine: CopyEngine | None = None, capacity: int = CAPACITY) -> None:
        self.engine: CopyEngine = engine if engine is not None else CudaCopies()
        self.capacity = capacity
        self._buffers: list[torch.Tensor] = []   # allocated on the first staged piece
        self._active = False

    def region(self, tensors: Iterable[torch.Tensor]) -> Iterator[np.ndarray]:
        """The float32 bytes of ``tensors`` laid end to end, as host arrays (writer contract §5.7.1)."""
        if self._active:
            raise RuntimeError("a Stager serves one region at a time (one per save and thread)")
        self._active = True
        ahead: tuple[int, Any, int] | None = None     # (buffer, ticket, floats) of the next piece
        turn = 0
        try:
            for piece in plan(tensors, self.capacity, self.engine.stages):
                launched = None
                if not isinstance(piece, np.ndarray):  # into the buffer the writer gave back
                    launched, turn = self._launch(piece, turn), turn ^ 1
                previous, ahead = ahead, launched
                if previous is not None:
                    yield self._landed(previous)
                if launched is None:                  # host memory: no copy, in file order
                    yield piece
            if ahead is not None:
                previous, ahead = ahead, None
                yield self._landed(previous)
        finally:
            if ahead is not None:                     # abandoned: no copy outlives the region
                self.engine.wait(ahead[1])
            self._active = False

    def _launch(self, segments: list[torch.Tensor], turn: int) -> tuple[int, Any, int]:
        if not self._buffers:
            self._buffers = [self.engine.buffer(self.capacity) for _ in range(2)]
        return turn, self.engine.launch(segments, self._buffers[turn]), sum(s.numel() for s in segments)

    def _landed(self, ahead: tuple[int, Any, int]) -> np.ndarray:
        turn, ticket, count = ahead
        self.engine.wait(ticket)
        return self._buffers[turn][:count].numpy()


def plan(tensors: Iterable[torch.Tensor], capacity: int, stages: Any) -> Iterator[Piece]:
    """The pieces of a region in file order: a host tensor as a zero-copy array, the others as
    lists of segments of at most ``capacity`` floats in all, one device per piece; zero-size
    tensors add nothing. A segment views its tensor's ``.contiguous()`` copy, so a temporary
    lives as long as a segment of it does."""
    segments: list[torch.Tensor] = []
    filled = 0
    for t in tensors:
        t = t.detach()
        if t.dtype != torch.float32:
            raise TypeError(f"ckptfmt stores float32; got a {t.dtype} tensor (keep fp32 master weights)")
        if segments and (not stages(t) or t.device != segments[0].device):
            yield segments
            segments, filled = [], 0
        if not stages(t):
            yield t.contiguous().view(-1).numpy()
            continue
        flat = t.contiguous().view(-1)
        start = 0
        while start < flat.numel():
            take = min(capacity - filled, flat.numel() - start)
            segments.append(flat[start:start + take])
            filled, start = filled + take, start + take
            if filled == capacity:
                yield segments
                segments, filled = [], 0
    if segments:
        yield segments
