"""What a piece of state that differs first between two runs says about a resume (spec/RUN.md §6.5).

``bisect`` names the first piece of state in which a resumed run parts from a straight one (the
history's per-step state digests, then the generations' tensors). This table is what each piece
usually means: the one place its words come from (spec/RUN.md §6.5 shows the same table; a test
holds the two together). Each row's ``component`` is a pattern: ``I``, ``G`` and ``NAME`` stand
for a device index, a param group and a name (spec/RUN.md §3.9 names the components so).

Pieces are ordered by what feeds what within a step: the RNGs and the data position are drawn
from first, the optimizer's lr, step and scaler act on the update, the scheduler steps after it,
and the loss and metrics come out of them. When several differ at the first step that differs,
the earliest in this order is named: the others follow from it more often than they cause it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    """One piece of state: what it is, in words, and what usually makes it differ after a resume."""
    component: str
    what: str
    causes: str


TABLE: tuple[Cause, ...] = (
    Cause("rng.python", "Python's `random` state",
          "something reseeded or drew from it after restore: a `random.seed` (or a `set_seed`) after "
          "`mgr.restore()`, a library that draws from `random` while the loop is set up again"),
    Cause("rng.numpy", "NumPy's global RNG (`np.random`)",
          "something reseeded or drew from it after restore: an `np.random.seed` (or a `set_seed`) after "
          "`mgr.restore()`, an object built after restore whose set-up draws from `np.random`"),
    Cause("rng.torch", "torch's CPU RNG",
          "something reseeded or drew from it after restore: a `torch.manual_seed` (or a `set_seed`) after "
          "`mgr.restore()`; a shuffling DataLoader without state whose iterator is made again mid-epoch "
          "(its new order's seed is drawn from this RNG, where the straight run drew nothing); a module "
          "built after restore (its initialisation draws)"),
    Cause("rng.cuda.I", "the RNG of CUDA device `I`",
          "a `torch.cuda.manual_seed(_all)` (or a `set_seed`) after `mgr.restore()`; a resume on another "
          "number of devices; a CUDA kernel that draws (dropout) run once more or once less at resume"),
    Cause("rng.NAME", "the registered generator `NAME`",
          "something reseeded or drew from it after restore: a loader's iterator made again mid-epoch with "
          "`generator=` this one, a `manual_seed`/`default_rng` on it after restore, or another object given "
          "under this name than the one the loop draws from"),
    Cause("state.NAME", "the state object `NAME` (its `state_dict()`)",
          "its `load_state_dict` does not put back what its `state_dict` gave (a data cursor off by one: "
          "the saved step's batch skipped or read again), the loop moves or resets it after restore, or the "
          "object given to the manager is not the one the loop uses"),
    Cause("update.lr.G", "the learning rate param group `G`'s update used at this step",
          "the lr in `param_groups` when `optimizer.step()` ran differs although the record before agreed: a "
          "scheduler built or loaded after restore (its constructor writes its first lr into `param_groups`, "
          "`load_state_dict` does not write it back), an lr written by hand after restore that the "
          "scheduler's next step then wrote over"),
    Cause("lr.G", "the learning rate of param group `G`",
          "the scheduler was built after `optimizer.load_state_dict` or after `mgr.restore()` (a new scheduler "
          "starts its schedule again and writes its first lr), or is not given to the manager; the lr was set "
          "by hand after restore (a config value or a warm-up written into `param_groups`)"),
    Cause("optimizer.step", "the optimizer's step count",
          "the optimizer's state was reset or rebuilt after restore (`optimizer.state` cleared, a new "
          "optimizer: its moments start again too); a GradScaler not given to the manager (`scaler=`): its "
          "scale starts again at a resume, so it skips other steps for inf gradients than the straight run"),
    Cause("amp.scale", "the GradScaler's scale",
          "the GradScaler's state was not restored (a scaler built after restore, or another one than the "
          "one given to the manager), or an inf/NaN gradient in one run only (then its inputs differ too)"),
    Cause("amp.scaler", "the GradScaler's state (scale, growth tracker)",
          "the GradScaler's state was not restored (a scaler built after restore, or another one than the "
          "one given to the manager), or an inf/NaN gradient in one run only"),
    Cause("scheduler", "the scheduler's state (`state_dict()`)",
          "the scheduler was built again after restore or stepped once more at resume (a `sched.step()` to "
          "catch up), or is another object than the one given to the manager"),
    Cause("undigested", "what the step reads that no digest covers",
          "the loss differs while every digest at this step and the one before is identical, so the weights "
          "the step began from differ: the update before it differed, or the weights or moments were changed "
          "after that record: the optimizer's moments reset (`exp_avg`/`exp_avg_sq` zeroed, or not restored), "
          "a scheduler built or loaded after restore (its constructor writes its first lr into `param_groups`, "
          "`load_state_dict` does not write it back: the update used another lr than the one recorded), the "
          "weights changed after restore, a generator the loop draws from but did not register (`generators=`), "
          "a state object not given (`state=`), an EMA or other copy of the model kept outside the state"),
    Cause("metric.NAME", "the metric `NAME`",
          "it differs while the loss and every digested piece are identical: it is computed from something "
          "outside the checkpoint: an EMA or averaged copy of the model kept outside the state (give it as "
          "`state=`), an evaluation drawn from a generator not registered"),
    Cause("loss", "the loss (the histories record no state digests)",
          "a history without digests says only where the loss parts: compare the generations around that "
          "step, or record digests (`CheckpointManager(digests=True)`, spec/RUN.md §3.9)"),
    Cause("m", "the optimizer's first moments (m, in the generation)",
          "the step's loss and every digested input are identical, so the moments it started from differed: "
          "the optimizer's moments were reset or changed after restore (`exp_avg` zeroed, `optimizer.state` "
          "cleared, a new optimizer), or an optimizer setting no digest covers (betas, eps) changed"),
    Cause("v", "the optimizer's second moments (v, in the generation)",
          "the step's loss and every digested input are identical, so the moments it started from differed: "
          "the optimizer's moments were reset or changed after restore (`exp_avg_sq` zeroed, `optimizer.state` "
          "cleared, a new optimizer), or an optimizer setting no digest covers (betas, eps) changed"),
    Cause("weights", "the weights (in the generation)",
          "the step's loss, moments and digested inputs are identical, so the update itself differed: an "
          "optimizer setting no digest covers (weight decay, `maximize`), gradient clipping, the weights "
          "written after the step (an EMA copied back), or an lr written into `param_groups` after restore "
          "that the scheduler's next step wrote over, or a scheduler built or loaded after restore (its "
          "constructor writes its first lr into `param_groups`, `load_state_dict` does not write it back): the "
          "update used that lr, the record after it shows the scheduler's"),
    Cause("companion", "a buffer or state tensor (the generation's companion file)",
          "a buffer (BatchNorm running statistics) or a state object's tensor updated differently: a module "
          "left in eval or train mode after restore, a buffer reset"),
    Cause("step", "a step recorded by one run only",
          "one run stopped earlier, or a resume skipped or repeated a step (a loop that starts again at the "
          "restored step, or one after the next)"),
)

BEFORE_ANY_RESUME = ("neither run resumed before this step, so this is a difference of the runs, not of a resume: "
                     "a seed, the data, the config or the code differ, an RNG seeded in one run only (or in "
                     "neither, and drawn from), or a metric that measures time (leave it out: `--ignore NAME`)")
KEPT_BEFORE_RESUME = ("step", "loss")      # rows whose causes hold without a resume


def for_step(component: str, resumed: bool) -> tuple[str, str]:
    """``described(component)``, but for a step before which neither run resumed: the causes
    ``BEFORE_ANY_RESUME`` (a row's causes are what goes wrong after restore)."""
    what, said = described(component)
    if resumed or row_of(component).component in KEPT_BEFORE_RESUME:
        return what, said
    return what, BEFORE_ANY_RESUME


_ORDER = ("rng.python", "rng.numpy", "rng.torch", "rng.cuda.I", "rng.NAME", "state.NAME", "lr.G", "update.lr.G",
          "optimizer.step", "amp.scale", "amp.scaler", "scheduler", "undigested", "loss", "metric.NAME",
          "m", "v", "weights", "companion", "step")


PLACES = {"I": r"\d+", "G": r"\d+", "NAME": r".+"}


def _pattern(component: str) -> "re.Pattern[str]":
    """A row's component as a regular expression: its last part, where it is a placeholder, as
    the group ``x`` (``rng.NAME`` takes ``rng.generators.noise`` too)."""
    prefix, _, last = component.rpartition(".")
    if last not in PLACES:
        return re.compile(re.escape(component) + r"\Z")
    return re.compile(re.escape(prefix + ".") + f"(?P<x>{PLACES[last]})" + r"\Z")


_ROWS = [(row, _pattern(row.component)) for row in TABLE]


def _match(component: str) -> "tuple[Cause, str | None]":
    for row, pattern in _ROWS:
        found = pattern.match(component)
        if found:
            return row, found.groupdict().get("x")
    return Cause(component, f"the recorded piece {component}", "not in this version's table of causes (a piece "
                 "a newer writer records)"), None


def row_of(component: str) -> Cause:
    """The row of the table that ``component`` (``rng.torch``, ``state.data``, ``lr.0``) falls
    under: the first that matches, so ``rng.cuda.0`` is a CUDA RNG and ``rng.noise`` a registered
    generator."""
    return _match(component)[0]


def rank(component: str) -> tuple[int, str]:
    """Where ``component`` comes in the order of what feeds what within a step (module docstring)."""
    row = row_of(component).component
    return _ORDER.index(row if row in _ORDER else "scheduler"), component


def described(component: str) -> tuple[str, str]:
    """(what it is, its likely causes) for one component, its name or index put in."""
    row, name = _match(component)
    if row.component == "rng.NAME" and name is not None and name.startswith("generators."):
        name = name[len("generators."):]          # a name that would hide a built-in RNG's (§3.9)
    put = lambda text: text if name is None else _put(text, name)  # noqa: E731
    return put(row.what), put(row.causes)


def _put(text: str, name: str) -> str:
    for place in PLACES:
        text = text.replace(f"`{place}`", f"`{name}`")
    return text
