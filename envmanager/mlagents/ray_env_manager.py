"""``RayMLAgentsEnvManager``: ML-Agents' trainer here, its Unity players on a Ray cluster's nodes
(``envmanager-learn --ray-address``; or ``RayMLAgentsEnvManager.from_run_options(..., address="auto")``).

One actor per node (:class:`~envmanager.mlagents.ray_node.PlayerNode`) hosts a block of
consecutive worker ids through the core's manager, which restarts a killed player alone. The
driver keeps one step request in flight per node, each with its own deadline (the core's plus
:data:`RAY_MARGIN`), and takes whichever node answers first; the policy stays in the trainer. A
node whose actor dies or misses its deadline is replaced (on another Ray node if there is one,
same worker ids and settings; its players back as interrupted resets) as the pool's
:class:`~envmanager.core.supervisor.Supervisor` decides, one restart count per player (see
docs/architecture.md, "The supervisor"); else :class:`RayPlayerError` names the node and its
worker ids, on every later use of it. A build path must exist on every node.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

from envmanager.core.arguments import is_count
from envmanager.core.deadline import Deadline
from envmanager.core.restart import MAX_LIFETIME_RESTARTS, RATE_LIMIT_N, RATE_LIMIT_PERIOD_S, RestartPolicy
from envmanager.core.results import StepInfo
from envmanager.core.supervisor import Fault, GiveUp, Supervisor
from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError
from envmanager.extras import requires_extra
from envmanager.mlagents.env_manager import MLAgentsEnvManager
from envmanager.mlagents.ray_errors import NodeLost, RayPlayerError, RayPlayerRestartLimitError
from envmanager.mlagents.ray_player_nodes import PlayerNodeState, live_ray_nodes
from envmanager.mlagents.worker_env import EnvFactory, WorkerEnvFactory
from envmanager.ray.session import RaySession, first_ready
from envmanager.wire.interrupts import blocking

with requires_extra("ray", __name__):
    import ray

logger = logging.getLogger(__name__)

__all__ = ["RayMLAgentsEnvManager", "RayPlayerPool", "RayPlayerError", "RayPlayerRestartLimitError", "RAY_MARGIN"]

#: Seconds a Ray call may take beyond the core's per-answer deadline (transport, scheduling).
RAY_MARGIN = 30.0
#: Seconds a node's actor may take to come up (its process imports envmanager and ML-Agents)
#: beyond the core's deadline, which bounds its players' start.
RAY_START_MARGIN = 60.0


class RayPlayerPool:
    """What :class:`MLAgentsEnvManager` uses of the core's ``SubprocessEnvManager``, over Ray nodes:
    ``n_nodes`` actors (default one per live Ray node, at most ``n_env``) placed on the live
    nodes in turn, each hosting a consecutive block of worker ids."""

    def __init__(self, worker_factory: WorkerEnvFactory, n_env: int, *,
                 address: str | None = None, ray_init: dict[str, Any] | None = None, timeout: float = 120.0,
                 restart_workers: bool = True, max_lifetime_restarts: int = MAX_LIFETIME_RESTARTS,
                 restarts_rate_limit_n: int = RATE_LIMIT_N, restarts_rate_limit_period_s: float = RATE_LIMIT_PERIOD_S,
                 context: str | None = None, n_nodes: int | None = None) -> None:
        self.n_env, self.worker_factory = int(n_env), worker_factory
        self.worker_ids = list(range(self.n_env))
        self.deadline_s = float(timeout) + RAY_MARGIN
        self.start_s = float(timeout) + RAY_MARGIN + RAY_START_MARGIN
        self.options = {"timeout": timeout, "restart_workers": restart_workers, "max_lifetime_restarts": max_lifetime_restarts,
                        "restarts_rate_limit_n": restarts_rate_limit_n,
                        "restarts_rate_limit_period_s": restarts_rate_limit_period_s}
        self.replay_calls: list[tuple[str, tuple, dict]] = []
        self.nodes: list[PlayerNodeState] = []
        self._last: dict[int, StepInfo] = {}
        self._ready: list[StepInfo] = []
        self._failures: dict[int, EnvManagerError] = {}  # worker id -> what its node's players raised for it
        self._closed = False
        if n_nodes is not None and not (is_count(n_nodes, 1) and n_nodes <= self.n_env):
            raise InvalidInputError(f"n_nodes must be between 1 and n_env ({self.n_env}), got {n_nodes!r}")
        self._session = RaySession.join(address, ray_init)
        try:
            alive = live_ray_nodes(self._session)
            count = min(self.n_env, len(alive)) if n_nodes is None else int(n_nodes)
            per, extra = divmod(self.n_env, count)
            bounds = [k * per + min(k, extra) for k in range(count + 1)]
            blocks = [self.worker_ids[bounds[k]:bounds[k + 1]] for k in range(count)]
            # one restart quota per player (per_slot); the nodes' deadline clocks
            policy = RestartPolicy(restart_workers, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s)
            self.supervisor = Supervisor(policy, self.deadline_s, blocks, "node", per_slot=True)
            self.nodes = [PlayerNodeState(k, blocks[k], alive[k % len(alive)], self.supervisor, self._session)
                          for k in range(count)]
            for node in self.nodes:  # every actor starts at once; then each is awaited
                node.start(node.ray_node_id, self.worker_factory, self.options, self.replay_calls)
            for node in self.nodes:
                node.await_start(self.start_s)
            logger.info("players on %d Ray node actors: %s", len(self.nodes), "; ".join(n.name() for n in self.nodes))
        except BaseException:
            self.close()
            raise

    # -- the core's interface, as MLAgentsEnvManager uses it -----------------------------------
    def call(self, name: str) -> list[Any]:
        found: dict[int, Any] = {}
        for node in self.nodes:
            answer = self._call(node, "call_on", None, name)
            if answer is None:  # the node was lost and replaced: ask its replacement
                answer = self._call(node, "call_on", None, name)
            if answer is None:
                raise RayPlayerError(node.index, node.ids, f"{node.name()} was lost twice answering {name!r}")
            found.update(zip(node.ids, answer, strict=True))
        return [found[w] for w in self.worker_ids]

    def get_attr(self, name: str) -> list[Any]:
        """Nothing: the players' processes are looked after on their nodes."""
        return [None] * self.n_env

    def call_on(self, worker_ids: Sequence[int], name: str, args: tuple = ()) -> list[Any]:
        """``name(*args)`` on these players' envs; a node lost meanwhile is replaced (its new
        players get the replay calls, which hold what is being set) and answers ``None``."""
        found: dict[int, Any] = {}
        replayed = name in {n for n, _, _ in self.replay_calls}  # a setting every restart replays
        for node in self.nodes:
            ids = [w for w in worker_ids if w in node.ids]
            if ids:
                answer = self._call(node, "call_on", ids, name, args, replayed)
                found.update(zip(ids, answer or [None] * len(ids), strict=True))
        return [found[w] for w in worker_ids]

    def set_replay_calls(self, calls: Sequence[tuple[str, tuple, dict]]) -> None:
        self.replay_calls = list(calls)
        for node in self.nodes:
            self._call(node, "set_replay_calls", self.replay_calls)

    def failure_of(self, worker_id: int) -> EnvManagerError | None:
        """Its node's error if the node was given up, else what its players raised for it."""
        node = next((n for n in self.nodes if worker_id in n.ids), None)  # (none once closed)
        given_up = None if node is None else self.supervisor.failure(node.index)
        return given_up or self._failures.get(worker_id)

    def restart_count(self, worker_id: int) -> int:
        """How often the player was restarted (on or with its node): its latest answer's generation."""
        last = self._last.get(worker_id)
        return 0 if last is None else last.generation

    def reset(self) -> list[StepInfo]:
        """Reset every player (steps in flight waited out, each to its node's deadline, and
        dropped); a node lost meanwhile is replaced: its players' fresh resets are its resets."""
        self._check_open()
        out: list[StepInfo] = []
        lost: list[tuple[PlayerNodeState, str]] = []
        for node in self.nodes:
            if node.pending is not None:
                try:
                    self._answer(node, node.pending, self.supervisor.left(node.index))
                except NodeLost as exc:
                    lost.append((node, str(exc)))
                except EnvManagerError:
                    pass  # a failed step before a reset: the reset below goes on
            node.steps_dropped()
        self._ready = []
        for node, why in lost:
            out += self._replace(node, why)
        resetting = [(node, node.submit("reset")) for node in self.nodes if all(node is not n for n, _ in lost)]
        for node, ref in resetting:
            try:
                out += self._arrived(node, self._answer(node, ref), reset=True)
            except NodeLost as exc:
                out += self._replace(node, str(exc))
        return sorted(out, key=lambda info: info.worker_id)

    def send_reset(self, seeds_and_options: dict[int, tuple[Any, Any]]) -> None:
        """Nothing: ``receive_resets`` resets them, every node at once (seeds are the players')."""

    def receive_resets(self, worker_ids: Sequence[int]) -> list[StepInfo]:
        """The fresh resets of ``worker_ids`` (idle players), from every node at once."""
        self._check_open()
        resetting = []
        for node in self.nodes:
            ids = [w for w in sorted(worker_ids) if w in node.ids]
            if ids:
                resetting.append((node, node.submit("reset", ids)))
        out: list[StepInfo] = []
        for node, ref in resetting:
            try:
                out += self._arrived(node, self._answer(node, ref), reset=True)
            except NodeLost as lost:  # its players come back as the replacement's resets
                self._ready += self._replace(node, str(lost))
        return sorted(out, key=lambda info: info.worker_id)

    @property
    def idle_worker_ids(self) -> list[int]:
        """Players whose last step arrived, on nodes with no request in flight."""
        return sorted(w for node in self.nodes if node.pending is None for w in node.idle)

    @property
    def waiting_worker_ids(self) -> list[int]:
        """Players with a step in flight."""
        return sorted(w for node in self.nodes if node.pending is not None for w in node.sent)

    @property
    def resets_in_flight(self) -> list[int]:
        """None: ``receive_resets`` sends and takes them in one call."""
        return []

    def send_step(self, actions: dict[int, Any]) -> None:
        """Send ``actions`` (idle players only), one request per node, its deadline from now."""
        self._check_open()
        idle = set(self.idle_worker_ids)
        for w in actions:
            if w not in idle:
                raise InvalidInputError(f"worker {w} is not idle: it cannot be sent actions now")
        for node in self.nodes:
            mine = {w: action for w, action in actions.items() if w in node.ids}
            if mine:
                node.send_step(mine)

    def receive_steps(self, min_count: int = 1) -> list[StepInfo]:
        """At least ``min_count`` finished steps (0: what is in), from whichever nodes answer first,
        waiting until the nearest node's deadline at a time; a node past its own is replaced."""
        self._check_open()
        out, self._ready = self._ready, []
        try:
            while True:
                for node in self.nodes:  # players in flight on a node that answered none (an error): collect them
                    if node.pending is None and node.sent and not node.idle and self.supervisor.failure(node.index) is None:
                        node.send_step({})
                pending = {node.pending: node for node in self.nodes if node.pending is not None}
                if not pending:
                    if len(out) >= min_count:
                        return out
                    raise EnvManagerError("no step in flight on any Ray node: nothing to wait for")
                heads = {node.index: ref for ref, node in pending.items()}
                timeout = 0.0 if len(out) >= min_count else self.supervisor.soonest(list(heads))
                try:
                    done, late = blocking(first_ready, heads, list(pending), self.supervisor, timeout)  # (interruptible)
                except Exception as exc:
                    self._session.reraise(exc, "waiting for the nodes' steps")
                error: EnvManagerError | None = None
                for ref in done:
                    node = pending[ref]
                    node.step_answered()
                    try:
                        out += self._arrived(node, self._answer(node, ref))  # in already
                    except NodeLost as lost:
                        out += self._replace(node, str(lost))
                    except EnvManagerError as exc:  # the other nodes' answers are kept
                        error = error or exc
                for i in late:
                    out += self._replace(self.nodes[i], f"no answer within its {self.deadline_s:g} s deadline (hung)")
                if error is not None:
                    raise error
                if len(out) >= min_count:
                    return out
        except BaseException:
            self._ready = out + self._ready  # handed over by the next call
            raise

    def close(self) -> None:
        """End every node's players, kill the actors, leave the Ray session. Idempotent."""
        self._closed = True
        nodes, self.nodes = self.nodes, []
        try:
            if nodes and self._session.alive():  # else the actors went with the session: nothing to end
                self._end(nodes)
        finally:
            self._session.leave()

    def _end(self, nodes: list[PlayerNodeState]) -> None:
        try:
            closing = [(n, n.actor.close.remote()) for n in nodes if n.actor is not None]
        except Exception as exc:  # the actors are killed all the same
            logger.warning("closing the Ray nodes: %r", exc)
            closing = []
        deadline = Deadline(RAY_MARGIN)
        for node, ref in closing:
            try:
                ray.get(ref, timeout=max(0.0, deadline.left()))
            except Exception as exc:  # RayError, GetTimeoutError, the session gone meanwhile
                logger.warning("%s did not close cleanly: %r", node.name(), exc)
        for node in nodes:
            node.kill()

    def node_info(self) -> list[dict[str, Any]]:
        return [dict(n.info, index=n.index) for n in self.nodes]

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        """Closed, or the session gone (any Ray call then would start a new one)."""
        if self._closed:
            raise ManagerClosedError("the Ray player pool is closed")
        self._session.check()

    def _call(self, node: PlayerNodeState, method: str, *args: Any) -> Any:
        """``node.<method>(*args)``; a lost node is replaced (its fresh resets wait for the next
        step) and answers ``None``."""
        try:
            return self._answer(node, node.submit(method, *args))
        except NodeLost as lost:
            self._ready += self._replace(node, str(lost))
            return None

    def _answer(self, node: PlayerNodeState, ref: Any, timeout: float | None = None) -> Any:
        """The value of a node's ``(value, error)`` answer; ``error`` is noted for ``failure_of`` and raised."""
        value, error = node.get(ref, timeout)
        if error is not None:
            if isinstance(error, EnvManagerError):
                for w in getattr(error, "worker_ids", None) or []:
                    self._failures[w] = error
                    node.failed(w)
            raise error
        return value

    def _arrived(self, node: PlayerNodeState, infos: list[StepInfo], interrupted: bool = False,
                 reset: bool = False) -> list[StepInfo]:
        """A node's answer as the trainer's steps, with the previous result (none for a reset) and
        the very action objects the policy made; its generations go to the supervisor (a newer
        one: the node restarted that player)."""
        out = []
        for info in infos:
            w = info.worker_id
            previous = self._last.get(w)
            cut = info.interrupted or interrupted
            action = node.arrived(w)
            self.supervisor.answered(w, info.generation)
            info = info._replace(previous_result=None if cut or reset or previous is None else previous.current_result,
                                 action=None if cut else action, interrupted=cut)
            self._last[w] = info
            out.append(info)
        return out

    def _replace(self, node: PlayerNodeState, why: str) -> list[StepInfo]:
        """Start ``node``'s worker ids anew (on another Ray node if there is one) if the supervisor
        allows; their fresh resets, interrupted. Else, or if it cannot start, ``RayPlayerError``."""
        node.kill()
        alive = live_ray_nodes(self._session, exclude=node.ray_node_id)
        # the live Ray node that hosts the fewest of the other nodes' worker ids
        target = min(alive, key=lambda nid: sum(len(n.ids) for n in self.nodes if n is not node and n.ray_node_id == nid))
        lost = RayPlayerError(node.index, node.ids, f"{node.name()} was lost ({why})")
        decision = self.supervisor.on_fault(node.index, Fault(
            lost, f"Ray node {node.index} (worker ids {node.ids}) lost: restarting its players on Ray node {target} ({why})"))
        if isinstance(decision, GiveUp):
            raise decision.error
        try:
            node.start(target, self.worker_factory, self.options, self.replay_calls, decision.generations)
            node.await_start(self.start_s)
        except RayPlayerError as exc:  # the replacement could not start: given up
            node.kill()
            raise self.supervisor.give_up(node.index, exc) from None
        for w in node.ids:  # restarted, as the supervisor decided: what the old node gave up is past
            self._failures.pop(w, None)
        try:
            infos = self._answer(node, node.submit("reset"))
        except NodeLost as lost_again:
            node.kill()
            raise self.supervisor.give_up(node.index, RayPlayerError(
                node.index, node.ids, f"{node.name()} was lost ({why}); its replacement was lost too ({lost_again})")) from None
        return self._arrived(node, infos, interrupted=True)


class RayMLAgentsEnvManager(MLAgentsEnvManager):
    """:class:`MLAgentsEnvManager` with the players on a Ray cluster's nodes (see the module).

    Args beyond ``MLAgentsEnvManager``'s: ``address`` (``ray.init``'s; ``"auto"``: the cluster
    this machine belongs to; ignored if Ray is initialized already), ``ray_init`` (more
    ``ray.init`` arguments) and ``n_nodes`` (node actors; default one per live Ray node). The Ray
    session is shared as in docs/guide/ray.md; a failed ``ray.init`` or the session gone is
    ``RaySessionError``.
    """

    def __init__(self, env_factory: EnvFactory, n_env: int = 1, *, address: str | None = None,
                 ray_init: dict[str, Any] | None = None, n_nodes: int | None = None, **kwargs: Any) -> None:
        self._address, self._ray_init, self._n_nodes = address, dict(ray_init or {}), n_nodes
        super().__init__(env_factory, n_env, **kwargs)

    def _start_core(self, worker_factory: WorkerEnvFactory, n_env: int, options: dict[str, Any]) -> Any:
        return RayPlayerPool(worker_factory, n_env, address=self._address,
                             ray_init=self._ray_init, n_nodes=self._n_nodes, **options)

    def node_info(self) -> list[dict[str, Any]]:
        """Per node: its Ray node id, actor pid, worker ids, worker and player pids."""
        return cast(RayPlayerPool, self.manager).node_info()
