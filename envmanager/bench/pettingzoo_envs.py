"""The PettingZoo envs of ``envmanager bench --scenario pettingzoo`` (PettingZoo is imported here
only: the scenarios' factories in ``envmanager.bench.scenarios`` reach this module when called).

* ``spread``: MPE's ``simple_spread_v3`` (package ``mpe2``): 3 agents, observations of 18
  floats, ``Discrete(5)`` actions, episodes of ``SPREAD_CYCLES`` steps -- the cheap env, a few
  hundred microseconds of Python per step.
* ``pistonball``: ``butterfly.pistonball_v6`` as PettingZoo makes it by default: 20 pistons,
  each observing a 457 x 120 RGB frame (3.3 MB of observations per env step), ``Box(-1, 1, (1,))``
  actions -- the costly env (~15 ms per step), the one PettingZoo's SB3 tutorial trains.
* ``burn``: :class:`BurnParallelEnv`, 4 agents whose env burns ``BURN_COST`` of CPU per step
  (as the ``sweep`` and ``pinned`` scenarios' single-agent envs do): a set cost per env step.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

from envmanager.testing.envs import burn_cpu

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame (pistonball), here and in the workers

__all__ = ["BURN_AGENTS", "BURN_COST", "BurnParallelEnv", "SPREAD_CYCLES", "burn", "pistonball", "spread"]

SPREAD_CYCLES = 100
BURN_COST = 200e-6  # seconds of CPU each step of ``burn`` takes
BURN_AGENTS = 4
BURN_CYCLES = 100


def spread(env_id: int) -> Any:
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env(N=3, max_cycles=SPREAD_CYCLES)


def pistonball(env_id: int) -> Any:
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.parallel_env()


def burn(env_id: int) -> BurnParallelEnv:
    return BurnParallelEnv(BURN_COST, BURN_AGENTS, BURN_CYCLES)


class BurnParallelEnv(ParallelEnv):
    """``n_agents`` agents, observations of 8 floats, ``Discrete(3)`` actions; every step burns
    ``cost`` seconds of CPU; every agent is truncated after ``max_cycles`` steps."""

    metadata = {"name": "burn_v0", "is_parallelizable": True}

    def __init__(self, cost: float, n_agents: int = BURN_AGENTS, max_cycles: int = BURN_CYCLES) -> None:
        self.cost, self.max_cycles = cost, max_cycles
        self.possible_agents = [f"agent_{i}" for i in range(n_agents)]
        self.agents: list[str] = []
        self.render_mode = None
        self._observation = spaces.Box(-1.0, 1.0, (8,), np.float32)
        self._action = spaces.Discrete(3)
        self._rng = np.random.default_rng()
        self._state = np.zeros((n_agents, 8), np.float32)
        self._t = 0

    def observation_space(self, agent: str) -> spaces.Box:
        return self._observation

    def action_space(self, agent: str) -> spaces.Discrete:
        return self._action

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._state = self._rng.uniform(-1, 1, self._state.shape).astype(np.float32)
        self._t = 0
        self.agents = list(self.possible_agents)
        return self._observations(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        burn_cpu(self.cost)
        self._t += 1
        moves = np.array([int(actions[a]) - 1 for a in self.possible_agents], np.float32)
        self._state = np.clip(np.roll(self._state, 1, axis=1) * 0.9 + 0.1 * moves[:, None], -1, 1)
        rewards = {a: float(-abs(self._state[i]).mean()) for i, a in enumerate(self.agents)}
        over = self._t >= self.max_cycles
        observations = self._observations()
        flags = dict.fromkeys(self.agents, False)
        truncations = dict.fromkeys(self.agents, over)
        infos: dict[str, dict] = {a: {} for a in self.agents}
        if over:
            self.agents = []
        return observations, rewards, flags, truncations, infos

    def _observations(self) -> dict[str, np.ndarray]:
        return {a: self._state[i].copy() for i, a in enumerate(self.possible_agents)}
