"""Envs as people write them, for the sloppy-returns conformance tests (``test_sloppy_returns.py``).

``ReplayEnv`` returns, call by call, what its script says: observations, rewards, flags and
infos of whatever Python or numpy type and shape the test generated. A script is a table with
one entry per env slot (``load(table)``, through ``call`` / ``env_method``, so one vector env
serves many generated examples); each env replays its own row. Everything it returns is a deep
copy: SB3's worker writes into the info dict it gets.

``RefusesParent`` cannot be built in the process that made the vector env (it stands for an env
that needs a GPU context, a licence server or a simulator only the workers have).

Top-level classes only, so workers import them under every start method.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

#: The observation spaces the generated cases run on, by name.
OBS_KINDS = ("box", "box_uint8", "discrete", "multibinary", "dict", "tuple")


def obs_space(kind: str) -> spaces.Space:
    if kind == "box":
        return spaces.Box(-10.0, 10.0, (3,), np.float32)
    if kind == "box_uint8":
        return spaces.Box(0, 255, (2, 2), np.uint8)
    if kind == "discrete":
        return spaces.Discrete(5)
    if kind == "multibinary":
        return spaces.MultiBinary(3)
    if kind == "dict":
        return spaces.Dict({"a": spaces.Box(-1.0, 1.0, (2,), np.float32), "k": spaces.Discrete(3)})
    if kind == "tuple":
        return spaces.Tuple((spaces.Box(-1.0, 1.0, (2,), np.float64), spaces.Discrete(3)))
    raise ValueError(kind)


class ReplayEnv(gym.Env):
    """Replays ``table[slot]``: ``{"reset": (obs, info), "steps": [(obs, reward, terminated,
    truncated, info), ...]}`` (and ``"delay"``: seconds its episode's first step takes); a reset
    starts the steps again from the first."""

    metadata = {"render_modes": []}

    def __init__(self, slot: int, obs_kind: str = "box") -> None:
        self.slot = slot
        self.observation_space = obs_space(obs_kind)
        self.action_space = spaces.Discrete(2)
        self._script: dict[str, Any] | None = None
        self._t = 0

    def load(self, table: list[dict[str, Any]]) -> None:
        """Take this slot's row of ``table``; the next reset replays it from the start."""
        self._script = table[self.slot]
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        if self._script is None:
            return self.observation_space.sample(), {}
        return copy.deepcopy(self._script["reset"])

    def step(self, action: Any):
        assert self._script is not None, "load() a script first"
        if self._t == 0 and self._script.get("delay"):  # the first step of its episode takes that long
            time.sleep(self._script["delay"])
        steps = self._script["steps"]
        out = steps[self._t % len(steps)]
        self._t += 1
        return copy.deepcopy(out)


class RefusesParent(gym.Env):
    """An env that raises when built in the process ``parent_pid`` (the test's), as an env that
    needs what only the workers have; otherwise a small deterministic env. With ``log``, each
    construction appends the pid of the process it ran in to that file."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 7}

    def __init__(self, parent_pid: int, render_mode: str | None = None, log: str | None = None) -> None:
        if log is not None:
            with open(log, "a") as out:
                out.write(f"{os.getpid()}\n")
        if os.getpid() == parent_pid:
            raise RuntimeError(f"RefusesParent cannot be built in the parent process (pid {parent_pid})")
        self.render_mode = render_mode
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(3)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {"built_in": os.getpid()}

    def step(self, action: Any):
        self._t += 1
        obs = np.array([self._t / 10.0, float(action) / 3.0], dtype=np.float32)
        return obs, float(action), self._t >= 4, False, {}

    def render(self) -> np.ndarray:
        return np.full((2, 2, 3), self._t, dtype=np.uint8)


class OneElementRewards(gym.Env):
    """Rewards as one-element arrays (``np.array([t])``), episodes of 3 steps."""

    def __init__(self, slot: int = 0) -> None:
        self.observation_space = spaces.Box(-10.0, 10.0, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action: Any):
        self._t += 1
        return np.full(3, self._t, np.float32), np.array([float(self._t)]), self._t >= 3, False, {}


def unbuildable(message: str) -> gym.Env:
    """An env factory that raises, wherever it runs (a licence server that does not answer)."""
    raise ValueError(message)
