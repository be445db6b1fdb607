"""``WorkerPolicySampler``: the policy in the workers, garage style.

Each process runs a picklable agent over its envs and writes whole fragments into an arena
(``envmanager.sampler.rollout``), one request per process per fragment; faults take the core's
one failure path. Each slot's episode is one record (``envmanager.sampler.slots``); ids are the
parent's. The arena, the faults and their outcomes: ``docs/guide/sampler.md``.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import secrets
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import cloudpickle
import numpy as np

from envmanager.core.arguments import positive_count, seeds_for
from envmanager.core.batch import BatchEnvManager
from envmanager.core.completion import worker_error
from envmanager.core.pool import get_context
from envmanager.core.supervisor import GiveUp, Rebuild, Restart
from envmanager.errors import EnvManagerError, InvalidInputError
from envmanager.sampler.batches import EpisodeBatch, TransitionBatch
from envmanager.sampler.episodes import spread
from envmanager.sampler.fragments import SentFragment, answer_rows, arena_rows, fill_agent_infos, fragment_batch, release_arena
from envmanager.sampler.learner import LearnerFeed, feed_fragments
from envmanager.sampler.rollout import ARENAS, Arena, ArenaSpec, RegisteredFactory, RolloutRequest, capacity_for, rollout
from envmanager.sampler.slots import EpisodeSlots, EpisodeState, Outcome, raise_given_up
from envmanager.sampler.stats import Stats
from envmanager.sampler.versions import SamplerBase, Versions
from envmanager.wire import shm
from envmanager.wire.interrupts import DEFERRED
from envmanager.wire.messages import EnvFunction
from envmanager.worker.envs import DISABLED

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

__all__ = ["WorkerPolicySampler"]

_ROLLOUT = EnvFunction(cloudpickle.dumps(rollout))
RUNNING = EpisodeState.RUNNING


class WorkerPolicySampler(SamplerBase):
    """Collect with a picklable agent in every worker: one request per fragment per process.

    Args:
        env_factory: ``env_factory(worker_id) -> env``.
        n_workers: env slots.
        agent: picklable (cloudpickle), with ``get_actions(observations, worker_ids)`` or
            ``get_action(observation)``; either may return ``(actions, agent_infos)``.
        seed: slot ``i``'s first reset gets ``seed + i``.
        fragment_bytes: arena bytes per slot; a fragment longer than fits is sent in pieces.
        manager_options: passed to ``BatchEnvManager`` (``envs_per_worker``, ``timeout``,
            ``restart_workers``, ``context``, ...).
    """

    def __init__(self, env_factory: Callable[[int], Any], n_workers: int, agent: Any, *, seed: int | None = None,
                 fragment_bytes: int = 4 << 20, **manager_options: Any) -> None:
        check_agent(agent)
        positive_count("n_workers", n_workers)
        positive_count("fragment_bytes", fragment_bytes)
        self.n_workers = n = n_workers
        self.stats = Stats("worker-sampler")
        #: One record per slot: the episode it runs (see ``envmanager.sampler.slots``).
        self.episodes = EpisodeSlots(seeds_for(seed, n), self.stats)
        #: The env update log and the newest agent, pickled once (update() may come from a learner thread).
        self.versions = Versions(n, prepare=cloudpickle.dumps, agent=cloudpickle.dumps(agent))
        self._token = secrets.token_hex(8)
        # Forked workers inherit the arena if it exists before they start; others get none.
        forked = get_context(manager_options.get("context")).get_start_method() == "fork"
        mapping = mmap.mmap(-1, n * int(fragment_bytes)) if forked else None
        self._release_arena: Callable[[], Any] | None = None
        if mapping is not None:
            ARENAS[self._token] = mapping
            # An unclosed sampler, once collected, frees its arena all the same.
            self._release_arena = weakref.finalize(self, release_arena, self._token, mapping)
        try:
            self.manager = BatchEnvManager(RegisteredFactory(env_factory), n, autoreset_mode=DISABLED, **manager_options)
        except BaseException:
            self._free_arena()
            raise
        self.stats.count_total("worker_restarts", self.manager.restarts)  # the supervisor's one count, noted
        try:  # the workers run: any failure from here on must reap them
            self._setup(n, int(fragment_bytes), mapping)
        except BaseException:
            self.close()
            raise

    def _setup(self, n: int, fragment_bytes: int, mapping: mmap.mmap | None) -> None:
        """The arena over the workers' spaces."""
        m = self.manager
        layouts = shm.array_layout(m.observation_space), shm.array_layout(m.action_space)
        if None in layouts:
            raise InvalidInputError(
                "the worker-side sampler needs Box/Discrete/MultiDiscrete/MultiBinary (or Dict/Tuple of them) spaces")
        one_row = Arena.nbytes_for(ArenaSpec(self._token, n, 1, *layouts))
        if one_row > n * fragment_bytes:
            raise InvalidInputError(f"fragment_bytes={fragment_bytes} is too small: one row of these spaces needs "
                                    f"{-(-one_row // n)} bytes per slot ({one_row} for {n} slots, arena headers included)")
        self._spec = ArenaSpec(self._token, n, capacity_for(n * fragment_bytes, n, *layouts), *layouts)
        self._arena = Arena(self._spec, mapping) if mapping is not None else None
        if self._arena is not None:  # a fragment that keeps writing rows is not hung, however long
            m.watch_progress(_progress_of(weakref.ref(self)))
        self._procs: dict[int, list[int]] = {}
        for slot in range(n):
            self._procs.setdefault(int(m.slot_process[slot]), []).append(slot)
        self._info_template: dict[str, np.ndarray] = {}
        self._recovered: list[TransitionBatch] = []  # rows read back from a killed worker, in this call
        self._held_error: EnvManagerError | None = None  # a fault's error a Ctrl-C overtook: the next call raises it

    # ------------------------------------------------------------------------------------------
    # Versions

    def update(self, agent_update: Any = None, env_update: Any = None, version: int | None = None) -> tuple[int, int]:
        """A new agent for the workers (picklable), used from each process's next request on,
        and/or an ``env_update`` (as ``Sampler.update``). Returns ``(policy_version,
        env_version)``; an agent without ``get_actions`` or ``get_action`` (weights, say) or one
        that does not pickle raises and changes no version."""
        if agent_update is not None:
            check_agent(agent_update)
        return self.versions.update(agent_update, env_update, version)

    # ------------------------------------------------------------------------------------------
    # Collection

    def obtain_steps(self, steps_per_worker: int, agent_update: Any = None, env_update: Any = None) -> TransitionBatch:
        """``steps_per_worker`` steps from every slot, in worker order; episodes continue."""
        positive_count("steps_per_worker", steps_per_worker)
        self.update(agent_update, env_update)
        return self._collect([int(steps_per_worker)] * self.n_workers, None,
                             lambda chunks: TransitionBatch.concatenate([c for per_slot in chunks for c in per_slot]))

    def obtain_exact_episodes(self, n_eps_per_worker: int, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """``n_eps_per_worker`` whole episodes from every slot, each started by this call (a
        running episode is abandoned, counted as ``discarded_episodes``), in worker order."""
        positive_count("n_eps_per_worker", n_eps_per_worker)
        self.update(agent_update, env_update)
        return self._exact([int(n_eps_per_worker)] * self.n_workers)

    def _exact(self, quotas: list[int]) -> EpisodeBatch:
        """``quotas[slot]`` whole episodes from each slot, each started by this call. One cut
        before its first step gives its admission back, as in the ``Sampler``."""
        collected: list[list[TransitionBatch]] = [[] for _ in quotas]
        short = quotas
        while any(short):
            empty_before = self.stats.counters.get("empty_cut_episodes", 0)
            for s, chunks in enumerate(self._collect(None, short, list)):  # (whole episodes: one lost is lost whole)
                collected[s] += chunks
            if self.stats.counters.get("empty_cut_episodes", 0) == empty_before:
                break
            have = [len({e for c in chunks for e in c.episode_ids.tolist()}) for chunks in collected]
            short = [max(0, q - h) for q, h in zip(quotas, have, strict=True)]
        episodes, cut = [], []
        for per_slot in collected:
            if not per_slot:
                continue
            rows = TransitionBatch.concatenate(per_slot)
            bounds = np.flatnonzero(np.diff(rows.episode_ids)) + 1
            for start, end in itertools.pairwise([0, *bounds.tolist(), len(rows)]):
                episodes.append(rows.select(slice(start, end)))
                cut.append(bool(rows.interrupted[start]))
        if not episodes:
            raise EnvManagerError("worker-side sampler: every admitted episode was cut before its first step")
        return EpisodeBatch.from_transitions(episodes, cut)

    def obtain_samples(self, itr: int, num_samples: int, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """Whole episodes until at least ``num_samples`` steps (garage): rounds of one episode
        from every slot, so no slot's short episodes crowd out another's. ``itr`` is for logs."""
        positive_count("num_samples", num_samples)
        self.update(agent_update, env_update)
        logger.debug("obtain_samples itr=%s num_samples=%d", itr, num_samples)
        rounds: list[EpisodeBatch] = []
        try:
            while sum(len(r) for r in rounds) < num_samples:
                rounds.append(self.obtain_exact_episodes(1))
        except BaseException:  # the rounds already in are dropped with the call: counted
            dropped = sum(len(r) for r in rounds)
            if dropped:
                self.stats.count("dropped_steps", dropped)
            raise
        return rounds[0] if len(rounds) == 1 else EpisodeBatch.concatenate(rounds)  # type: ignore[return-value]

    def obtain_episodes(self, n: int, per_worker: bool = False, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """``n`` whole episodes in all (quotas ``spread`` over the slots up front, so unbiased),
        or ``n`` from every slot with ``per_worker=True``."""
        positive_count("n", n)
        self.update(agent_update, env_update)
        return self._exact([int(n)] * self.n_workers if per_worker else spread(int(n), self.n_workers))  # (0: starts none)

    def stream(self, steps_per_worker: int, feed: LearnerFeed | None = None, max_batches_waiting: int = 2,
               max_fragments: int | None = None) -> Iterator[TransitionBatch]:
        """Fragments of ``steps_per_worker`` steps from every slot, as ``Sampler.stream``. Agents
        published meanwhile are used from each process's next request on."""
        yield from feed_fragments(lambda: self.obtain_steps(steps_per_worker), self.stats, feed,
                                  max_batches_waiting, max_fragments)

    def _collect(self, steps: list[int] | None, quotas: list[int] | None,
                 hand_out: Callable[[list[list[TransitionBatch]]], _T]) -> _T:
        """Fragments until every slot has its ``steps`` rows (or ``quotas`` whole episodes), per
        slot in order, given to ``hand_out``. A call that raises drops its rows
        (``dropped_steps``) and lets the running episodes go, so none has a gap."""
        m, episodes = self.manager, self.episodes
        raise_given_up(m, episodes)
        held, self._held_error = self._held_error, None
        if held is not None:  # the last call ended by a Ctrl-C while this error waited for the other fragments
            raise held
        for p in self._procs:
            self._sync(p)
        if quotas is not None:  # exact episodes start afresh: what runs now is let go
            self.let_running_go()
        want = list(steps) if steps is not None else [self._spec.capacity] * self.n_workers
        starts = list(quotas) if quotas is not None else [-1] * self.n_workers
        out: list[list[TransitionBatch]] = [[] for _ in range(self.n_workers)]
        cut_before = len(episodes.cut_episodes)
        # Whole episodes: the agent in force when the call starts acts every piece of them (each
        # episode has one policy version); steps: the newest agent from each request on.
        agent = self.versions.agent() if quotas is not None else None
        pending: dict[int, SentFragment] = {}
        error: EnvManagerError | None = None
        self._recovered = []

        def work(p: int) -> bool:
            slots = self._procs[p]
            if steps is not None:
                return any(want[s] > 0 for s in slots)
            return any(starts[s] > 0 or episodes[s].state is RUNNING for s in slots)

        try:
            for p in self._procs:
                if work(p):
                    pending[p] = self._send(p, want if steps is not None else None, starts, agent)
            with self.stats.timer("collect"):
                while pending:  # (the pool's deadline counts from a fragment's last row written: ``_progress``)
                    m.wait_for(lambda: any(m.call_ready(sent.call) for sent in pending.values()), None, "rollout fragments",
                               lambda: [s for p in pending for s in self._procs[p]])
                    for p in [p for p, sent in pending.items() if m.call_ready(sent.call)]:
                        # A Ctrl-C waits until the answer taken is filed and the next piece sent
                        # (``interrupts``): raised halfway, the answer would be lost, its fault undecided.
                        with DEFERRED:
                            sent = pending.pop(p)
                            try:
                                answer = m.receive_call(sent.call, timeout=0)[0]
                            except EnvManagerError as exc:
                                failure = self._lost(p, sent, exc, out, want, starts)
                            else:
                                failure = self._file(p, sent, answer, out, want, starts)
                            error = error or failure
                            if error is None and work(p):
                                pending[p] = self._send(p, want if steps is not None else None, starts, agent)
            if error is not None:
                raise_given_up(m, episodes)  # a process given up: the first one's error, as every later call raises
                raise error
            with DEFERRED:  # a Ctrl-C waits until the rows are handed out: they leave the records whole
                return hand_out(self._finished(out, cut_before))
        except BaseException as exc:  # raised: what was collected is dropped, what runs let go (no gaps)
            if error is not None and not isinstance(exc, EnvManagerError):  # (a Ctrl-C in the wait for the others)
                self._held_error = error  # not lost: the next call raises it
            dropped = sum(len(chunk) for per_slot in out for chunk in per_slot)
            if dropped:
                self.stats.count("dropped_steps", dropped)
            self.let_running_go()
            raise

    def let_running_go(self) -> None:
        """After a call that raised: the running episodes are let go (``discarded_episodes``)."""
        for s in self.episodes.in_state(RUNNING):
            self.episodes.close(s, Outcome.DISCARDED)

    def _finished(self, out: list[list[TransitionBatch]], cut_before: int) -> list[list[TransitionBatch]]:
        """The rows collected, those of episodes cut meanwhile flagged, agent infos filled in."""
        cut = self.episodes.cut_episodes[cut_before:]
        if cut:
            for per_slot in out:
                for chunk in per_slot:
                    chunk.interrupted |= np.isin(chunk.episode_ids, cut)
        for chunk in self._recovered:  # filled in now: the template may come from a later fragment
            fill_agent_infos(chunk, self._info_template)
        self._recovered = []
        return out

    def _send(self, p: int, want: list[int] | None, starts: list[int], agent: tuple[int, Any] | None = None) -> SentFragment:
        """The next fragment request for process ``p``, from its slots' records (``agent``:
        the version and agent to send; default the newest)."""
        m, episodes = self.manager, self.episodes
        self._sync(p)
        slots = self._procs[p]
        version, payload = agent or self.versions.agent()  # together: a request never pairs them wrongly
        due = [self.versions.env_updates.due(s, episodes[s].env_version) for s in slots]
        budget = tuple(min(want[s], self._spec.capacity) if want is not None else self._spec.capacity for s in slots)
        records = [episodes[s] for s in slots]
        request = RolloutRequest(
            slots=tuple(slots), first=slots[0], spec=self._spec, shared=self._arena is not None, agent=payload,
            steps=budget, starts=tuple(starts[s] for s in slots), ids=tuple(episodes.next_id(s) for s in slots),
            id_stride=episodes.id_stride, let_go=tuple(r.state is not RUNNING for r in records), env_updates=tuple(due),
            seeds=tuple(r.seed for r in records), generations=tuple(r.generation for r in records),
            replays=tuple(m.pool.replay_calls))
        if self._arena is not None:  # a worker killed before its first row must not show old rows
            self._arena.rows[slots] = 0
            self._arena.started[slots] = 0
        call = m.send_call(_ROLLOUT, (request,), None, [slots[0]])
        return SentFragment(call, version, [episodes[s].env_version for s in slots], [r for r, _ in due])

    def _progress(self, slots: list[int]) -> int:
        """Rows written and episodes started on ``slots`` by the fragments in flight (0 without
        an arena: spawn and forkserver)."""
        arena = self._arena
        return 0 if arena is None else int(arena.rows[slots].sum() + arena.started[slots].sum())

    # ------------------------------------------------------------------------------------------
    # Answers: what each fragment did to each slot's record

    def _file(self, p: int, sent: SentFragment, answer: dict[str, Any], out: list[list[TransitionBatch]], want: list[int],
              starts: list[int]) -> EnvManagerError | None:
        """Take one fragment of process ``p``: its rows out of the arena (or the answer), its records, its fault."""
        slots, arrays, failures = self._procs[p], answer["arrays"], answer["failures"]
        empty: dict[int, int] = {}
        self._replaced(slots, answer["generations"])  # (the records' generations: a fresh env only if they missed it)
        for i, s in enumerate(slots):
            n = answer["rows"][i]
            if n:
                fields = answer_rows(arrays, i, n) if arrays is not None else self._read_arena(s, n)
                infos = {k: v[i, :n] for k, v in answer["agent_infos"].items()}
                batch = self._batch(s, fields, infos, answer["env_infos"][i], answer["env_versions"][i], sent, i)
                out[s].append(batch)
            empty[s] = self._advance(s, fields if n else None, answer["started"][i], answer["running"][i],
                                     answer["cut"][i], want, starts)
            self.episodes[s].applied(answer["env_version"][i])
        self.stats.count("env_steps", sum(answer["rows"]))
        self.stats.count("fragments")
        error = None
        if failures:
            first = min(failures)
            for i in sorted(failures)[1:]:  # one fault decides for them all, raised (or absorbed) as the first's
                logger.error("worker-side sampler: %s (in the same fragment as worker %d's failure)",
                             worker_error(failures[i], p), slots[first])
            error = self._fault(p, worker_error(failures[first], p), [slots[i] for i in sorted(failures)],
                                envs_raised=set(answer["env_raised"]) == set(failures))
        self._count_empty(empty, absorbed=error is None)
        return error

    def _lost(self, p: int, sent: SentFragment, error: EnvManagerError, out: list[list[TransitionBatch]], want: list[int],
              starts: list[int]) -> EnvManagerError | None:
        """Process ``p``'s fragment failed as a whole (it died, hung, or the rollout raised):
        keep what it wrote to the arena, then the pool decides: restarted, or the error."""
        slots, arena = self._procs[p], self._arena
        empty: dict[int, int] = {}
        for i, s in enumerate(slots):
            n, started = (int(arena.rows[s]), int(arena.started[s])) if arena is not None else (0, 0)
            fields = arena_rows(arena, s, n) if arena is not None and n else None
            if fields is not None:
                out[s].append(self._batch(s, fields, None, None, {}, sent, i))
                self.stats.count("env_steps", n)
                self.stats.count("recovered_steps", n)
            record = self.episodes[s]
            running = record.episode_id if record.state is RUNNING and not started else -1
            if fields is not None and not (fields["terminated"][-1] or fields["truncated"][-1]):
                running = int(fields["episodes"][-1])
            empty[s] = self._advance(s, fields, started, running, -1, want, starts)
        if arena is None:
            self.stats.count("lost_fragments")  # its rows travelled in the answer that never came
        failure = self._fault(p, error, slots)
        self._count_empty(empty, absorbed=failure is None)
        return failure

    def _advance(self, s: int, fields: dict[str, Any] | None, started: int, running: int, cut: int, want: list[int],
                 starts: list[int]) -> int:
        """Book one slot's part of a fragment in its record: the episode it goes on with
        (``running``, -1: none), or the one a failure ended (``cut``), held for the pool's
        decision if anything of it was seen. Returns how many episodes started in it wrote no row."""
        record = self.episodes[s]
        before = record.episode_id if record.state is RUNNING else -1
        with_rows: set[int] = set()
        if fields is not None:
            with_rows = set(np.unique(fields["episodes"]).tolist())
            want[s] -= len(fields["rewards"])
            self.stats.count("episodes", int(np.count_nonzero(fields["terminated"] | fields["truncated"])))
        if cut >= 0 and (cut == before or cut in with_rows):
            running = cut  # (one that ended before its first row is one of the empty ones)
        if starts[s] > 0:  # admitted episodes count, cut or not: none is silently replaced
            starts[s] = max(0, starts[s] - started)
        self.episodes.advanced(s, started, running)
        return max(0, started - len(with_rows - {before}))

    def _fault(self, p: int, error: EnvManagerError, failing: list[int], envs_raised: bool = False) -> EnvManagerError | None:
        """A fault of process ``p``, put to the supervisor: envs that raised rebuilt in place, or
        the process restarted, their episodes cut (``None``); else the error to raise (the
        failing slots' episodes failed; every slot's if the process was given up)."""
        m, slots = self.manager, self._procs[p]
        decision = m.fault(failing, error, envs_raised, {s: self.episodes[s].generation for s in slots})
        if isinstance(decision, Rebuild):
            self._replaced(decision.slots, decision.generations)
            logger.warning("worker-side sampler: %s; the env was rebuilt in its process, its cut episode kept and flagged",
                           error)
            return None
        if isinstance(decision, Restart):
            self._replaced(slots, (None,) * len(slots))
            logger.warning("worker-side sampler: %s; the process was restarted, its cut episodes kept and flagged", error)
            return None
        assert isinstance(decision, GiveUp)
        for s in slots if decision.given_up else failing:
            self.episodes.close(s, Outcome.FAILED)
        return decision.error

    def _sync(self, p: int) -> None:
        """Process ``p``'s fresh resets that came meanwhile (a restart while no fragment was in
        flight): the generations they carry cut the episodes of a replaced env."""
        m = self.manager
        m.wait_idle(self._procs[p])
        batch = m.receive_unreceived()
        if batch is not None:
            slots, generations = batch.slots.tolist(), batch.generations
            assert generations is not None  # (the manager's array: every batch it hands out has it)
            self._replaced(slots, [int(generations[s]) for s in slots])

    def _replaced(self, slots: Sequence[int], generations: Sequence[int | None]) -> None:
        """The envs of ``slots`` are of ``generations`` (``None``: a restart's, whose fresh reset
        brings it): the episodes of replaced ones are cut."""
        if [s for s, g in zip(slots, generations, strict=True) if self.episodes.replaced(s, g) is not None]:
            self.stats.count_total("worker_restarts", self.manager.restarts)  # the supervisor's one count

    def _count_empty(self, empty: dict[int, int], absorbed: bool) -> None:
        for s, k in empty.items():
            if not k:
                continue
            if absorbed:  # no row can carry the flag: counted (an exact-episodes call admits another)
                self.stats.count("interrupted_episodes", k)
                self.stats.count("empty_cut_episodes", k)
                logger.warning("worker-side sampler: %d admitted episode(s) on worker %d cut before their first step", k, s)
            else:
                self.stats.count("failed_episodes", k)

    def _read_arena(self, s: int, n: int) -> dict[str, Any]:
        assert self._arena is not None
        return arena_rows(self._arena, s, n)

    def _batch(self, s: int, fields: dict[str, Any], infos: dict[str, np.ndarray] | None, env_infos: list[dict] | None,
               env_versions: dict[int, int], sent: SentFragment, i: int) -> TransitionBatch:
        """Rows of slot ``s`` as a batch; keeps a template of the policy's infos, for rows
        recovered from a dead worker to be filled in."""
        record = self.episodes[s]
        running = record.episode_id if record.state is RUNNING else -1
        batch = fragment_batch(s, fields, infos, env_infos, env_versions, sent, i, running)
        if infos and not self._info_template:
            self._info_template = {k: v[:1] for k, v in infos.items()}
        if infos is None:  # rows recovered from a dead worker: its policy's infos died with it
            self._recovered.append(batch)
        return batch

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def _free_arena(self) -> None:
        self._arena = None  # its views first: the mapping cannot close under them
        if self._release_arena is not None:
            self._release_arena()  # once only (weakref.finalize)

    def close(self) -> None:
        """Close the manager (reaps every worker) and free the arena. Idempotent."""
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.close()
        self._free_arena()


def _progress_of(ref: weakref.ref) -> Callable[[list[int]], int]:
    """The pool's progress hook, holding the sampler weakly (it must not keep the arena alive)."""
    def progress(slots: list[int]) -> int:
        sampler = ref()
        return 0 if sampler is None else sampler._progress(slots)
    return progress


def check_agent(agent: Any) -> None:
    """An agent the workers can run (refused before any worker gets it: every rollout would fail)."""
    if not (hasattr(agent, "get_action") or hasattr(agent, "get_actions")):
        raise InvalidInputError(f"the agent needs get_actions(observations, worker_ids) or get_action(observation), "
                                f"got {type(agent).__name__}")
