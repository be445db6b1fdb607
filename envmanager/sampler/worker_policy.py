"""``WorkerPolicySampler``: the policy in the workers, garage style.

Each worker gets a picklable agent (``agent.get_action(observation) -> action`` or
``(action, agent_info)``) and runs a whole fragment or whole episodes per request, so cheap envs
pay one inter-process round trip per fragment instead of one per step. The agent travels
cloudpickled with each request and is unpickled once per version in each process.

This first version returns fragments through the worker's pipe (pickled numpy arrays), not
yet through shared memory announced by one notice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from envmanager.core.batch import BatchEnvManager, seeds_for
from envmanager.errors import InvalidInputError
from envmanager.sampler.batches import EpisodeBatch, Step, TransitionBatch
from envmanager.sampler.stats import Stats
from envmanager.worker.envs import DISABLED

logger = logging.getLogger(__name__)

__all__ = ["WorkerPolicySampler"]

# In each worker process: the agent of the latest version, and each env's running episode.
_agent: tuple[int, Any] | None = None
_running: dict[int, dict[str, Any]] = {}


def _get_agent(version: int, payload: bytes) -> Any:
    global _agent
    if _agent is None or _agent[0] != version:
        _agent = (version, cloudpickle.loads(payload))
    return _agent[1]


def _act(agent: Any, observation: Any) -> tuple[Any, dict[str, Any]]:
    out = agent.get_action(observation)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out
    return out, {}


def _set_seed(env: Any, seed: int | None) -> None:
    """Run in the worker: the seed of this env's next (first) reset."""
    _running[id(env)] = {"obs": None, "episode": -1, "seed": seed}


def _rollout(env: Any, version: int, payload: bytes, n_steps: int, n_episodes: int) -> dict[str, Any]:
    """Run in the worker: ``n_steps`` steps continuing the running episode (``n_episodes=0``),
    or ``n_episodes`` whole episodes each started now. Returns one list per field."""
    agent = _get_agent(version, payload)
    state = _running.setdefault(id(env), {"obs": None, "episode": -1, "seed": None})
    fields: dict[str, list] = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated", "next_obs", "episode", "info")}
    discarded = 0
    if n_episodes:
        discarded = int(state["obs"] is not None)
        state["obs"] = None
    finished = 0
    while (n_episodes and finished < n_episodes) or (not n_episodes and len(fields["reward"]) < n_steps):
        if state["obs"] is None:
            state["obs"], _ = env.reset(seed=state["seed"])
            state["seed"] = None
            state["episode"] += 1
        action, info = _act(agent, state["obs"])
        obs, reward, terminated, truncated, _ = env.step(action)
        for key, value in (("obs", state["obs"]), ("action", action), ("reward", float(reward)), ("terminated", bool(terminated)),
                           ("truncated", bool(truncated)), ("next_obs", obs), ("episode", state["episode"]), ("info", info)):
            fields[key].append(value)
        if terminated or truncated:
            state["obs"] = None
            finished += 1
        else:
            state["obs"] = obs
    fields["discarded_episodes"] = discarded  # type: ignore[assignment]
    return fields


class WorkerPolicySampler:
    """Collect with a picklable agent in every worker: one request per fragment per process.

    Args:
        env_factory: ``env_factory(worker_id) -> env``.
        n_workers: env slots.
        agent: picklable (cloudpickle), with ``get_action(observation)``.
        seed: slot ``i``'s first reset gets ``seed + i``.
        manager_options: passed to ``BatchEnvManager`` (``envs_per_worker``, ``timeout``, ...).
    """

    def __init__(self, env_factory: Callable[[int], Any], n_workers: int, agent: Any, *, seed: int | None = None,
                 **manager_options: Any) -> None:
        if not hasattr(agent, "get_action"):
            raise InvalidInputError("the agent needs get_action(observation)")
        self.manager = BatchEnvManager(env_factory, n_workers, autoreset_mode=DISABLED, **manager_options)
        self.n_workers = n_workers
        self.stats = Stats("worker-sampler")
        for slot, slot_seed in enumerate(seeds_for(seed, n_workers)):
            if slot_seed is not None:
                self.manager.call_on([slot], _set_seed, (slot_seed,))
        self.policy_version = 0
        self._payload = cloudpickle.dumps(agent)
        self._episode_ids: dict[tuple[int, int], int] = {}

    def update(self, agent_update: Any = None) -> int:
        """A new agent for the workers (picklable): used from the next request on."""
        if agent_update is not None:
            self.policy_version += 1
            self._payload = cloudpickle.dumps(agent_update)
        return self.policy_version

    def obtain_steps(self, steps_per_worker: int, agent_update: Any = None) -> TransitionBatch:
        """``steps_per_worker`` steps from every slot, in worker order; episodes continue."""
        if not isinstance(steps_per_worker, int) or steps_per_worker < 1:
            raise InvalidInputError(f"steps_per_worker must be a positive int, got {steps_per_worker!r}")
        self.update(agent_update)
        return TransitionBatch.from_steps([s for per_slot in self._run(steps_per_worker, 0) for s in per_slot])

    def obtain_exact_episodes(self, n_eps_per_worker: int, agent_update: Any = None) -> EpisodeBatch:
        """``n_eps_per_worker`` whole episodes from every slot, each started by this call (a
        running episode is abandoned, counted as ``discarded_episodes``), in worker order."""
        if not isinstance(n_eps_per_worker, int) or n_eps_per_worker < 1:
            raise InvalidInputError(f"n_eps_per_worker must be a positive int, got {n_eps_per_worker!r}")
        self.update(agent_update)
        episodes = []
        for per_slot in self._run(0, n_eps_per_worker):
            by_episode: dict[int, list[Step]] = {}
            for step in per_slot:
                by_episode.setdefault(step.episode_id, []).append(step)
            episodes += [TransitionBatch.from_steps(steps) for steps in by_episode.values()]
        return EpisodeBatch.from_transitions(episodes, [False] * len(episodes))

    def _run(self, n_steps: int, n_episodes: int) -> list[list[Step]]:
        m = self.manager
        out: list[list[Step]] = []
        # One request per process (its slots run one after the other), every process at once.
        with self.stats.timer("collect"):
            answers = m.call_on(None, _rollout, (self.policy_version, self._payload, n_steps, n_episodes))
        for slot, fields in enumerate(answers):
            self.stats.count("discarded_episodes", fields["discarded_episodes"])
            self.stats.count("env_steps", len(fields["reward"]))
            steps = []
            for i in range(len(fields["reward"])):
                key = (slot, fields["episode"][i])
                episode = self._episode_ids.setdefault(key, len(self._episode_ids))
                steps.append(Step(fields["obs"][i], fields["action"][i], fields["reward"][i], fields["terminated"][i],
                                  fields["truncated"][i], fields["next_obs"][i], slot, episode, self.policy_version, 0,
                                  fields["info"][i], {}))
            out.append(steps)
        return out

    def close(self) -> None:
        self.manager.close()

    shutdown_worker = close

    def __enter__(self) -> WorkerPolicySampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
