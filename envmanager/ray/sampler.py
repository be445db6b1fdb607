"""``RaySampler``: the ``Sampler``'s methods across a Ray cluster, one actor per node.

Each node runs a local ``Sampler`` with the policy on the node, and every Ray call carries a
whole fragment (an actor call costs ~0.85 ms, 20-27x a pipe round trip). The driver takes
whichever node's answer is done first and keeps the others running. Weights travel once per
version (one ``ray.put``), sent to every node without waiting; steps carry the version that
chose them, and the driver measures the policy lag of what it hands out.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envmanager.core.arguments import positive_count
from envmanager.core.deadline import positive_seconds
from envmanager.core.restart import MAX_LIFETIME_RESTARTS, RATE_LIMIT_N, RATE_LIMIT_PERIOD_S, RestartPolicy
from envmanager.core.updates import Pickled
from envmanager.errors import EnvManagerError, InvalidInputError
from envmanager.extras import requires_extra
from envmanager.ray.node import COUNTERS
from envmanager.ray.nodes import Node, NodePool, RayNodeError, Request
from envmanager.ray.records import SlotRecords
from envmanager.sampler import EpisodeBatch, Stats, TransitionBatch
from envmanager.sampler.episodes import spread
from envmanager.sampler.learner import feed_fragments
from envmanager.sampler.sampler import exact_quotas
from envmanager.sampler.versions import SamplerBase, Versions
from envmanager.wire.interrupts import deferred

with requires_extra("ray", "envmanager.ray"):
    import ray

if TYPE_CHECKING:
    from envmanager.sampler import LearnerFeed

logger = logging.getLogger(__name__)

__all__ = ["RaySampler"]


class RaySampler(SamplerBase):
    """Collect transitions or whole episodes on Ray nodes; the ``Sampler``'s interface.

    Args:
        env_factory: ``env_factory(worker_id) -> env``, picklable; ``worker_id`` is the global
            env slot (node ``i`` hosts slots ``offset_i .. offset_i + envs_per_node[i] - 1``).
        policy: picklable, with ``get_actions(observations, worker_ids)`` (global slot ids), run
            on each node over that node's ready envs; ``update`` as ``Sampler.update``.
        nodes: how many nodes (actors); ``envs_per_node``: an int, or one per node.
        fragment_steps: transitions per Ray call of ``obtain_steps`` / ``stream`` (choose >= 10 ms
            of env work: see the Ray guide's granularity section).
        in_flight: requests queued per node, so a node starts its next fragment at once.
        first_ready: take whichever node is done first (default). ``False``: each round waits for
            one fragment from every node, handed out in node order (reproducible; the slowest
            node sets the pace).
        seed: slot ``i``'s first reset gets ``seed + i``.
        timeout: seconds a node may take for one request (from when it could start it); past
            it the node counts as hung. ``start_timeout``: for an actor to be placed and start.
            ``env_timeout``: the deadline of each env step on the node (its manager's ``timeout``);
            keep it below ``timeout`` so a hung env is reported by its node, naming the env.
        restart_nodes, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s:
            restarts of a node that died, hung, or whose sampler raised, per node (ML-Agents'
            rule). Past the limits, or off: ``RayNodeError`` (see ``docs/guide/faults.md``).
        actor_options: Ray actor options (``num_cpus``, ``resources``, ``scheduling_strategy``,
            ``runtime_env``...); default one CPU per node, spread over the cluster.
        ray_address, ray_init_options: for ``ray.init`` when no Ray session is running (shut
            down when the last sampler using it closes; a session you started is left alone).
        sampler_options: passed to each node's ``Sampler`` (``envs_per_worker``, ``timeout``,
            ``restart_workers``, ``context`` (default forkserver)...).
    """

    def __init__(self, env_factory: Callable[[int], Any], policy: Any, *, nodes: int = 2,
                 envs_per_node: int | Sequence[int] = 4, fragment_steps: int = 256, in_flight: int = 2, first_ready: bool = True,
                 seed: int | None = None, timeout: float = 60.0, start_timeout: float = 60.0, env_timeout: float | None = None,
                 restart_nodes: bool = True, max_lifetime_restarts: int = MAX_LIFETIME_RESTARTS,
                 restarts_rate_limit_n: int = RATE_LIMIT_N, restarts_rate_limit_period_s: float = RATE_LIMIT_PERIOD_S,
                 actor_options: dict[str, Any] | None = None,
                 ray_address: str | None = None, ray_init_options: dict[str, Any] | None = None,
                 log_interval: float | None = None, **sampler_options: Any) -> None:
        positive_count("nodes", nodes)
        positive_count("fragment_steps", fragment_steps)
        positive_count("in_flight", in_flight)
        sizes = [envs_per_node] * nodes if isinstance(envs_per_node, (int, np.integer)) else list(envs_per_node)
        if len(sizes) != nodes or not all(isinstance(n, (int, np.integer)) and n >= 1 for n in sizes):
            raise InvalidInputError(f"envs_per_node must be a positive int or {nodes} of them, got {envs_per_node!r}")
        positive_seconds("timeout", timeout)
        positive_seconds("start_timeout", start_timeout)
        if env_timeout is not None:
            positive_seconds("env_timeout", env_timeout)
            sampler_options["timeout"] = env_timeout
        self.n_nodes = nodes
        self.n_workers = sum(sizes)
        self.fragment_steps = int(fragment_steps)
        self.in_flight = int(in_flight)
        self.first_ready = bool(first_ready)
        self.stats = Stats("ray-sampler", log_interval)
        #: The env update log and the newest weights (an ObjectRef): replayed into a restarted node.
        self.versions = Versions(self.n_workers, prepare=self._put, publish=self._publish)
        self._buffer: collections.deque[TransitionBatch] = collections.deque()  # fragments not handed out yet
        #: One record per global slot: what a restarted node resumes from (``envmanager.ray.records``).
        self.records = SlotRecords([None if seed is None else seed + s for s in range(self.n_workers)])
        restarts = RestartPolicy(restart_nodes, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s,
                                 switch="restart_nodes")
        self._pool = NodePool(env_factory, sizes, policy, self.records.resume, dict(sampler_options), dict(actor_options or {}),
                              float(timeout), float(start_timeout), restarts, ray_address, dict(ray_init_options or {}))
        self._pool.replay = self._replay

    # -- Versions and updates ------------------------------------------------------------------

    @deferred  # a caught Ctrl-C: raised in a wait for the nodes (nothing taken) or once it returned
    def update(self, agent_update: Any = None, env_update: Any = None, version: int | None = None) -> tuple[int, int]:
        """A new policy (one ``ray.put``, sent to every node without waiting) and/or env update
        (as ``Sampler.update``, one per global slot). Returns ``(policy_version, env_version)``.
        One that cannot be pickled, put or sent raises and is not recorded (no restarted node gets it)."""
        self._pool.check_usable()  # never a ray.put without our session: it would start a new one
        return self.versions.update(agent_update, env_update, version)

    def _put(self, agent_update: Any) -> Any:
        try:
            return ray.put(agent_update)
        except Exception as exc:
            self._pool.session.reraise(exc, "putting the weights in Ray's object store")

    def _publish(self, version: int | None, weights: Any, env: Pickled | None) -> None:
        """An update to every node not given up (whose error every collection call raises)."""
        for node in self._pool.nodes:
            if self._pool.failure(node) is None:  # (one not replayed yet gets it with its replay: send_update)
                sliced = None if env is None else Pickled(tuple(_slice(env.payloads, node)))
                self._pool.send_update(node, version, weights, sliced)

    def _replay(self, node: Node) -> None:
        """A (re)started node gets the newest weights and every env update, in order. Under the
        versions' lock: an update from another thread is recorded before (and so replayed) or
        published after (to the node, replayed by then), never both or neither."""
        with self.versions.locked():
            version, weights = self.versions.agent()
            if weights is not None:  # (None: no agent update yet, the node has the policy it was built with)
                self._pool.send_update(node, version, weights, None, replay=True)
            for entry in self.versions.env_updates.since(0):
                self._pool.send_update(node, None, None, entry.sliced(node.offset, node.offset + node.n_envs), replay=True)
            node.caught_up()

    # -- Steps: fragments, first-ready across nodes --------------------------------------------

    @deferred  # a caught Ctrl-C: raised in a wait for the nodes (nothing taken) or once it returned
    def obtain_steps(self, n: int, agent_update: Any = None, env_update: Any = None) -> TransitionBatch:
        """Exactly ``n`` transitions, in the order the nodes delivered them; the rest, and every
        node's ``in_flight`` fragments under way, go on into the next call, as episodes do."""
        positive_count("n", n)
        self.update(agent_update, env_update)
        self._pool.raise_given_up()
        while self.buffered_steps < n:
            if self.first_ready:
                self._top_up()
                self._wait()
            else:
                self._round()
        batch = self._take(n)
        self._top_up(ahead=True)
        self.stats.lag(self.policy_version - batch.policy_versions)
        self.stats.count("steps_handed_out", len(batch))
        self.stats.maybe_log()
        return batch

    def stream(self, fragment_steps: int | None = None, feed: LearnerFeed | None = None, max_batches_waiting: int = 2,
               max_fragments: int | None = None) -> Iterator[TransitionBatch]:
        """Batches of ``fragment_steps`` (default: the sampler's) transitions as the nodes deliver
        them, as ``Sampler.stream``."""
        size = self.fragment_steps if fragment_steps is None else fragment_steps
        positive_count("fragment_steps", size)
        yield from feed_fragments(lambda: self.obtain_steps(size), self.stats, feed, max_batches_waiting, max_fragments)

    @property
    def buffered_steps(self) -> int:
        """Steps collected but not handed out yet (the next ``obtain_steps`` starts with them)."""
        return sum(len(b) for b in self._buffer)

    @property
    def open_episodes(self) -> set[int]:
        """Ids of episodes whose steps were handed out or buffered and that are still running."""
        return self.records.running()

    @property
    def cut_episodes(self) -> list[int]:
        """Global ids of the episodes cut (inside a node, or with a lost node), in the order seen."""
        return self.records.cut_episodes

    def _round(self) -> None:
        """Wait-for-all: one fragment from every node, booked in node order (also those that
        came when a node's error ends the round: their nodes' episodes go on)."""
        requests = [self._pool.submit(node, "steps", self.fragment_steps) for node in self._pool.nodes]
        answers: dict[int, tuple[Request, Any]] = {}
        try:
            while len(answers) < len(requests):
                for request, answer in self._receive():
                    if request in requests:
                        answers[request.node] = (request, answer)
                    else:  # an answer to an earlier call
                        self._book([(request, answer)])
        finally:
            self._book([answers[i] for i in sorted(answers)])

    def _top_up(self, ahead: bool = False) -> None:
        """Keep ``in_flight`` step fragments queued on each node (first-ready streaming).
        ``ahead`` (for the next call): not while the buffer holds a whole round already, else
        every episodes call would stock one more round (rows ever older, the buffer ever larger)."""
        if not self.first_ready or (ahead and self.buffered_steps >= self.in_flight * self.fragment_steps * self.n_nodes):
            return
        for node in self._pool.nodes:
            if self._pool.failure(node) is None and all(r.kind == "steps" for r in node.queue):
                while len(node.queue) < self.in_flight:
                    self._pool.submit(node, "steps", self.fragment_steps)

    def _take(self, n: int) -> TransitionBatch:
        parts, have = [], 0
        while have < n:
            batch = self._buffer.popleft()
            if have + len(batch) > n:
                self._buffer.appendleft(batch.select(slice(n - have, None)))
                batch = batch.select(slice(0, n - have))
            parts.append(batch)
            have += len(batch)
        return TransitionBatch.concatenate(parts)

    def _wait(self, asked: Sequence[Request] = ()) -> list[tuple[Request, Any]]:
        return self._book(self._receive(), asked)

    def _receive(self) -> list[tuple[Request, Any]]:
        """The next answers. After a node error raised here the node's running episodes never
        continue (counted here as ``failed_episodes`` if the node was given up with its counts)."""
        try:
            return self._pool.wait()
        except RayNodeError as exc:
            node = self._pool.nodes[exc.node]
            failed = self.records.let_go(node.slots)
            if self._pool.failure(node) is not None and failed:
                self.stats.count("failed_episodes", failed)
            raise

    def _book(self, answers: list[tuple[Request, Any]], asked: Sequence[Request] = ()) -> list[tuple[Request, Any]]:
        """Book answers; returns those of ``asked`` (``None``: lost with its node). An episode
        answer nobody asks for any more (its call raised) is dropped, counted."""
        out = []
        for request, answer in answers:
            node = self._pool.nodes[request.node]
            if answer is None:  # it died with its node (restarted): an episode request is asked again
                self.stats.count("lost_requests")
                if request.kind == "steps":  # the fragment's running episodes are cut
                    self._cut([self.records[s].running for s in node.slots if self.records[s].running >= 0], counted=False)
            elif not self._booked(node, request, answer):  # a replaced node's: as lost (an episode request is asked again)
                if request in asked:
                    out.append((request, None))
                continue
            if request.kind == "steps":
                continue
            self.records.let_go(node.slots)  # an episode request ran them out unrecorded
            if request in asked:
                out.append((request, None if answer is None else answer[0]))
            elif answer is not None:
                self.stats.count("dropped_steps", len(answer[0]))
        return out

    def _booked(self, node: Node, request: Request, answer: Any) -> bool:
        """Book one answer into the records (and a fragment into the buffer), unless it is of
        another generation of the node (a replaced node's): dropped whole, counted."""
        batch, counters = answer
        generation = counters.get("generation")
        if not self.records.booked(batch, counters.get("started"), node.offset, runs_on=request.kind == "steps",
                                   generation=generation):
            self.stats.count("stale_answers")
            self.stats.count("dropped_steps", len(batch))
            logger.warning("ray sampler: an answer of generation %s of %s came after generation %d started; its %d "
                           "steps are dropped", generation, node.name(), self._pool.supervisor.generation(node.index),
                           len(batch))
            return False
        for key in COUNTERS:
            self.stats.count(key, counters.get(key, 0))
        if request.kind == "steps":
            self.stats.count("fragments")
            batch.interrupted = batch.interrupted.copy()  # Ray hands arrays out read-only; a later cut may flag these
            self._buffer.append(batch)
        self._cut(counters.get("cut_episodes", ()), counted=True)  # cut inside the node (rows flagged there)
        return True

    def _cut(self, episodes: Sequence[int], counted: bool) -> None:
        """``episodes`` were cut (inside a node, ``counted`` there, or with it): their rows not
        handed out yet are flagged ``interrupted``."""
        for episode in self.records.cut(episodes):
            if not counted:
                self.stats.count("interrupted_episodes")
            for batch in self._buffer:
                batch.interrupted[batch.episode_ids == episode] = True

    # -- Whole episodes ------------------------------------------------------------------------

    @deferred  # a caught Ctrl-C: raised in a wait for the nodes (nothing taken) or once it returned
    def obtain_samples(self, itr: int, num_samples: int, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """Whole episodes, each started during this call, until at least ``num_samples`` steps
        (garage), in chunks first-ready: a faster node delivers more of them."""
        positive_count("num_samples", num_samples)
        self.update(agent_update, env_update)
        self._pool.raise_given_up()
        logger.debug("ray obtain_samples itr=%s num_samples=%d", itr, num_samples)
        chunk = max(1, min(self.fragment_steps, -(-num_samples // self.n_nodes)))
        got: list[EpisodeBatch] = []
        received, outstanding = 0, [self._pool.submit(node, "samples", chunk) for node in self._pool.nodes]
        while outstanding:
            for request, batch in self._wait(outstanding):
                outstanding.remove(request)
                if batch is not None:
                    got.append(batch)
                    received += len(batch)
                if received + chunk * len(outstanding) < num_samples:  # a lost chunk is asked for again
                    outstanding.append(self._pool.submit(self._pool.nodes[request.node], "samples", chunk))
        return self._merge(got)

    @deferred  # a caught Ctrl-C: raised in a wait for the nodes (nothing taken) or once it returned
    def obtain_exact_episodes(self, n_eps_per_worker: int | Sequence[int], agent_update: Any = None,
                              env_update: Any = None) -> EpisodeBatch:
        """Exactly ``n_eps_per_worker`` episodes from each global slot, as ``Sampler``'s. A node
        lost during the call loses its whole answer (``lost_episodes``); that does not depend on
        episode lengths, so asking its replacement for the same quotas keeps the sample unbiased."""
        quotas = exact_quotas(n_eps_per_worker, self.n_workers)
        self.update(agent_update, env_update)
        self._pool.raise_given_up()
        got: dict[int, EpisodeBatch] = {}
        outstanding = []
        for node in self._pool.nodes:
            local = _slice(quotas, node)
            if sum(local):
                outstanding.append(self._pool.submit(node, "episodes", local))
        while outstanding:
            for request, batch in self._wait(outstanding):
                outstanding.remove(request)
                if batch is None:
                    self.stats.count("lost_episodes", sum(request.arg))
                    logger.warning("ray sampler: node %d was lost during obtain_exact_episodes; its %d episodes are "
                                   "collected again by its replacement", request.node, sum(request.arg))
                    outstanding.append(self._pool.submit(self._pool.nodes[request.node], "episodes", request.arg))
                else:
                    got[request.node] = batch
        return self._merge([got[i] for i in sorted(got)])

    def obtain_episodes(self, n: int, per_worker: bool = False, agent_update: Any = None,
                        env_update: Any = None) -> EpisodeBatch:
        """``n`` episodes in all (quotas spread over the global slots up front), or ``n`` per
        slot with ``per_worker=True``."""
        positive_count("n", n)
        quotas = n if per_worker else spread(n, self.n_workers)
        return self.obtain_exact_episodes(quotas, agent_update, env_update)

    def _merge(self, batches: list[EpisodeBatch]) -> EpisodeBatch:
        """Episodes in (worker, admission) order: by global slot, then in the order they came
        (a stream going on before the call gets its fragments topped up first)."""
        if self._buffer or any(r.kind == "steps" for node in self._pool.nodes for r in node.queue):
            self._top_up(ahead=True)
        episodes = [e for b in batches for e in b.split_episodes()]
        if not episodes:
            raise EnvManagerError("ray sampler: no episode was collected")
        order = sorted(range(len(episodes)), key=lambda i: (int(episodes[i].worker_ids[0]), i))
        merged = EpisodeBatch.from_transitions([episodes[i] for i in order],
                                               [bool(episodes[i].episode_interrupted[0]) for i in order])
        self.stats.lag(self.policy_version - merged.policy_versions)
        self.stats.count("episodes_handed_out", merged.n_episodes)
        return merged

    # -- Nodes and lifetime --------------------------------------------------------------------

    def node_info(self) -> list[dict[str, Any]]:
        """Where each node runs (host, actor pid, env worker pids, Ray node id), as of its start."""
        return [dict(node.info) for node in self._pool.nodes]

    def kill_node(self, index: int) -> None:
        """Kill node ``index``'s actor as a fault would; the sampler notices and restarts it."""
        self._pool.kill_node(index)

    def restart_count(self, index: int) -> int:
        """How often node ``index`` was restarted."""
        return self._pool.supervisor.restart_count(index)

    @property
    def restarts(self) -> int:
        """Node restarts so far, of every node."""
        return self._pool.supervisor.restarts

    def close(self) -> None:
        """End every node (reaping its env processes) and leave the Ray session. Idempotent."""
        self._pool.close()
        self._buffer.clear()


def _slice(per_slot: Sequence[Any], node: Node) -> list[Any]:
    return list(per_slot[node.offset: node.offset + node.n_envs])
