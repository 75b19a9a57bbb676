"""The one place that installs, chains and restores signal handlers, for every loop: the
``CheckpointManager`` (``install``), the reference trainer (``Flags`` set from before its slow
start-up), the Lightning callback (``Flags``, then the handlers it chains) and the Hugging Face
callback (its session's flags, while its training loop runs). A handler only sets flags: the loop acts
on them at a step boundary.

``Handlers(owner, take, signals)`` is the mechanism: on each signal ``take(owner, signum, frame)``
says whether the owner takes it (True) or leaves it to the handlers that were there before
(False: called, or a default action raised again). The owner is held weakly: once it is gone, a
signal goes where it went before. Python lets only the main thread install handlers:
``install()`` outside it installs nothing and returns False. ``restore()`` puts back the
handlers it replaced; one installed outside Python (``signal.getsignal`` returns None) cannot
be: ours stays, and passes what arrives to nothing.

>>> flags = Flags()
>>> Handlers(flags, Flags.take, ()).install()
True
>>> flags.request_stop("SIGINT"); flags.request_stop("SIGTERM"); (flags.stop, flags.reason)
(True, 'SIGINT')
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, Mapping

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)   # stop, stop (Ctrl-C), save

Take = Callable[[Any, int, "FrameType | None"], bool]


@dataclass(eq=False)
class Flags:
    """What signals (or a caller) asked for: a stop (SIGTERM, SIGINT) and a save (SIGUSR1).
    ``reason`` names the first stop's signal, ``stop_at`` its ``time.monotonic()``; a second
    stop changes neither (the final save is not abandoned)."""
    stop: bool = False
    save: bool = False
    reason: str | None = None
    stop_at: float | None = None

    def request_stop(self, reason: str = "SIGTERM") -> None:
        if not self.stop:
            self.stop, self.reason, self.stop_at = True, reason, time.monotonic()

    def request_save(self) -> None:
        self.save = True

    def pop_save(self) -> bool:
        """Whether a save was asked for since the last call."""
        save, self.save = self.save, False
        return save

    def pop_stop(self) -> bool:
        """Whether a stop was asked for since the last call."""
        stop, self.stop, self.reason, self.stop_at = self.stop, False, None, None
        return stop

    def note(self, signum: int) -> None:
        """The request ``signum`` makes: SIGUSR1 a save, any other a stop."""
        if signum == signal.SIGUSR1:
            self.request_save()
        else:
            self.request_stop(signal.Signals(signum).name)

    def take(self, signum: int, frame: FrameType | None) -> bool:
        """A ``take`` for ``Handlers``: noted, and nothing else runs (the reference trainer)."""
        self.note(signum)
        return True

    def note_and_chain(self, signum: int, frame: FrameType | None) -> bool:
        """A ``take`` for ``Handlers``: noted, then the chained handlers run too (Lightning's)."""
        self.note(signum)
        return False


class Handlers:
    """``signals`` handled for ``owner`` (held weakly) by ``take`` (see the module's docstring)."""

    def __init__(self, owner: Any, take: Take, signals: Iterable[int] = SIGNALS) -> None:
        self._owner, self._take, self.signals = weakref.ref(owner), take, tuple(signals)
        self.replaced: dict[int, Any] = {}          # the handlers ours replaced, to put back
        self._chain: dict[int, list[Any]] = {}

    def install(self, chain: Mapping[int, Iterable[Any]] | None = None) -> bool:
        """Ours for each signal; False outside the main thread (nothing installed). ``chain``: for
        a signal, the handlers one not taken goes to instead of the one replaced (the callables
        among them, in order). Installed again, the first replaced handler is kept, never ours."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._chain = {sig: [h for h in handlers if callable(h)] for sig, handlers in (chain or {}).items()}
        for sig in self.signals:
            self.replaced.setdefault(sig, signal.signal(sig, self.handle))
        return True

    def restore(self) -> None:
        """The handlers ours replaced, back (from the main thread; elsewhere Python allows none);
        one installed outside Python cannot be: ours stays."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in list(self.replaced.items()):
            if handler is not None:
                signal.signal(sig, handler)
                del self.replaced[sig]

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The handler installed: the owner's, or, not taken (or the owner gone), the one before."""
        owner, before = self._owner(), self.replaced.get(signum)   # before: ``take`` may restore
        if owner is None or not self._take(owner, signum, frame):
            for handler in self._chain.get(signum, [before]):
                _chain(handler, signum, frame)


def _chain(before: Any, signum: int, frame: FrameType | None) -> None:
    """What the handler ours replaced would have done (Python's own SIGINT handler raises
    KeyboardInterrupt; the default action of SIGTERM ends the process; ignored, or installed
    outside Python: nothing)."""
    if callable(before):
        before(signum, frame)
    elif before == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# ---------------------------------------------------------------- the checkpoint manager's
def install(mgr: Any) -> Handlers | None:
    """SIGTERM/SIGINT request a stop of ``mgr``, SIGUSR1 a save (``request_stop(reason)``,
    ``request_save()``; its ``flags`` say whether a stop was asked for already). A manager built in another thread than the main one handles none, and
    says so once (``mgr.log``). Held weakly: once it is closed or gone, and for a second Ctrl-C
    after a stop was requested (a notebook cell that failed before ``close()``, a loop that no
    longer calls ``step()`` or ignores its answer), a signal does what it did before the manager
    (Ctrl-C raises KeyboardInterrupt again)."""
    handlers = Handlers(mgr, _manager_takes)
    if not handlers.install():
        mgr.log("signals are not handled: the manager was built outside the main thread "
                "(handle_signals=False says so and keeps this quiet); call request_stop() / "
                "request_save() from the thread that receives them")
        return None
    return handlers


def _manager_takes(mgr: Any, signum: int, frame: FrameType | None) -> bool:
    """The request the signal makes; a first Ctrl-C says what it did on stderr (a manager left
    unclosed by a notebook cell would otherwise swallow it in silence)."""
    if mgr.closed or (signum == signal.SIGINT and mgr.flags.stop):   # a second Ctrl-C: force
        return False
    if signum == signal.SIGUSR1:
        mgr.request_save()
        return True
    if signum == signal.SIGINT:
        sys.stderr.write(f"ckptfmt: Ctrl-C: the checkpoint manager of {mgr.run.where} commits at its "
                         "next step() and stops the loop; Ctrl-C again interrupts at once\n")
    mgr.request_stop(signal.Signals(signum).name)
    return True


def restore(installed: Handlers | None) -> None:
    """The handlers ``install`` replaced, back (none were: nothing)."""
    if installed is not None:
        installed.restore()


@contextlib.contextmanager
def given_back_on_error(installed: Handlers | None) -> Iterator[None]:
    """``restore(installed)`` when the block raises: a manager whose construction failed leaves
    no handler of its own (one kept alive by its error, as a notebook keeps the last one, would
    otherwise take a Ctrl-C for it)."""
    try:
        yield
    except BaseException:
        restore(installed)
        raise


def release_when_collected(mgr: Any, lock: Any) -> Any:
    """A manager dropped without ``close()`` gives its run lock up when it is collected."""
    return weakref.finalize(mgr, lock.release) if lock is not None else None
