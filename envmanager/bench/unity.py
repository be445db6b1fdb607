"""The ``unity`` scenario: fake Unity players (real gRPC, real ``mlagents_envs`` client).

Each run writes a launcher for :mod:`envmanager.testing.fake_unity` into a temporary
directory and starts ``n_env`` players with a step latency of ``UNITY_LATENCY[0]`` seconds
plus a uniform ``[0, UNITY_LATENCY[1]]``. The agent (one per player, behaviour ``FakeBehavior?team=0``, one
discrete branch of 3) gets the scenario's seeded actions in every backend:

* ``envmanager``: :class:`envmanager.mlagents.MLAgentsEnvManager` (``get_steps``, first-ready),
  acting through a policy, as an ML-Agents trainer does;
* ``envmanager-lockstep``: the same workers, held to lockstep;
* ``mlagents.sequential``: ``n_env`` ``UnityEnvironment``s stepped one after another in this
  process, the plain ``mlagents_envs`` loop (the "Sync" of this scenario).

Only imported when the scenario runs (it needs ``mlagents-envs``).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from envmanager.bench.common import Progress, Tick, lockstep
from envmanager.bench.scenarios import UNITY_LATENCY, Scenario

BEHAVIOR = "FakeBehavior?team=0"
PLAYER_CONFIG = {"step_latency": UNITY_LATENCY[0], "latency_jitter": UNITY_LATENCY[1], "stats": False}
TIMEOUT_WAIT = 60  # seconds a player may take to connect

@contextmanager
def _launcher() -> Iterator[str]:
    from envmanager.testing.fake_unity import write_launcher

    with tempfile.TemporaryDirectory(prefix="envmanager-bench-") as directory:
        yield write_launcher(directory, PLAYER_CONFIG, "fakeplayer")


def _with_free_ports(start: Callable[[int], Any], n: int, attempts: int = 3) -> Any:
    """``start(base_port)`` on a free port range, retried if someone takes it meanwhile."""
    from mlagents_envs.exception import UnityWorkerInUseException

    from envmanager.mlagents import UnityPortInUseError
    from envmanager.testing.fake_unity import free_base_port

    for attempt in range(attempts):
        try:
            return start(free_base_port(n))
        except (UnityPortInUseError, UnityWorkerInUseException):
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _action(value: int, n_agents: int) -> Any:
    from mlagents_envs.base_env import ActionTuple

    return ActionTuple(discrete=np.full((n_agents, 1), value, dtype=np.int32))


class _SeededPolicy:
    """ML-Agents policy interface: ``get_action(decision_steps, worker_id) -> ActionInfo``."""

    def __init__(self, columns: list[list[int]]) -> None:
        from envmanager.mlagents import ActionInfo

        self.columns = columns
        self.rows = len(columns[0])
        self.position = [0] * len(columns)
        self.for_steps = ActionInfo.for_steps
        self.empty = ActionInfo.empty

    def get_action(self, decision_steps: Any, worker_id: int) -> Any:
        n = len(decision_steps)
        if n == 0:
            return self.empty()
        p = self.position[worker_id]
        self.position[worker_id] = p + 1
        return self.for_steps(decision_steps, _action(self.columns[worker_id][p % self.rows], n))


def _manager(scenario: Scenario, path: str) -> Any:
    from envmanager.mlagents import MLAgentsEnvManager, UnityEnvironmentFactory

    return _with_free_ports(
        lambda port: MLAgentsEnvManager(
            UnityEnvironmentFactory(path, base_port=port, timeout_wait=TIMEOUT_WAIT), scenario.n_env,
            restart_workers=False,
        ),
        scenario.n_env,
    )


def run_first_ready(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    progress = Progress(tick, scenario, steps)
    with _launcher() as path, _manager(scenario, path) as manager:
        manager.set_policy(BEHAVIOR, _SeededPolicy(actions.T.tolist()))
        manager.reset()
        get_steps = manager.get_steps
        start = time.perf_counter()
        while progress.done < steps:
            progress.add(len(get_steps()))
        elapsed = time.perf_counter() - start
    progress.close()
    return progress.done, elapsed


def run_lockstep(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    n = scenario.n_env
    table = [{w: {BEHAVIOR: _action(a, 1)} for w, a in enumerate(row)} for row in actions.tolist()]
    progress = Progress(tick, scenario, steps)
    with _launcher() as path, _manager(scenario, path) as wrapped:
        core = wrapped.manager  # the SubprocessEnvManager under MLAgentsEnvManager
        core.reset()
        start = time.perf_counter()
        lockstep(core.step, table, n, -(-steps // n), progress)
        elapsed = time.perf_counter() - start
    progress.close()
    return progress.done, elapsed


def run_sequential(scenario: Scenario, steps: int, actions: np.ndarray, tick: Tick) -> tuple[int, float]:
    from mlagents_envs.environment import UnityEnvironment

    n = scenario.n_env
    rows = len(actions)
    progress = Progress(tick, scenario, steps)
    envs: list[Any] = []
    with _launcher() as path:
        try:
            def start(port: int) -> None:
                for env in envs:  # a previous attempt's
                    env.close()
                envs.clear()
                for i in range(n):
                    envs.append(UnityEnvironment(file_name=path, worker_id=i, base_port=port, seed=i,
                                                 no_graphics=True, timeout_wait=TIMEOUT_WAIT))

            _with_free_ports(start, n)
            for env in envs:
                env.reset()
            start_time = time.perf_counter()
            for k in range(-(-steps // n)):
                row = actions[k % rows]
                for i, env in enumerate(envs):
                    decision_steps, _ = env.get_steps(BEHAVIOR)
                    if len(decision_steps):
                        env.set_actions(BEHAVIOR, _action(int(row[i]), len(decision_steps)))
                    env.step()
                progress.add(n)
            elapsed = time.perf_counter() - start_time
        finally:
            for env in envs:
                try:
                    env.close()
                except Exception:
                    pass
    progress.close()
    return progress.done, elapsed
