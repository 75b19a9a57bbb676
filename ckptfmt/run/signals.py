"""The one place that installs, chains and restores signal handlers (those of a
``CheckpointManager`` today): SIGTERM and SIGINT ask for a stop, SIGUSR1 for a save; the
handlers only set flags, and hold their owner weakly."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import weakref
from typing import Any, Iterator


def install(mgr: Any) -> dict[int, Any] | None:
    """SIGTERM/SIGINT request a stop, SIGUSR1 a save; the handlers only set flags. Python lets
    only the main thread install handlers: a manager built in another thread handles none, and
    says so once. The handlers hold the manager weakly: once it is closed or gone, and for a
    second Ctrl-C after a stop was requested (a notebook cell that failed before ``close()``, a
    loop that no longer calls ``step()`` or ignores its answer), a signal does what it did
    before the manager (Ctrl-C raises KeyboardInterrupt again)."""
    if threading.current_thread() is not threading.main_thread():
        mgr.log("signals are not handled: the manager was built outside the main thread "
                "(handle_signals=False says so and keeps this quiet); call request_stop() / "
                "request_save() from the thread that receives them")
        return None
    ref = weakref.ref(mgr)
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        previous[sig] = signal.signal(sig, functools.partial(_on_signal, ref, signal.getsignal(sig)))
    return previous


def restore(previous: dict[int, Any] | None) -> None:
    """The handlers ``install`` replaced, back (none were: nothing)."""
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def given_back_on_error(previous: dict[int, Any] | None) -> Iterator[None]:
    """``restore(previous)`` when the block raises: a manager whose construction failed leaves
    no handler of its own (one kept alive by its error, as a notebook keeps the last one, would
    otherwise take a Ctrl-C for it)."""
    try:
        yield
    except BaseException:
        restore(previous)
        raise


def _on_signal(ref: "weakref.ref[Any]", before: Any, signum: int, frame: Any) -> None:
    """The flag the signal asks for; a first Ctrl-C says what it did on stderr (a manager left
    unclosed by a notebook cell would otherwise swallow it in silence)."""
    mgr, name = ref(), signal.Signals(signum).name
    if mgr is None or mgr.closed or (signum == signal.SIGINT and mgr._stop):   # a second Ctrl-C: force
        _chain(before, signum, frame)
    elif signum == signal.SIGUSR1:
        mgr.request_save()
    else:
        if signum == signal.SIGINT and not mgr._stop:     # said, or a Ctrl-C that only reaches a
            sys.stderr.write(f"ckptfmt: Ctrl-C: the checkpoint manager of {mgr.run.where} commits at its "
                             "next step() and stops the loop; Ctrl-C again interrupts at once\n")
        mgr.request_stop(name)


def _chain(before: Any, signum: int, frame: Any) -> None:
    """What the handler the manager replaced would have done (Python's own SIGINT handler
    raises KeyboardInterrupt; the default action of SIGTERM ends the process)."""
    if callable(before):
        before(signum, frame)
    elif before == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def release_when_collected(mgr: Any, lock: Any) -> Any:
    """A manager dropped without ``close()`` gives its run lock up when it is collected."""
    return weakref.finalize(mgr, lock.release) if lock is not None else None
