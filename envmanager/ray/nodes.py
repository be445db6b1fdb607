"""The driver's side of the nodes: its share of the Ray session, one actor per node, requests
in flight with deadlines (every ``ray.get`` / ``ray.wait`` here has a timeout), and restarts.

A node that hung, died or whose sampler raised goes through ``NodePool.failed``; the pool's
``Supervisor`` decides (see docs/architecture.md, "The supervisor"): started again with the
newest weights and every env update replayed, or ``RayNodeError``. Every other Ray call's
failure is ``RaySessionError`` (``RaySession.reraise``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from envmanager.core.deadline import Deadline
from envmanager.core.restart import RestartPolicy
from envmanager.core.supervisor import Fault, GiveUp, Supervisor
from envmanager.core.updates import Pickled
from envmanager.errors import EnvManagerError, ManagerClosedError, NodeError, NodeRestartLimitError
from envmanager.extras import requires_extra
from envmanager.ray.node import NodeFailure, SamplerNode
from envmanager.ray.session import (
    DIED,
    LOST,
    RAISED,
    TIMED_OUT,
    RaySession,
    RaySessionError,
    first_ready,
    kill_actor,
    node_failure,
)
from envmanager.wire.interrupts import blocking

with requires_extra("ray", "envmanager.ray"):
    import ray

logger = logging.getLogger(__name__)

__all__ = ["NodePool", "RayNodeError", "RayNodeRestartLimitError", "RaySessionError", "Request"]

#: Seconds a node's actor gets to end cleanly on close before it is killed.
CLOSE_TIMEOUT = 10.0


#: A node failed and was not restarted (restarts off, or past the limits), or could not be placed:
#: the core's node error (``node``, ``worker_ids``: its global slots, ``cause``: what its sampler
#: raised, naming global slots, ``remote_traceback``).
RayNodeError = NodeError
#: A node failed past the restart limits: a ``RestartLimitError`` and a ``RayNodeError`` (the core's).
RayNodeRestartLimitError = NodeRestartLimitError


@ray.remote(concurrency_groups={"control": 1})  # type: ignore[call-overload]  # Ray's stubs omit concurrency_groups
class _NodeActor(SamplerNode):
    """``SamplerNode`` as an actor; ``update`` runs in its own thread so new weights reach a
    fragment already under way (the Sampler is thread-safe there)."""

    @ray.method(concurrency_group="control")
    def update(  # type: ignore[override]  # ray.method turns it into a remote method (called as .remote)
            self, version: int | None, agent_update: Any, env_updates: Pickled | None) -> tuple[int, int]:
        return super().update(version, agent_update, env_updates)


@dataclasses.dataclass(eq=False)
class Request:
    """One collection call in flight on a node."""

    node: int
    kind: str  # "steps", "samples" or "episodes"
    arg: Any
    ref: Any = None


@dataclasses.dataclass(eq=False)
class NodeFault:
    """A node fault ``wait`` found, in the node's ``generation``: it died or ``hung``, or
    (``request``) its sampler raised ``error``."""

    node: Node
    generation: int
    why: str
    hung: bool = False
    request: Request | None = None
    error: BaseException | None = None
    remote_traceback: str | None = None
    serves: bool = False  # the node can go on (its sampler raised, nothing in it given up)


@dataclasses.dataclass
class Node:
    """The driver's record of one node, changed only through its own methods: its actor, what
    it said of itself once started (``info``), its requests in flight in submission order (Ray runs them so), the updates sent
    to this actor (a request waits on the node for them)."""

    index: int
    offset: int
    n_envs: int
    actor: Any = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    queue: list[Request] = dataclasses.field(default_factory=list)
    updates_sent: int = 0
    start_deadline: Deadline = dataclasses.field(default_factory=lambda: Deadline(0.0))  # its actor's, to be up
    replayed: bool = False  # the newest weights and every env update were sent to this actor

    def name(self) -> str:
        where = f", host {self.info['host']}, pid {self.info['pid']}" if self.info else ""
        return f"node {self.index} (slots {self.offset}–{self.offset + self.n_envs - 1}{where})"

    @property
    def slots(self) -> list[int]:
        return list(range(self.offset, self.offset + self.n_envs))

    def started(self, actor: Any, start_timeout: float) -> None:
        """A new actor, which must be up within ``start_timeout``."""
        self.actor, self.info, self.queue, self.updates_sent = actor, {}, [], 0
        self.start_deadline = Deadline(start_timeout)

    def answered_info(self, info: dict[str, Any]) -> None:
        self.info = info

    def asked(self, request: Request) -> None:
        self.queue.append(request)

    def answered(self) -> None:
        """Its oldest request answered (or answered with its error)."""
        self.queue.pop(0)

    def update_sent(self) -> None:
        self.updates_sent += 1

    def kill(self) -> list[Request]:
        """Its actor killed for good; returns the requests that die with it."""
        kill_actor(self.actor, f"ray sampler: {self.name()}")
        return self.forget()

    def forget(self) -> list[Request]:
        """Its actor forgotten (killed, or gone with the session): the requests that die with it."""
        self.replayed = False  # (first: an update that sees the actor sees it not replayed)
        lost, self.actor, self.queue = self.queue, None, []
        return lost

    def caught_up(self) -> None:
        """Its replay was sent: later updates go to it as they come (before, the replay brings them)."""
        self.replayed = True


class NodePool:
    """Ray actors for the nodes, the requests in flight, deadlines and restarts."""

    def __init__(self, env_factory: Callable[[int], Any], envs_per_node: list[int], policy: Any,
                 resume: Callable[[list[int], int], tuple[list[int | None], list[int]]],
                 sampler_options: dict[str, Any], actor_options: dict[str, Any], timeout: float, start_timeout: float,
                 restarts: RestartPolicy, address: str | None, init_options: dict[str, Any]) -> None:
        self.start_timeout = start_timeout
        #: Node faults' outcomes, restart counts, each node's generation and deadline clock.
        self.supervisor = Supervisor(restarts, timeout, [[i] for i in range(len(envs_per_node))], "node")
        self._args = (env_factory, policy, sampler_options)
        self.resume = resume  # ``SlotRecords.resume``
        self._actor_options = {"num_cpus": 1, "scheduling_strategy": "SPREAD", **actor_options,
                               "max_restarts": 0, "max_task_retries": 0}
        offsets = [sum(envs_per_node[:i]) for i in range(len(envs_per_node))]
        self.nodes = [Node(i, offsets[i], n) for i, n in enumerate(envs_per_node)]
        self.replay: Callable[[Node], None] = Node.caught_up  # set by the sampler: weights and env updates
        self._updates: list[Any] = []  # the refs of updates not yet confirmed
        self._faults: list[NodeFault] = []  # node faults found, handled once the answers taken with them are booked
        #: Updates may come from a learner thread: actors swapped, updates sent and their refs kept under it.
        self._lock = threading.RLock()
        self.closed = False
        self.session = RaySession.join(address, init_options)  # the pool's share of the session the nodes run in
        try:
            for node in self.nodes:
                self._start(node)
            self._await_started(self.nodes)
        except BaseException:
            self.close()
            raise

    def failure(self, node: Node) -> EnvManagerError | None:
        """``node``'s error if it was given up, else ``None``."""
        return self.supervisor.failure(node.index)

    # -- Starting and restarting ---------------------------------------------------------------

    def _start(self, node: Node) -> None:
        env_factory, policy, sampler_options = self._args
        generation = self.supervisor.generation(node.index)
        seeds, started = self.resume(node.slots, generation)
        n_slots = sum(n.n_envs for n in self.nodes)
        self.check_usable()  # a restart after the session went would start a new one
        try:
            # @ray.remote made the class an actor class with .options; the stubs keep the plain class
            node.started(_NodeActor.options(**self._actor_options).remote(  # type: ignore[attr-defined]
                node.index, env_factory, node.n_envs, node.offset, policy, seeds, started, n_slots, sampler_options,
                generation), self.start_timeout)
        except Exception as exc:
            self.session.reraise(exc, f"starting {node.name()}")

    def _await_started(self, nodes: list[Node]) -> None:
        """Each node must answer ``info`` within ``start_timeout`` (an actor whose resources
        cannot be met would otherwise block forever)."""
        try:
            refs = [node.actor.info.remote() for node in nodes]
        except Exception as exc:
            self.session.reraise(exc, "asking the nodes for their info")
        deadline = Deadline(self.start_timeout)
        first: RayNodeError | None = None  # raised after every other node's answer is in (close ends those)
        for node, ref in zip(nodes, refs, strict=True):
            try:
                node.answered_info(ray.get(ref, timeout=deadline.left()))
            except Exception as exc:
                failure = node_failure(exc)
                if failure is None:  # the session went meanwhile
                    self.session.reraise(exc, f"waiting for {node.name()} to start")
                first = first or RayNodeError(node.index, node.slots, {
                    TIMED_OUT: f"{node.name()} did not start within {self.start_timeout:g} s (can the cluster meet its "
                               f"actor options {self._actor_options}?)",
                    RAISED: f"{node.name()} failed to start: {getattr(exc, 'cause', None)!r}",
                    DIED: f"{node.name()} died while starting: {exc}",
                    LOST: f"{node.name()} could not start: {type(exc).__name__}: {exc}",  # its runtime env, its node...
                }[failure], None, str(exc) if failure == RAISED else None)
            else:
                self.replay(node)
        if first is not None:
            raise first

    def failed(self, node: Node, why: str, error: BaseException | None = None, remote_traceback: str | None = None,
               serves: bool = False) -> list[Request]:
        """The node layer's one failure path: ``node`` died, hung, or its sampler raised
        ``error``; the supervisor decides. Restarted (a new actor that does not start is a fault
        of its own, retried for no longer than ``timeout``): returns the requests that died with
        it. Else ``RayNodeError`` is raised, and the node given up unless restarts are off and it
        ``serves`` on (its sampler raised, nothing in it given up), as a process whose env raised."""
        fault = RayNodeError(node.index, node.slots, f"{node.name()} {why}", error, remote_traceback)
        lost: list[Request] = []
        retrying = Deadline(self.supervisor.timeout)  # even with the limits lifted, the call returns
        while True:  # a restart whose new actor does not start is a fault of its own, decided alike
            if self.closed:  # closed by another thread meanwhile: nothing is restarted
                raise ManagerClosedError("the ray sampler was closed")
            decision = self.supervisor.on_fault(node.index, Fault(fault, f"ray sampler: {fault.message}; restarting it",
                                                                  serves))
            if isinstance(decision, GiveUp):
                if decision.given_up:
                    node.kill()
                raise decision.error
            with self._lock:
                lost += node.kill()
                self._start(node)  # told its new generation
            try:
                self._await_started([node])
                return lost
            except RayNodeError as exc:
                if retrying.passed():
                    self.supervisor.give_up(node.index, exc)
                    node.kill()
                    raise
                fault, serves = exc, False

    # -- Requests ------------------------------------------------------------------------------

    def submit(self, node: Node, kind: str, arg: Any) -> Request:
        """Queue a collection call on ``node`` (Ray runs one node's calls in order)."""
        self.check_usable(node)
        request = Request(node.index, kind, arg)
        with self._lock:
            method = {"steps": node.actor.steps, "samples": node.actor.samples, "episodes": node.actor.exact_episodes}[kind]
            try:
                request.ref = method.remote(arg, node.updates_sent)
            except Exception as exc:
                self.session.reraise(exc, f"sending a {kind} request to {node.name()}")
        if not node.queue:  # (else an earlier request's clock runs)
            self.supervisor.start_clock(node.index)
        node.asked(request)
        return request

    def send_update(self, node: Node, version: int | None, weights: Any, env_updates: Pickled | None,
                    replay: bool = False) -> None:
        """Send an update without waiting; its answer is checked later (``wait``)."""
        self.check_usable(node)
        with self._lock:
            if node.actor is None or not (replay or node.replayed):  # being (re)started: its replay brings it everything
                return
            try:
                ref = node.actor.update.remote(version, weights, env_updates)
            except Exception as exc:
                self.session.reraise(exc, f"sending an update to {node.name()}")
            node.update_sent()
            self._updates.append(ref)

    def check_usable(self, node: Node | None = None) -> None:
        """Raise at once what makes a request futile: closed, the session gone, the node given up."""
        if self.closed:
            raise ManagerClosedError("the ray sampler is closed")
        self.session.check()
        if node is not None:
            self.supervisor.check(node.index)

    def raise_given_up(self) -> None:
        """What makes a collection call futile, at once: closed, the session gone, or a node
        given up (its error, on every later call, as a process the local samplers gave up)."""
        self.check_usable()
        self.supervisor.check()

    def wait(self) -> list[tuple[Request, Any]]:
        """Block until some node's oldest request is done, then take every other answer already
        done, each node's in order: ``(request, answer)`` pairs. A node fault found meanwhile is
        handled by the next call, once the caller booked these (so a restarted node goes on from
        every episode they hold); a request that died with its node is answered ``None`` after
        the restart, or ``RayNodeError`` is raised. With nothing asked of any node: ``EnvManagerError``."""
        self.check_usable()
        self._check_updates()
        out: list[tuple[Request, Any]] = []
        if not self._faults:
            pending = [r.ref for node in self.nodes for r in node.queue]
            if not pending:  # a caller waiting on this would wait for ever (or spin): its own error, at once
                raise EnvManagerError("ray sampler: waiting for answers, but no node holds a request (nothing can finish)")
            heads = {node.index: node.queue[0].ref for node in self.nodes if node.queue}  # only they can be booked first
            try:
                ready, late = blocking(first_ready, heads, pending, self.supervisor, self.supervisor.soonest(list(heads)))
            except Exception as exc:
                self.session.reraise(exc, "waiting for the nodes' answers")
            self._faults += [self._fault(self.nodes[i], f"missed its {self.supervisor.timeout:g} s deadline (hung)", hung=True)
                             for i in late]
            self._take(ready, out)
        while self._faults and not out:  # answers of one fault go back (to be booked) before the next is handled
            fault = self._faults.pop(0)
            node = fault.node
            if self.supervisor.already(node.index, {node.index: fault.generation}) or self.supervisor.failure(node.index):
                if fault.request is not None:  # answered with an error: it died with the node all the same
                    out.append((fault.request, None))
                continue  # restarted or given up meanwhile
            if fault.hung and (not node.queue or self._done([node.queue[0].ref], "checking a request")):
                continue  # done meanwhile: the next wait takes it
            lost = self.failed(node, fault.why, fault.error, fault.remote_traceback, fault.serves)
            out += [(r, None) for r in ([fault.request] if fault.request is not None else []) + lost]
        return out

    def _take(self, ready: list[Any], out: list[tuple[Request, Any]]) -> None:
        """The answers of ``ready`` into ``out``, each node's in the order it was asked, up to its
        first not ready (Ray may report a later one ready first: an episode's steps would come
        out of order); a node fault found in them is noted for ``wait``."""
        done = set(ready)
        for node in self.nodes:
            while node.queue and node.queue[0].ref in done:
                request = node.queue[0]
                try:
                    answer = ray.get(request.ref, timeout=self.supervisor.timeout)
                except Exception as exc:
                    kind = node_failure(exc)
                    if kind is None:
                        raise
                    if kind != RAISED:  # the actor died, or its node with the answer, or Ray lost it another way
                        self._faults.append(self._fault(node, f"died ({type(exc).__name__})" if kind == DIED
                                                        else f"failed ({type(exc).__name__}: {exc})"))
                        break
                    # answered with the node's error: that request is done
                    cause = getattr(exc, "cause", None)
                    failure = (cause if isinstance(cause, NodeFailure)
                               else NodeFailure(cause if isinstance(cause, BaseException) else exc, True))
                    self._faults.append(self._fault(node, f"raised during {request.kind}: {failure.error!r}",
                                                    request=request, error=failure.error, remote_traceback=str(exc),
                                                    serves=failure.serves))
                    answer = None
                node.answered()
                if node.queue:  # the next request's clock starts now
                    self.supervisor.start_clock(node.index)
                if answer is not None:
                    out.append((request, answer))

    def _fault(self, node: Node, why: str, **what: Any) -> NodeFault:
        """A fault of ``node`` as it is now (its generation: a later restart makes it stale)."""
        return NodeFault(node, self.supervisor.generation(node.index), why, **what)

    def _check_updates(self) -> None:
        """Forget the updates whose answers are in (one that failed on its node fails the node's
        next request, taking the one failure path there)."""
        with self._lock:
            refs = list(self._updates)  # (a learner thread may append meanwhile)
        if refs:
            done = self._done(refs, "checking the updates sent")
            with self._lock:
                self._updates = [ref for ref in self._updates if ref not in done]

    def _done(self, refs: list[Any], doing: str) -> set[Any]:
        """Those of ``refs`` done now."""
        try:
            return set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        except Exception as exc:
            self.session.reraise(exc, doing)

    # -- Lifetime ------------------------------------------------------------------------------

    def kill_node(self, index: int) -> None:
        """Kill one node's actor, as a fault would (for tests and the benchmark)."""
        self.check_usable(self.nodes[index])
        try:
            ray.kill(self.nodes[index].actor, no_restart=True)
        except Exception as exc:
            self.session.reraise(exc, f"killing {self.nodes[index].name()}")

    def close(self) -> None:
        """End every node (reaping its env processes), kill the actors and leave the Ray session. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.session.alive():  # else its actors went with it: nothing to end
                self._end_nodes()
        finally:
            for node in self.nodes:
                node.forget()
            self._updates, self._faults = [], []
            self.session.leave()

    def _end_nodes(self) -> None:
        live = [node for node in self.nodes if node.actor is not None]
        try:
            # Every live actor reaps its envs; one still starting runs close right after its start.
            started = [node.actor.close.remote() for node in live if node.info]
            starting = [node.actor.close.remote() for node in live if not node.info]
            deadline = Deadline(CLOSE_TIMEOUT)
            if started:
                ray.wait(started, num_returns=len(started), timeout=deadline.left())
            if starting:  # maybe never placed: no longer than what is left of their start_timeout
                left = max(node.start_deadline.left() for node in live if not node.info)
                ray.wait(starting, num_returns=len(starting), timeout=min(deadline.left(), left))
        except Exception as exc:  # the actors are killed all the same
            logger.warning("ray sampler: closing the nodes: %r", exc)
        for node in live:
            node.kill()
