"""Where two runs' canonical histories part, and what differs in the records there (spec/RUN.md §6.4-§6.5).

A step record holds what the step put out (its loss and the loop's metrics) and, from a writer
that digests them, ``state``: the state after the step, piece by piece (spec/RUN.md §3.1). Two
runs of one loop that resume bit-exactly write equal records for every step but for the record's
clock (``time``, and the reference trainer's ``wall``), so the first step whose records differ
in anything else is where they part. Both histories are walked side by side, holding one record
of each (spec/RUN.md §3.6).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import causes

CLOCK = ("time", "wall")                 # a record's clock: differs between any two runs
NOT_OUTPUTS = ("step", "state", *CLOCK)

Record = dict[str, Any]


@dataclass
class Parting:
    """The first step at which two histories differ (None: they agree), each run's record of it
    (None: that run has no record of the step), and the number of steps of each."""
    step: int | None = None
    a: Record | None = None
    b: Record | None = None
    lengths: list[int] = field(default_factory=lambda: [0, 0])
    watched: tuple[Record | None, Record | None] = (None, None)


def walk(a: Iterable[Record], b: Iterable[Record], same: Callable[[Record, Record], bool],
         watch: int | None = None) -> Parting:
    """The first step at which two canonical histories (records in step order) differ: a step
    that only one of them has, or one whose records ``same`` does not take as equal. Both are
    walked to their end, holding one record of each; the two records of step ``watch`` are kept."""
    ia, ib = iter(a), iter(b)
    ra, rb = next(ia, None), next(ib, None)
    out, na, nb, watched = Parting(), 0, 0, (None, None)
    while ra is not None and rb is not None:
        sa, sb = ra["step"], rb["step"]
        if watch in (sa, sb):
            watched = (ra if sa == watch else watched[0], rb if sb == watch else watched[1])
        if out.step is None and (sa != sb or not same(ra, rb)):
            out = Parting(min(sa, sb), ra if sa <= sb else None, rb if sb <= sa else None)
        na, nb = na + (sa <= sb), nb + (sb <= sa)
        ra, rb = (next(ia, None) if sa <= sb else ra), (next(ib, None) if sb <= sa else rb)
    rest = ra if ra is not None else rb
    if rest is not None and out.step is None:
        out = Parting(rest["step"], ra, rb)
    out.watched = watched
    out.lengths = [na + (0 if ra is None else 1 + sum(1 for _ in ia)), nb + (0 if rb is None else 1 + sum(1 for _ in ib))]
    return out


def same_loss(ra: Record, rb: Record) -> bool:
    """Whether two records of a step hold the same loss (a record without one has None; a NaN
    read back as a literal differs from everything)."""
    return not ra.get("loss") != rb.get("loss")


def first_loss_difference(a: Iterable[Record], b: Iterable[Record]) -> tuple[int | None, list[int]]:
    """The first step at which two canonical histories differ in their loss (a step only one
    has differs), and the number of steps of each."""
    parted = walk(a, b, same_loss)
    return parted.step, parted.lengths


def outputs(rec: Record, ignore: Iterable[str] = ()) -> dict[str, Any]:
    """What the step put out, by component name: ``loss``, and ``metric.NAME`` for the rest
    (but the fields in ``ignore``: a metric that measures time)."""
    return {(k if k == "loss" else f"metric.{k}"): v for k, v in rec.items()
            if k not in NOT_OUTPUTS and k not in ignore}


def states(rec: Record) -> dict[str, Any] | None:
    """The record's state digests (None: its writer recorded none)."""
    found = rec.get("state")
    return found if isinstance(found, dict) else None


@dataclass
class Comparison:
    """The components of one step's two records: those that differ and those equal (each in the
    order of ``causes.rank``), those recorded by one run only, and whether both had digests."""
    differ: list[str] = field(default_factory=list)
    equal: list[str] = field(default_factory=list)
    one_only: list[str] = field(default_factory=list)
    digested: bool = False

    def state_differs(self) -> list[str]:
        """The digested components that differ (outputs and the loss left out)."""
        return [c for c in self.differ if c != "loss" and not c.startswith("metric.")]


def compare(ra: Record, rb: Record, ignore: Iterable[str] = ()) -> Comparison:
    """What differs between two records of one step. An output (loss, metric) one of them lacks
    differs; a digest one of them lacks is ``one_only``, not recorded there, never a difference
    (a state object digested every N steps, a piece added at a pivot: spec/RUN.md §3.9); where
    either recorded no digests at all, the digests are not compared. The record fields and
    components in ``ignore`` are left out."""
    out = Comparison()
    oa, ob = outputs(ra, ignore), outputs(rb, ignore)
    for name in set(oa) | set(ob):
        (out.differ if oa.get(name) != ob.get(name) else out.equal).append(name)
    sa, sb = states(ra), states(rb)
    if sa is not None and sb is not None:
        out.digested = True
        for name in (set(sa) | set(sb)) - set(ignore):
            if name not in sa or name not in sb:
                out.one_only.append(name)
            else:
                (out.differ if sa[name] != sb[name] else out.equal).append(name)
    for names in (out.differ, out.equal, out.one_only):
        names.sort(key=causes.rank)
    return out


def from_start(ra: Record, rb: Record, ignore: Iterable[str] = ()) -> list[str]:
    """The digests that differ in two runs' first common record while its loss agrees: an RNG
    neither run seeds nor draws from (NumPy's or Python's global one, seeded from the OS in each
    process) differs from the first record on, a difference of the runs, not of a resume
    (spec/RUN.md §3.9, §6.5). Decided on the loss alone: a metric that measures time differs in
    any two runs and says nothing of the state. One rule for ``bisect`` and ``verify-resume``."""
    return compare(ra, rb, ignore).state_differs() if same_loss(ra, rb) else []


class Records:
    """How ``bisect`` compares two histories' records of a step: in everything but their clock
    and the fields or components in ``ignore``, and but the digests ``from_start`` finds in the
    runs' first common record (left out from there on)."""

    def __init__(self, ignore: Iterable[str] = ()):
        self.ignore = frozenset(ignore)
        self.from_start: list[str] | None = None        # decided at the first common record

    def compare(self, ra: Record, rb: Record) -> Comparison:
        """``compare`` of the two records, leaving out what this comparison leaves out."""
        return compare(ra, rb, self.ignore | set(self.from_start or ()))

    def same(self, ra: Record, rb: Record) -> bool:
        """Whether two records of a step agree (the walk's ``same``)."""
        found = self.compare(ra, rb)
        if self.from_start is None:
            self.from_start = from_start(ra, rb, self.ignore)
            found = self.compare(ra, rb)
        return not found.differ
