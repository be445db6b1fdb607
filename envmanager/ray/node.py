"""What runs on a Ray node: one actor holding a local ``Sampler`` over local env processes.

The policy runs here, so a Ray call carries a whole fragment of env work, never one step. The
class becomes an actor in ``envmanager.ray.nodes``. Envs and policy see global slot ids.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from typing import Any

from envmanager.core.updates import Pickled
from envmanager.errors import EnvManagerError, with_slot_offset
from envmanager.sampler import EpisodeBatch, Sampler, TransitionBatch
from envmanager.sampler.sampler import apply_agent_update
from envmanager.sampler.slots import EpisodeIds

__all__ = ["SamplerNode", "NodeFailure"]

#: Stats counters of the node's sampler that the driver adds up across the cluster.
COUNTERS = ("env_steps", "discarded_steps", "interrupted_episodes", "episodes", "policy_updates", "failed_episodes",
            "dropped_steps", "empty_cut_episodes", "worker_restarts")
#: Seconds a request waits on the node for updates the driver sent before it (they come in
#: another thread: Ray does not order calls across concurrency groups).
UPDATE_WAIT = 60.0


def _global_env(env_factory: Any, offset: int, local_id: int) -> Any:
    """The user's factory sees the global slot id (``offset + local``), on every node."""
    return env_factory(offset + local_id)


def _worker_pid(env: Any) -> int:
    return os.getpid()


class NodeFailure(EnvManagerError):
    """What a node's collection raised (``error``, naming global slots), and whether the node
    ``serves`` on after it (no env process given up, no update failed)."""

    def __init__(self, error: BaseException, serves: bool) -> None:
        self.error, self.serves = error, serves
        super().__init__(str(error))

    def __reduce__(self):
        return (type(self), (self.error, self.serves))


class GlobalIdsPolicy:
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
    """One node's share of the envs: slots ``offset .. offset + n_envs - 1`` of the cluster's
    ``n_slots``. Collection methods return ``(batch, counters)`` with global worker and episode
    ids; errors name the global slots. A restarted node gets ``seeds`` and ``started`` from
    ``SlotRecords.resume`` (no seeded episode replayed, no id reused), and its ``generation``."""

    def __init__(self, index: int, env_factory: Any, n_envs: int, offset: int, policy: Any, seeds: list[int | None],
                 started: list[int], n_slots: int, sampler_options: dict[str, Any], generation: int = 0) -> None:
        self.index = index
        self.offset = offset
        self.generation = generation
        options = {"context": "forkserver", **sampler_options}  # never fork a Ray worker: it runs threads
        self.sampler = Sampler(functools.partial(_global_env, env_factory, offset), n_envs, GlobalIdsPolicy(policy, offset),
                               seed=seeds, episode_ids=EpisodeIds(offset, n_slots, started), **options)
        self._reported: dict[str, int] = {}
        self._cut_reported = 0  # episodes cut by this node's sampler, told the driver so far
        self._updates = threading.Condition()
        self._updates_received = 0
        self._update_error: BaseException | None = None  # the first update that raised: every later request raises it

    # -- control (runs concurrently with collection: the Sampler's update is thread-safe) ------

    def update(self, version: int | None, agent_update: Any, env_updates: Pickled | None) -> tuple[int, int]:
        """A policy version and/or an env update (this node's slots of the driver's log entry).
        Counted even if it raises (requests waiting on it must not wait in vain); the error is
        kept and raised by every later request."""
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
        """Wait for every update the driver sent before this request."""
        with self._updates:
            if not self._updates.wait_for(lambda: self._updates_received >= sent, timeout=UPDATE_WAIT):
                raise EnvManagerError(f"node {self.index}: {sent - self._updates_received} update(s) sent before this "
                                      f"request did not arrive within {UPDATE_WAIT:g} s")
            error = self._update_error
        if error is not None:  # its own traceback goes with it (and Ray's names this node's actor)
            raise EnvManagerError(f"node {self.index}: an update sent before this request raised {error!r}") from error

    def info(self) -> dict[str, Any]:
        import ray

        return {"index": self.index, "generation": self.generation, "host": socket.gethostname(), "pid": os.getpid(),
                "worker_pids": sorted(set(self.sampler.manager.call_on(None, _worker_pid))),
                "ray_node_id": ray.get_runtime_context().get_node_id()}

    # -- collection ----------------------------------------------------------------------------

    def steps(self, n: int, updates: int = 0) -> tuple[TransitionBatch, dict[str, int]]:
        """A fragment of ``n`` transitions; the node's episodes continue in the next fragment."""
        return self._collect(updates, self.sampler.obtain_steps, n)

    def samples(self, n: int, updates: int = 0) -> tuple[EpisodeBatch, dict[str, int]]:
        """Whole episodes, started now, until at least ``n`` transitions (garage's rule)."""
        return self._collect(updates, self.sampler.obtain_samples, 0, n)

    def exact_episodes(self, quotas: list[int], updates: int = 0) -> tuple[EpisodeBatch, dict[str, int]]:
        """``quotas[i]`` episodes from local slot ``i``, each started now, in (slot, admission) order."""
        return self._collect(updates, self.sampler.obtain_exact_episodes, quotas)

    def _collect(self, updates: int, obtain: Any, *args: Any) -> tuple[Any, dict[str, int]]:
        try:
            self._await_updates(updates)
            return self._answer(obtain(*args))
        except Exception as exc:
            error = with_slot_offset(exc, self.offset)  # named as the cluster knows the slots
            raise NodeFailure(error, self._serves()) from error

    def _serves(self) -> bool:
        """Whether the node can go on after an error: no env process given up, no update failed."""
        m = self.sampler.manager
        return self._update_error is None and all(m.failure_of(s) is None for s in range(m.n_env))

    def _answer(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """The batch with global slot ids, and what the node's counters grew by since the last
        answer, with the episodes its sampler cut since, each slot's episodes started so far
        (even one that left no trace is never numbered twice) and the node's ``generation``."""
        batch.worker_ids = batch.worker_ids + self.offset
        now = {k: int(self.sampler.stats.counters.get(k, 0)) for k in COUNTERS}
        grown: dict[str, Any] = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        cut = self.sampler.cut_episodes
        grown["cut_episodes"], self._cut_reported = list(cut[self._cut_reported:]), len(cut)
        grown["started"] = [record.started for record in self.sampler.episodes]
        grown["generation"] = self.generation
        return batch, grown

    def close(self) -> None:
        self.sampler.close()
