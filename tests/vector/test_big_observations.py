"""Big observations (an Atari-sized frame an env) through ``envmanager.AsyncVectorEnv`` with
``copy=True``: copied out of shared memory as each process answers, not all after the step.
Checked against ``SyncVectorEnv`` step by step, and that what a step returns is the caller's own."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import envmanager
from envmanager.adapters.gymnasium import COPY_AHEAD_BYTES


class FrameEnv(gym.Env):
    """A 96x96 RGB frame that encodes the env, its step in the episode and the last action."""

    def __init__(self, env_id: int, length: int = 5) -> None:
        self.env_id, self.length, self.t = env_id, length, 0
        self.observation_space = spaces.Box(0, 255, (96, 96, 3), np.uint8)
        self.action_space = spaces.Discrete(4)

    def _frame(self, action: int) -> np.ndarray:
        frame = np.zeros((96, 96, 3), np.uint8)
        frame[..., 0], frame[..., 1], frame[..., 2] = self.env_id, self.t, action
        return frame

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._frame(0), {}

    def step(self, action):
        self.t += 1
        return self._frame(int(action)), float(action), self.t >= self.length, False, {"t": self.t}


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_big_observations_copied_as_they_come_equal_sync(envs_per_worker):
    fns = [functools.partial(FrameEnv, i, 3 + i) for i in range(4)]
    assert np.zeros((96, 96, 3), np.uint8).nbytes >= COPY_AHEAD_BYTES
    ours = envmanager.AsyncVectorEnv(fns, envs_per_worker=envs_per_worker, context="fork")
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        assert ours._copy_ahead
        o1, _ = ours.reset(seed=0)
        o2, _ = sync.reset(seed=0)
        np.testing.assert_array_equal(o1, o2)
        rng = np.random.default_rng(0)
        kept = []
        for _ in range(12):
            actions = rng.integers(0, 4, 4)
            got, want = ours.step(actions), sync.step(actions)
            for a, b in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(a, b)
            assert got[4].keys() == want[4].keys()
            for key in want[4]:
                np.testing.assert_array_equal(got[4][key], want[4][key])
            kept.append((got[0], want[0].copy()))
        for mine, theirs in kept:  # each step's observations are the caller's own: later steps leave them be
            np.testing.assert_array_equal(mine, theirs)
    finally:
        ours.close()
        sync.close()
