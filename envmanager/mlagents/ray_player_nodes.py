"""``PlayerNodeState``: the driver's record of one :class:`~envmanager.mlagents.ray_node.PlayerNode`
actor, for :class:`~envmanager.mlagents.ray_env_manager.RayPlayerPool` (one per node), changed only
through its own methods, as Sample Factory's ``ActorState``. A lost node's replacement and the
answers as the trainer's steps are the pool's. Imports Ray (extra ``ray``).
"""

from __future__ import annotations

import time
from typing import Any

from envmanager.core.deadline import Deadline
from envmanager.core.supervisor import Supervisor
from envmanager.extras import requires_extra
from envmanager.mlagents.ray_errors import NodeLost, RayPlayerError
from envmanager.mlagents.ray_node import PlayerNode
from envmanager.mlagents.worker_env import WorkerEnvFactory
from envmanager.ray.session import RAISED, RaySession, RaySessionError, kill_actor, node_failure

with requires_extra("ray", __name__):
    import ray

__all__ = ["PlayerNodeState", "live_ray_nodes"]

_Actor = ray.remote(PlayerNode)


def live_ray_nodes(session: RaySession, exclude: str | None = None, wait_s: float = 10.0) -> list[str]:
    """Ids of the cluster's live nodes but ``exclude`` (the head's first; ``exclude`` alone if it is
    the only one alive), waiting up to ``wait_s`` for one if none is."""
    deadline = Deadline(wait_s)
    try:
        while True:
            every = [n for n in ray.nodes() if n.get("Alive")]
            nodes = [n for n in every if n["NodeID"] != exclude] or every
            if nodes or deadline.passed():
                break
            time.sleep(0.2)
    except Exception as exc:
        session.reraise(exc, "listing the cluster's nodes")
    if not nodes:
        raise RaySessionError(f"no node of the Ray cluster is alive (waited {wait_s:g} s for one)")
    nodes.sort(key=lambda n: (not n.get("Resources", {}).get("node:__internal_head__"), n["NodeID"]))
    return [n["NodeID"] for n in nodes]


class PlayerNodeState:
    """A node actor as the driver sees it. Calls go through the pool's ``supervisor`` (a node given
    up raises its error; its ``timeout``: how long an answer is awaited by default) and ``session``."""

    def __init__(self, index: int, ids: list[int], ray_node_id: str, supervisor: Supervisor, session: RaySession) -> None:
        self.index, self.ids, self.ray_node_id = index, ids, ray_node_id
        self.actor: Any = None
        self.pending: Any = None  # the step request in flight (its deadline: the supervisor's clock, judged while it flies)
        self.idle: set[int] = set()  # ids whose last step arrived, to be sent actions
        self.sent: dict[int, Any] = {}  # id -> the actions of its step in flight
        self.info: dict[str, Any] = {}
        self._supervisor, self._session = supervisor, session

    def name(self) -> str:
        return f"Ray node {self.index} (worker ids {self.ids}, Ray node {self.ray_node_id})"

    def start(self, ray_node_id: str, worker_factory: WorkerEnvFactory, options: dict[str, Any],
              replay_calls: list[tuple[str, tuple, dict]], generations: tuple[int, ...] | None = None) -> None:
        """Start the actor on ``ray_node_id``. A replacement's players go on from ``generations``;
        it first kills what the lost actor left on its host (the processes its ``info`` named)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        left_behind = (self.info["host"], self.info["processes"]) if self.info else None
        self.ray_node_id = ray_node_id
        self._session.check()  # a replacement after the session went would start a new one
        options = options if generations is None else {**options, "generations": generations}
        try:
            self.actor = _Actor.options(
                num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
            ).remote(worker_factory, self.ids, options, replay_calls, left_behind)
        except Exception as exc:
            self._session.reraise(exc, f"starting {self.name()}")
        self.idle, self.sent, self.info = set(self.ids), {}, {}

    def await_start(self, timeout: float) -> None:
        """The node's ``info`` once it started; else ``RayPlayerError`` (``cause``: what its players raised)."""
        try:
            info, error = self.get(self.submit("info"), timeout)
        except NodeLost as lost:
            raise RayPlayerError(self.index, self.ids, f"{self.name()} could not start: {lost}") from None
        if error is not None:
            raise RayPlayerError(self.index, self.ids, f"{self.name()} could not start its players: "
                                 f"{type(error).__name__}: {error}", error) from None
        self.info = info

    def submit(self, method: str, *args: Any) -> Any:
        """``actor.<method>.remote(*args)``: its ref (the node's error if it was given up)."""
        self._supervisor.check(self.index)
        try:
            return getattr(self.actor, method).remote(*args)
        except Exception as exc:
            self._session.reraise(exc, f"sending {method!r} to {self.name()}")

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """``ray.get``; a dead or silent actor is ``NodeLost``, a node's own error ``RayPlayerError``."""
        try:
            return ray.get(ref, timeout=self._supervisor.timeout if timeout is None else timeout)
        except Exception as exc:
            failure = node_failure(exc)
            if failure is None:  # the session went meanwhile
                self._session.reraise(exc, f"waiting for {self.name()}")
            if failure == RAISED:
                raise RayPlayerError(self.index, self.ids, f"{self.name()} raised: {exc}") from None
            raise NodeLost(f"{type(exc).__name__}: {exc}") from None  # died, silent, or lost by Ray

    def send_step(self, actions: dict[int, Any]) -> None:
        """The node's one request in flight, its deadline from now."""
        self.pending = self.submit("step", actions)
        self._supervisor.start_clock(self.index)  # (one request in flight per node)
        self.idle -= set(actions)
        self.sent.update(actions)

    def step_answered(self) -> None:
        """Its request in flight answered (or given up waiting for)."""
        self.pending = None

    def steps_dropped(self) -> None:
        """The steps in flight are dropped (a reset)."""
        self.pending = None
        self.sent.clear()

    def arrived(self, worker_id: int) -> Any:
        """``worker_id``'s step arrived; the actions that led there (``None`` if none)."""
        self.idle.add(worker_id)
        return self.sent.pop(worker_id, None)

    def failed(self, worker_id: int) -> None:
        """``worker_id``'s env failed: no step of it to wait for."""
        self.sent.pop(worker_id, None)

    def kill(self) -> None:
        kill_actor(self.actor, self.name())
        self.actor = None
        self.pending = None
