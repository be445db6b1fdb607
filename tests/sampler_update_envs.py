"""Envs and agents for ``test_sampler_updates_and_quotas.py``. Observation: ``[t, applied, nonce,
slot]`` (``applied``: the env updates run on this env object), so a test sees what each env got."""
from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np

from fault_envs import strike  # the fault happens once, across processes


class CountEnv(gym.Env):
    """Episodes of ``length`` steps. ``applied``: how many times an env update ran on this env object."""
    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, slot: int, length: int = 4, step_s: float = 0.0, raise_at: int = 0, marker: str | None = None,
                 how: str = "raise"):
        self.slot, self.length, self.step_s = slot, length, step_s
        self.raise_at, self.marker, self.how, self.total = raise_at, marker, how, 0
        self.applied = []  # each env update that ran on it, in order
        self.t = 0
        self.nonce = 0

    def _obs(self):
        return np.array([self.t, len(self.applied), self.nonce, self.slot], dtype=np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.nonce = float(int.from_bytes(os.urandom(4), "little"))  # one env episode
        return self._obs(), {}

    def step(self, action):
        if self.step_s:
            time.sleep(self.step_s)
        self.total += 1
        if self.raise_at and self.total == self.raise_at and strike(self.marker):
            if self.how == "raise":
                raise RuntimeError("env step blew up")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(120)
        self.t += 1
        return self._obs(), 1.0, self.t >= self.length, False, {}


class CountFactory:
    """Slot ``fault_slot`` raises (or is killed / hangs: ``how``) once at its ``raise_at``-th step (total)."""
    def __init__(self, length: int = 4, step_s: float = 0.0, raise_at: int = 0, marker: str | None = None,
                 fault_slot: int = 1, how: str = "raise"):
        self.length, self.step_s, self.raise_at, self.marker, self.fault_slot, self.how = (
            length, step_s, raise_at, marker, fault_slot, how)

    def __call__(self, slot: int):
        at = self.raise_at if slot == self.fault_slot else 0
        return CountEnv(slot, self.length, self.step_s, at, self.marker, self.how)


class Tag:
    """An env update: appends its tag to env.applied; raises once on slot ``raise_slot`` if a marker is given."""
    def __init__(self, tag: str, marker: str | None = None, raise_slot: int = 1):
        self.tag, self.marker, self.raise_slot = tag, marker, raise_slot

    def __call__(self, env):
        env = env.unwrapped
        if self.marker and env.slot == self.raise_slot and strike(self.marker):
            raise RuntimeError(f"update {self.tag} blew up")
        env.applied.append(self.tag)


class ZeroPolicy:
    def get_actions(self, observations, worker_ids):
        return np.zeros(len(worker_ids), dtype=np.int64)


class VersionAgent:
    """A worker-side agent that tells its version in its agent infos."""
    def __init__(self, version: int = 0):
        self.version = version

    def get_actions(self, observations, worker_ids):
        n = len(worker_ids)
        return np.zeros(n, dtype=np.int64), {"agent": np.full(n, self.version)}


class RaiseOnceAgent:
    """A worker-side agent that raises once (marker), the first time it acts for slot ``slot``."""
    def __init__(self, marker: str, slot: int = 0):
        self.marker, self.slot = marker, slot

    def get_actions(self, observations, worker_ids):
        if self.slot in np.asarray(worker_ids).tolist() and strike(self.marker):
            raise RuntimeError("agent blew up")
        return np.zeros(len(worker_ids), dtype=np.int64)
