"""What runs on a Ray node: one actor holding a local ``Sampler`` over local env processes.

The policy runs here, on the node (batched over the node's ready envs), so a Ray call carries
a whole fragment of env work, never one step. The class becomes an actor in ``envmanager.ray.nodes``
(it needs ``ray`` only to name its Ray node). Envs and policy see global slot ids, and steps
carry the policy versions the driver chose; the driver only makes episode ids unique.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from typing import Any

from envmanager.errors import EnvManagerError
from envmanager.sampler import EpisodeBatch, Sampler, TransitionBatch
from envmanager.sampler.sampler import apply_agent_update

logger = logging.getLogger(__name__)

__all__ = ["SamplerNode"]

#: Stats counters of the node's sampler that the driver adds up across the cluster.
COUNTERS = ("env_steps", "discarded_steps", "interrupted_episodes", "episodes", "policy_updates")
#: Seconds a request waits on the node for updates the driver sent before it (they come in
#: another thread: Ray does not order calls across concurrency groups).
UPDATE_WAIT = 60.0


def _global_env(env_factory: Any, offset: int, local_id: int) -> Any:
    """The user's factory sees the global slot id (``offset + local``), on every node."""
    return env_factory(offset + local_id)


def _worker_pid(env: Any) -> int:
    return os.getpid()


class GlobalIds:
    """A policy as seen by a node's sampler: it gets global slot ids, and stays the user's object."""

    def __init__(self, policy: Any, offset: int) -> None:
        self.policy = policy
        self.offset = offset

    def get_actions(self, observations: Any, worker_ids: Any) -> Any:
        get_actions = getattr(self.policy, "get_actions", self.policy)
        return get_actions(observations, worker_ids + self.offset)

    def set_param_values(self, update: Any) -> None:
        """Weights into the user's policy (``set_param_values`` / ``load_state_dict``), or a new policy."""
        self.policy = apply_agent_update(self.policy, update)


class SamplerNode:
    """One node's share of the envs: slots ``offset .. offset + n_envs - 1`` of the cluster.

    Every collection method returns ``(batch, counters)``; the batch's ``worker_ids`` are global
    slots, its ``episode_ids`` the node's own (the driver makes them unique across nodes and
    restarts), its ``policy_versions`` the versions that chose each action on this node.
    """

    def __init__(self, index: int, env_factory: Any, n_envs: int, offset: int, policy: Any, seed: int | None,
                 sampler_options: dict[str, Any]) -> None:
        self.index = index
        self.offset = offset
        options = {"context": "forkserver", **sampler_options}  # never fork a Ray worker: it runs threads
        self.sampler = Sampler(functools.partial(_global_env, env_factory, offset), n_envs, GlobalIds(policy, offset),
                               seed=None if seed is None else seed + offset, **options)
        self._reported: dict[str, int] = {}
        self._updates = threading.Condition()
        self._updates_received = 0
        self._update_error: BaseException | None = None  # the first update that raised: every later request raises it

    # -- control (runs concurrently with collection: the Sampler's update is thread-safe) ------

    def update(self, version: int | None, agent_update: Any, env_updates: list[Any] | None) -> tuple[int, int]:
        """A policy version (weights from one ``ray.put``, resolved by Ray) and/or env updates.
        Counted even if it raises (requests waiting on it must not wait in vain); the error is
        kept and raised by every later request, naming this node."""
        try:
            return self.sampler.update(agent_update, env_updates, version=version)
        except BaseException as exc:
            with self._updates:
                if self._update_error is None:
                    self._update_error = exc
            raise
        finally:
            with self._updates:
                self._updates_received += 1
                self._updates.notify_all()

    def _await_updates(self, sent: int) -> None:
        """Every update the driver sent before this request is in (so a call made after
        ``update`` collects with it)."""
        with self._updates:
            if not self._updates.wait_for(lambda: self._updates_received >= sent, timeout=UPDATE_WAIT):
                raise EnvManagerError(f"node {self.index}: {sent - self._updates_received} update(s) sent before this "
                                      f"request did not arrive within {UPDATE_WAIT:g} s")
            error = self._update_error
        if error is not None:  # its own traceback goes with it (and Ray's names this node's actor)
            raise EnvManagerError(f"node {self.index}: an update sent before this request raised {error!r}") from error

    def info(self) -> dict[str, Any]:
        """Where this node runs: host, actor pid, env worker pids, Ray node id."""
        import ray

        return {"index": self.index, "host": socket.gethostname(), "pid": os.getpid(),
                "worker_pids": sorted(set(self.sampler.manager.call_on(None, _worker_pid))),
                "ray_node_id": ray.get_runtime_context().get_node_id()}

    # -- collection ----------------------------------------------------------------------------

    def steps(self, n: int, updates: int = 0) -> tuple[TransitionBatch, dict[str, int]]:
        """A fragment of ``n`` transitions; the node's episodes continue in the next fragment."""
        self._await_updates(updates)
        return self._answer(self.sampler.obtain_steps(n))

    def samples(self, n: int, updates: int = 0) -> tuple[EpisodeBatch, dict[str, int]]:
        """Whole episodes, started now, until at least ``n`` transitions (garage's rule)."""
        self._await_updates(updates)
        return self._answer(self.sampler.obtain_samples(0, n))

    def exact_episodes(self, quotas: list[int], updates: int = 0) -> tuple[EpisodeBatch, dict[str, int]]:
        """``quotas[i]`` episodes from local slot ``i``, each started now, in (slot, admission) order."""
        self._await_updates(updates)
        return self._answer(self.sampler.obtain_exact_episodes(quotas))

    def _answer(self, batch: Any) -> tuple[Any, dict[str, int]]:
        """The batch with global slot ids, and what the node's counters grew by since the last answer."""
        batch.worker_ids = batch.worker_ids + self.offset
        now = {k: int(self.sampler.stats.counters.get(k, 0)) for k in COUNTERS}
        grown = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return batch, grown

    def close(self) -> None:
        self.sampler.close()
