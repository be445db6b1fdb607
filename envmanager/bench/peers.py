"""Peers of ``envmanager bench`` that need more than gymnasium: tianshou and TorchRL.

Each is an optional dependency, imported only when its backend runs; each backend is skipped
with the reason when its library does not import. Both step in lockstep (``step(actions)``
for all envs) with the same actions as every other backend, and reset finished envs
themselves where the library does not (tianshou), inside the timed loop as autoresets are.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from envmanager.bench.scenarios import Scenario

__all__ = ["run_tianshou_subproc", "run_tianshou_shmem", "run_torchrl", "tianshou_unavailable", "torchrl_unavailable"]


@functools.cache
def _import_problem(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install
        return f"{module.split('.')[0]} cannot be imported ({type(exc).__name__}: {exc})"
    return None


def _gym_only(scenario: Scenario) -> str | None:
    return None if scenario.kind == "gym" else f"not applicable to {scenario.kind} scenarios"


def tianshou_unavailable(scenario: Scenario) -> str | None:
    return _gym_only(scenario) or _import_problem("tianshou.env")


def torchrl_unavailable(scenario: Scenario) -> str | None:
    return _gym_only(scenario) or _import_problem("torchrl.envs")


# ---------------------------------------------------------------------------------------------
# tianshou


def _run_tianshou(scenario: Scenario, steps: int, actions: np.ndarray, tick: Callable[[int], None],
                  share_memory: bool) -> tuple[int, float]:
    from tianshou.env import SubprocVectorEnv

    from envmanager.bench.common import START_METHOD, Progress, env_fns

    n, rows = scenario.n_env, len(actions)
    progress = Progress(tick, scenario, steps)
    # ShmemVectorEnv is SubprocVectorEnv(share_memory=True) without a ``context`` argument
    env = SubprocVectorEnv(env_fns(scenario), share_memory=share_memory, context=START_METHOD)
    try:
        env.seed(0)  # env i gets seed i, as everywhere else
        env.reset()
        step, reset = env.step, env.reset
        progress.start()
        for k in range(-(-steps // n)):
            _, _, terminated, truncated, _ = step(actions[k % rows])
            done = np.flatnonzero(np.logical_or(terminated, truncated))
            if len(done):  # tianshou's vector envs leave resets to the caller
                reset(done)
            progress.add(n)
        elapsed = progress.stop()
    finally:
        env.close()
    progress.close()
    return progress.done, elapsed


def run_tianshou_subproc(scenario: Scenario, steps: int, actions: np.ndarray, tick: Callable[[int], None]) -> tuple[int, float]:
    return _run_tianshou(scenario, steps, actions, tick, share_memory=False)


def run_tianshou_shmem(scenario: Scenario, steps: int, actions: np.ndarray, tick: Callable[[int], None]) -> tuple[int, float]:
    return _run_tianshou(scenario, steps, actions, tick, share_memory=True)


# ---------------------------------------------------------------------------------------------
# TorchRL


class _TorchRLEnv:
    """Builds env ``env_id`` of a scenario as a TorchRL env (picklable for the workers)."""

    def __init__(self, factory: Callable[[int], Any], env_id: int) -> None:
        self.factory, self.env_id = factory, env_id

    def __call__(self) -> Any:
        from torchrl.envs import GymWrapper

        return GymWrapper(self.factory(self.env_id), categorical_action_encoding=True)


def run_torchrl(scenario: Scenario, steps: int, actions: np.ndarray, tick: Callable[[int], None]) -> tuple[int, float]:
    """TorchRL's ``ParallelEnv`` (one process per env, shared-memory tensordicts), stepped with
    ``step_and_maybe_reset`` as its collectors do."""
    import torch
    from torchrl.envs import ParallelEnv

    from envmanager.bench.common import START_METHOD, Progress

    n, rows = scenario.n_env, len(actions)
    progress = Progress(tick, scenario, steps)
    table = torch.as_tensor(actions)
    env = ParallelEnv(n, [_TorchRLEnv(scenario.factory, i) for i in range(n)], mp_start_method=START_METHOD)
    try:
        env.set_seed(0)
        td = env.reset()
        progress.start()
        for k in range(-(-steps // n)):
            td["action"] = table[k % rows]
            _, td = env.step_and_maybe_reset(td)
            progress.add(n)
        elapsed = progress.stop()
    finally:
        env.close()
    progress.close()
    return progress.done, elapsed
