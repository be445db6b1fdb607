"""Peers of ``envmanager bench`` that need more than gymnasium: tianshou, TorchRL and PufferLib.

Each is an optional dependency, imported only when its backend runs; each backend is skipped
with the reason when its library does not import. tianshou and TorchRL step in lockstep
(``step(actions)`` for all envs) with the same actions as every other backend, and reset
finished envs themselves where the library does not (tianshou), inside the timed loop as
autoresets are. PufferLib's ``Multiprocessing`` runs twice: in batches of half the envs, as its
docs recommend, and in full batches (lockstep, like the other peers).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from envmanager.bench.common import Progress, worker_cores
from envmanager.bench.scenarios import Scenario

__all__ = ["run_tianshou_subproc", "run_tianshou_shmem", "run_torchrl", "run_pufferlib", "run_pufferlib_sync",
           "tianshou_unavailable", "torchrl_unavailable", "pufferlib_unavailable", "pufferlib_batched_unavailable",
           "pufferlib_layout"]


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
    context: Any = START_METHOD  # tianshou 2 types it Literal["fork", "spawn"]; ours is a platform's default
    env = SubprocVectorEnv(env_fns(scenario), share_memory=share_memory, context=context)
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


# ---------------------------------------------------------------------------------------------
# PufferLib


def pufferlib_unavailable(scenario: Scenario) -> str | None:
    """Why ``pufferlib.Multiprocessing-sync`` cannot run ``scenario``, or ``None``."""
    return _gym_only(scenario) or _import_problem("pufferlib.vector")


def pufferlib_batched_unavailable(scenario: Scenario) -> str | None:
    """Why ``pufferlib.Multiprocessing`` (batches of half the envs) cannot run ``scenario``, or ``None``."""
    if worker_cores(scenario) < 2:
        return ("not applicable on 1 worker core: its batches are whole processes, one process per core "
                "(PufferLib's rule), so one core makes one batch of all envs (pufferlib.Multiprocessing-sync)")
    if scenario.n_env % 2:
        return f"not applicable: batches of half the envs need an even n_env ({scenario.n_env})"
    return pufferlib_unavailable(scenario)


def pufferlib_layout(scenario: Scenario, batched: bool) -> tuple[int, int]:
    """PufferLib's ``(num_workers, batch_size)`` for ``scenario``: one process per core the
    workers may use (its rule: one process per hardware core), ``n_env`` divisible by it, and a
    batch of whole processes. ``batched``: batches of ``n_env // 2`` (its ``batch_size="auto"``),
    so that one batch steps while the other is handed back; else one batch of all ``n_env``."""
    n = scenario.n_env
    batch = n // 2 if batched else n
    most = min(n, worker_cores(scenario))
    workers = max(d for d in range(1, most + 1) if n % d == 0 and batch % (n // d) == 0)
    return workers, batch


def _pufferlib_envs(scenario: Scenario, batched: bool) -> Any:
    """``pufferlib.vector.make(..., backend=Multiprocessing)`` of the scenario's envs (env ``i``
    from ``factory(i)``, wrapped in PufferLib's ``GymnasiumPufferEnv``), zero-copy as by default."""
    import psutil
    import pufferlib.emulation
    import pufferlib.vector

    n = scenario.n_env
    workers, batch = pufferlib_layout(scenario, batched)
    creators = [functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=functools.partial(scenario.factory, i))
                for i in range(n)]
    # it refuses more processes than hardware cores unless told to (overwork)
    overwork = workers > (psutil.cpu_count(logical=False) or 1)
    return pufferlib.vector.make(creators, env_args=[[] for _ in range(n)], env_kwargs=[{} for _ in range(n)],
                                 backend=pufferlib.vector.Multiprocessing, num_envs=n, num_workers=workers,
                                 batch_size=batch, overwork=overwork)


def _pufferlib_close(vec: Any) -> None:
    """``close`` terminates the workers, without reaping them or closing its pipes: both here."""
    try:
        vec.close()
    finally:
        for process in vec.processes:
            process.join(timeout=10)
        for pipe in (*vec.send_pipes, *vec.recv_pipes):
            pipe.close()


def run_pufferlib(scenario: Scenario, steps: int, actions: np.ndarray, tick: Callable[[int], None]) -> tuple[int, float]:
    """PufferLib's ``Multiprocessing`` in batches of ``n_env // 2`` (``recv`` returns a batch of
    whole processes, ``send`` gives them their next actions): its recommended, EnvPool-style use.
    Its workers and its ``recv`` busy-wait on flags in shared memory."""
    n, rows = scenario.n_env, len(actions)
    progress = Progress(tick, scenario, steps)
    vec = _pufferlib_envs(scenario, batched=True)
    try:
        vec.async_reset(0)  # worker w gets seed w; its env j seed w + j (PufferLib's seeding)
        position = np.ones(n, dtype=np.int64)
        recv, send = vec.recv, vec.send
        for _ in range(n // vec.agents_per_batch):  # every batch's reset back, its first actions sent
            ids = recv()[5]
            send(actions[0, ids])
        progress.start()
        while progress.done < steps:
            ids = recv()[5]  # obs, rewards, terminals, truncations, infos, env ids, masks
            p = position[ids]
            send(actions[p % rows, ids])
            position[ids] = p + 1
            progress.add(len(ids))
        elapsed = progress.stop()
    finally:
        _pufferlib_close(vec)
    progress.close()
    return progress.done, elapsed


def run_pufferlib_sync(scenario: Scenario, steps: int, actions: np.ndarray, tick: Callable[[int], None]) -> tuple[int, float]:
    """PufferLib's ``Multiprocessing`` with ``batch_size = n_env``: lockstep, ``send`` then ``recv``
    of all envs, as every lockstep peer steps."""
    n, rows = scenario.n_env, len(actions)
    progress = Progress(tick, scenario, steps)
    vec = _pufferlib_envs(scenario, batched=False)
    try:
        vec.async_reset(0)
        vec.recv()
        send, recv = vec.send, vec.recv
        progress.start()
        for k in range(-(-steps // n)):
            send(actions[k % rows])
            recv()
            progress.add(n)
        elapsed = progress.stop()
    finally:
        _pufferlib_close(vec)
    progress.close()
    return progress.done, elapsed
