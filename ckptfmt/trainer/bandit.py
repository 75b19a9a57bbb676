"""The curriculum bandit: picks the source of each batch, with per-arm caps and floors on the
sampling share, learning from the loss. Its state lives in ``.state.json`` and the manifest.

Reward of a pull = the arm's previous EMA loss minus this loss (learning progress); shares are
a softmax of EMA rewards, then projected into [floor, cap]. All arithmetic is Python floats,
so the state round-trips through JSON exactly and a resume is bit-identical.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from ..warn import warn


class Bandit:
    def __init__(self, arms: tuple[str, ...], caps: dict[str, float], floors: dict[str, float],
                 *, seed: int, ema: float = 0.9, temperature: float = 0.05, phase: int = 0):
        if sum(floors[a] for a in arms) > 1 + 1e-9 or sum(caps[a] for a in arms) < 1 - 1e-9:
            raise ValueError("floors must sum to at most 1 and caps to at least 1")
        self.arms, self.caps, self.floors = arms, caps, floors
        self.ema, self.temperature = ema, temperature
        self.rng = np.random.Generator(np.random.PCG64([seed, 0xBA4D17]))
        self.stats = {a: {"pulls": 0, "ema_reward": 0.0, "ema_loss": None} for a in arms}
        self.phase, self.phase_steps = phase, 0

    def shares(self) -> list[float]:
        rewards = [self.stats[a]["ema_reward"] / self.temperature for a in self.arms]
        top = max(rewards)
        raw = [math.exp(r - top) for r in rewards]
        total = sum(raw)
        return project([r / total for r in raw], [self.floors[a] for a in self.arms],
                       [self.caps[a] for a in self.arms])

    def pick(self) -> str:
        return self.arms[int(self.rng.choice(len(self.arms), p=self.shares()))]

    def update(self, arm: str, loss: float) -> None:
        st = self.stats[arm]
        reward = 0.0 if st["ema_loss"] is None or not math.isfinite(loss) else st["ema_loss"] - loss
        st["ema_reward"] = self.ema * st["ema_reward"] + (1 - self.ema) * reward
        if math.isfinite(loss):
            st["ema_loss"] = loss if st["ema_loss"] is None else self.ema * st["ema_loss"] + (1 - self.ema) * loss
        st["pulls"] += 1
        self.phase_steps += 1

    def state(self) -> dict[str, Any]:
        """Arm statistics and phase counters; the RNG lives under the manifest's ``rng`` (so a
        resume that skips RNG restore really skips it); ``.state.json`` adds it."""
        return {"arms": {a: dict(s) for a, s in self.stats.items()}, "phase": self.phase,
                "phase_steps": self.phase_steps, "caps": dict(self.caps), "floors": dict(self.floors)}

    def load_state(self, state: dict[str, Any]) -> list[str]:
        """Restore; arms whose source is gone are dropped with a warning (zombie arms)."""
        zombies = sorted(set(state["arms"]) - set(self.arms))
        for arm in zombies:
            warn(f"dropping zombie bandit arm {arm!r}: its data source is not in the config")
        for arm in self.arms:
            if arm in state["arms"]:
                self.stats[arm] = dict(state["arms"][arm])
        self.phase, self.phase_steps = state["phase"], state["phase_steps"]
        return zombies


def project(p: list[float], floors: list[float], caps: list[float]) -> list[float]:
    """Move shares into [floor, cap] while keeping their sum 1 (water-filling, at most n rounds)."""
    p = [min(max(x, lo), hi) for x, lo, hi in zip(p, floors, caps)]
    for _ in range(len(p)):
        gap = 1.0 - sum(p)
        if abs(gap) < 1e-12:
            break
        free = [i for i in range(len(p)) if (gap > 0 and p[i] < caps[i]) or (gap < 0 and p[i] > floors[i])]
        if not free:
            break
        weight = sum(p[i] for i in free) or len(free)
        for i in free:
            share = (p[i] if weight != len(free) else 1.0) / weight
            p[i] = min(max(p[i] + gap * share, floors[i]), caps[i])
    total = sum(p)
    return [x / total for x in p]
