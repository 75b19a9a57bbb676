"""Signal handling (seed: "SIGTERM & SIGUSR1"). Handlers only set flags; the loop acts on them
at a step boundary. Installed before the slow start-up (torch import, resume), so a signal
during start-up is honoured rather than fatal.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field


@dataclass
class Flags:
    stop: bool = False           # SIGTERM / SIGINT: checkpoint this step, then exit 0
    checkpoint: bool = False     # SIGUSR1: checkpoint this step, then continue
    stop_at: float | None = None
    received: list[str] = field(default_factory=list)


FLAGS = Flags()


def _handler(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    FLAGS.received.append(name)
    if signum == signal.SIGUSR1:
        FLAGS.checkpoint = True
    elif not FLAGS.stop:      # a second SIGTERM changes nothing: the final save is not abandoned
        FLAGS.stop = True
        FLAGS.stop_at = time.monotonic()


def install() -> Flags:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, _handler)
    return FLAGS
