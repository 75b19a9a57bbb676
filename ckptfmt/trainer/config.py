"""Named training configs. Everything that shapes the trajectory is here (so it is recorded in
every manifest and a changed config is caught on resume); how long to train is not."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigMismatchError

SOURCES = ("code", "topics", "docstrings")

# Fields a polish pivot may change (seed: new caps & floors; the issue: a new lr schedule).
POLICY_FIELDS = ("caps", "floors", "sources", "lr", "warmup", "decay_steps", "min_lr_frac", "bandit_temperature")


@dataclass(frozen=True)
class TrainConfig:
    name: str
    ctx: int
    d_model: int
    n_layer: int
    n_head: int
    batch: int
    dropout: float = 0.1
    lr: float = 3e-3
    warmup: int = 20
    decay_steps: int = 2000
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)   # seed: beta1 0.9, beta2 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    sources: tuple[str, ...] = SOURCES
    caps: dict[str, float] = field(default_factory=lambda: {s: 0.7 for s in SOURCES})
    floors: dict[str, float] = field(default_factory=lambda: {s: 0.1 for s in SOURCES})
    bandit_ema: float = 0.9
    bandit_temperature: float = 0.05
    corpus_bytes: int = 1 << 21
    seed: int = 0
    threads: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"], d["sources"] = list(self.betas), list(self.sources)
        return d

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


CONFIGS = {
    "tiny": TrainConfig("tiny", ctx=64, d_model=64, n_layer=2, n_head=2, batch=8, corpus_bytes=1 << 19),
    "andrea-12m": TrainConfig("andrea-12m", ctx=512, d_model=384, n_layer=7, n_head=6, batch=4,
                              lr=6e-4, warmup=200, decay_steps=200_000),
    "andrea-120m": TrainConfig("andrea-120m", ctx=1024, d_model=768, n_layer=17, n_head=12, batch=4,
                               lr=3e-4, warmup=2000, decay_steps=200_000),
}


def get(name: str, **overrides: Any) -> TrainConfig:
    if name not in CONFIGS:
        raise KeyError(f"unknown config {name!r}: choose one of {', '.join(CONFIGS)}")
    cfg = CONFIGS[name].replace(**{k: v for k, v in overrides.items() if v is not None})
    missing = [s for s in cfg.sources if s not in cfg.caps or s not in cfg.floors]
    if missing:
        raise ValueError(f"sources {missing} need caps and floors")
    return cfg


def parse_sets(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (VALUE as JSON, else a string) for fields of TrainConfig."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in names or key == "name":
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(names - {'name'}))}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key] = tuple(value) if key in ("betas", "sources") and isinstance(value, list) else value
    return out


def check(name: str, overrides: dict[str, Any]) -> TrainConfig:
    """The config ``--set`` asks for, refused in one line (``ValueError``) before anything runs
    when a value has the wrong type or cannot work (caps and floors must name every source).

    >>> check("tiny", {"caps": {"code": 0.5}})
    Traceback (most recent call last):
    ValueError: --set: sources ['topics', 'docstrings'] need caps and floors
    >>> check("tiny", {"lr": "fast"})
    Traceback (most recent call last):
    ValueError: --set lr: expected a positive number, got 'fast'
    """
    for key, value in overrides.items():
        problem = _type_problem(key, value, getattr(CONFIGS[name], key))
        if problem:
            raise ValueError(f"--set {key}: {problem}, got {value!r}")
    try:
        cfg = get(name, **overrides)
    except ValueError as exc:
        raise ValueError(f"--set: {exc}") from None
    if not set(cfg.sources) <= set(SOURCES) or not cfg.sources:
        raise ValueError(f"--set sources: each one of {', '.join(SOURCES)}, got {list(cfg.sources)!r}")
    if sum(cfg.floors[s] for s in cfg.sources) > 1 + 1e-9 or sum(cfg.caps[s] for s in cfg.sources) < 1 - 1e-9:
        raise ValueError("--set: the floors must sum to at most 1 and the caps to at least 1")
    return cfg


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _type_problem(key: str, value: Any, default: Any) -> str | None:
    """Why ``value`` cannot stand for a field whose default is ``default`` (None: it can)."""
    if isinstance(default, int) and not isinstance(default, bool):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= (0 if key in ("seed", "warmup") else 1)
        return None if ok else "expected a " + ("non-negative" if key in ("seed", "warmup") else "positive") + " integer"
    if isinstance(default, float):
        positive = key in ("lr", "eps")
        ok = _number(value) and (value > 0 if positive else value >= 0)
        return None if ok else "expected a " + ("positive" if positive else "non-negative") + " number"
    if key == "betas":
        ok = isinstance(value, tuple) and len(value) == 2 and all(_number(b) for b in value)
        return None if ok else "expected two numbers"
    if key == "sources":
        return None if isinstance(value, tuple) and all(isinstance(s, str) for s in value) else "expected a list of source names"
    if isinstance(default, dict):
        ok = isinstance(value, dict) and all(_number(v) for v in value.values())
        return None if ok else "expected an object of numbers by source"
    return None


def from_dict(d: dict[str, Any]) -> TrainConfig:
    d = dict(d)
    d["betas"], d["sources"] = tuple(d["betas"]), tuple(d["sources"])
    return TrainConfig(**d)


def check_compatible(path: str, stored: dict[str, Any], wanted: TrainConfig, *, pivot: bool) -> None:
    """Refuse a resume under a different config, except policy fields at a pivot."""
    new = wanted.to_dict()
    changed = sorted(k for k in set(stored) | set(new) if stored.get(k) != new.get(k))
    forbidden = [k for k in changed if not (pivot and k in POLICY_FIELDS)]
    if forbidden:
        detail = ", ".join(f"{k}: run has {stored.get(k)!r}, asked {new.get(k)!r}" for k in forbidden)
        policy_only = all(k in POLICY_FIELDS for k in forbidden)     # then a pivot would allow it
        hint = ("" if pivot or not policy_only else " (caps, floors and the lr schedule may change after "
                "`ckptfmt pivot RUN`)")
        raise ConfigMismatchError(path, f"config differs from the run's: {detail}{hint}")
