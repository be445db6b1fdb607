"""The ``ray`` scenario of ``envmanager bench``: ``RaySampler`` on a local Ray session.

Three measurements, each against a peer measured in the same run:

* throughput: 2 nodes x 4 CartPole-v1, fragments of 256 steps, a small numpy MLP policy on the
  nodes, against a local ``Sampler`` over the same 8 envs and against one step per Ray call;
* uneven envs (lognormal step time): first-ready across nodes against waiting for every node,
  with both nodes alike and with node 1's envs three times slower;
* faults: a node killed every ~10k steps of a long run; lost, duplicated and cut episodes.

The nodes are simulated: two actors on this machine (``ray.init(num_cpus=cores)``).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from envmanager.bench.runner import Measurement, ScenarioResult, Target
from envmanager.bench.scenarios import UNEVEN, Scenario, cartpole
from envmanager.sampler import Sampler, TransitionBatch
from envmanager.testing.envs import ControlledEnv

logger = logging.getLogger(__name__)

__all__ = ["MLPPolicy", "RayResult", "run"]

FRAGMENT = 256
NODES, ENVS_PER_NODE = 2, 4
SLOW_NODE = 3.0  # ``uneven-slow-node``: node 1's envs sleep this many times longer
LOCAL, RAY, ONE_STEP = "local Sampler 8 envs", "ray 2x4 fragments", "ray 1 step per call"
FIRST, ALL = "first-ready", "wait-for-all"


class MLPPolicy:
    """A small numpy MLP (obs -> 64 -> actions), sampled; one batched call per ready set."""

    def __init__(self, obs_dim: int = 4, n_actions: int = 2, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = rng.normal(0, 0.5, (obs_dim, 64)).astype(np.float32)
        self.w2 = rng.normal(0, 0.5, (64, n_actions)).astype(np.float32)
        self.rng = np.random.default_rng(seed + 1)

    def get_actions(self, observations: Any, worker_ids: Any) -> np.ndarray:
        logits = np.tanh(np.asarray(observations, dtype=np.float32) @ self.w1) @ self.w2
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return (self.rng.random((len(p), 1)) > np.cumsum(p, axis=1)).sum(axis=1)

    def set_param_values(self, params: tuple[np.ndarray, np.ndarray]) -> None:
        self.w1, self.w2 = params


def uneven_env(slow_from: int, env_id: int) -> ControlledEnv:
    """``uneven``'s env (lognormal sleep per step); slots from ``slow_from`` on sleep ``SLOW_NODE``x longer."""
    scale = SLOW_NODE if env_id >= slow_from else 1.0
    return ControlledEnv(env_id, lognormal=(UNEVEN[0] * scale, UNEVEN[1]))


class RayResult(ScenarioResult):
    """A ``ScenarioResult`` with the ray scenario's own ratio columns, notes and targets."""

    def __init__(self, scenario: Scenario, steps: int, repeats: int) -> None:
        super().__init__(scenario, steps, repeats)
        self.notes: list[str] = []
        self.faults: dict[str, Any] = {}

    def ratios(self) -> dict[str, dict[str, float]]:
        m = {k: v.median for k, v in self.measurements.items()}
        out: dict[str, dict[str, float]] = {}
        if RAY in m and LOCAL in m:
            out["vs local"] = {RAY: m[RAY] / m[LOCAL]}
        if RAY in m and ONE_STEP in m:
            out["vs 1-step"] = {RAY: m[RAY] / m[ONE_STEP]}
        for variant in ("uneven", "uneven-slow-node"):
            first, every = f"{variant} {FIRST}", f"{variant} {ALL}"
            if first in m and every in m:
                out.setdefault("vs wait-all", {})[first] = m[first] / m[every]
        return out

    def targets(self) -> list[Target]:
        r, name = self.ratios(), self.name
        out = []
        for column, key, what, threshold in (("vs local", RAY, "x local Sampler", 0.8),
                                             ("vs 1-step", RAY, "x 1 step per call", 20.0),
                                             ("vs wait-all", f"uneven {FIRST}", "first-ready x wait-all", 1.8)):
            if key in r.get(column, {}):
                out.append(Target(name, what, key, r[column][key], threshold))
        if self.faults:
            f = self.faults
            ok = float(f["lost"] == 0 and f["duplicated"] == 0 and f["cut_unreported"] == 0)
            out.append(Target(name, "0 lost/dup, cuts reported", "ray", ok, 1.0))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "notes": self.notes, "faults": self.faults}


def run(scenario: Scenario, steps: int, repeats: int, progress: Any = None, seed: int = 0) -> RayResult:
    """Measure the ray scenario (``steps``: env-steps per timed throughput repeat)."""
    import ray

    from envmanager.ray import RaySampler

    result = RayResult(scenario, steps, repeats)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    temp_dir = tempfile.mkdtemp(prefix="envmgr-bench-ray-") if started else None
    if started:
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        policy = MLPPolicy()
        contenders = {
            LOCAL: lambda: _local(policy, steps),
            RAY: lambda: _ray(RaySampler, cartpole, policy, steps, FRAGMENT, first_ready=True),
            ONE_STEP: lambda: _ray(RaySampler, cartpole, policy, max(300, steps // 50), 1, first_ready=True),
        }
        for slow_from, variant in ((NODES * ENVS_PER_NODE, "uneven"), (ENVS_PER_NODE, "uneven-slow-node")):
            factory = functools.partial(uneven_env, slow_from)
            uneven_policy = MLPPolicy(n_actions=3)
            for mode, first in ((FIRST, True), (ALL, False)):
                contenders[f"{variant} {mode}"] = functools.partial(
                    _ray, RaySampler, factory, uneven_policy, max(500, steps // 25), 64, first_ready=first,
                    envs_per_worker=1)  # sleeping envs: one per process, as the uneven scenario
        for r in range(repeats):
            for name, measure in contenders.items():
                if name in result.failed:
                    continue
                try:
                    n, seconds = measure()
                except Exception as exc:
                    logger.warning("ray: %s failed: %r", name, exc)
                    result.failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                result.measurements.setdefault(name, Measurement(name, scenario.name, scenario.n_env)).add(n, seconds)
                logger.info("ray: %s repeat %d: %.0f steps/s", name, r + 1, n / seconds)
        result.faults = _faults(RaySampler, policy, 2 * steps)
        f = result.faults
        result.notes += [
            f"uneven: envs sleep lognormal(median {UNEVEN[0] * 1e3:g} ms, sigma {UNEVEN[1]:g}) per step, one per process,"
            " fragments of 64 steps;"
            f" uneven-slow-node: node 1's envs {SLOW_NODE:g}x slower",
            f"faults: {f['steps']:,} steps, a node killed every {f['kill_every']:,}"
            f" ({f['kills']} kills, {f['restarts']} restarts,"
            f" {f['seconds']:.1f} s): lost {f['lost']}, duplicated {f['duplicated']}, cut episodes {f['cut']}"
            f" (reported {f['cut'] - f['cut_unreported']}, steps flagged {f['flagged_steps']})",
        ]
    finally:
        if started:
            ray.shutdown()
            shutil.rmtree(temp_dir or "", ignore_errors=True)
    return result


def _local(policy: MLPPolicy, steps: int) -> tuple[int, float]:
    # forkserver, as on the nodes: this process runs Ray's threads, which must not be forked
    with Sampler(cartpole, NODES * ENVS_PER_NODE, policy, seed=0, envs_per_worker=ENVS_PER_NODE,
                 context="forkserver") as sampler:
        sampler.obtain_steps(FRAGMENT)  # warm-up: envs built and reset
        start, n = time.perf_counter(), 0
        while n < steps:
            n += len(sampler.obtain_steps(FRAGMENT))
        return n, time.perf_counter() - start


def _ray(ray_sampler: Any, factory: Any, policy: MLPPolicy, steps: int, fragment: int, first_ready: bool,
         envs_per_worker: int = ENVS_PER_NODE) -> tuple[int, float]:
    with ray_sampler(factory, policy, nodes=NODES, envs_per_node=ENVS_PER_NODE, fragment_steps=fragment, seed=0,
                     first_ready=first_ready, envs_per_worker=envs_per_worker) as sampler:
        sampler.obtain_steps(fragment * NODES)  # warm-up: actors, envs and the first fragments
        start, n = time.perf_counter(), 0
        while n < steps:
            n += len(sampler.obtain_steps(fragment))
        return n, time.perf_counter() - start


def _faults(ray_sampler: Any, policy: MLPPolicy, steps: int) -> dict[str, Any]:
    """A long run with a node killed every ~``steps / 20`` steps; what the learner would see."""
    batches: list[TransitionBatch] = []
    kill_every = max(1_000, steps // 20)  # ~10k steps in a 200k-step run
    kills, next_kill, n = 0, kill_every, 0
    start = time.perf_counter()
    with ray_sampler(cartpole, policy, nodes=NODES, envs_per_node=ENVS_PER_NODE, fragment_steps=FRAGMENT, seed=0,
                     envs_per_worker=ENVS_PER_NODE, max_lifetime_restarts=-1, restarts_rate_limit_n=-1) as sampler:
        while n < steps:
            batch = sampler.obtain_steps(FRAGMENT)
            batches.append(batch)
            n += len(batch)
            if n >= next_kill:
                sampler.kill_node(kills % NODES)
                kills += 1
                next_kill += kill_every
        stats = sampler.stats.stats()
        buffered = sampler.buffered_steps
        reported = set(sampler.cut_episodes)
        open_at_end = sampler.open_episodes
        restarts = sum(sampler.restart_count(i) for i in range(NODES))
    seconds = time.perf_counter() - start
    every = TransitionBatch.concatenate(batches)
    return {"steps": len(every), "kills": kills, "kill_every": kill_every, "restarts": restarts, "seconds": seconds,
            **check_stream(every, int(stats.get("env_steps", 0)) - buffered, reported, open_at_end)}


def check_stream(batch: TransitionBatch, delivered: int, reported: set[int], open_at_end: set[int]) -> dict[str, int]:
    """Lost, duplicated and cut episodes in a stream of steps (rows in hand-out order).

    ``delivered``: steps the nodes delivered to the driver that should have been handed out.
    A step is duplicated if its episode already had a step with the same observation; a gap
    is a step whose observation is not the previous step's next observation (lost in between).
    A cut episode ends without a done and is not running at the end.
    """
    duplicated = gaps = cut = unreported = 0
    for episode in np.unique(batch.episode_ids):
        rows = np.flatnonzero(batch.episode_ids == episode)
        obs, nxt = batch.observations[rows], batch.next_observations[rows]
        duplicated += len(rows) - len({o.tobytes() for o in obs})
        gaps += int((obs[1:] != nxt[:-1]).any(axis=1).sum())
        if not batch.dones[rows[-1]] and int(episode) not in open_at_end:
            cut += 1
            unreported += int(episode) not in reported
    return {"lost": max(0, delivered - len(batch)) + gaps, "duplicated": duplicated, "cut": cut,
            "cut_unreported": unreported, "flagged_steps": int(batch.interrupted.sum())}
