"""``RayMLAgentsEnvManager``: ML-Agents' trainer here, its Unity players on a Ray cluster's nodes.

``envmanager-learn ... --ray-address=auto`` uses it; so can a framework, as
``RayMLAgentsEnvManager.from_run_options(env_factory, run_options, n_env, address="auto")``.

One actor per node (:class:`~envmanager.mlagents.ray_node.PlayerNode`, pinned to it) hosts that
node's share of the worker ids through the core's manager, so on a node a killed player is
restarted alone, as on one machine. The driver keeps at most one step request in flight per node
and takes whichever node answers first (``ray.wait``): first-ready across nodes, and within a
node. The policy stays in the trainer: a request carries the actions of the node's idle players,
an answer the steps that finished (observations and stats, no previous results). Every
``ray.get``/``ray.wait`` has a deadline (the core's per-answer deadline plus
:data:`RAY_MARGIN`). A node whose actor dies (node lost, actor killed) or misses its deadline is
replaced on another node with the same worker ids, the environment parameters, engine settings
and analytics set so far, within the restart limits (per node, ML-Agents' rule); its players come
back as interrupted resets. Past the limits :class:`RayPlayerError` names the node and its ids.

The env factory runs on the nodes: a build path must exist on every node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from envmanager.core.deadline import Deadline
from envmanager.core.restart import RestartPolicy
from envmanager.core.results import StepInfo
from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError
from envmanager.mlagents.env_manager import MLAgentsEnvManager
from envmanager.mlagents.ray_node import PlayerNode
from envmanager.mlagents.worker_env import EnvFactory, WorkerEnvFactory

logger = logging.getLogger(__name__)

__all__ = ["RayMLAgentsEnvManager", "RayPlayerPool", "RayPlayerError", "RAY_MARGIN"]

#: Seconds a Ray call may take beyond the core's per-answer deadline (transport, actor start).
RAY_MARGIN = 30.0
_Actor = ray.remote(PlayerNode)


class RayPlayerError(EnvManagerError):
    """A node's players could not go on: its actor was lost past the restart limits, or it raised."""


@dataclass
class _Node:
    index: int
    ids: List[int]
    ray_node_id: str
    actor: Any = None
    pending: Any = None  # the step request in flight
    idle: Set[int] = field(default_factory=set)  # ids whose last step arrived, to be sent actions
    sent: Dict[int, Any] = field(default_factory=dict)  # id -> the actions of its step in flight
    info: Dict[str, Any] = field(default_factory=dict)


class RayPlayerPool:
    """What :class:`MLAgentsEnvManager` uses of the core's ``SubprocessEnvManager``, over Ray nodes."""

    def __init__(self, worker_factory: WorkerEnvFactory, n_env: int, *,
                 address: Optional[str] = None, ray_init: Optional[Dict[str, Any]] = None, timeout: float = 120.0,
                 restart_workers: bool = True, max_lifetime_restarts: int = 10, restarts_rate_limit_n: int = 1,
                 restarts_rate_limit_period_s: float = 60.0, context: Optional[str] = None) -> None:
        self.n_env, self.worker_factory = int(n_env), worker_factory
        self.worker_ids = list(range(self.n_env))
        self.deadline_s = float(timeout) + RAY_MARGIN
        self.options = dict(timeout=timeout, restart_workers=restart_workers, max_lifetime_restarts=max_lifetime_restarts,
                            restarts_rate_limit_n=restarts_rate_limit_n,
                            restarts_rate_limit_period_s=restarts_rate_limit_period_s)
        self.restarts = RestartPolicy(restart_workers, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s)
        self.replay_calls: List[Tuple[str, tuple, dict]] = []
        self.nodes: List[_Node] = []
        self._last: Dict[int, StepInfo] = {}
        self._ready: List[StepInfo] = []
        self._resets: List[int] = []
        self.restarts_seen: Dict[int, int] = {}  # worker id -> its fresh resets after a restart
        self._started_ray = False
        self._closed = False
        if not ray.is_initialized():
            local = {"include_dashboard": False} if address is None else {}  # a session of our own: no dashboard
            ray.init(address=address, **{**local, **(ray_init or {})})
            self._started_ray = True
        try:
            alive = _alive_nodes()
            per = -(-self.n_env // len(alive))
            blocks = [self.worker_ids[i:i + per] for i in range(0, self.n_env, per)]
            self.nodes = [_Node(k, ids, alive[k]) for k, ids in enumerate(blocks)]
            for node in self.nodes:
                self._start(node, node.ray_node_id)
            for node in self.nodes:
                node.info = self._get(node, node.actor.info.remote())
            logger.info("players on %d Ray nodes: %s", len(self.nodes),
                        "; ".join(f"node {n.index}: ids {n.ids}" for n in self.nodes))
        except BaseException:
            self.close()
            raise

    # -- the core's interface, as MLAgentsEnvManager uses it -----------------------------------
    def call(self, name: str) -> List[Any]:
        found: Dict[int, Any] = {}
        for node in self.nodes:
            found.update(dict(zip(node.ids, self._answer(node, node.actor.call_on.remote(None, name)))))
        return [found[w] for w in self.worker_ids]

    def get_attr(self, name: str) -> List[Any]:
        """Players live on the nodes, where their processes are looked after: nothing here."""
        return [None] * self.n_env

    def call_on(self, worker_ids: Sequence[int], name: str, args: tuple = ()) -> List[Any]:
        """``name(*args)`` on the given players' envs; a node lost meanwhile is replaced (its new
        players get the replay calls, which hold what is being set) and answers ``None``."""
        found: Dict[int, Any] = {}
        replayed = name in {n for n, _, _ in self.replay_calls}  # a setting every restart replays
        for node in self.nodes:
            ids = [w for w in worker_ids if w in node.ids]
            if ids:
                found.update(dict(zip(ids, self._call(node, "call_on", ids, name, args, replayed) or [None] * len(ids))))
        return [found[w] for w in worker_ids]

    def set_replay_calls(self, calls: Sequence[Tuple[str, tuple, dict]]) -> None:
        self.replay_calls = list(calls)
        for node in self.nodes:
            self._call(node, "set_replay_calls", self.replay_calls)

    def failure_of(self, worker_id: int) -> Optional[EnvManagerError]:
        return None  # a node that cannot go on raises instead

    def restart_count(self, worker_id: int) -> int:
        """How often the player was restarted: on its node, or with its node."""
        return self.restarts_seen.get(worker_id, 0)

    def reset(self) -> List[StepInfo]:
        """Reset every player (steps in flight are waited out and dropped)."""
        for node in self.nodes:
            if node.pending is not None:
                try:
                    self._answer(node, node.pending)
                except EnvManagerError:
                    pass  # a failed step before a reset: the reset below goes on
                node.pending = None
            node.sent.clear()
        self._ready = []
        out: List[StepInfo] = []
        for node in self.nodes:
            try:
                out += self._arrived(node, self._answer(node, node.actor.reset.remote()))
            except _NodeLost as lost:
                out += self._replace(node, str(lost))
        return sorted(out, key=lambda info: info.worker_id)

    def send_reset(self, seeds_and_options: Dict[int, Tuple[Any, Any]]) -> None:
        """Reset these players (seeds and options are the players' own): done by ``receive_resets``."""
        self._resets = sorted(seeds_and_options)

    def receive_resets(self, worker_ids: Sequence[int]) -> List[StepInfo]:
        """The fresh resets of the players ``send_reset`` named (idle ones), node by node."""
        out: List[StepInfo] = []
        for node in self.nodes:
            ids = [w for w in self._resets if w in node.ids]
            if ids:
                try:
                    out += self._arrived(node, self._answer(node, node.actor.reset.remote(ids)))
                except _NodeLost as lost:  # its players come back as the replacement's resets
                    self._ready += self._replace(node, str(lost))
        self._resets = []
        return sorted(out, key=lambda info: info.worker_id)

    @property
    def idle_worker_ids(self) -> List[int]:
        """Players whose last step arrived, on nodes with no request in flight: they can be sent
        actions now."""
        return sorted(w for node in self.nodes if node.pending is None for w in node.idle)

    def send_step(self, actions: Dict[int, Any]) -> None:
        """Send ``actions`` (worker id -> the env's actions; idle players only), one request per node."""
        self._check_open()
        by_node: Dict[int, Dict[int, Any]] = {}
        for w, action in actions.items():
            node = self._node_of(w)
            if node.pending is not None or w not in node.idle:
                raise InvalidInputError(f"worker {w} is not idle: it cannot be sent actions now")
            by_node.setdefault(node.index, {})[w] = action
        for node in self.nodes:
            if node.index in by_node:
                sent = by_node[node.index]
                node.pending = node.actor.step.remote(sent)
                node.idle -= set(sent)
                node.sent.update(sent)

    def receive_steps(self, min_count: int = 1) -> List[StepInfo]:
        """The steps that finished: at least ``min_count`` (0: only what is in already), from
        whichever nodes answer first."""
        self._check_open()
        out, self._ready = self._ready, []
        deadline = Deadline(self.deadline_s)
        first = True
        while first or len(out) < min_count:
            pending = {node.pending: node for node in self.nodes if node.pending is not None}
            if not pending:
                if len(out) >= min_count:
                    break
                raise EnvManagerError("no step in flight on any Ray node: nothing to wait for")
            timeout = 0.0 if len(out) >= min_count else max(0.0, deadline.left())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            first = False
            if not done:
                if len(out) >= min_count:
                    break
                node = next(iter(pending.values()))  # every node missed the deadline: the oldest counts as hung
                out += self._replace(node, f"no answer within {self.deadline_s:.0f} s")
                continue
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in done:
                node = pending[ref]
                node.pending = None
                try:
                    out += self._arrived(node, self._answer(node, ref))
                except _NodeLost as lost:
                    out += self._replace(node, str(lost))
        return out

    def close(self) -> None:
        self._closed = True
        nodes, self.nodes = self.nodes, []
        try:
            closing = [(n, n.actor.close.remote()) for n in nodes if n.actor is not None]
            deadline = Deadline(RAY_MARGIN)
            for node, ref in closing:
                try:
                    ray.get(ref, timeout=max(0.0, deadline.left()))
                except (RayError, GetTimeoutError) as exc:
                    logger.warning("Ray node %d did not close cleanly: %r", node.index, exc)
            for node in nodes:
                if node.actor is not None:
                    ray.kill(node.actor, no_restart=True)
        finally:
            if self._started_ray:
                self._started_ray = False
                ray.shutdown()

    def node_info(self) -> List[Dict[str, Any]]:
        return [dict(n.info, index=n.index) for n in self.nodes]

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the Ray player pool is closed")

    def _node_of(self, worker_id: int) -> _Node:
        return next(n for n in self.nodes if worker_id in n.ids)

    def _start(self, node: _Node, ray_node_id: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node.ray_node_id = ray_node_id
        node.actor = _Actor.options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
        ).remote(self.worker_factory, node.ids, self.options, self.replay_calls)
        node.idle, node.sent = set(node.ids), {}

    def _call(self, node: _Node, method: str, *args: Any) -> Any:
        """``node.<method>(*args)``; if the node is lost, it is replaced (its fresh resets wait for
        the next ``step``) and the answer is ``None``."""
        try:
            return self._answer(node, getattr(node.actor, method).remote(*args))
        except _NodeLost as lost:
            self._ready += self._replace(node, str(lost))
            return None

    def _answer(self, node: _Node, ref: Any) -> Any:
        """The value of a node call that answers ``(value, error)``: ``error`` (what its players
        raised, naming global ids) is raised."""
        value, error = self._get(node, ref)
        if error is not None:
            raise error
        return value

    def _get(self, node: _Node, ref: Any) -> Any:
        """``ray.get`` with the deadline; a dead or silent actor is ``_NodeLost``, a node's own error
        is raised as it is (an ``EnvManagerError``) or as ``RayPlayerError``."""
        try:
            return ray.get(ref, timeout=self.deadline_s)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, EnvManagerError):
                raise cause from None
            raise RayPlayerError(f"Ray node {node.index} (worker ids {node.ids}) raised: {exc}") from None
        except (RayActorError, GetTimeoutError) as exc:
            raise _NodeLost(f"{type(exc).__name__}: {exc}") from None
        except RayError as exc:
            raise _NodeLost(f"{type(exc).__name__}: {exc}") from None

    def _arrived(self, node: _Node, infos: List[StepInfo], interrupted: bool = False) -> List[StepInfo]:
        """A node's answer as the trainer's steps: global ids (the node's), the previous result
        and the actions sent (the driver's: the very objects the policy made)."""
        out = []
        for info in infos:
            w = info.worker_id
            previous = self._last.get(w)
            cut = info.interrupted or interrupted
            action = node.sent.pop(w, None)
            if cut:
                self.restarts_seen[w] = self.restarts_seen.get(w, 0) + 1
            info = info._replace(previous_result=None if cut or previous is None else previous.current_result,
                                 action=None if cut else action, interrupted=cut)
            self._last[w] = info
            node.idle.add(w)
            out.append(info)
        return out

    def _replace(self, node: _Node, why: str) -> List[StepInfo]:
        """Start ``node``'s worker ids on another Ray node (within the limits); their fresh resets."""
        while True:
            refusal = self.restarts.refusal(node.index)
            if refusal:
                raise RayPlayerError(f"Ray node {node.index} (worker ids {node.ids}, Ray node {node.ray_node_id}) "
                                     f"was lost ({why}) and not replaced: {refusal}")
            self.restarts.record(node.index)
            old = node.ray_node_id
            if node.actor is not None:
                ray.kill(node.actor, no_restart=True)
            node.pending, node.actor = None, None
            alive = _alive_nodes(exclude=old) or _alive_nodes()
            busy = {n.ray_node_id: len(n.ids) for n in self.nodes if n is not node}
            target = min(alive, key=lambda nid: busy.get(nid, 0))
            logger.warning("Ray node %d (worker ids %s) lost: restarting its players on Ray node %s (%s)",
                           node.index, node.ids, target, why)
            try:
                self._start(node, target)
                node.info = self._get(node, node.actor.info.remote())
                return self._arrived(node, self._answer(node, node.actor.reset.remote()), interrupted=True)
            except _NodeLost as lost:
                why = str(lost)


class _NodeLost(Exception):
    pass


def _alive_nodes(exclude: Optional[str] = None, wait_s: float = 10.0) -> List[str]:
    """Ids of the cluster's live nodes (the head's first), waiting up to ``wait_s`` for one."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] != exclude]
        if nodes or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    nodes.sort(key=lambda n: (not n.get("Resources", {}).get("node:__internal_head__"), n["NodeID"]))
    return [n["NodeID"] for n in nodes]


class RayMLAgentsEnvManager(MLAgentsEnvManager):
    """:class:`MLAgentsEnvManager` with the players on a Ray cluster's nodes (see the module).

    Args beyond ``MLAgentsEnvManager``'s: ``address`` (``ray.init``'s; ``"auto"``: the cluster
    this machine belongs to; ignored if Ray is initialized already) and ``ray_init`` (more
    ``ray.init`` arguments). A session it started is shut down by :meth:`close`.
    """

    def __init__(self, env_factory: EnvFactory, n_env: int = 1, *, address: Optional[str] = None,
                 ray_init: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        self._address, self._ray_init = address, dict(ray_init or {})
        super().__init__(env_factory, n_env, **kwargs)

    def _start_core(self, worker_factory: WorkerEnvFactory, n_env: int, options: Dict[str, Any]) -> Any:
        return RayPlayerPool(worker_factory, n_env, address=self._address,
                             ray_init=self._ray_init, **options)

    def node_info(self) -> List[Dict[str, Any]]:
        """Per node: its Ray node id, actor pid, worker ids, worker and player pids."""
        return self.manager.node_info()
