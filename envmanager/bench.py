"""The benchmark behind ``envmanager bench``: steps per second of envmanager and its peers.

Every backend in a run steps the same environments with the same actions; results are
reported as ratios against gymnasium's vector envs measured in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["Scenario", "SCENARIOS", "Measurement", "run_backend", "BACKENDS"]


def _cartpole(env_id: int) -> gym.Env:
    return gym.make("CartPole-v1")


@dataclass(frozen=True)
class Scenario:
    """``n_env`` envs from ``factory(env_id)``, stepped for ``steps`` env-steps per repeat."""

    name: str
    factory: Callable[[int], Any]
    n_env: int
    steps: int
    description: str


SCENARIOS: dict[str, Scenario] = {
    "cartpole": Scenario("cartpole", _cartpole, 8, 40_000, "8 CartPole-v1 envs"),
}


@dataclass
class Measurement:
    backend: str
    scenario: str
    steps_per_second: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(np.median(self.steps_per_second))

    @property
    def best(self) -> float:
        return float(np.max(self.steps_per_second))


def _actions(n_env: int, count: int, seed: int = 0) -> np.ndarray:
    """The same action sequence for every backend: ``count`` rows of ``n_env`` actions."""
    return np.random.default_rng(seed).integers(0, 2, size=(count, n_env))


def _run_envmanager(scenario: Scenario, steps: int, tick: Callable[[int], None], **kwargs: Any) -> float:
    from envmanager import SubprocessEnvManager

    with SubprocessEnvManager(scenario.factory, scenario.n_env, **kwargs) as manager:
        manager.reset(seed=0)
        actions = _actions(scenario.n_env, steps // scenario.n_env + 2)
        row = [0] * scenario.n_env  # next action row per env
        done = 0
        start = time.perf_counter()
        while done < steps:
            todo = {w: int(actions[row[w] % len(actions), w]) for w in manager.idle_worker_ids}
            for w in todo:
                row[w] += 1
            finished = len(manager.step(todo))
            done += finished
            tick(finished)
        return done / (time.perf_counter() - start)


def _run_gym_vector(cls: type, scenario: Scenario, steps: int, tick: Callable[[int], None]) -> float:
    fns = [lambda i=i: scenario.factory(i) for i in range(scenario.n_env)]
    env = cls(fns)
    try:
        env.reset(seed=0)
        actions = _actions(scenario.n_env, steps // scenario.n_env + 2)
        rounds = steps // scenario.n_env
        start = time.perf_counter()
        for n in range(rounds):
            env.step(actions[n])
            tick(scenario.n_env)
        return rounds * scenario.n_env / (time.perf_counter() - start)
    finally:
        env.close()


BACKENDS: dict[str, Callable[[Scenario, int, Callable[[int], None]], float]] = {
    "envmanager": _run_envmanager,
    "gym.SyncVectorEnv": lambda s, n, t: _run_gym_vector(gym.vector.SyncVectorEnv, s, n, t),
    "gym.AsyncVectorEnv": lambda s, n, t: _run_gym_vector(gym.vector.AsyncVectorEnv, s, n, t),
}


def run_backend(
    backend: str, scenario: Scenario, steps: int, repeats: int, tick: Callable[[int], None] = lambda n: None
) -> Measurement:
    """Measure one backend: a short warm-up, then ``repeats`` timed runs of ``steps`` steps."""
    run = BACKENDS[backend]
    run(scenario, max(scenario.n_env * 20, steps // 20), lambda n: None)  # warm-up
    m = Measurement(backend, scenario.name)
    for _ in range(repeats):
        m.steps_per_second.append(run(scenario, steps, tick))
    return m


def ratios(measurements: Iterable[Measurement], reference: str) -> dict[str, float]:
    by_name = {m.backend: m for m in measurements}
    ref = by_name[reference].median
    return {name: m.median / ref for name, m in by_name.items()}
