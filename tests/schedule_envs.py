"""An env and a policy for the randomized fault schedules (``tests/test_fault_schedules.py``).

The observation says everything the test needs to check a schedule from the data alone:
``[slot, episode, t, last action received, nonce, env version]``. ``episode`` counts this env
object's resets, ``t`` the episode's steps, ``nonce`` is drawn when the env object is built (a
restarted process, or a rebuilt env, has a new one), so an episode of the env is
``(nonce, episode)``: an episode id under two of them spans two env episodes, and a step lost or
duplicated shows as a gap or a repeat in ``t``.

Faults on command: the test writes a file ``<commands>/<slot>.<fault>``; the env removes it
(atomically, so each command acts once, whichever process reads it) and does the fault at its
next step or reset: ``step_raise``, ``reset_raise``, ``step_hang`` (sleeps past any deadline).
The policy raises on ``<commands>/policy_raise`` the same way. A command that acted is gone, so
the test knows which slot failed.
"""

from __future__ import annotations

import os
import secrets
import time

import gymnasium as gym
import numpy as np

OBS_SIZE = 6
SLOT, EPISODE, T, LAST, NONCE, VERSION = range(OBS_SIZE)
N_ACTIONS = 4
STEP_FAULTS = ("step_raise", "step_hang")
RESET_FAULTS = ("reset_raise",)


def episode_length(slot: int, episode: int) -> int:
    """Episodes of 2 to 6 steps, varying by slot and episode."""
    return 2 + (episode * 7 + slot * 3) % 5


def consume(commands: str, slot: int | str, fault: str) -> bool:
    """Whether the command was there (and is now gone): each command acts once."""
    try:
        os.unlink(os.path.join(commands, f"{slot}.{fault}"))
    except FileNotFoundError:
        return False
    return True


def command(commands: str, slot: int | str, fault: str) -> str:
    path = os.path.join(commands, f"{slot}.{fault}")
    with open(path, "w"):
        pass
    return path


class ScheduleEnv(gym.Env):
    observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS_SIZE,), np.float64)
    action_space = gym.spaces.Discrete(N_ACTIONS)

    def __init__(self, slot: int, commands: str) -> None:
        self.slot, self.commands = slot, commands
        self.pid = os.getpid()
        self.nonce = float(secrets.randbits(40))  # exact in a float64
        self.episode, self.t, self.last, self.version = 0, 0, -1.0, 0.0
        self.length = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.slot, self.episode, self.t, self.last, self.nonce, self.version], dtype=np.float64)

    def _fault(self, fault: str) -> None:
        if consume(self.commands, self.slot, fault):
            if fault.endswith("raise"):
                raise RuntimeError(f"slot {self.slot}: {fault} on command")
            time.sleep(600)  # hung: the manager's deadline kills the process

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._fault("reset_raise")
        self.episode += 1
        self.t, self.last = 0, -1.0
        self.length = episode_length(self.slot, self.episode)
        return self._obs(), {}

    def step(self, action):
        for fault in STEP_FAULTS:
            self._fault(fault)
        self.t += 1
        self.last = float(action)  # exactly what it received
        return self._obs(), float(self.version), self.t >= self.length, False, {}


class ScheduleFactory:
    """``factory(worker_id)``; picklable under every start method."""

    def __init__(self, commands: str) -> None:
        self.commands = commands

    def __call__(self, worker_id: int) -> ScheduleEnv:
        return ScheduleEnv(worker_id, self.commands)


class ScheduleEnvFn:
    """An ``env_fns`` entry for the drop-ins (a callable without arguments)."""

    def __init__(self, slot: int, commands: str) -> None:
        self.slot, self.commands = slot, commands

    def __call__(self) -> ScheduleEnv:
        return ScheduleEnv(self.slot, self.commands)


def set_version(version: int):
    """An env update: the env's rewards and observations carry ``version`` from its next episode."""
    def update(env):
        env.unwrapped.version = float(version)
    return update


class SchedulePolicy:
    """Actions ``(t + slot + params) % 4``; ``params`` (the weights, ``set_param_values``) in the
    agent info; raises once per ``policy_raise`` command. Picklable (a worker-side agent too)."""

    def __init__(self, commands: str, params: int = 0) -> None:
        self.commands = commands
        self.params = params

    def set_param_values(self, params) -> None:
        self.params = int(params)

    def get_actions(self, observations, worker_ids):
        observations, worker_ids = np.asarray(observations), np.asarray(worker_ids)
        if consume(self.commands, "policy", "raise"):
            raise RuntimeError("policy_raise on command")
        actions = (observations[:, T].astype(np.int64) + worker_ids + self.params) % N_ACTIONS
        return actions, {"params": np.full(len(actions), self.params, dtype=np.int64)}
