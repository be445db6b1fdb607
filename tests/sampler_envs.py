"""Envs and a numpy policy shared by the sampler tests."""

from __future__ import annotations

import os
import signal
import sys
import time

import gymnasium as gym
import numpy as np
import pytest


class KindEnv(gym.Env):
    """Episodes of 5 or 50 steps, the kind drawn from the env's RNG at reset (so by seed).
    Observation ``[t, length, bonus]``; reward ``1 + bonus``; ``bonus`` is set by env updates."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, crash_marker: str | None = None, crash_at: int = 0, crash: str = "exit", step_s: float = 0.0,
                 hang_at: int = 0) -> None:
        self.step_s, self.hang_at = step_s, hang_at  # each step sleeps step_s; step hang_at (total) sleeps a minute
        self.bonus = 0.0
        self.t = 0
        self.length = 0
        self.total = 0
        self.crash_marker, self.crash_at, self.crash = crash_marker, crash_at, crash

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.length, self.bonus], dtype=np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.length = 5 if self.np_random.random() < 0.5 else 50
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        self.total += 1
        if self.step_s or self.total == self.hang_at:
            time.sleep(60.0 if self.total == self.hang_at else self.step_s)
        if self.crash_marker and self.total == self.crash_at and not os.path.exists(self.crash_marker):
            open(self.crash_marker, "w").close()
            if self.crash == "raise":
                raise RuntimeError("env blew up")
            if self.crash == "sys_exit":  # a pygame-style "window closed"
                sys.exit(4)
            if self.crash == "interrupt":
                raise KeyboardInterrupt
            if self.crash == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        return self._obs(), 1.0 + self.bonus, self.t >= self.length, False, {"t": self.t}


def kind_env(worker_id: int) -> KindEnv:
    return KindEnv()


def true_lengths(seed: int, slot: int, k: int) -> list[int]:
    """The lengths of a slot's first ``k`` episodes: first reset seeded ``seed + slot``."""
    env = KindEnv()
    env.reset(seed=seed + slot)
    lengths = [env.length]
    for _ in range(k - 1):
        env.reset()
        lengths.append(env.length)
    return lengths


class RandomPolicy:
    """A numpy policy: random actions, with a log-prob agent info and settable parameters."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.params = 0
        self.calls: list[np.ndarray] = []

    def get_actions(self, observations, worker_ids):
        assert observations.shape == (len(worker_ids), 3)
        self.calls.append(np.array(worker_ids))
        actions = self.rng.integers(0, 2, len(worker_ids))
        return actions, {"logp": np.full(len(worker_ids), np.log(0.5)), "params": np.full(len(worker_ids), self.params)}

    def set_param_values(self, params) -> None:
        self.params = params


def set_bonus(value):
    def update(env):
        env.unwrapped.bonus = value
    return update


def add_bonus(value):
    """An env update that adds to the bonus: one applied twice shows in the env's state."""
    def update(env):
        env.unwrapped.bonus += value
    return update


def recorded_kind_env(worker_id: int) -> gym.Env:
    """A ``KindEnv`` under gymnasium's ``RecordEpisodeStatistics``: ``info["episode"]`` on an
    episode's last step only (``info["t"]`` on every step)."""
    return gym.wrappers.RecordEpisodeStatistics(KindEnv())


def check_episode_infos(batch) -> int:
    """Every row that ends an episode carries its ``episode`` info, with the episode's length
    and return (those of its rows, when the batch has them all); every other row ``None``;
    ``t`` stays an int column. Returns how many episodes ended in the batch."""
    assert batch.env_infos["t"].dtype.kind == "i"
    assert (batch.env_infos["t"] == batch.next_observations[:, 0]).all()
    episode = batch.env_infos["episode"]
    assert episode.dtype == object and len(episode) == len(batch)
    for i in range(len(batch)):
        if not batch.dones[i]:
            assert episode[i] is None, i
            continue
        rows = np.flatnonzero(batch.episode_ids == batch.episode_ids[i])
        assert episode[i]["l"] == batch.env_infos["t"][i]
        if batch.observations[rows[0], 0] == 0:  # the batch has the whole episode
            assert len(rows) == episode[i]["l"]
            assert episode[i]["r"] == pytest.approx(batch.rewards[rows].sum())
    return int(batch.dones.sum())
