"""Envs for the drop-ins' call-sequence tests (``test_dropin_call_sequences.py``): counters in
the observations, so a test sees which step of which episode it got, and faults that fire once
(a marker file remembers them across processes and restarts)."""
import os
import signal
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class ImgEnv(gym.Env):
    """Big image observation (30 KB): every pixel = 10*env_id + t (mod 256). step_time per env."""
    metadata = {"render_modes": []}

    def __init__(self, env_id=0, step_time=0.0, shape=(100, 100, 3)):
        self.env_id, self.step_time = env_id, step_time
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.action_space = spaces.Discrete(3)
        self.t = 0

    def _obs(self):
        return np.full(self.observation_space.shape, (10 * self.env_id + self.t) % 256, np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        if self.step_time:
            time.sleep(self.step_time)
        self.t += 1
        return self._obs(), float(self.t), False, False, {}


class CountEnv(gym.Env):
    """obs = [env_id, t, episode, total_steps]; fault once (marker file) at total step fault_at.

    fault: None | 'raise' | 'raise_reset' | 'kill' | 'hang'; marker: path created when the fault fires
    (so a rebuilt/restarted env does not fault again); close_s: seconds its close() takes."""

    def __init__(self, env_id=0, step_time=0.0, fault=None, fault_at=1, marker=None, episode_length=10**6,
                 hang_s=30.0, close_s=0.0):
        self.env_id, self.step_time, self.close_s = env_id, step_time, close_s
        self.fault, self.fault_at, self.marker = fault, fault_at, marker
        self.episode_length, self.hang_s = episode_length, hang_s
        self.observation_space = spaces.Box(-1e9, 1e9, (4,), np.float64)
        self.action_space = spaces.Discrete(5)
        self.t = 0
        self.episode = 0
        self.total = 0
        self.resets = 0

    def _obs(self):
        return np.array([self.env_id, self.t, self.episode, self.total], np.float64)

    def _armed(self):
        return self.fault is not None and (self.marker is None or not os.path.exists(self.marker))

    def _fire(self):
        if self.marker is not None:
            open(self.marker, "w").close()
        if self.fault in ("raise", "raise_reset"):
            raise RuntimeError(f"env {self.env_id} fails on purpose")
        if self.fault in ("kill", "kill_reset"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "hang":
            time.sleep(self.hang_s)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets += 1
        if self.fault in ("raise_reset", "kill_reset") and self._armed() and self.resets >= self.fault_at:
            self._fire()
        self.t = 0
        self.episode += 1
        return self._obs(), {"env_id": self.env_id}

    def step(self, action):
        self.total += 1
        if self.fault in ("raise", "kill", "hang") and self._armed() and self.total >= self.fault_at:
            self._fire()
        delay = self.step_time
        if isinstance(delay, (list, tuple)):  # per step of the env's life (the last one repeats)
            delay = delay[min(self.total, len(delay)) - 1]
        if delay:
            time.sleep(delay)
        self.t += 1
        done = self.t >= self.episode_length
        return self._obs(), float(action), done, False, {"t": self.t}

    def close(self):
        time.sleep(self.close_s)  # a simulator taking its time to shut down


class Make:
    """Picklable env_fn: Make(cls_name, **kwargs)()."""

    def __init__(self, cls, **kwargs):
        self.cls, self.kwargs = cls, kwargs

    def __call__(self):
        return globals()[self.cls](**self.kwargs)


try:
    from pettingzoo import ParallelEnv
except ImportError:  # pragma: no cover
    ParallelEnv = object


class PZEnv(ParallelEnv):
    """Two agents a, b; obs per agent [env_id, t, episode, total]; episode of `episode_length`
    steps; fault once (marker) in step at total step fault_at: raise / kill / hang; close_s:
    seconds its close() takes."""
    metadata = {"name": "pz_h", "render_modes": []}

    def __init__(self, env_id=0, step_time=0.0, fault=None, fault_at=1, marker=None, episode_length=10**6, hang_s=30.0,
                 length_by_seed=False, close_s=0.0):
        self.length_by_seed, self.close_s = length_by_seed, close_s
        self.possible_agents = ["a", "b"]
        self.agents = []
        self.env_id, self.step_time, self.episode_length = env_id, step_time, episode_length
        self.inner = CountEnv(env_id, 0.0, fault, fault_at, marker, 10**9, hang_s)
        self._obs_space = spaces.Box(-1e9, 1e9, (4,), np.float64)
        self._act_space = spaces.Discrete(3)
        self.t = 0
        self.episode = 0

    def observation_space(self, agent):
        return self._obs_space

    def action_space(self, agent):
        return self._act_space

    def _obs(self):
        return {a: np.array([self.env_id, self.t, self.episode, self.inner.total], np.float64) for a in self.agents}

    def reset(self, seed=None, options=None):
        if seed is not None and self.length_by_seed:  # env i of a vector (seed + i): episodes of 2 + i % 2 steps
            self.episode_length = 2 + seed % 2
        self.inner.reset(seed=seed)
        self.agents = list(self.possible_agents)
        self.t = 0
        self.episode += 1
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions):
        self.inner.step(0)
        delay = self.step_time
        if isinstance(delay, (list, tuple)):
            delay = delay[min(self.inner.total, len(delay)) - 1]
        if delay:
            time.sleep(delay)
        self.t += 1
        done = self.t >= self.episode_length
        obs = self._obs()
        rew = {a: float(self.t) for a in self.agents}
        term = dict.fromkeys(self.agents, done)
        trunc = dict.fromkeys(self.agents, False)
        infos = {a: {} for a in self.agents}
        if done:
            self.agents = []
        return obs, rew, term, trunc, infos

    def render(self):
        return None

    def close(self):
        time.sleep(self.close_s)
