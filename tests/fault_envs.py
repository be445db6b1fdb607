"""An env and policies for the samplers' fault matrix: each fault happens once (a marker file
remembers it across processes and restarts), and the env's observation shows what it received,
so a test can check the data, not only the error.

Observation ``[t, last action received, nonce, length]``: ``t`` counts the episode's steps, the
nonce is unique to one env episode (its process id, slot and the process's reset count, so an
env rebuilt in its process never repeats one; ``pid_of`` reads the process back), so an
episode id that spans two env episodes shows two nonces, and a duplicated step shows the same
``t`` twice.
"""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np

#: Faults of the env: where (step, reset, env update) and how (raise, kill, hang).
ENV_FAULTS = ("step_raise", "step_kill", "step_hang", "reset_raise", "reset_kill", "reset_hang")
#: Faults of the policy: it raises, or gives one action too few, a fraction, a value out of range.
POLICY_FAULTS = ("policy_raise", "policy_count", "policy_dtype", "policy_range")
FAULT_SLOT = 1
_RESETS_HERE = 0  # resets of every env in this process (for the nonce)


def strike(marker: str) -> bool:
    """True the first time only (across processes): the fault happens once."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def do(how: str, what: str) -> None:
    if how == "raise":
        raise RuntimeError(f"{what} blew up")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        time.sleep(120)


class FaultEnv(gym.Env):
    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, slot: int, fault: str | None = None, marker: str | None = None, step_s: float = 0.0) -> None:
        self.slot, self.fault, self.marker, self.step_s = slot, fault, marker, step_s
        self.t, self.last, self.nonce, self.length = 0, -1.0, 0.0, 0
        self.resets = self.total = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.last, self.nonce, self.length], dtype=np.float64)

    def _maybe(self, where: str, count: int, at: int) -> None:
        if self.fault and self.fault.startswith(where) and count == at and strike(self.marker):
            do(self.fault.split("_")[1], f"env {where}")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets += 1
        self._maybe("reset", self.resets, 3)
        self.length = 3 + int(self.np_random.integers(0, 6))
        global _RESETS_HERE
        _RESETS_HERE += 1  # counted per process, not per env: an env rebuilt in its process starts at 0 again
        self.nonce = float((os.getpid() * 100 + self.slot) * 100_000 + _RESETS_HERE)  # exact in a float64
        self.t, self.last = 0, -1.0
        return self._obs(), {}

    def step(self, action):
        self.total += 1
        if self.resets == 2:  # the second step of its second episode: one step of it already done
            self._maybe("step", self.t + 1, 2)
        if self.step_s:
            time.sleep(self.step_s)
        self.t += 1
        self.last = float(action)  # exactly what it received
        return self._obs(), 1.0, self.t >= self.length, False, {}


class FaultFactory:
    """``factory(worker_id)``: slot ``slot`` gets the fault; the slots ``slow`` (default: all)
    take ``step_s`` seconds a step."""

    def __init__(self, fault: str | None, marker: str, step_s: float = 0.0, slot: int = FAULT_SLOT,
                 slow: tuple[int, ...] | None = None) -> None:
        self.fault, self.marker, self.step_s, self.slot, self.slow = fault, marker, step_s, slot, slow

    def __call__(self, worker_id: int) -> FaultEnv:
        fault = self.fault if self.fault in ENV_FAULTS and worker_id == self.slot else None
        step_s = self.step_s if self.slow is None or worker_id in self.slow else 0.0
        return FaultEnv(worker_id, fault, self.marker, step_s)


class FailsToMake:
    """``FaultFactory(None)``, but once ``armed`` exists, making slot ``slot``'s env raises: once
    (``struck`` marks it: the next start of its process or node fails), or every time."""

    def __init__(self, armed: str, struck: str, slot: int = FAULT_SLOT, once: bool = True) -> None:
        self.armed, self.struck, self.slot, self.once = armed, struck, slot, once

    def __call__(self, worker_id: int) -> FaultEnv:
        if worker_id == self.slot and os.path.exists(self.armed) and (strike(self.struck) or not self.once):
            raise RuntimeError("the env could not be made")
        return FaultFactory(None, self.struck)(worker_id)


class FaultPolicy:
    """Actions ``t % 3``; once, when it acts for slot ``slot`` at its episode step 2, does its
    fault. Picklable (a worker-side agent too); weights (``set_param_values``) show in the
    agent info ``params``."""

    def __init__(self, fault: str | None, marker: str, slot: int = FAULT_SLOT) -> None:
        self.fault, self.marker, self.slot = fault, marker, slot
        self.params = 0

    def set_param_values(self, params) -> None:
        self.params = params

    def get_actions(self, observations, worker_ids):
        observations, worker_ids = np.asarray(observations), np.asarray(worker_ids)
        actions = observations[:, 0].astype(np.int64) % 3
        infos = {"t": observations[:, 0], "params": np.full(len(actions), self.params)}
        hit = (worker_ids == self.slot) & (observations[:, 0] == 2)
        if self.fault in POLICY_FAULTS and hit.any() and strike(self.marker):
            if self.fault == "policy_raise":
                raise RuntimeError("policy blew up")
            if self.fault == "policy_count":
                return actions[:-1], {k: v[:-1] for k, v in infos.items()}
            if self.fault == "policy_dtype":
                return np.where(hit, 0.5, actions.astype(np.float64)), infos
            return np.where(hit, 7, actions), infos  # out of Discrete(3)
        return actions, infos


def update_raising_once(marker: str, slot: int = FAULT_SLOT):
    """An env update that raises on slot ``slot``'s env the first time it runs there."""
    def update(env):
        if env.unwrapped.slot == slot and strike(marker):
            raise RuntimeError("env update blew up")
        env.unwrapped.updated = True
    return update


def pid_of(nonce: float) -> int:
    """The env process whose episode the observation's nonce names."""
    return int(nonce) // 10_000_000


def check_rows(batch, cut_episodes, n_slots: int, whole: bool = True) -> None:
    """What a fault must never do to the data. ``whole``: ``batch`` is one call's (a cut
    episode's rows in it are all flagged); rows handed out by earlier calls cannot be."""
    ids, nonce = batch.episode_ids, batch.next_observations[:, 2]
    for episode in np.unique(ids).tolist():
        rows = np.flatnonzero(ids == episode)
        assert len(set(nonce[rows].tolist())) == 1, f"episode id {episode} spans two env episodes"
        assert len(set(batch.worker_ids[rows].tolist())) == 1, f"episode id {episode} spans two slots"
        ts = batch.next_observations[rows, 0].astype(int).tolist()
        assert ts == list(range(ts[0], ts[0] + len(ts))), f"episode {episode}: a step lost or duplicated: {ts}"
        assert (batch.observations[rows[1:]] == batch.next_observations[rows[:-1]]).all(), f"episode {episode} broken"
        assert episode % n_slots == batch.worker_ids[rows[0]], f"episode id {episode} is not its slot's"
    for value in np.unique(nonce).tolist():
        under = set(ids[nonce == value].tolist())
        assert len(under) == 1, f"one env episode ({value:.0f}) under ids {under}"
    assert (batch.actions == batch.next_observations[:, 1]).all(), "a recorded action is not what the env received"
    flagged = set(ids[batch.interrupted].tolist())
    assert flagged <= set(cut_episodes), "rows flagged interrupted of an episode not listed as cut"
    for episode in set(cut_episodes) & set(ids.tolist()) if whole else ():
        assert batch.interrupted[ids == episode].all(), f"cut episode {episode} has rows not flagged"


class MarkerEnv(gym.Env):
    """Writes ``marker`` when closed."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def reset(self, *, seed=None, options=None):
        return np.zeros(1), {}

    def step(self, action):
        return np.zeros(1), 0.0, False, False, {}

    def close(self) -> None:
        with open(self.marker, "w") as f:
            f.write("closed")


class SignalledOnCloseEnv(MarkerEnv):
    """A :class:`MarkerEnv` whose ``close()`` gets a SIGTERM halfway (as when the parent interrupts
    a worker it saw as busy while that worker was already closing), then finishes and writes
    ``marker``."""

    def close(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the signal is handled here, if it is handled at all
        super().close()
