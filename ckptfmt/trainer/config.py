"""Named training configs. Everything that shapes the trajectory is here (so it is recorded in
every manifest and a changed config is caught on resume); how long to train is not."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigMismatchError

METRICS = ("loss", "loss_ema", "lr", "tokens", "wall")   # what the reference trainer reports each step

SOURCES = ("code", "topics", "docstrings")

# Fields a polish pivot may change (seed: new caps & floors; the issue: a new lr schedule).
POLICY_FIELDS = ("caps", "floors", "sources", "lr", "warmup", "decay_steps", "min_lr_frac", "bandit_temperature")
POLICY_TEXT = "caps, floors, sources, bandit_temperature and the lr schedule (lr, warmup, decay_steps, min_lr_frac)"


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
    check(cfg)
    missing = [s for s in cfg.sources if s not in cfg.caps or s not in cfg.floors]
    if missing:
        raise ValueError(f"sources {missing} need caps and floors")
    if sum(cfg.floors[s] for s in cfg.sources) > 1 + 1e-9 or sum(cfg.caps[s] for s in cfg.sources) < 1 - 1e-9:
        raise ValueError("the sources' floors must sum to at most 1 and their caps to at least 1")   # as Bandit
    return cfg


def for_run(name: str, sets: dict[str, Any] | None = None, seed: int | None = None,
             threads: int | None = None) -> TrainConfig:
    """The config ``ckptfmt train --config NAME --set ... [--seed] [--threads]`` trains with
    (``ValueError`` naming a field it cannot run with): the CLI checks it before the run
    directory exists, the loop builds it."""
    return get(name, **{**(sets or {}), **{k: v for k, v in (("seed", seed), ("threads", threads)) if v is not None}})


INT_MIN = {"ctx": 1, "d_model": 1, "n_layer": 1, "n_head": 1, "batch": 1, "warmup": 0, "decay_steps": 1,
           "corpus_bytes": 1, "seed": 0, "threads": 1}
UNIT = (lambda x: 0 <= x <= 1, "in [0, 1]")
FLOAT_OK = {"dropout": (lambda x: 0 <= x < 1, "in [0, 1)"), "lr": (lambda x: x >= 0, ">= 0"),
            "min_lr_frac": UNIT, "weight_decay": (lambda x: x >= 0, ">= 0"), "eps": (lambda x: x >= 0, ">= 0"),
            "grad_clip": (lambda x: x > 0, "> 0"), "bandit_ema": UNIT,
            "bandit_temperature": (lambda x: x > 0, "> 0")}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check(cfg: TrainConfig) -> None:
    """``ValueError`` naming the first field the trainer cannot run with (a ``--set`` typo would
    otherwise fail deep inside torch or numpy, far from its cause)."""
    for name, low in INT_MIN.items():
        value = getattr(cfg, name)
        if type(value) is not int or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    for name, (ok, text) in FLOAT_OK.items():
        value = getattr(cfg, name)
        if not (_number(value) and ok(value)):
            raise ValueError(f"{name} must be a finite number {text}, got {value!r}")
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"d_model ({cfg.d_model}) must be a multiple of n_head ({cfg.n_head})")
    betas, sources = cfg.betas, cfg.sources
    if not isinstance(betas, tuple) or len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(sources, tuple) or not sources or not all(s in SOURCES for s in sources):
        raise ValueError(f"sources must be a non-empty list of {', '.join(SOURCES)}, got {sources!r}")
    for name in ("caps", "floors"):
        table = getattr(cfg, name)
        if not isinstance(table, dict) or not all(_number(v) and UNIT[0](v) for v in table.values()):
            raise ValueError(f"{name} must map source names to numbers in [0, 1], got {table!r}")


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
        hint = "" if pivot or not policy_only else f" ({POLICY_TEXT} may change after `ckptfmt pivot RUN`)"
        raise ConfigMismatchError(path, f"config differs from the run's: {detail}{hint}")
