"""Real PettingZoo envs for the PettingZoo tests, small and cheap, made in the workers (module
level functions: pickled by reference), a wrapper that makes a real env fail once, and a
seeded policy that gives actions as dicts (PettingZoo's) and as the vector's arrays."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame, in this process and the workers it starts

import numpy as np
from gymnasium import spaces
from pettingzoo.utils.wrappers import BaseParallelWrapper, BaseWrapper


def pistonball() -> Any:
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.parallel_env(n_pistons=3, max_cycles=12)


def pistonball_aec() -> Any:
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.env(n_pistons=3, max_cycles=12)


def kaz() -> Any:
    """Zombies every other cycle: agents die mid-episode."""
    from pettingzoo.butterfly import knights_archers_zombies_v11

    return knights_archers_zombies_v11.parallel_env(spawn_delay=2, max_zombies=20, max_cycles=150)


def multiwalker() -> Any:
    from pettingzoo.sisl import multiwalker_v9

    return multiwalker_v9.parallel_env(n_walkers=2, max_cycles=25)


def adversary() -> Any:
    """Agents of two kinds with different observation spaces: two groups."""
    from mpe2 import simple_adversary_v3

    return simple_adversary_v3.parallel_env(max_cycles=8)


def spread() -> Any:
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env(N=3, max_cycles=40)


def tictactoe() -> Any:
    from pettingzoo.classic import tictactoe_v3

    return tictactoe_v3.env()


class EveryStepReward(BaseWrapper):
    """A real turn-based game that rewards every agent at every step (a shaping bonus), so an
    agent is rewarded while it waits for its turn."""

    @property
    def rewards(self) -> dict:
        return {a: r + 0.25 for a, r in self.env.rewards.items()}


def tictactoe_shaped() -> Any:
    from pettingzoo.classic import tictactoe_v3

    return EveryStepReward(tictactoe_v3.env())


def strike(marker: str) -> bool:
    """True the first time only, across processes (a restarted env does not fail again)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


class FailingOnce(BaseParallelWrapper):
    """A real env that, at its ``at``-th step, raises, hangs or kills its process, once."""

    def __init__(self, env: Any, how: str, at: int, marker: str) -> None:
        super().__init__(env)
        self.how, self.at, self.marker, self.steps = how, at, marker, 0

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.steps = 0
        return self.env.reset(seed=seed, options=options)

    def step(self, actions: dict) -> Any:
        self.steps += 1
        if self.steps == self.at and strike(self.marker):
            if self.how == "raise":
                raise RuntimeError("the env blew up mid-episode")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(60)
        return self.env.step(actions)


class Failing:
    """``env_fns[i]``: ``make()``, wrapped in :class:`FailingOnce`."""

    def __init__(self, make: Any, how: str, at: int, marker: str) -> None:
        self.make, self.how, self.at, self.marker = make, how, at, marker

    def __call__(self) -> Any:
        return FailingOnce(self.make(), self.how, self.at, self.marker)


def sample(space: spaces.Space, rng: np.random.Generator, mask: np.ndarray | None = None) -> Any:
    """One action: a legal one where a mask is given."""
    if isinstance(space, spaces.Discrete):
        legal = np.flatnonzero(mask) if mask is not None and mask.any() else np.arange(space.n)
        return int(space.start + rng.choice(legal))
    assert isinstance(space, spaces.Box)
    return rng.uniform(space.low, space.high).astype(space.dtype)


def policy(vec: Any, batch: Any, rng: np.random.Generator, garbage: bool = True) -> tuple[list[dict], Any]:
    """Actions for every active agent of ``batch``: per env a dict, and the same as the vector's
    arrays (one group: an array; several: a dict), with garbage (NaN, -1) in inactive rows."""
    names, n = vec.possible_agents, vec.num_agents
    dicts: list[dict] = []
    for i in range(batch.num_envs):
        acts = {}
        for a in range(n):
            if batch.active[i * n + a]:
                g = next(g for g in batch.groups.values() if names[a] in g.group.agents)
                row = i * g.group.size + g.group.agents.index(names[a])
                mask = g.action_mask[row] if g.action_mask is not None else None
                acts[names[a]] = sample(g.group.action_space, rng, mask)
        dicts.append(acts)
    arrays = {}
    for name, g in batch.groups.items():
        space = g.group.action_space
        dtype = np.dtype(space.dtype if isinstance(space, spaces.Box) else np.int64)
        block = np.full((batch.num_envs * g.group.size, *space.shape), np.nan if garbage and dtype.kind == "f" else 0,
                        dtype)
        if garbage and dtype.kind != "f":
            block[:] = -1
        for i, acts in enumerate(dicts):
            for j, agent in enumerate(g.group.agents):
                if agent in acts:
                    block[i * g.group.size + j] = acts[agent]
        arrays[name] = block
    return dicts, (next(iter(arrays.values())) if len(arrays) == 1 else arrays)


class KeepsAgentsListed(BaseParallelWrapper):
    """A real env that leaves done agents in ``agents`` (some third-party envs do)."""

    @property
    def agents(self) -> list:
        return list(self.env.possible_agents)


def spread_keeping_agents() -> Any:
    from mpe2 import simple_spread_v3

    return KeepsAgentsListed(simple_spread_v3.parallel_env(N=3, max_cycles=3))


class MaskInInfo(BaseParallelWrapper):
    """A real env that gives action masks in its infos (``info["action_mask"]``), and a note."""

    MASK = np.array([1, 0, 1, 0, 1], np.int8)

    def _with_masks(self, infos: dict) -> dict:
        return {a: {**infos.get(a, {}), "action_mask": self.MASK, "note": a} for a in self.env.agents}

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        obs, infos = self.env.reset(seed=seed, options=options)
        return obs, self._with_masks(infos)

    def step(self, actions: dict) -> Any:
        obs, rew, term, trunc, infos = self.env.step(actions)
        return obs, rew, term, trunc, self._with_masks(infos)


def spread_mask_in_info() -> Any:
    from mpe2 import simple_spread_v3

    return MaskInInfo(simple_spread_v3.parallel_env(N=3, max_cycles=5))
