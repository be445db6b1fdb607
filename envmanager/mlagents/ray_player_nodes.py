"""``PlayerNodes``: the driver's half of :class:`~envmanager.mlagents.ray_node.PlayerNode`, for
:class:`~envmanager.mlagents.ray_env_manager.RayPlayerPool` (its base class).

One :class:`Node` per node actor: started pinned to a Ray node, awaited, called (a call's
``(value, error)`` answer unpacked; Ray's failures as ``NodeLost`` or the session's error),
killed; a node lost is replaced on another Ray node if there is one, as the supervisor decides
(its players' restart quotas), its players coming back as interrupted resets from the
generations it gave them (else given up with ``RayPlayerError``); a node's answers become the
trainer's ``StepInfo``\\ s, and tell the supervisor of players their node restarted. The pool keeps the
``SubprocessEnvManager`` interface the ML-Agents manager uses (steps, resets, calls), its
construction and closing. Imports Ray (extra ``ray``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from envmanager.core.deadline import Deadline
from envmanager.core.results import StepInfo
from envmanager.core.supervisor import Fault, GiveUp, Supervisor
from envmanager.errors import EnvManagerError
from envmanager.extras import requires_extra
from envmanager.mlagents.ray_errors import NodeLost, RayPlayerError
from envmanager.mlagents.ray_node import PlayerNode
from envmanager.mlagents.worker_env import WorkerEnvFactory
from envmanager.ray.session import RAISED, RaySession, node_failure

with requires_extra("ray", __name__):
    import ray

#: The pool's log: its lines keep the logger they had before this module was split off.
logger = logging.getLogger("envmanager.mlagents.ray_env_manager")

__all__ = ["Node", "PlayerNodes"]

_Actor = ray.remote(PlayerNode)


@dataclass
class Node:
    """A node actor as the driver sees it: the worker ids it hosts, its request in flight."""

    index: int
    ids: list[int]
    ray_node_id: str
    actor: Any = None
    pending: Any = None  # the step request in flight (its deadline: the supervisor's clock, judged while it flies)
    idle: set[int] = field(default_factory=set)  # ids whose last step arrived, to be sent actions
    sent: dict[int, Any] = field(default_factory=dict)  # id -> the actions of its step in flight
    info: dict[str, Any] = field(default_factory=dict)

    def name(self) -> str:
        return f"Ray node {self.index} (worker ids {self.ids}, Ray node {self.ray_node_id})"


class PlayerNodes:
    """The node actors of a :class:`RayPlayerPool`: start, calls, loss and replacement (see the module)."""

    # The pool's state this half works on (set by ``RayPlayerPool.__init__``).
    worker_factory: WorkerEnvFactory
    options: dict[str, Any]
    deadline_s: float
    start_s: float
    supervisor: Supervisor
    replay_calls: list[tuple[str, tuple, dict]]
    nodes: list[Node]
    _last: dict[int, StepInfo]
    _ready: list[StepInfo]
    _failures: dict[int, EnvManagerError]
    _session: RaySession

    def _submit(self, node: Node, method: str, *args: Any) -> Any:
        """``node.<method>.remote(*args)``: its ref, or the package's error for Ray's failure (or
        the node's own, if it was given up)."""
        self.supervisor.check(node.index)
        try:
            return getattr(node.actor, method).remote(*args)
        except Exception as exc:
            self._session.reraise(exc, f"sending {method!r} to {node.name()}")

    def _alive_nodes(self, exclude: str | None = None, wait_s: float = 10.0) -> list[str]:
        """Ids of the cluster's live nodes but ``exclude`` (the head's first), waiting up to
        ``wait_s`` for one; if none, every live node."""
        deadline = Deadline(wait_s)
        try:
            while True:
                every = [n for n in ray.nodes() if n.get("Alive")]
                nodes = [n for n in every if n["NodeID"] != exclude]
                if nodes or deadline.passed():
                    break
                time.sleep(0.2)
        except Exception as exc:
            self._session.reraise(exc, "listing the cluster's nodes")
        nodes = nodes or every
        nodes.sort(key=lambda n: (not n.get("Resources", {}).get("node:__internal_head__"), n["NodeID"]))
        return [n["NodeID"] for n in nodes]

    def _node_of(self, worker_id: int) -> Node:
        return next(n for n in self.nodes if worker_id in n.ids)

    def _start(self, node: Node, ray_node_id: str, left_behind: Any = None,
               generations: tuple[int, ...] | None = None) -> None:
        """Start ``node``'s actor on ``ray_node_id``; its players go on from ``generations``
        (a replacement's: their restart counts so far, the supervisor's)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node.ray_node_id = ray_node_id
        self._session.check()  # a replacement after the session went would start a new one
        options = self.options if generations is None else {**self.options, "generations": generations}
        try:
            node.actor = _Actor.options(
                num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
            ).remote(self.worker_factory, node.ids, options, self.replay_calls, left_behind)
        except Exception as exc:
            self._session.reraise(exc, f"starting {node.name()}")
        node.idle, node.sent, node.info = set(node.ids), {}, {}
        node.pending = None

    def _await_start(self, node: Node) -> None:
        """The node's ``info`` once it started; else ``RayPlayerError`` naming it (``cause``: what
        its players raised, a port taken say)."""
        try:
            info, error = self._get(node, self._submit(node, "info"), self.start_s)
        except NodeLost as lost:
            raise RayPlayerError(node.index, node.ids, f"{node.name()} could not start: {lost}") from None
        if error is not None:
            raise RayPlayerError(node.index, node.ids, f"{node.name()} could not start its players: "
                                 f"{type(error).__name__}: {error}", error) from None
        node.info = info

    def _kill(self, node: Node) -> None:
        if node.actor is not None:
            try:
                ray.kill(node.actor, no_restart=True)
            except Exception as exc:  # gone already
                logger.debug("killing %s: %r", node.name(), exc)
        node.actor = None
        node.pending = None

    def _call(self, node: Node, method: str, *args: Any) -> Any:
        """``node.<method>(*args)``; if the node is lost, it is replaced (its fresh resets wait for
        the next ``step``) and the answer is ``None``."""
        try:
            return self._answer(node, self._submit(node, method, *args))
        except NodeLost as lost:
            self._ready += self._replace(node, str(lost))
            return None

    def _answer(self, node: Node, ref: Any, timeout: float | None = None) -> Any:
        """The value of a node call that answers ``(value, error)``: ``error`` (what its players
        raised, naming the trainer's worker ids) is noted for ``failure_of`` and raised."""
        value, error = self._get(node, ref, timeout)
        if error is not None:
            if isinstance(error, EnvManagerError):
                for w in getattr(error, "worker_ids", None) or []:
                    self._failures[w] = error
            raise error
        return value

    def _get(self, node: Node, ref: Any, timeout: float | None = None) -> Any:
        """``ray.get`` within ``timeout`` (default: a deadline from now); a dead or silent actor is
        ``NodeLost``, a node's own error is ``RayPlayerError``."""
        try:
            return ray.get(ref, timeout=self.deadline_s if timeout is None else timeout)
        except Exception as exc:
            failure = node_failure(exc)
            if failure is None:  # the session went meanwhile
                self._session.reraise(exc, f"waiting for {node.name()}")
            if failure == RAISED:
                raise RayPlayerError(node.index, node.ids, f"{node.name()} raised: {exc}") from None
            raise NodeLost(f"{type(exc).__name__}: {exc}") from None  # died, silent, or lost by Ray

    def _arrived(self, node: Node, infos: list[StepInfo], interrupted: bool = False) -> list[StepInfo]:
        """A node's answer as the trainer's steps: global ids (the node's), the previous result
        and the actions sent (the driver's: the very objects the policy made). Each carries its
        player's generation (a newer one than the supervisor knows: its node restarted it)."""
        out = []
        for info in infos:
            w = info.worker_id
            previous = self._last.get(w)
            cut = info.interrupted or interrupted
            action = node.sent.pop(w, None)
            self.supervisor.answered(w, info.generation)
            info = info._replace(previous_result=None if cut or previous is None else previous.current_result,
                                 action=None if cut else action, interrupted=cut)
            self._last[w] = info
            node.idle.add(w)
            out.append(info)
        return out

    def _replace(self, node: Node, why: str) -> list[StepInfo]:
        """Start ``node``'s worker ids anew (on another Ray node if there is one), as the
        supervisor decides (each player's restart quota); their fresh resets (interrupted). Else,
        or if the new one cannot start, ``RayPlayerError`` names the node and its worker ids."""
        old, left_behind = node.ray_node_id, (node.info.get("host"), node.info.get("processes", []))
        self._kill(node)
        alive = self._alive_nodes(exclude=old)
        busy: dict[str, int] = {}
        for n in self.nodes:
            if n is not node:
                busy[n.ray_node_id] = busy.get(n.ray_node_id, 0) + len(n.ids)
        target = min(alive, key=lambda nid: busy.get(nid, 0))
        lost = RayPlayerError(node.index, node.ids, f"{node.name()} was lost ({why})")
        decision = self.supervisor.on_fault(node.index, Fault(
            lost, f"Ray node {node.index} (worker ids {node.ids}) lost: restarting its players on Ray node {target} ({why})"))
        if isinstance(decision, GiveUp):
            raise decision.error
        try:
            self._start(node, target, left_behind, decision.generations)
            self._await_start(node)
        except RayPlayerError as exc:  # the replacement could not start: given up
            self._kill(node)
            raise self.supervisor.give_up(node.index, exc) from None
        try:
            infos = self._answer(node, self._submit(node, "reset"))
        except NodeLost as lost_again:
            self._kill(node)
            raise self.supervisor.give_up(node.index, RayPlayerError(
                node.index, node.ids, f"{node.name()} was lost ({why}); its replacement was lost too ({lost_again})")) from None
        return self._arrived(node, infos, interrupted=True)
