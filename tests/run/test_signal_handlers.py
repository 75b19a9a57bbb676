"""The run layer's signal handlers (``ckptfmt.run.signals``), without torch, with real signals sent
to this process: a signal the owner takes sets its flags and nothing else runs; one it leaves
(or one after the owner is gone: it is held weakly) goes to the handler replaced, or to the ones
given to chain, or ends the process by its default action; ``restore`` puts the replaced
handlers back (one installed outside Python stays ours); outside the main thread nothing is
installed; the checkpoint manager's rules (a first Ctrl-C said, a second one forced)."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

from ckptfmt.run import signals
from ckptfmt.run.signals import SIGNALS, Flags, Handlers


@pytest.fixture(autouse=True)
def own_handlers():
    """Each test starts from Python's handlers (SIGINT raises KeyboardInterrupt) and leaves them."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def kill(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0)                  # the handler runs before the next line


def recorder(seen: list) -> object:
    return lambda signum, frame: seen.append(signum)


def test_a_signal_taken_sets_the_flags_and_nothing_else_runs_and_restore_gives_the_previous_back():
    seen = []
    for sig in SIGNALS:
        signal.signal(sig, recorder(seen))
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    flags = Flags()
    handlers = Handlers(flags, Flags.take)
    assert handlers.install()
    kill(signal.SIGUSR1)
    assert flags.save and not flags.stop
    kill(signal.SIGINT)
    kill(signal.SIGTERM)                          # a second stop changes nothing: the first is why
    assert (flags.stop, flags.reason) == (True, "SIGINT") and seen == []
    assert flags.pop_save() and not flags.save and flags.pop_stop() and not flags.stop
    handlers.restore()
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == previous
    kill(signal.SIGUSR1)
    assert seen == [signal.SIGUSR1] and not flags.save


def test_a_signal_left_goes_to_the_handler_replaced_once_installed_twice():
    seen = []
    signal.signal(signal.SIGUSR1, recorder(seen))
    previous = signal.getsignal(signal.SIGUSR1)
    flags = Flags()
    handlers = Handlers(flags, Flags.note_and_chain, (signal.SIGUSR1,))
    assert handlers.install() and handlers.install()       # the second keeps the first one replaced
    kill(signal.SIGUSR1)
    assert flags.save and seen == [signal.SIGUSR1]
    handlers.restore()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_the_handlers_given_to_chain_run_instead_of_the_one_replaced_in_order():
    seen, first, second = [], [], []
    signal.signal(signal.SIGTERM, recorder(seen))
    flags = Flags()
    handlers = Handlers(flags, Flags.note_and_chain, (signal.SIGTERM,))
    assert handlers.install({signal.SIGTERM: [recorder(first), signal.SIG_DFL, None, recorder(second)]})
    kill(signal.SIGTERM)
    assert flags.stop and first == second == [signal.SIGTERM] and seen == []
    handlers.restore()


def test_the_owner_is_held_weakly_and_once_gone_its_signals_go_where_they_went_before():
    flags = Flags()
    gone = weakref.ref(flags)
    assert Handlers(flags, Flags.take).install()
    del flags
    gc.collect()
    assert gone() is None                         # the handlers installed did not keep it alive
    with pytest.raises(KeyboardInterrupt):
        kill(signal.SIGINT)                       # Python's own handler again
        time.sleep(1)


def test_an_owner_that_gives_the_handlers_back_when_it_leaves_a_signal_passes_it_to_the_previous():
    seen = []
    signal.signal(signal.SIGUSR1, recorder(seen))
    previous = signal.getsignal(signal.SIGUSR1)

    class Finished:                               # the HF callback after a train() that raised
        def take(self, signum, frame):
            handlers.restore()
            return False
    owner = Finished()
    handlers = Handlers(owner, Finished.take, (signal.SIGUSR1,))
    assert handlers.install()
    kill(signal.SIGUSR1)
    assert seen == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) is previous


def test_a_handler_installed_outside_python_cannot_be_restored_ours_stays_and_drops_the_signal():
    flags = Flags()
    handlers = Handlers(flags, Flags.note_and_chain, (signal.SIGUSR1,))
    assert handlers.install()
    handlers.replaced[signal.SIGUSR1] = None      # what getsignal() says of a handler set in C
    handlers.restore()
    assert signal.getsignal(signal.SIGUSR1) == handlers.handle
    kill(signal.SIGUSR1)                          # passed to nothing: no error, the process goes on
    assert flags.save


def test_a_signal_left_whose_previous_action_was_the_default_ends_the_process_by_it():
    code = ("import os, signal, time; from ckptfmt.run.signals import Flags, Handlers; "
            "flags = Flags(); Handlers(flags, Flags.note_and_chain).install(); "
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('survived')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == -signal.SIGTERM and "survived" not in result.stdout, result


def in_a_thread(work) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_outside_the_main_thread_nothing_is_installed_nor_restored():
    def now():
        return {sig: signal.getsignal(sig) for sig in SIGNALS}
    before, flags, answers = now(), Flags(), []
    installed, other = Handlers(flags, Flags.take), Handlers(flags, Flags.take)
    assert installed.install()
    mine = now()
    in_a_thread(lambda: answers.append(other.install()))
    assert answers == [False] and other.replaced == {} and now() == mine
    in_a_thread(installed.restore)                # Python allows no handler set there: none is
    assert now() == mine != before
    installed.restore()
    assert now() == before


class Loop:
    """What ``signals.install`` asks of its owner (the checkpoint manager's protocol)."""

    class run:
        where = "/runs/a"

    def __init__(self):
        self.closed, self.flags, self.saves, self.said = False, signals.Flags(), 0, []
        self.reason = None

    def request_stop(self, reason="SIGTERM"):
        self.flags.request_stop(reason)
        self.reason = self.flags.reason

    def request_save(self):
        self.saves += 1

    def log(self, message):
        self.said.append(message)


def test_the_managers_first_ctrl_c_asks_for_a_stop_and_says_so_a_second_interrupts(capsys):
    loop = Loop()
    installed = signals.install(loop)
    kill(signal.SIGUSR1)
    kill(signal.SIGINT)
    assert (loop.saves, loop.reason) == (1, "SIGINT")
    assert capsys.readouterr().err == ("ckptfmt: Ctrl-C: the checkpoint manager of /runs/a commits at its "
                                       "next step() and stops the loop; Ctrl-C again interrupts at once\n")
    kill(signal.SIGTERM)
    assert loop.reason == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        kill(signal.SIGINT)
        time.sleep(1)
    loop.closed = True
    with pytest.raises(KeyboardInterrupt):        # closed: whatever it asked before
        kill(signal.SIGINT)
        time.sleep(1)
    signals.restore(installed)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_manager_outside_the_main_thread_installs_nothing_and_says_so_once():
    loop, got = Loop(), []
    in_a_thread(lambda: got.append(signals.install(loop)))
    assert got == [None] and len(loop.said) == 1 and "outside the main thread" in loop.said[0]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failed_construction_gives_the_handlers_back():
    loop = Loop()
    with pytest.raises(OSError):
        with signals.given_back_on_error(signals.install(loop)):
            raise OSError("the lock is held")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
