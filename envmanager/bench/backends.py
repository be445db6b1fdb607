"""The contenders of ``envmanager bench``: ours in several stepping styles (and the drop-ins as
users get them), and our peers.

A backend's ``run(scenario, steps, actions, tick)`` builds the envs, resets them with seed 0,
steps at least ``steps`` env-steps, calls ``tick(n)`` now and then (in chunks, never per step)
with the env-steps done since the last call, closes everything and returns
``(env_steps, seconds)``: only the stepping loop is timed, not start-up, reset or close.

Every backend takes env ``i``'s ``k``-th action from ``actions[k % len(actions), i]``, so
all of them step the same envs with the same actions.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from envmanager.bench import peers
from envmanager.bench.common import START_METHOD, Progress, Tick, cores, env_fns, lockstep, worker_cores
from envmanager.bench.scenarios import Scenario, env_columns

__all__ = ["Backend", "BACKENDS", "DEFAULT_BACKENDS", "backends_for", "cores"]

#: What ``envs_per_worker="auto"`` chose, by scenario name (the last run of ``envmanager-auto``).
AUTO_CHOICES: dict[str, int] = {}

Run = Callable[[Scenario, int, np.ndarray, Tick], "tuple[int, float]"]


# ---------------------------------------------------------------------------------------------
# Ours


def run_first_ready(
    scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick, envs_per_worker: int | str = 1,
    double_buffer: bool | str = False,
) -> tuple[int, float]:
    """SubprocessEnvManager as designed: step every idle env, take whatever has finished."""
    from envmanager import SubprocessEnvManager

    n = scenario.n_env
    columns = env_columns(actions)
    rows = len(columns[0])
    progress = Progress(tick, scenario, steps)
    manager = SubprocessEnvManager(scenario.factory, n, envs_per_worker=envs_per_worker, context=START_METHOD,
                                   double_buffer=double_buffer)
    if envs_per_worker == "auto":
        AUTO_CHOICES[scenario.name] = manager.envs_per_worker
    progress.pool = lambda: manager.pool
    with manager:
        manager.reset(seed=0)
        step = manager.step
        position = [1] * n
        todo = {w: columns[w][0] for w in range(n)}
        progress.start()
        while progress.done < steps:
            infos = step(todo)
            todo = {}
            for info in infos:  # only the finished envs get their next action
                w = info.worker_id
                p = position[w]
                todo[w] = columns[w][p % rows]
                position[w] = p + 1
            progress.add(len(infos))
        elapsed = progress.stop()
    progress.close()
    return progress.done, elapsed


def run_k_per_worker(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """First-ready, with ``n_env // cores`` envs per worker process, stepped as one message."""
    return run_first_ready(scenario, steps, actions, tick, envs_per_worker=envs_per_worker_for(scenario))


def run_auto(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """First-ready, ``envs_per_worker="auto"`` (and its lanes): the manager measures one env and chooses."""
    return run_first_ready(scenario, steps, actions, tick, envs_per_worker="auto", double_buffer="auto")


def run_parent_core(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """First-ready, the envs in one process per core but the parent's, double buffered: every
    process and the parent have a core (they spin; the mailbox carries requests and answers)."""
    processes = max(1, worker_cores(scenario) - (0 if scenario.pin else 1))
    return run_first_ready(scenario, steps, actions, tick, envs_per_worker=-(-scenario.n_env // processes),
                           double_buffer=True)


def envs_per_worker_for(scenario: Scenario) -> int:
    """Envs per worker process for the ``-k``, ``-vector`` and batch-level backends: one process
    per core (per worker core, pinned)."""
    return max(1, scenario.n_env // worker_cores(scenario))


def run_batch_level(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick,
                    double_buffer: bool = False) -> tuple[int, float]:
    """The core's batch level, first-ready: whatever came back is sent its next actions at once
    (rows of the action table, one numpy operation); ``envs_per_worker_for`` envs per process."""
    from envmanager.core.batch import BatchEnvManager

    n, rows = scenario.n_env, len(actions)
    progress = Progress(tick, scenario, steps)
    manager = BatchEnvManager(scenario.factory, n, envs_per_worker=envs_per_worker_for(scenario), context=START_METHOD,
                              double_buffer=double_buffer, info_columns=True)
    progress.pool = lambda: manager.pool
    with manager:
        manager.send_reset({i: (i, None) for i in range(n)})
        manager.receive_reset_batch()
        position = np.ones(n, dtype=np.int64)
        every = np.arange(n)
        manager.send_batch(every, actions[0])
        progress.start()
        while progress.done < steps:
            slots = manager.receive_batch(1, info_columns=True).slots  # infos unread: no dicts made
            p = position[slots]
            manager.send_batch(slots, actions[p % rows, slots])
            position[slots] = p + 1
            progress.add(len(slots))
        elapsed = progress.stop()
        manager.drain()
    progress.close()
    return progress.done, elapsed


def run_double_buffered(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """``run_batch_level`` with two lanes per process: one half steps while the other turns around."""
    return run_batch_level(scenario, steps, actions, tick, double_buffer=True)


def run_partial_batch_db(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """The drop-in's partial batches, double buffered: ``batch_size = n_env // 2``,
    ``envs_per_worker_for`` envs per process in two lanes: Sample Factory's design, through
    ``envmanager.AsyncVectorEnv``'s ``send``/``recv``."""
    return run_partial_batch(scenario, steps, actions, tick, envs_per_worker=envs_per_worker_for(scenario),
                             double_buffer=True)


def run_lockstep(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """SubprocessEnvManager held to lockstep: wait until every env has finished, then step all."""
    from envmanager import SubprocessEnvManager

    n = scenario.n_env
    table = [dict(enumerate(row)) for row in actions.tolist()]
    progress = Progress(tick, scenario, steps)
    with SubprocessEnvManager(scenario.factory, n, context=START_METHOD) as manager:
        progress.pool = lambda: manager.pool
        manager.reset(seed=0)
        progress.start()
        lockstep(manager.step, table, n, -(-steps // n), progress)
        elapsed = progress.stop()
    progress.close()
    return progress.done, elapsed


def run_partial_batch(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick, **options: Any) -> tuple[int, float]:
    """``envmanager.AsyncVectorEnv(batch_size=n // 2)``: EnvPool-style ``send``/``recv``."""
    import envmanager

    n = scenario.n_env
    batch = max(1, n // 2)
    rows = len(actions)
    progress = Progress(tick, scenario, steps)
    vec = envmanager.AsyncVectorEnv(env_fns(scenario), batch_size=batch, context=START_METHOD, **options)
    progress.pool = lambda: vec._manager.pool if vec._manager is not None else None
    try:
        vec.reset(seed=0)
        position = np.ones(n, dtype=np.int64)
        ids = np.arange(n)
        vec.send(actions[0].copy(), ids)
        progress.start()
        while progress.done < steps:
            *_, infos = vec.recv()
            ids = np.asarray(infos["env_id"])
            p = position[ids]
            vec.send(actions[p % rows, ids], ids)
            position[ids] = p + 1
            progress.add(len(ids))
        elapsed = progress.stop()
        for _ in range(n // batch):  # collect what is still stepping before closing
            vec.recv()
    finally:
        vec.close()
    progress.close()
    return progress.done, elapsed


def run_vector(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """The drop-in ``envmanager.AsyncVectorEnv`` stepped in lockstep, ``step(actions)``, as
    gymnasium's; with ``n_env // cores`` envs per worker, its best setting for cheap envs."""
    import envmanager

    return _run_vector(
        scenario, steps, actions, tick,
        lambda: envmanager.AsyncVectorEnv(
            env_fns(scenario), context=START_METHOD, envs_per_worker=envs_per_worker_for(scenario)
        ),
    )


def run_vector_default(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """The drop-in ``envmanager.AsyncVectorEnv(fns)`` as users get it (``envs_per_worker`` and
    ``double_buffer`` left at their defaults), ``step(actions)`` in lockstep."""
    import envmanager

    return _run_vector(scenario, steps, actions, tick,
                       lambda: envmanager.AsyncVectorEnv(env_fns(scenario), context=START_METHOD))


def run_sb3_drop_in(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """The SB3 drop-in ``envmanager.sb3.SubprocVecEnv(fns)`` as users get it (its defaults but
    the start method, :data:`START_METHOD` as for every backend), ``step(actions)``."""
    from envmanager.sb3 import SubprocVecEnv

    def reset(env: Any) -> None:
        env.seed(0)
        env.reset()

    return _run_vector(scenario, steps, actions, tick,
                       lambda: SubprocVecEnv(env_fns(scenario), start_method=START_METHOD), reset)


# ---------------------------------------------------------------------------------------------
# Peers


def _run_vector(
    scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick,
    make: Callable[[], Any], reset: Callable[[Any], Any] = lambda env: env.reset(seed=0),
) -> tuple[int, float]:
    """Any lockstep vector env: ``step(actions_row)`` for all envs at once."""
    n = scenario.n_env
    rows = len(actions)
    progress = Progress(tick, scenario, steps)
    env = make()
    if getattr(env, "_manager", None) is not None:  # ours: count the answers
        progress.pool = lambda: env._manager.pool if env._manager is not None else None
    try:
        reset(env)
        step = env.step
        progress.start()
        for k in range(-(-steps // n)):
            step(actions[k % rows])
            progress.add(n)
        elapsed = progress.stop()
    finally:
        env.close()
    progress.close()
    return progress.done, elapsed


def run_gym_sync(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    return _run_vector(scenario, steps, actions, tick, lambda: gym.vector.SyncVectorEnv(env_fns(scenario)))


def run_gym_async(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    return _run_vector(
        scenario, steps, actions, tick, lambda: gym.vector.AsyncVectorEnv(env_fns(scenario), context=START_METHOD)
    )


def run_sb3(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """SB3's SubprocVecEnv (it autoresets within the same step).

    Started with :data:`START_METHOD` like every other backend: SB3's default, ``forkserver``,
    makes every worker import torch afresh (~10 s each on a small machine), which is start-up
    cost only, never timed, but would dominate the run.
    """
    from stable_baselines3.common.vec_env import SubprocVecEnv

    def reset(env: Any) -> None:
        env.seed(0)
        env.reset()

    return _run_vector(
        scenario, steps, actions, tick, lambda: SubprocVecEnv(env_fns(scenario), start_method=START_METHOD), reset
    )


def run_envpool(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    """EnvPool's own C++ version of the scenario's envs, synchronous mode (threads in this process).

    It does not autoreset as gymnasium does (it resets a finished env on its next step), and
    its stepping loop is the same lockstep ``step(actions)`` as every vector env here.
    """
    import envpool

    task = scenario.envpool_id
    assert task is not None, "envpool runs only scenarios with an envpool_id (_envpool_unavailable)"

    def make() -> Any:
        with warnings.catch_warnings():  # envpool's spaces warn about float precision
            warnings.simplefilter("ignore")
            return envpool.make_gymnasium(task, num_envs=scenario.n_env, seed=0,
                                          **dict(scenario.envpool_kwargs))

    def reset(env: Any) -> None:
        with warnings.catch_warnings():  # "seeds are fixed when the environment is created"
            warnings.simplefilter("ignore")
            env.reset()

    return _run_vector(scenario, steps, actions, tick, make, reset)


def _module_unavailable(module: str) -> Callable[[Scenario], str | None]:
    @functools.cache
    def check() -> str | None:
        try:
            importlib.import_module(module)
        except Exception as exc:
            return f"{module} cannot be imported ({type(exc).__name__}: {exc})"
        return None

    return lambda scenario: check()


_sb3_unavailable = _module_unavailable("stable_baselines3")


@functools.cache
def _envpool_broken() -> str | None:
    try:
        import envpool

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            env = envpool.make_gymnasium("CartPole-v1", num_envs=2, seed=0)
            try:
                env.reset()
                env.step(np.zeros(2, dtype=np.int64))
            finally:
                env.close()
    except Exception as exc:
        return f"envpool does not work here ({type(exc).__name__}: {exc})"
    return None


def _envpool_unavailable(scenario: Scenario) -> str | None:
    if scenario.envpool_id is None:
        return "not applicable: EnvPool runs its own C++ envs (CartPole, Pong, HalfCheetah here), not Python envs"
    return _envpool_broken() or _envpool_env_broken(scenario.envpool_id, scenario.envpool_kwargs)


@functools.cache
def _envpool_env_broken(task: str, kwargs: tuple[tuple[str, Any], ...]) -> str | None:
    try:
        import envpool

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            env = envpool.make_gymnasium(task, num_envs=1, seed=0, **dict(kwargs))
            env.close()
    except Exception as exc:
        return f"envpool's {task} does not work here ({type(exc).__name__}: {exc})"
    return None


def _not_pinned(scenario: Scenario) -> str | None:
    return "not applicable when pinned: its threads run in this process (no worker processes to pin)" if scenario.pin else None


def _always(scenario: Scenario) -> str | None:
    return None


def _gym_envs_only(scenario: Scenario) -> str | None:
    return None if scenario.kind == "gym" else f"not applicable to {scenario.kind} scenarios"


def _unity_only(scenario: Scenario) -> str | None:
    return None if scenario.kind == "unity" else "not applicable: only for the unity scenario"


def _unity(name: str) -> Run:
    """A runner from :mod:`envmanager.bench.unity`, imported only when used."""

    def run(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
        from envmanager.bench import unity

        return getattr(unity, name)(scenario, steps, actions, tick)

    return run


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """One way of stepping a scenario's envs. ``unavailable(scenario)`` says why not, or None."""

    name: str
    run: Run
    description: str
    ours: bool = False
    lockstep: bool = False
    unavailable: Callable[[Scenario], str | None] = _always
    unity: Run | None = None  # its variant for the unity scenario, if it has one

    def runner(self, scenario: Scenario) -> Run:
        return self.unity if scenario.kind == "unity" and self.unity is not None else self.run

    def why_not(self, scenario: Scenario) -> str | None:
        """Why this backend cannot run ``scenario``, or ``None``."""
        if scenario.kind == "unity" and self.unity is not None:
            return None
        return self.unavailable(scenario)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("envmanager", run_first_ready, "SubprocessEnvManager, 1 env/worker, first-ready "
                "(unity: MLAgentsEnvManager.get_steps)", ours=True, unavailable=_gym_envs_only,
                unity=_unity("run_first_ready")),
        Backend("envmanager-auto", run_auto, 'SubprocessEnvManager, envs_per_worker="auto"',
                ours=True, unavailable=_gym_envs_only),
        Backend("envmanager-k", run_k_per_worker, "SubprocessEnvManager, n_env // cores envs/worker",
                ours=True, unavailable=_gym_envs_only),
        Backend("envmanager-parentcore", run_parent_core, "SubprocessEnvManager, the envs in one process per core but "
                "the parent's, double buffered", ours=True, unavailable=_gym_envs_only),
        Backend("envmanager-lockstep", run_lockstep, "SubprocessEnvManager, waiting for all envs each step",
                ours=True, lockstep=True, unavailable=_gym_envs_only, unity=_unity("run_lockstep")),
        Backend("envmanager-batch", run_partial_batch, "envmanager.AsyncVectorEnv, batch_size = n_env // 2, send/recv "
                "(envs_per_worker and double_buffer at their defaults, as users get it)", ours=True,
                unavailable=_gym_envs_only),
        Backend("envmanager-batchlevel", run_batch_level, "the core's batch level (send_batch / receive_batch), "
                "first-ready, n_env // cores envs/worker", ours=True, unavailable=_gym_envs_only),
        Backend("envmanager-db", run_double_buffered, "the batch level, first-ready, n_env // cores envs/worker, "
                "double buffered (two lanes per process)", ours=True, unavailable=_gym_envs_only),
        Backend("envmanager-batch-db", run_partial_batch_db, "envmanager.AsyncVectorEnv, batch_size = n_env // 2, "
                "n_env // cores envs/worker, double buffered", ours=True, unavailable=_gym_envs_only),
        Backend("envmanager-vector", run_vector, "envmanager.AsyncVectorEnv, step(actions) in lockstep, "
                "n_env // cores envs/worker", ours=True, lockstep=True, unavailable=_gym_envs_only),
        Backend("envmanager-vector-default", run_vector_default, "envmanager.AsyncVectorEnv(fns), step(actions) in "
                "lockstep: the drop-in as users get it (envs_per_worker and double_buffer at their defaults)",
                ours=True, lockstep=True, unavailable=_gym_envs_only),
        Backend("envmanager-sb3", run_sb3_drop_in, "envmanager.sb3.SubprocVecEnv(fns), step(actions): the SB3 drop-in "
                "as users get it", ours=True, lockstep=True, unavailable=lambda s: _gym_envs_only(s) or _sb3_unavailable(s)),
        Backend("gym.SyncVectorEnv", run_gym_sync, "gymnasium SyncVectorEnv (in process)",
                lockstep=True, unavailable=_gym_envs_only),
        Backend("gym.AsyncVectorEnv", run_gym_async, "gymnasium AsyncVectorEnv (shared memory)",
                lockstep=True, unavailable=_gym_envs_only),
        Backend("sb3.SubprocVecEnv", run_sb3, "Stable-Baselines3 SubprocVecEnv",
                lockstep=True, unavailable=lambda s: _gym_envs_only(s) or _sb3_unavailable(s)),
        Backend("tianshou.SubprocVectorEnv", peers.run_tianshou_subproc, "tianshou SubprocVectorEnv (pipes)",
                lockstep=True, unavailable=peers.tianshou_unavailable),
        Backend("tianshou.ShmemVectorEnv", peers.run_tianshou_shmem, "tianshou ShmemVectorEnv (shared memory)",
                lockstep=True, unavailable=peers.tianshou_unavailable),
        Backend("torchrl.ParallelEnv", peers.run_torchrl, "TorchRL ParallelEnv of GymWrapper envs",
                lockstep=True, unavailable=peers.torchrl_unavailable),
        Backend("pufferlib.Multiprocessing", peers.run_pufferlib, "PufferLib 3.0 Multiprocessing, batches of "
                "n_env // 2, one process per worker core (busy-waiting on shared memory)",
                unavailable=peers.pufferlib_batched_unavailable),
        Backend("pufferlib.Multiprocessing-sync", peers.run_pufferlib_sync, "PufferLib 3.0 Multiprocessing, "
                "batch_size = n_env (lockstep)", lockstep=True, unavailable=peers.pufferlib_unavailable),
        Backend("envpool", run_envpool, "EnvPool (its own C++ envs, sync mode)",
                lockstep=True, unavailable=lambda s: _not_pinned(s) or _envpool_unavailable(s)),
        Backend("mlagents.sequential", _unity("run_sequential"),
                "mlagents_envs UnityEnvironments stepped one after another in this process",
                lockstep=True, unavailable=_unity_only),
    )
}

#: What ``envmanager bench`` runs when no ``--backends`` are given: every backend, each
#: scenario skipping those that do not apply to it or are not installed.
DEFAULT_BACKENDS = tuple(BACKENDS)

NOT_APPLICABLE = "not applicable"  # how the reasons of backends that do not fit a scenario start


def backends_for(scenario: Scenario, backends: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """The backends a run of ``scenario`` tries: ``backends``, or with none named its own
    contenders (``scenario.backends``) or every backend; and those left out, with why."""
    if backends is not None:
        return list(backends), {}
    if scenario.backends is None:
        return list(DEFAULT_BACKENDS), {}
    why = f"{NOT_APPLICABLE}: not one of {scenario.group or scenario.name}'s contenders (name it with --backends)"
    return list(scenario.backends), {b: why for b in DEFAULT_BACKENDS if b not in scenario.backends}
