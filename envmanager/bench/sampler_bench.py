"""The ``sampler`` scenario of ``envmanager bench``: the sampling layer's figures, as ratios
measured in one run (interleaved repeats, as every scenario).

* Worker-side policy: 8 CartPole envs and a small numpy MLP; ``WorkerPolicySampler`` against
  the same rollout loop over 8 envs in one process (same policy, same lockstep, same
  recording), and against the policy in the parent stepping gymnasium's ``AsyncVectorEnv``.
* Parent-side policy on the ``uneven`` envs: ``Sampler.obtain_steps`` (first-ready, partial
  batches) against a lockstep loop with the same policy (wait for all 8, act on all 8).
* Learner feed: ``Sampler.stream`` into a ``LearnerFeed`` whose ``learn_fn`` takes as long as
  collecting one fragment, against collecting and learning in turn; throughput is env-steps
  learned per second, and the policy lag that overlap costs is reported. The ``learn_fn``
  sleeps (a learner on an accelerator or a core of its own), so it competes for no CPU.

Its contenders are its own (``--backends`` does not apply); targets show with ``--targets``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from envmanager.bench.common import START_METHOD, cores
from envmanager.bench.runner import Measurement, ScenarioResult, Target
from envmanager.bench.scenarios import Scenario, cartpole, uneven_env

logger = logging.getLogger(__name__)

__all__ = ["MLPPolicy", "SamplerResult", "run", "TARGETS"]

WORKER, LOCAL, ASYNC = "worker-policy", "1-process loop", "gym.Async+policy"
FIRST_READY, LOCKSTEP = "uneven first-ready", "uneven lockstep"
OVERLAP, IN_TURN = "learner overlapped", "learner in turn"
#: (what, contender, reference, column, threshold): the issue's figures.
TARGETS = (
    ("worker x 1-process loop", WORKER, LOCAL, "vs 1-process", 1.5),
    ("worker x gym Async+policy", WORKER, ASYNC, "vs gym Async", 3.0),
    ("uneven first-ready x lockstep", FIRST_READY, LOCKSTEP, "vs lockstep", 1.8),
    ("learner overlap x in turn", OVERLAP, IN_TURN, "vs in turn", 1.6),
)


@dataclasses.dataclass
class SamplerResult(ScenarioResult):
    """A ``ScenarioResult`` with ratio columns, targets and notes of its own."""

    extra_ratios: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    own_targets: list[Target] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def ratios(self) -> dict[str, dict[str, float]]:
        return dict(self.extra_ratios)

    def targets(self) -> list[Target]:
        return list(self.own_targets)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "notes": list(self.notes), "extra": dict(self.extra)}


class MLPPolicy:
    """A small numpy MLP (obs -> 64 -> 64 -> actions, tanh), sampling actions: batched
    ``get_actions(observations, worker_ids)``; picklable, so it also runs in the workers."""

    def __init__(self, obs_dim: int = 4, n_actions: int = 2, hidden: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.params = [rng.normal(0, 1 / np.sqrt(a), (a, b)).astype(np.float32)
                       for a, b in ((obs_dim, hidden), (hidden, hidden), (hidden, n_actions))]
        self.rng = np.random.default_rng(seed + 1)

    def get_actions(self, observations: np.ndarray, worker_ids: np.ndarray) -> np.ndarray:
        h = np.tanh(np.asarray(observations, dtype=np.float32) @ self.params[0])
        h = np.tanh(h @ self.params[1])
        logits = h @ self.params[2]
        return np.argmax(logits - np.log(-np.log(self.rng.random(logits.shape))), axis=1)  # Gumbel-max sample

    def set_param_values(self, params: list[np.ndarray]) -> None:
        self.params = params


# ---------------------------------------------------------------------------------------------
# The contenders: each returns (env-steps, seconds of the timed loop)


def run_worker_policy(steps: int, n: int) -> tuple[int, float]:
    from envmanager.sampler import WorkerPolicySampler

    per_slot = max(1, steps // n)
    with WorkerPolicySampler(cartpole, n, MLPPolicy(), seed=0, envs_per_worker=max(1, n // cores()),
                             context=START_METHOD) as sampler:
        sampler.obtain_steps(min(per_slot, 16))  # first fragment: unpickles the agent, maps the arena
        start = time.perf_counter()
        batch = sampler.obtain_steps(per_slot)
        return len(batch), time.perf_counter() - start


def run_one_process(steps: int, n: int) -> tuple[int, float]:
    from envmanager.sampler.rollout import ArenaSpec, run_local
    from envmanager.wire import shm

    per_slot = max(1, steps // n)
    envs = [cartpole(i) for i in range(n)]
    try:
        spec = ArenaSpec("", n, per_slot, shm.array_layout(envs[0].observation_space), shm.array_layout(envs[0].action_space))
        policy = MLPPolicy()
        _, arena, states = run_local(envs, policy, min(per_slot, 16), spec)
        start = time.perf_counter()
        answer, arena, _ = run_local(envs, policy, per_slot, spec, states, arena)
        rows = answer["rows"][0]
        batch = {f: getattr(arena, f)[:, :rows].reshape(n * rows, *getattr(arena, f).shape[2:]).copy()
                 for f in ("observations", "next_observations", "actions", "rewards", "terminated", "truncated", "episodes")}
        elapsed = time.perf_counter() - start
        return len(batch["rewards"]), elapsed
    finally:
        for env in envs:
            env.close()


def run_async_parent_policy(steps: int, n: int) -> tuple[int, float]:
    vec = gym.vector.AsyncVectorEnv([functools.partial(cartpole, i) for i in range(n)], context=START_METHOD)
    try:
        policy = MLPPolicy()
        ids = np.arange(n)
        obs, _ = vec.reset(seed=0)
        record: list[tuple[Any, ...]] = []
        start = time.perf_counter()
        for _ in range(max(1, steps // n)):
            actions = policy.get_actions(obs, ids)
            next_obs, rewards, terminated, truncated, _ = vec.step(actions)
            record.append((obs, actions, rewards, terminated, truncated, next_obs))
            obs = next_obs
        batch = [np.concatenate(column) for column in zip(*record, strict=True)]
        elapsed = time.perf_counter() - start
        return len(batch[2]), elapsed
    finally:
        vec.close()


def run_first_ready_uneven(steps: int, n: int) -> tuple[int, float]:
    from envmanager.sampler import Sampler

    with Sampler(uneven_env, n, MLPPolicy(n_actions=3), seed=0, context=START_METHOD) as sampler:
        sampler.obtain_steps(n)
        start = time.perf_counter()
        batch = sampler.obtain_steps(steps)
        return len(batch), time.perf_counter() - start


def run_lockstep_uneven(steps: int, n: int) -> tuple[int, float]:
    """The same policy, held to lockstep: act on all envs, wait until all have stepped."""
    from envmanager.core.batch import BatchEnvManager

    policy = MLPPolicy(n_actions=3)
    ids = np.arange(n, dtype=np.int64)
    with BatchEnvManager(uneven_env, n, autoreset_mode="disabled", context=START_METHOD) as m:
        m.send_reset({s: (s, None) for s in range(n)})
        m.receive_reset_batch()
        r = m.results
        obs = r.observation.copy()
        record: list[tuple[Any, ...]] = []
        start = time.perf_counter()
        for _ in range(max(1, steps // n)):
            actions = policy.get_actions(obs, ids)
            m.send_batch(ids, actions)
            got = 0
            while got < n:
                got += len(m.receive_batch(1).slots)
            next_obs = r.observation.copy()
            ended = r.terminated | r.truncated
            record.append((obs, actions, r.reward.copy(), r.terminated.copy(), r.truncated.copy(), next_obs))
            obs = next_obs
            if ended.any():
                done = np.flatnonzero(ended).tolist()
                m.send_reset(dict.fromkeys(done, (None, None)))
                m.receive_reset_batch(done)
                obs[done] = r.observation[done]
        batch = [np.concatenate(column) for column in zip(*record, strict=True)]
        return len(batch[2]), time.perf_counter() - start


def _sleeper(seconds: float) -> Callable[[Any], dict[str, Any]]:
    def learn(batch: Any) -> dict[str, Any]:
        time.sleep(seconds)
        return {"steps": len(batch)}
    return learn


def learn_cost(fragment: int, n: int) -> float:
    """Seconds to collect one fragment with the parent-side sampler (median of 3): what
    ``learn_fn`` is made to cost."""
    from envmanager.sampler import Sampler

    with Sampler(cartpole, n, MLPPolicy(), seed=0, context=START_METHOD) as sampler:
        sampler.obtain_steps(fragment)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            sampler.obtain_steps(fragment)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_in_turn(steps: int, n: int, fragment: int, cost: float) -> tuple[int, float]:
    from envmanager.sampler import Sampler

    policy = MLPPolicy()
    learn = _sleeper(cost)
    with Sampler(cartpole, n, policy, seed=0, context=START_METHOD) as sampler:
        sampler.obtain_steps(fragment)
        done = 0
        start = time.perf_counter()
        for version in range(1, max(1, steps // fragment) + 1):
            batch = sampler.obtain_steps(fragment)
            learn(batch)
            sampler.update(agent_update=policy.params, version=version)
            done += len(batch)
        return done, time.perf_counter() - start


def run_overlapped(steps: int, n: int, fragment: int, cost: float, lags: list[dict[str, float]]) -> tuple[int, float]:
    from envmanager.sampler import LearnerFeed, Sampler

    policy = MLPPolicy()
    with Sampler(cartpole, n, policy, seed=0, context=START_METHOD) as sampler:
        sampler.obtain_steps(fragment)
        fragments = max(1, steps // fragment)
        feed = LearnerFeed(_sleeper(cost), queue_size=1, starve_timeout=60 + 10 * cost,
                           on_update=lambda version, metrics: sampler.update(agent_update=policy.params, version=version))
        with feed:
            start = time.perf_counter()
            for _ in sampler.stream(fragment, feed=feed, max_batches_waiting=1, max_fragments=fragments):
                pass
            feed.drain()
            elapsed = time.perf_counter() - start
        s = feed.stats.stats()
        lags.append({k: s.get(f"policy_lag_{k}", 0.0) for k in ("min", "mean", "max")})
        return fragments * fragment, elapsed


# ---------------------------------------------------------------------------------------------


def run(scenario: Scenario, steps: int, repeats: int, progress: Any = None, seed: int = 0) -> SamplerResult:
    """Measure every contender ``repeats`` times, interleaved; ratios, targets and notes."""
    n = scenario.n_env
    result = SamplerResult(scenario, steps, repeats)
    uneven_steps = max(2 * n, steps // 10)
    learn_steps = max(2 * n, steps // 2)
    fragment = max(n, learn_steps // 20)
    lags: list[dict[str, float]] = []
    cost = 0.0
    costs: list[float] = []
    contenders: dict[str, Callable[[], tuple[int, float]]] = {
        WORKER: lambda: run_worker_policy(steps, n),
        LOCAL: lambda: run_one_process(steps, n),
        ASYNC: lambda: run_async_parent_policy(steps, n),
        FIRST_READY: lambda: run_first_ready_uneven(uneven_steps, n),
        LOCKSTEP: lambda: run_lockstep_uneven(uneven_steps, n),
        IN_TURN: lambda: run_in_turn(learn_steps, n, fragment, cost),
        OVERLAP: lambda: run_overlapped(learn_steps, n, fragment, cost, lags),
    }
    total = repeats * (3 * steps + 2 * uneven_steps + 2 * learn_steps)
    bar = progress(total, scenario.name) if progress else None
    try:
        for r in range(repeats):
            for name, measure in contenders.items():
                if name in result.failed:
                    continue
                if name == IN_TURN:  # measured again just before the learner pair of each repeat:
                    try:  # other load on the machine changes it
                        cost = learn_cost(fragment, n)
                    except Exception as exc:
                        result.failed[IN_TURN] = result.failed[OVERLAP] = f"calibration: {type(exc).__name__}: {exc}"
                        continue
                    costs.append(cost)
                if bar is not None:
                    bar.set_description(f"{scenario.name}: {name} ({r + 1}/{repeats})")
                try:
                    got = measure()
                except Exception as exc:
                    logger.warning("sampler: %s failed: %r", name, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
                    result.failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                result.measurements.setdefault(name, Measurement(name, scenario.name, n)).add(*got)
                if bar is not None:
                    bar.update(got[0])
    finally:
        if bar is not None:
            bar.close()
    for name in result.failed:
        result.measurements.pop(name, None)
    m = result.measurements
    for what, contender, reference, column, threshold in TARGETS:
        if contender in m and reference in m:
            value = m[contender].median / m[reference].median
            result.extra_ratios.setdefault(column, {})[contender] = value
            result.own_targets.append(Target(scenario.name, what, contender, value, threshold))
    result.notes.append(f"{WORKER}: {max(1, n // cores())} envs per process ({cores()} cores), fragments of "
                        f"{max(1, steps // n)} steps per env; {ASYNC}: the MLP in this process, lockstep")
    result.notes.append(f"uneven: {uneven_steps:,} steps per repeat; learner: {learn_steps:,} steps in fragments of "
                        f"{fragment:,}, learn_fn sleeping {min(costs, default=0) * 1e3:.1f}-{max(costs, default=0) * 1e3:.1f} "
                        "ms per fragment (one fragment's collection, measured before each repeat)")
    if lags:
        mean = statistics.mean(lag["mean"] for lag in lags)
        result.notes.append(f"{OVERLAP}: policy lag min {min(lag['min'] for lag in lags):.0f} / mean {mean:.2f} / "
                            f"max {max(lag['max'] for lag in lags):.0f} versions (in turn: 0)")
        result.extra["policy_lag"] = {"mean": mean, "max": max(lag["max"] for lag in lags)}
    result.extra["learn_fn_seconds"] = costs
    return result
