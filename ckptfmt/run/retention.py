"""Retention policy (spec/RUN.md §5): one immutable ``Policy`` and one pure ``plan``; deleting is
``Run.gc``'s separate step, and the guards (newest valid, newest finite, pins, leases) hold
whatever the rules say.

>>> plan(Policy(keep_last=2, keep_every=200), [Candidate(s) for s in (100, 200, 300, 400, 500)]).doomed
[100, 300]
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, Iterable, Mapping, TypeVar

__all__ = ["Candidate", "Guards", "Plan", "Policy", "candidate", "candidate_for", "find_guards", "guarded",
           "ordering", "parse_duration", "plan", "plan_retention"]

G = TypeVar("G")

DURATION = re.compile(r"([1-9][0-9]*)([smhd])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MODES = ("min", "max")
FIELDS = ("keep_last", "keep_every", "keep_best", "metric", "keep_within", "keep_interval", "keep_all")   # as recorded
RULES = ("keep_last", "keep_every", "keep_best", "keep_within", "keep_interval")
NO_RULE = ("a retention policy needs a keep rule (keep_last, keep_every, keep_best with metric, keep_within, "
           "keep_interval); Policy.KEEP_ALL keeps every generation")


def parse_duration(text: str) -> int:
    """Seconds of a duration: a positive whole number and one unit, ``s``, ``m``, ``h`` or ``d``.

    Examples:
        >>> parse_duration("90s"), parse_duration("30m"), parse_duration("6h"), parse_duration("2d")
        (90, 1800, 21600, 172800)
    """
    match = DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not a duration: {text!r} (a whole number and a unit: 90s, 30m, 6h, 2d)")
    return int(match.group(1)) * UNIT_S[match.group(2)]


@dataclass(frozen=True)
class Policy:
    """What to keep; a generation is kept if ANY rule keeps it. ``keep_best`` K by ``metric``
    (``mode`` min or max; NaN and inf are never best; generations without the metric are kept
    while ``keep_missing``); ``keep_within`` and ``keep_interval`` in seconds of commit time, or
    a duration (``"6h"``, ``parse_duration``); ``None`` turns a rule off. A policy has at least
    one rule (the guards alone are never a policy, spec/RUN.md §5.1): ``Policy()`` is a
    ``ValueError``, and ``Policy.KEEP_ALL`` (``keep_all=True``, no other rule) is the explicit
    value that keeps every generation.

    Examples:
        >>> Policy(keep_last=2, keep_interval="1h").keep_interval
        3600
        >>> plan(Policy.KEEP_ALL, [Candidate(1), Candidate(2)]).doomed
        []
    """

    KEEP_ALL: ClassVar["Policy"]

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    keep_missing: bool = True
    keep_within: int | str | None = None      # seconds once made
    keep_interval: int | str | None = None
    keep_all: bool = False

    def __post_init__(self) -> None:
        for name in ("keep_within", "keep_interval"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, parse_duration(getattr(self, name)))
        for name in ("keep_last", "keep_every", "keep_best", "keep_within", "keep_interval"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        if (self.keep_best is None) != (self.metric is None):
            raise ValueError("keep_best and metric go together: the best K by which metric")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        ruled = any(getattr(self, name) is not None for name in RULES)
        if self.keep_all is not False and (self.keep_all is not True or ruled):
            raise ValueError("keep_all=True keeps every generation and takes no other rule")
        if not ruled and not self.keep_all:
            raise ValueError(NO_RULE)

    @classmethod
    def by_count(cls, keep_last: int | None, keep_every: int | None = None) -> "Policy":
        """The policy of the step-only arguments of the manager, the trainer and ``mirror``
        (``keep_every`` 0 or None: off)."""
        return cls(keep_last=keep_last, keep_every=keep_every or None)

    def to_json(self) -> dict[str, Any]:
        """The rules that are on, as the run's policy sidecar records them (spec/RUN.md §5.6)."""
        doc = {name: getattr(self, name) for name in FIELDS if getattr(self, name) not in (None, False)}
        if self.keep_best is not None:
            doc.update(mode=self.mode, keep_missing=self.keep_missing)
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> "Policy":
        """The policy ``to_json`` wrote; ``ValueError`` for what is not one."""
        if not isinstance(doc, dict) or set(doc) - set(FIELDS) - {"mode", "keep_missing"}:
            raise ValueError(f"not a retention policy: {doc!r}")
        try:
            return cls(**doc)
        except TypeError as exc:
            raise ValueError(f"not a retention policy: {exc}") from None

    @property
    def needs_manifests(self) -> bool:
        """Whether the rules read what manifests record (metrics, commit times)."""
        return any(v is not None for v in (self.keep_best, self.keep_within, self.keep_interval))


Policy.KEEP_ALL = Policy(keep_all=True)


@dataclass(frozen=True)
class Candidate:
    """What retention knows of one committed generation: its step, the metrics its manifest
    recorded (name -> float; NaN and inf included) and its commit time (``None``: not recorded).

    Examples:
        >>> from ckptfmt.run import Candidate, Policy, plan
        >>> seen = [Candidate(10, {"val_loss": 0.5}), Candidate(20, {"val_loss": 0.3}), Candidate(30, {"val_loss": 0.4})]
        >>> plan(Policy(keep_best=1, metric="val_loss"), seen).kept
        {20: ['best val_loss']}
    """

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    committed_at: float | None = None


@dataclass(frozen=True)
class Plan:
    """``kept``: step -> the rules and guards that keep it; ``doomed``: the other steps, in order."""

    kept: dict[int, list[str]]
    doomed: list[int]


def plan(policy: Policy, generations: Iterable[Candidate], *, pinned: Iterable[int] = (),
         protect: Mapping[int, str] | None = None) -> Plan:
    """The pure policy: each generation kept by any rule, by a pin or by a guard (``protect``:
    step -> why, e.g. the newest valid), with the reasons; the rest doomed.

    Examples:
        >>> from ckptfmt.run import Candidate, Policy, plan
        >>> seen = [Candidate(10, {"loss": 0.5}), Candidate(20, {"loss": 0.3}), Candidate(30, {"loss": 0.4})]
        >>> plan(Policy(keep_last=1, keep_best=1, metric="loss"), seen, pinned=[10])
        Plan(kept={10: ['pinned'], 20: ['best loss'], 30: ['last']}, doomed=[])
    """
    gens = sorted({g.step: g for g in generations}.values(), key=lambda g: g.step)
    kept: dict[int, list[str]] = {g.step: [] for g in gens}
    pins = set(pinned)
    for step, reason in _reasons(policy, gens):
        kept[step].append(reason)
    for g in gens:
        if g.step in pins:
            kept[g.step].append("pinned")
        if protect and g.step in protect:
            kept[g.step].append(protect[g.step])
    return Plan({s: r for s, r in kept.items() if r}, [s for s, r in kept.items() if not r])


@dataclass
class Guards(Generic[G]):
    """What ``find_guards`` found, newest first: ``finite`` the newest valid generation whose
    recorded values are finite (what a restore takes; None: none), ``diverged`` the newer valid
    ones that are not (``non_finite[step]`` says what), ``invalid`` (generation, why) for each
    one that failed its check on the way."""

    finite: G | None = None
    diverged: list[G] = field(default_factory=list)
    non_finite: dict[int, Any] = field(default_factory=dict)
    invalid: list[tuple[G, str]] = field(default_factory=list)
    step: Callable[[G], int] = field(default=lambda g: g.step, repr=False)

    @property
    def valid(self) -> G | None:
        """The newest valid generation, diverged or not (never to be deleted)."""
        return self.diverged[0] if self.diverged else self.finite

    @property
    def newest_valid(self) -> int | None:
        return None if self.valid is None else self.step(self.valid)

    @property
    def newest_finite(self) -> int | None:
        return None if self.finite is None else self.step(self.finite)


def find_guards(newest_first: Iterable[G], *, check: Callable[[G], str | None],
                non_finite: Callable[[G], Any], step: Callable[[G], int] = lambda g: g.step) -> Guards[G]:
    """The guards of retention (spec/RUN.md §5.2, §5.4), found one way for every store and caller:
    walk the generations newest first, each one ``check``ed (None, or why it is not valid: the
    caller's verification, spec/RUN.md §5.2 says which), until one is valid and not
    ``non_finite`` (its recorded NaN/inf counts: empty or 0 is finite). That one is the newest
    finite; the first valid one is the newest valid. Nothing older is checked.

    >>> g = find_guards([3, 2, 1], check=lambda s: "torn" if s == 3 else None, non_finite=lambda s: s == 2,
    ...                 step=int)
    >>> g.newest_valid, g.newest_finite, g.invalid
    (2, 1, [(3, 'torn')])
    """
    out: Guards[G] = Guards(step=step)
    for gen in newest_first:
        why = check(gen)
        if why is not None:
            out.invalid.append((gen, why))
            continue
        bad = non_finite(gen)
        if not bad:
            out.finite = gen
            break
        out.diverged.append(gen)
        out.non_finite[step(gen)] = bad
    return out


def guarded(policy: Policy, generations: Iterable[Candidate], guards: Guards | None, *,
            pinned: Iterable[int] = (), also: Mapping[int, str] | None = None) -> Plan:
    """``plan`` under the guards (spec/RUN.md §5.2, §5.4), built one way for every caller (a run
    on a directory or a store, a mirror's destination, Lightning's and Hugging Face's checkpoint
    directories, the RAM tier): ``also`` (step -> why: a caller's own, e.g. the Trainer's best),
    then the newest valid generation and the newest finite one of ``guards`` (``find_guards``:
    one step, ``newest valid``, where they are the same; None: the caller verifies nothing,
    the RAM tier, whose rule alone keeps its newest), and the pins.

    >>> guards = find_guards([3, 2, 1], check=lambda s: None, non_finite=lambda s: s == 3, step=int)
    >>> guarded(Policy(keep_last=1), [Candidate(s) for s in (1, 2, 3)], guards).doomed
    [1]
    """
    protect = dict(also or {})
    found = (guards.newest_valid, guards.newest_finite) if guards is not None else (None, None)
    for step, why in zip(found, ("newest valid", "newest finite")):
        if step is not None:
            protect.setdefault(step, why)
    return plan(policy, generations, pinned=pinned, protect=protect)


def _reasons(policy: Policy, gens: list[Candidate]) -> Iterable[tuple[int, str]]:
    """(step, rule) for every rule of ``policy`` that keeps a generation of ``gens`` (in step order)."""
    if policy.keep_all:
        yield from ((g.step, "keep all") for g in gens)
    if policy.keep_last:
        yield from ((g.step, "last") for g in gens[-policy.keep_last:])
    if policy.keep_every:
        yield from ((g.step, "every") for g in gens if g.step % policy.keep_every == 0)
    if policy.keep_best:
        yield from _best(policy, gens)
    if policy.keep_within or policy.keep_interval:
        yield from _by_time(policy, gens)


def ordering(mode: str) -> int:
    """1 when the smallest value is best (``min``), -1 when the largest is (``max``): a value
    ``a`` is better than ``b`` when ``ordering(mode) * a < ordering(mode) * b``. NaN and inf are
    never best; callers leave them out first."""
    return 1 if mode == "min" else -1


def _best(policy: Policy, gens: list[Candidate]) -> Iterable[tuple[int, str]]:
    """The best ``keep_best`` finite values of ``metric`` (ties: the newer first); generations
    without the metric while ``keep_missing``."""
    metric = policy.metric
    finite = [g for g in gens if metric in g.metrics and math.isfinite(g.metrics[metric])]
    sign = ordering(policy.mode)
    ranked = sorted(finite, key=lambda g: (sign * g.metrics[metric], -g.step))
    yield from ((g.step, f"best {metric}") for g in ranked[:policy.keep_best])
    if policy.keep_missing:
        yield from ((g.step, f"no {metric}") for g in gens if metric not in g.metrics)


def _by_time(policy: Policy, gens: list[Candidate]) -> Iterable[tuple[int, str]]:
    """``keep_within`` of the newest commit time and the first generation of each
    ``keep_interval`` bucket (counted from the epoch); a generation without a commit time is
    kept (the safe rule: its age is unknown)."""
    timed = [g for g in gens if g.committed_at is not None]
    yield from ((g.step, "no commit time") for g in gens if g.committed_at is None)
    if policy.keep_within and timed:
        newest = max(g.committed_at for g in timed)
        yield from ((g.step, "within") for g in timed if g.committed_at >= newest - policy.keep_within)
    if policy.keep_interval:
        first: dict[int, Candidate] = {}
        for g in sorted(timed, key=lambda g: (g.committed_at, g.step)):
            first.setdefault(math.floor(g.committed_at / policy.keep_interval), g)
        yield from ((g.step, "interval") for g in sorted(first.values(), key=lambda g: g.step))


def candidate(step: int, manifest: Mapping[str, Any] | None) -> Candidate:
    """The ``Candidate`` of a generation from its manifest (spec/FORMAT.md §4: ``metrics`` and
    ``created``); a manifest without them (``convert``, ``ckptfmt.save``, older files) gives a
    generation with no metrics and no commit time."""
    doc = manifest or {}
    metrics = doc.get("metrics")
    values = {name: _number(entry.get("value")) for name, entry in metrics.items()
              if isinstance(entry, dict)} if isinstance(metrics, dict) else {}
    created = _number(doc.get("created"))
    return Candidate(step, {k: v for k, v in values.items() if v is not None},
                     created if created is not None and math.isfinite(created) else None)


def candidate_for(policy: Policy, step: int, manifest: Callable[[], Mapping[str, Any] | None]) -> Candidate:
    """The ``Candidate`` of ``step`` for ``policy``: with its manifest's metrics and commit time
    (``manifest()``, read only then) where a rule reads them, else the step alone."""
    return candidate(step, manifest()) if policy.needs_manifests else Candidate(step)


def _number(value: Any) -> float | None:
    """A manifest number as a float (``{"__float__": "nan"}`` included), else None."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        try:
            return float(value["__float__"])
        except (TypeError, ValueError):
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def plan_retention(steps: Iterable[int], *, keep_last: int, keep_every: int | None = None,
                   pinned: Iterable[int] = (), protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete under the last ``keep_last`` and every ``keep_every``-th step, pins and
    protected steps: ``plan`` of that ``Policy`` (kept for callers of the step-only form).

    Examples:
        >>> plan_retention([100, 200, 300, 400, 500], keep_last=2, keep_every=200)
        [100, 300]
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    return plan(Policy.by_count(keep_last, keep_every), [Candidate(s) for s in steps], pinned=pinned,
                protect={s: "protected" for s in protect}).doomed
