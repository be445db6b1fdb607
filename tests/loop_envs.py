"""The env of the EnvPool-loop properties (``tests/test_envpool_loop.py``): envmanager's
``ControlledEnv`` (observation ``[t, env_id, last action, episode]``, reward = the action, a
chosen step time), episodes of 2 to 5 steps that end by termination or truncation depending
on the env, and a fault that happens once in a slot's life: a marker file (``fault_envs.strike``)
remembers it across processes, so a restarted process's fresh env does not do it again.

Each env is also made in the test process, fault and step time left out: its reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from envmanager.testing.envs import ControlledEnv
from fault_envs import strike

__all__ = ["LoopEnv", "LoopEnvFn", "episode_length", "truncates", "reference"]


def episode_length(env_id: int) -> int:
    """2 to 5 steps, varying by env."""
    return 2 + (3 * env_id) % 4


def truncates(env_id: int) -> bool:
    """Every third env's episodes end truncated, the others' terminated."""
    return env_id % 3 == 2


class LoopEnv(ControlledEnv):
    """``ControlledEnv(env_id)`` with its episode length and ending; ``once`` (a ``ControlledEnv``
    fault: ``"raise"``, ``"sigkill"``, ``"hang"``...) at step ``fault_at`` of the env's life,
    once per ``marker`` whatever the process."""

    def __init__(self, env_id: int, step_time: float | list[float] = 0.0, once: str | None = None,
                 fault_at: int = 1, marker: str | None = None) -> None:
        super().__init__(env_id, step_time=step_time, episode_length=episode_length(env_id),
                         truncate=truncates(env_id), fault_at=fault_at)
        self.once, self.marker = once, marker

    def step(self, action: Any):
        if self.once is not None and self.total_steps + 1 >= self.fault_at and self.marker and strike(self.marker):
            self.total_steps += 1
            self.fault = self.once
            try:
                self._fail()  # raises, kills this process or hangs
            finally:
                self.fault = None
        return super().step(action)


class LoopEnvFn:
    """An ``env_fns`` entry (no arguments) and a core ``env_factory`` (``factory(worker_id)``)."""

    def __init__(self, per_env: dict[int, dict[str, Any]] | None = None, env_id: int | None = None) -> None:
        self.per_env, self.env_id = per_env or {}, env_id

    def __call__(self, worker_id: int | None = None) -> LoopEnv:
        env_id = self.env_id if worker_id is None else worker_id
        assert env_id is not None
        return LoopEnv(env_id, **self.per_env.get(env_id, {}))


def reference(env_id: int, seed: int | None = None) -> SyncVectorEnv:
    """Env ``env_id`` alone in gymnasium's ``SyncVectorEnv`` (next-step autoreset), reset."""
    ref = SyncVectorEnv([lambda: LoopEnv(env_id)], autoreset_mode=AutoresetMode.NEXT_STEP)
    ref.reset(seed=seed)
    return ref


def step_reference(ref: SyncVectorEnv, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
    """One step of a reference: its row as ``(obs, reward, terminated, truncated, infos)``."""
    obs, reward, terminated, truncated, infos = ref.step(np.array([action]))
    return obs[0], float(reward[0]), bool(terminated[0]), bool(truncated[0]), infos
