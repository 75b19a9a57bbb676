"""``Checkpointing``: a ``transformers.TrainerCallback`` that runs a Trainer's saves on the run
layer's ``Session`` (spec/RUN.md §8, §12): SIGTERM and SIGUSR1 save through the Trainer's own
flags, every ``checkpoint-N`` the Trainer writes is committed, and the output directory keeps
the run's history (``.loss.json``: each step with what the Trainer logged at it, the ``start``
or ``resume`` event and a ``checkpoint`` event per commit), as a ``CheckpointManager`` run does.

Which hook runs when, and what it touches (transformers 5.x):

- ``on_init_end`` (in ``Trainer.__init__``): refuses ``save_total_limit`` (the Trainer's own
  rotation by mtime; retention here is ``retention=Policy(...)``), naming it.
- ``on_train_begin``: refuses a hyper-parameter search (the Trainer writes ``run-{trial}/``
  there), closes the session a ``train()`` that raised left open, and opens this ``train()``'s
  on every rank (rank 0 writes the history; the ranks agree through torch.distributed): a
  ``start`` event, or, where the Trainer resumed (``global_step`` > 0), ``resumed`` and a
  ``resume`` event at that step (a history past it, a lost timeline's, leaves the canonical
  one: resuming an earlier checkpoint than the newest is a Trainer's right). Installs the
  SIGTERM and SIGUSR1 handlers (main thread only; they set the session's flags and return; a
  signal that arrives when no ``train()`` runs, after one raised, closes its session and goes
  to the handler that was there before) and makes the Trainer's ``control.should_save`` hold a
  requested save and read false until the first step (a save then would rewrite the checkpoint
  resumed from).
- ``on_step_end`` (every rank, once per optimizer step, after the Trainer's flow callback):
  ``session.step``, the flags of every rank agreed into one decision (a signal reaches one
  process); a requested save sets ``control.should_save`` (held: an evaluation under
  ``save_strategy="best"`` that overwrites it cannot drop it) and SIGTERM also
  ``control.should_training_stop``. The Trainer then logs, evaluates, saves ``checkpoint-N``
  itself and stops. The step's record waits for those logs: it is written at the next step's
  ``on_step_begin``, before a checkpoint of the step is committed, or at ``on_train_end``; with
  ``digests=True`` it holds the state digests taken here (``hf.digests``).
  Where a save follows and ``checkpoint-N`` is already there (a lost timeline's, committed or
  half-written: the run resumed from an earlier one), rank 0 removes it first, record first, so
  it is never committed while the Trainer rewrites it; a barrier. ``on_epoch_end`` the same, and
  ``on_evaluate`` under ``save_strategy="best"``.
- ``on_save`` (every rank, after the Trainer wrote ``checkpoint-N``): a barrier (each rank writes
  its ``rng_state_K.pth``), then rank 0 writes the step's record, fsyncs the history, then every
  file and the directory, and writes the commit record last, durably; every rank tells the
  session (``framework_saved``: the ``checkpoint`` event and retention, rank 0); a second
  barrier. The held request is released, and ``should_save`` reads false until the next step
  begins: ``checkpoint-N`` is written once (``on_epoch_end`` after a stop would ask again).
- ``on_train_end``: the last step's record, the session closed, the previous signal handlers
  back (one installed outside Python cannot be: ours stays, and drops what arrives after
  training); ``stopped_by_signal`` says why ``train()`` returned early (None: it ran to the end),
  a SIGTERM after the last step included.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import transformers
from transformers import TrainerCallback

from ..errors import CheckpointError, UnsupportedSetupError
from ..hfcheckpoint import RECORD, HFCheckpoint
from ..run.retention import Policy
from ..run.saving import SavePolicy
from ..run.session import Session
from ..run.signals import Handlers
from ..tools import hfdir, hfrun
from ..torch import optim
from ..torch.digests import DEFAULT as DIGESTS
from ..torch.ranks import TorchCollective
from .digests import step_digests
from ..warn import warn

__all__ = ["Checkpointing"]

PENDING = "_ckptfmt_save"                  # the held request, in the control's own __dict__
SAVED = "_ckptfmt_saved"                   # checkpoint-N of this step is written: no second save


class _Held:
    """Mixed into the Trainer's ``TrainerControl`` class: ``should_save`` reads true while a
    requested save is pending, whatever the Trainer assigns to it meanwhile, and false once this
    step's checkpoint is written (``SAVED``, until the next step begins). Pickled and copied as
    the plain class it extends."""

    @property
    def should_save(self) -> bool:
        own = self.__dict__
        return not own.get(SAVED, False) and bool(own.get("should_save", False) or own.get(PENDING, False))

    @should_save.setter
    def should_save(self, value: bool) -> None:
        self.__dict__["should_save"] = value

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        base = next(c for c in type(self).__mro__ if not issubclass(c, _Held))
        state = {k: v for k, v in self.__dict__.items() if k not in (PENDING, SAVED)}
        return base, (), state             # TrainerControl(): every field has a default


class TrainerControl(_Held, transformers.TrainerControl):
    """transformers' ``TrainerControl`` that holds a requested save; keeps its name, under which
    the Trainer stores the control's state (``stateful_callbacks["TrainerControl"]``)."""


_HELD: dict[type, type] = {transformers.TrainerControl: TrainerControl}


def hold(control: Any) -> Any:
    """``control`` with a ``should_save`` that holds a pending request (its class keeps its
    name: the Trainer stores the control's state under it)."""
    if not isinstance(control, _Held):
        cls = type(control)
        if cls not in _HELD:                # a subclass of the Trainer's own: made once
            _HELD[cls] = type(cls.__name__, (_Held, cls), {"__module__": cls.__module__})
        control.__class__ = _HELD[cls]
    return control


class Checkpointing(TrainerCallback):
    """Trainer(..., callbacks=[ckptfmt.hf.Checkpointing()]): SIGTERM saves at the end of the
    current step and stops (``train()`` returns; ``stopped_by_signal`` is ``"SIGTERM"``);
    SIGUSR1 saves and goes on; every ``checkpoint-N`` is committed by its record, and the output
    directory's history records the steps, the checkpoints and the resumes.

    ``retention=Policy(keep_last=3)`` (or ``keep_best`` with ``metric="eval_loss"``) deletes
    committed checkpoints the policy does not keep, never the newest valid one, the newest
    finite one, nor ``state.best_model_checkpoint``; ``signals=()`` installs no handlers;
    ``digests=True``: each step's record holds the digests of what ``checkpoint-N`` restores, as
    the next step finds it (spec/RUN.md §3.9; ``hf.digests``), for ``ckptfmt bisect``.

    Examples:
        One callback in a ``transformers.Trainer`` (the tutorial's ``train.py``):

        ```python
        from transformers import Trainer, TrainingArguments
        from ckptfmt.hf import Checkpointing, resume_path
        from ckptfmt.run import Policy

        args = TrainingArguments(output_dir="out", max_steps=20, save_steps=5, report_to=[])
        ckpt = Checkpointing(retention=Policy(keep_last=3))
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ckpt])
        trainer.train(resume_from_checkpoint=resume_path(args.output_dir))
        if ckpt.stopped_by_signal:            # SIGTERM: checkpoint-N saved and committed
            raise SystemExit(0)
        ```
    """

    def __init__(self, *, retention: Policy | None = None,
                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1), digests: bool = DIGESTS):
        if retention is not None and not isinstance(retention, Policy):
            raise TypeError(f"Checkpointing: retention must be a ckptfmt.run.Policy, got {type(retention).__name__}")
        self.retention, self.signals, self.digests = retention, tuple(signals), digests
        self.stopped_by_signal: str | None = None      # "SIGTERM" when train() returned because of it
        self.committed: list[str] = []                # checkpoint directories committed, in order
        self.deleted: list[int] = []                  # steps retention deleted
        self.diverged: list[str] = []                 # committed checkpoints whose weights hold NaN/inf
        self.session: Session | None = None           # the running train()'s (one a train() that raised left)
        self._state: Any = None                       # the Trainer's state in it: what it logged
        self._stepped = 0                             # the newest step the session has (resumed at or given)
        self._unrecorded: tuple[int, Any] | None = None   # a step given (and its digests), its record waiting for the logs
        self._handlers = Handlers(self, Checkpointing._take, self.signals)
        self._loop: CodeType | None = None            # the Trainer's training loop while train() runs

    # ------------------------------------------------------------ signals
    def request_save(self) -> None:
        """Save at the end of the current step and go on (what SIGUSR1 does); while no
        ``train()`` runs, nothing."""
        if self.session is not None:
            self.session.request_save()

    def request_stop(self, reason: str = "SIGTERM") -> None:
        """Save at the end of the current step and stop (what SIGTERM does)."""
        if self.session is not None:
            self.session.request_stop(reason)

    def _take(self, signum: int, frame: FrameType | None) -> bool:
        """A signal while ``train()`` runs: its request, in the session's flags. None runs (a
        ``train()`` raised past ``on_train_end``): its session is closed, the handlers that were
        there before are back, and this signal goes to its own (False; the default one raised
        again)."""
        if not self._training(frame):
            with contextlib.suppress(CheckpointError, OSError):   # the signal goes on whatever the history says
                self._end()
            return False
        if self.session is not None:
            self.session.flags.note(signum)
        return True

    def _training(self, frame: FrameType | None) -> bool:
        """Whether the frame a signal interrupted runs inside the training loop of ``train()``
        (not after it returned or raised)."""
        if self._loop is None or frame is None:
            return self._loop is not None
        while frame is not None and frame.f_code is not self._loop:
            frame = frame.f_back
        return frame is not None

    def _end(self) -> None:
        """No training runs: the previous handlers back (one installed outside Python,
        ``signal()`` returned None, cannot be: ours stays, and drops the signals that arrive
        while no training runs), then the session's last record and its close."""
        self._loop = None
        self._handlers.restore()
        self._close()

    def _close(self) -> None:
        """The session's last record written and the session closed (rank 0: the history fsynced)."""
        if self.session is not None:
            try:
                self._record_pending()
            finally:
                session, self.session = self.session, None
                session.close()

    # ------------------------------------------------------------ hooks
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """In ``Trainer.__init__``: ``save_total_limit`` refused (``refuse_rotation``)."""
        refuse_rotation(args)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """This ``train()``'s session (a raised one's closed first), signal handlers installed
        (main thread), ``control.should_save`` made to hold requests and read false until the
        first step."""
        refuse_rotation(args)
        if getattr(state, "is_hyper_param_search", False):
            raise UnsupportedSetupError(args.output_dir, "hyperparameter_search: the Trainer saves into run-{trial}/ "
                                        "there; ckptfmt.hf.Checkpointing commits checkpoint-N of one run")
        hold(control).__dict__[SAVED] = True
        self.stopped_by_signal = None
        self._close()
        self._loop = _training_loop()             # first: a signal right after the install is ours
        self.session = self._open(args.output_dir, state)
        if not self._handlers.install():          # outside the main thread: none, and no loop watched
            self._loop = None

    def _open(self, output_dir: str, state: Any) -> Session:
        """The session of this ``train()`` over the output directory, every rank's: started, or
        resumed at the Trainer's ``global_step`` (its metrics the newest known; ``durable``
        where that step's checkpoint is this directory's, committed)."""
        session = Session(output_dir, write=None, writer=None, saving=SavePolicy(), retention=self.retention,
                          collective=TorchCollective(), lock=False, handle_signals=False,
                          retain=lambda: self._retain(output_dir, getattr(state, "best_model_checkpoint", None)))
        self._state, self._stepped, self._unrecorded = state, state.global_step, None
        if state.global_step > 0:
            logged = hfdir.metrics_at({"log_history": getattr(state, "log_history", None)}, state.global_step)
            done = os.path.join(output_dir, f"checkpoint-{state.global_step}", RECORD)
            session.resumed(state.global_step, logged, durable=os.path.isfile(done))
            session.event("resume", state.global_step)
        else:
            session.resumed(None, {}, durable=False)
            session.event("start", 0, world_size=session.world)
        return session

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A new step: its checkpoint is not written yet; the previous step's record (the Trainer
        logged it by now)."""
        hold(control).__dict__.pop(SAVED, None)
        self._record_pending()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The decision every rank agrees on: save (held), and stop after SIGTERM."""
        hold(control)
        stop, save = self._agreed(state, kwargs)
        if stop or save:
            control.__dict__[PENDING] = True
        if stop:
            control.should_training_stop = True
            self.stopped_by_signal = self.session.flags.reason
        self._prepare(args, state, control.should_save)

    def _agreed(self, state: Any, hooked: dict[str, Any]) -> tuple[bool, bool]:
        """(stop, save) at the end of the step, as every rank sees them: the session's step (its
        record, with the state digests taken now, waits for the Trainer's logs, which follow this
        hook), or, for a step the session has already (resumed at, or the hook called again at
        it), the requests alone."""
        self._record_pending()
        step = state.global_step
        if step <= self._stepped:
            return self.session.requests()
        self._stepped, self._unrecorded = step, (step, step_digests(state, hooked) if self.digests else None)
        return self.session.step(step, None)

    def _record_pending(self) -> None:
        """The record of the step given last, with what the Trainer logged at it; once."""
        pending, self._unrecorded = self._unrecorded, None
        if pending is not None and self.session is not None:
            self.session.record(pending[0], logged_at(self._state, pending[0]), state=pending[1])

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A save the flow callback asks for at the epoch's end: prepared as at a step's end."""
        self._prepare(args, state, hold(control).should_save)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Under ``save_strategy="best"`` a save may follow an evaluation, with no hook between."""
        if self._loop is not None and str(getattr(args, "save_strategy", "")).endswith("best"):
            self._prepare(args, state, not hold(control).__dict__.get(SAVED, False))

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                **kwargs: Any) -> None:
        """After the Trainer wrote ``checkpoint-N``: barrier; rank 0 the step's record, the history
        fsynced, the commit; every rank ``framework_saved`` (rank 0: the event, retention); barrier."""
        session, name = self.session, f"checkpoint-{state.global_step}"
        session.collective.barrier()               # every rank's rng_state_K.pth is written
        self._record_pending()
        record = None
        if state.is_world_process_zero:
            session.run.history.sync()             # its records up to N on disk before N commits
            record = self._commit(os.path.join(args.output_dir, name), state, model, optimizer)
        session.framework_saved(state.global_step, record, path=name)
        session.collective.barrier()
        control.__dict__.pop(PENDING, None)
        control.__dict__[SAVED] = True             # checkpoint-N is written once, until the next step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A SIGTERM after the last step still counts; the session closed, the previous signal
        handlers back."""
        stop, _ = self.session.requests()
        if stop:
            self.stopped_by_signal = self.session.flags.reason
        self._end()

    # ------------------------------------------------------------ commit
    def _prepare(self, args: Any, state: Any, saving: bool) -> None:
        """Before the Trainer writes ``checkpoint-N`` (``saving``): a directory of that name it
        did not write in this run (a lost timeline's) is removed, record first, by rank 0, so it
        is never committed while rewritten and none of its files is recorded as this save's."""
        if not saving:
            return
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and directory.is_dir() and not directory.is_symlink():
            warn(f"{directory}: there before this save (a lost timeline's): removed first, "
                          "so it is never committed while rewritten")
            HFCheckpoint.at(directory).remove()
        self.session.collective.barrier()          # no rank writes into it before it is gone

    def _commit(self, directory: str, state: Any, model: Any, optimizer: Any) -> dict[str, Any]:
        names = optim.members(model, optimizer) if model is not None and optimizer is not None else None
        order = [name for name, _ in model.named_parameters()] if model is not None else None
        record = hfdir.commit(directory, state.global_step, names, **({"parameters": order} if order else {}))
        self.committed.append(directory)
        if hfdir.non_finite(record):
            self.diverged.append(directory)
            warn(f"{directory}: its weights hold {hfdir.non_finite(record)} non-finite values "
                          "(diverged): resume_path and retention pass it over")
        return record

    def _retain(self, output_dir: str, best: str | None) -> list[int]:
        """The session's retention after a commit (rank 0): ``hfrun.retain`` over the output
        directory, the Trainer's ``best_model_checkpoint`` guarded."""
        deleted = hfrun.retain(output_dir, self.retention, best=best)
        self.deleted += deleted
        return deleted


def logged_at(state: Any, step: int) -> dict[str, Any]:
    """The numbers the Trainer logged at ``step`` (``state.log_history``: loss, learning_rate,
    eval_loss, ...), read from the end (the log grows in step order)."""
    out: dict[str, Any] = {}
    for entry in reversed(getattr(state, "log_history", None) or []):
        at = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(at, int) and at < step:
            break
        if at == step:
            out.update({k: v for k, v in entry.items() if k != "step" and k not in out
                        and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def _training_loop() -> CodeType | None:
    """The code of the Trainer's loop that runs this hook: the first frame up the stack outside
    this module and transformers' callback handler (a signal whose frame is not under it
    arrived when no ``train()`` runs)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in (__name__, "transformers.trainer_callback"):
        frame = frame.f_back
    return frame.f_code if frame is not None else None


def refuse_rotation(args: Any) -> None:
    """``save_total_limit`` rotates checkpoint directories by mtime, unaware of which are
    committed, valid or finite: refused by name (retention is ``Checkpointing(retention=...)``)."""
    if getattr(args, "save_total_limit", None) is not None:
        raise UnsupportedSetupError(None, f"TrainingArguments.save_total_limit={args.save_total_limit}: the "
                                          "Trainer's rotation would delete checkpoints without checking them; "
                                          "set save_total_limit=None and give ckptfmt.hf.Checkpointing("
                                          "retention=Policy(keep_last=K))")
