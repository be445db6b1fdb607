"""``WorkerPolicySampler``: the policy in the workers, garage style.

Each worker process gets a picklable agent (``get_actions(observations, worker_ids)``, batched
as the parent-side ``Sampler``'s policy, or ``get_action(observation)``), steps all of its envs
in lockstep with one policy call per tick and writes whole rollout fragments into a fragment
arena; one answer per process per fragment announces them (``envmanager.sampler.rollout``).
Fragments are handed out first-ready: a process that finished gets its next request at once.

Faults: an env that raises mid-fragment, or a worker process that dies (killed, crashed), cuts
the episodes running on those slots. With ``restart_workers`` on and within the restart limits
(the manager's policy, counted per process), the cut episodes are kept -- the rows written
before the fault, read from the arena -- flagged ``interrupted`` and counted, and collection
goes on (the env is reset, or the process restarted by the pool); past the limits, or with
restarts off, the error names the slot and process, with the worker's traceback.
"""

from __future__ import annotations

import logging
import mmap
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING
from typing import Any

import cloudpickle
import numpy as np

from envmanager.core.batch import BatchEnvManager, seeds_for
from envmanager.core.pool import get_context, worker_error
from envmanager.errors import EnvManagerError, InvalidInputError, RestartLimitError, WorkerTimeoutError
from envmanager.sampler.batches import EpisodeBatch, TransitionBatch, _stack_or_objects
from envmanager.sampler.episodes import spread
from envmanager.sampler.rollout import ARENAS, Arena, ArenaSpec, RegisteredFactory, RolloutRequest, capacity_for, rollout
from envmanager.sampler.learner import feed_fragments
from envmanager.sampler.stats import Stats
from envmanager.wire import shm
from envmanager.wire.messages import EnvFunction
from envmanager.worker.envs import DISABLED

if TYPE_CHECKING:
    from envmanager.sampler.learner import LearnerFeed

logger = logging.getLogger(__name__)

__all__ = ["WorkerPolicySampler"]

_ROLLOUT = EnvFunction(cloudpickle.dumps(rollout))
_FIELDS = ("observations", "next_observations", "actions", "rewards", "terminated", "truncated", "episodes")


class WorkerPolicySampler:
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
        if not (hasattr(agent, "get_action") or hasattr(agent, "get_actions")):
            raise InvalidInputError("the agent needs get_actions(observations, worker_ids) or get_action(observation)")
        if not isinstance(n_workers, int) or n_workers < 1:
            raise InvalidInputError(f"n_workers must be a positive int, got {n_workers!r}")
        if isinstance(fragment_bytes, bool) or not isinstance(fragment_bytes, (int, np.integer)) or fragment_bytes < 1:
            raise InvalidInputError(f"fragment_bytes must be a positive int, got {fragment_bytes!r}")
        self.n_workers = n = n_workers
        self.stats = Stats("worker-sampler")
        self.policy_version = 0
        self.env_version = 0
        self._payload = cloudpickle.dumps(agent)
        self._lock = threading.Lock()  # update() may come from a learner thread
        self._token = secrets.token_hex(8)
        # Forked workers inherit the arena if it exists before they start; others get none.
        forked = get_context(manager_options.get("context")).get_start_method() == "fork"
        self._mapping = mmap.mmap(-1, n * int(fragment_bytes)) if forked else None
        self._release_arena: Callable[[], Any] | None = None
        if self._mapping is not None:
            ARENAS[self._token] = self._mapping
            # An unclosed sampler, once collected, frees its arena all the same.
            self._release_arena = weakref.finalize(self, _release_arena, self._token, self._mapping)
        try:
            self.manager = BatchEnvManager(RegisteredFactory(env_factory), n, autoreset_mode=DISABLED, **manager_options)
        except BaseException:
            self._free_arena()
            raise
        try:  # the workers run: any failure from here on must reap them
            self._setup(n, int(fragment_bytes), seed)
        except BaseException:
            self.close()
            raise

    def _setup(self, n: int, fragment_bytes: int, seed: int | None) -> None:
        """The arena over the workers' spaces and the per-slot bookkeeping."""
        m = self.manager
        layouts = shm.array_layout(m.observation_space), shm.array_layout(m.action_space)
        if None in layouts:
            raise InvalidInputError("the worker-side sampler needs Box/Discrete/MultiDiscrete/MultiBinary (or Dict/Tuple of them) spaces")
        one_row = Arena.nbytes_for(ArenaSpec(self._token, n, 1, *layouts))
        if one_row > n * fragment_bytes:
            per_slot = -(-one_row // n)
            raise InvalidInputError(f"fragment_bytes={fragment_bytes} is too small: one row of these spaces needs "
                                    f"{per_slot} bytes per slot ({one_row} for {n} slots, arena headers included)")
        capacity = capacity_for(n * fragment_bytes, n, *layouts)
        self._spec = ArenaSpec(self._token, n, capacity, *layouts)
        self._arena = Arena(self._spec, self._mapping) if self._mapping is not None else None
        if self._arena is not None:  # a fragment that keeps writing rows is not hung, however long
            m.watch_progress(_progress_of(weakref.ref(self)))
        self._procs: dict[int, list[int]] = {}
        for slot in range(n):
            self._procs.setdefault(int(m.slot_process[slot]), []).append(slot)
        self._seeds = seeds_for(seed, n)
        self._env_updates: list[tuple[int, bytes] | None] = [None] * n
        self._incarnation = dict.fromkeys(self._procs, 0)
        self._sent_version = dict.fromkeys(self._procs, 0)  # the agent version of each process's last request
        self._sent_env: dict[int, list[int]] = {}  # the env-update version each slot of a process was last sent
        self._ids: list[dict[tuple[int, int], int]] = [{} for _ in range(n)]  # (incarnation, local episode) -> id
        self._next_id = 0
        self._running: list[tuple[int, int] | None] = [None] * n  # (incarnation, local episode) running on a slot
        self._slot_env_version = [0] * n
        self._info_template: dict[str, np.ndarray] = {}
        self._recovered: list[TransitionBatch] = []  # rows read back from a killed worker, in this call

    # ------------------------------------------------------------------------------------------
    # Versions

    def update(self, agent_update: Any = None, env_update: Any = None, version: int | None = None) -> int:
        """A new agent for the workers (picklable), used from the next request on; and/or an
        ``env_update`` (a picklable ``fn(env)``, or a list with one per slot) applied in the
        worker before each slot's next episode starts. A restarted worker gets the latest."""
        payload = cloudpickle.dumps(agent_update) if agent_update is not None else None
        updates = None
        if env_update is not None:
            updates = list(env_update) if isinstance(env_update, (list, tuple)) else [env_update] * self.n_workers
            if len(updates) != self.n_workers or not all(u is None or callable(u) for u in updates):
                raise InvalidInputError(f"env_update must be a callable fn(env) or a list of {self.n_workers} of them")
        with self._lock:  # version and payload change together: a request never pairs them wrongly
            if payload is not None:
                self.policy_version = self.policy_version + 1 if version is None else int(version)
                self._payload = payload
            if updates is not None:
                self.env_version += 1
                for slot, u in enumerate(updates):
                    if u is not None:
                        self._env_updates[slot] = (self.env_version, cloudpickle.dumps(u))
            return self.policy_version

    # ------------------------------------------------------------------------------------------
    # Collection

    def obtain_steps(self, steps_per_worker: int, agent_update: Any = None, env_update: Any = None) -> TransitionBatch:
        """``steps_per_worker`` steps from every slot, in worker order; episodes continue."""
        if not isinstance(steps_per_worker, (int, np.integer)) or steps_per_worker < 1:
            raise InvalidInputError(f"steps_per_worker must be a positive int, got {steps_per_worker!r}")
        self.update(agent_update, env_update)
        chunks = self._collect([int(steps_per_worker)] * self.n_workers, None)
        return TransitionBatch.concatenate([c for per_slot in chunks for c in per_slot])

    def obtain_exact_episodes(self, n_eps_per_worker: int, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """``n_eps_per_worker`` whole episodes from every slot, each started by this call (a
        running episode is abandoned, counted as ``discarded_episodes``), in worker order."""
        if not isinstance(n_eps_per_worker, (int, np.integer)) or n_eps_per_worker < 1:
            raise InvalidInputError(f"n_eps_per_worker must be a positive int, got {n_eps_per_worker!r}")
        self.update(agent_update, env_update)
        episodes, cut = [], []
        for per_slot in self._collect(None, [int(n_eps_per_worker)] * self.n_workers):
            if not per_slot:
                continue
            rows = TransitionBatch.concatenate(per_slot)
            bounds = np.flatnonzero(np.diff(rows.episode_ids)) + 1
            for start, end in zip([0, *bounds.tolist()], [*bounds.tolist(), len(rows)]):
                episodes.append(rows.select(slice(start, end)))
                cut.append(bool(rows.interrupted[start]))
        return EpisodeBatch.from_transitions(episodes, cut)

    def obtain_samples(self, itr: int, num_samples: int, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """Whole episodes until at least ``num_samples`` steps (garage's ``obtain_samples``):
        rounds of one episode from every slot, each started by its round, so no slot's short
        episodes crowd out another's. ``itr`` is for logs."""
        if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise InvalidInputError(f"num_samples must be a positive int, got {num_samples!r}")
        self.update(agent_update, env_update)
        logger.debug("obtain_samples itr=%s num_samples=%d", itr, num_samples)
        rounds: list[EpisodeBatch] = []
        while sum(len(r) for r in rounds) < num_samples:
            rounds.append(self.obtain_exact_episodes(1))
        return rounds[0] if len(rounds) == 1 else EpisodeBatch.concatenate(rounds)  # type: ignore[return-value]

    def obtain_episodes(self, n: int, per_worker: bool = False, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """``n`` whole episodes in all, or ``n`` from every slot with ``per_worker=True`` (as
        ``Sampler.obtain_episodes``). In all: quotas spread over the slots before collection
        (``spread``); slots with the smaller quota give their first episodes only, chosen by
        admission order, never by length, so the sample stays unbiased."""
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise InvalidInputError(f"n must be a positive int, got {n!r}")
        if per_worker:
            return self.obtain_exact_episodes(n, agent_update, env_update)
        quotas = spread(int(n), self.n_workers)
        batch = self.obtain_exact_episodes(max(quotas), agent_update, env_update)
        taken = [0] * self.n_workers
        keep = []
        for i, episode in enumerate(batch.split_episodes()):
            slot = int(episode.worker_ids[0])
            if taken[slot] < quotas[slot]:
                taken[slot] += 1
                keep.append(i)
        if len(keep) == batch.n_episodes:
            return batch
        kept = [batch.episode(i) for i in keep]
        return EpisodeBatch.concatenate(kept)  # type: ignore[return-value]

    def stream(self, steps_per_worker: int, feed: LearnerFeed | None = None, max_batches_waiting: int = 2,
               max_fragments: int | None = None) -> Iterator[TransitionBatch]:
        """Fragments of ``steps_per_worker`` steps from every slot, as ``Sampler.stream``: with
        ``feed``, each is put into the learner feed, and collection pauses while the learner has
        ``max_batches_waiting`` batches waiting. Agents published meanwhile (``update``, from the
        feed's ``on_update``, thread-safe) are used from each process's next request on."""
        yield from feed_fragments(lambda: self.obtain_steps(steps_per_worker), self.stats, feed,
                                  max_batches_waiting, max_fragments)

    def _collect(self, steps: list[int] | None, quotas: list[int] | None) -> list[list[TransitionBatch]]:
        """Fragments until every slot has its ``steps`` rows (or ``quotas`` episodes, each run to
        its end), per slot in order. First-ready: each process is sent its next piece as soon
        as its last one is in."""
        m = self.manager
        want = list(steps) if steps is not None else [self._spec.capacity] * self.n_workers
        starts = list(quotas) if quotas is not None else [-1] * self.n_workers
        out: list[list[TransitionBatch]] = [[] for _ in range(self.n_workers)]
        cut: set[int] = set()  # episode ids cut by a fault, flagged at the end
        fresh = dict.fromkeys(self._procs, quotas is not None)  # the first piece abandons running episodes
        pending: dict[int, Any] = {}
        error: EnvManagerError | None = None
        self._recovered = []

        def work(p: int) -> bool:
            slots = self._procs[p]
            if steps is not None:
                return any(want[s] > 0 for s in slots)
            return any(starts[s] > 0 or (self._running[s] is not None and not fresh[p]) for s in slots)

        def send(p: int) -> None:
            slots = self._procs[p]
            with self._lock:
                version, payload, updates = self.policy_version, self._payload, tuple(self._env_updates[s] for s in slots)
            self._sent_version[p] = version
            self._sent_env[p] = [u[0] if u is not None else 0 for u in updates]
            budget = tuple(min(want[s], self._spec.capacity) if steps is not None else self._spec.capacity for s in slots)
            request = RolloutRequest(tuple(slots), slots[0], self._spec, self._arena is not None, version, payload, budget,
                                     tuple(starts[s] for s in slots), fresh[p], tuple(self._seeds[s] for s in slots), updates)
            if fresh[p]:  # the request abandons the episodes running there: a fault cannot cut them
                for s in slots:
                    self._running[s] = None
            if self._arena is not None:  # a worker killed before its first row must not show old rows
                self._arena.rows[slots] = 0
                self._arena.started[slots] = 0
            pending[p] = m.send_call(_ROLLOUT, (request,), None, [slots[0]])  # type: ignore[arg-type]

        for p in self._procs:
            if work(p):
                send(p)
        with self.stats.timer("collect"):
            while pending:
                self._wait_any(pending)
                for p in [p for p, r in pending.items() if m.call_ready(r)]:
                    request = pending.pop(p)
                    try:
                        answer = m.receive_call(request, timeout=0)[0]
                    except EnvManagerError as exc:
                        error = error or self._lost(p, exc, out, want, starts, cut)
                    else:
                        error = error or self._file(p, answer, out, want, starts, cut)
                    fresh[p] = False
                    if error is None and work(p):
                        send(p)
        if error is not None:
            raise error
        if cut:
            for per_slot in out:
                for chunk in per_slot:
                    chunk.interrupted |= np.isin(chunk.episode_ids, list(cut))
        for chunk in self._recovered:  # filled in now: the template may come from a later fragment
            chunk.agent_infos = {k: np.full((len(chunk), *v.shape[1:]), np.nan if v.dtype.kind == "f" else 0, dtype=v.dtype)
                                 for k, v in self._info_template.items()}
        self._recovered = []
        for s in range(self.n_workers):  # only a running episode can go on in a later call
            self._ids[s] = {k: v for k, v in self._ids[s].items() if k == self._running[s]}
        return out

    def _wait_any(self, pending: dict[int, Any]) -> None:
        """Until one of the ``pending`` fragments is in. A fragment may take longer than the
        deadline as long as it writes rows (the pool does not call it hung then, see
        ``_progress``): a wait ends in ``WorkerTimeoutError`` only if nothing was written."""
        m = self.manager

        def late() -> list[int]:
            return [s for p in pending for s in self._procs[p]]

        while True:
            before = self._progress(late())
            try:
                m.wait_for(lambda: any(m.call_ready(r) for r in pending.values()), None, "rollout fragments", late)
                return
            except WorkerTimeoutError:
                if self._arena is None or self._progress(late()) == before:
                    raise

    def _progress(self, slots: list[int]) -> int:
        """Rows written and episodes started on ``slots`` by the fragments in flight (the
        arena's counters, zeroed at each send; 0 without an arena: spawn and forkserver)."""
        arena = self._arena
        return 0 if arena is None else int(arena.rows[slots].sum() + arena.started[slots].sum())

    def _file(self, p: int, answer: dict[str, Any], out: list[list[TransitionBatch]], want: list[int],
              starts: list[int], cut: set[int]) -> EnvManagerError | None:
        """Take one fragment of process ``p``: its rows out of the arena (or the answer)."""
        slots, arrays, failures = self._procs[p], answer["arrays"], answer["failures"]
        error: EnvManagerError | None = None
        for i, s in enumerate(slots):
            self._seeds[s] = None
            n, before = answer["rows"][i], self._running[s]
            last: tuple[int, int] | None = None
            seen = 0  # episodes started in this fragment that wrote a row
            if n:
                if arrays is not None:
                    fields = {f: shm.tree_map(lambda a: a[i, :n], arrays[f]) for f in _FIELDS}
                else:
                    fields = self._read_arena(s, n)
                seen = sum((self._incarnation[p], e) != before for e in np.unique(fields["episodes"]).tolist())
                infos = {k: v[i, :n] for k, v in answer["agent_infos"].items()}
                out[s].append(self._batch(s, p, fields, infos, answer["env_infos"][i], answer["env_versions"][i]))
                if not (fields["terminated"][-1] or fields["truncated"][-1]):
                    last = (self._incarnation[p], int(fields["episodes"][-1]))
            elif answer["running"][i] or i in failures:
                last = before
            self._running[s] = last if answer["running"][i] or i in failures else None
            want[s] -= n
            if starts[s] > 0:
                starts[s] = max(0, starts[s] - answer["started"][i])
            self.stats.count("episodes_started", answer["started"][i])
            if answer["started"][i] > seen:  # started, then cut by its env before its first step was written
                self._empty_cut(s, answer["started"][i] - seen)
            if i in failures:
                self._cut(s, cut)
                failure = worker_error(failures[i], p)
                refusal = self._refusal(p)
                if refusal is not None:
                    policy_on = self.manager.restart_policy.enabled
                    error = error or (RestartLimitError(s, refusal, failure, tuple(slots), p) if policy_on else failure)
                else:
                    self.manager.restart_policy.record(p)
                    logger.warning("worker-side sampler: %s; its episode is kept, flagged interrupted; the env is reset", failure)
        self.stats.count("discarded_episodes", answer["discarded"])
        self.stats.count("env_steps", sum(answer["rows"]))
        self.stats.count("fragments")
        return error

    def _lost(self, p: int, error: EnvManagerError, out: list[list[TransitionBatch]], want: list[int],
              starts: list[int], cut: set[int]) -> EnvManagerError | None:
        """Process ``p`` died mid-fragment: keep what it wrote (shared arena), flag the cut
        episodes; the error, unless the pool restarted the process."""
        slots = self._procs[p]
        if self.manager.failure_of(slots[0]) is not None or not self.manager.restart_policy.enabled:
            return error
        for s in slots:
            n = int(self._arena.rows[s]) if self._arena is not None else 0
            started = int(self._arena.started[s]) if self._arena is not None else 0
            seen = 0
            if n:
                fields = self._read_arena(s, n)
                before = self._running[s]
                new = [e for e in np.unique(fields["episodes"]).tolist() if (self._incarnation[p], e) != before]
                seen = len(new)
                sent = self._sent_env.get(p, [0] * len(slots))[slots.index(s)]  # new episodes applied it first
                out[s].append(self._batch(s, p, fields, None, None, {e: max(sent, self._slot_env_version[s]) for e in new}))
                want[s] -= n
                self.stats.count("env_steps", n)
                self.stats.count("recovered_steps", n)
                ended = fields["terminated"][-1] or fields["truncated"][-1]
                self._running[s] = None if ended else (self._incarnation[p], int(fields["episodes"][-1]))
            if starts[s] > 0:  # admitted episodes count, cut or not: none is silently replaced
                starts[s] = max(0, starts[s] - started)
            if started > seen:  # started, then cut before its first step was written
                self._empty_cut(s, started - seen)
            if started:  # the first reset took the seed: the restarted process must not replay it
                self._seeds[s] = None
            self._cut(s, cut)
        if self._arena is None:
            self.stats.count("lost_fragments")  # its rows travelled in the answer that never came
        self._incarnation[p] += 1
        self.stats.count("worker_restarts")
        logger.warning("worker-side sampler: %s; the process was restarted, its cut episodes kept and flagged", error)
        return None

    def _read_arena(self, s: int, n: int) -> dict[str, Any]:
        assert self._arena is not None
        return {f: shm.tree_map(lambda a: a[s, :n].copy(), getattr(self._arena, f)) for f in _FIELDS}

    def _cut(self, s: int, cut: set[int]) -> None:
        """The episode running on slot ``s`` was cut by a fault: flag it, count it."""
        running = self._running[s]
        if running is not None:
            if running in self._ids[s]:
                cut.add(self._ids[s][running])
            self.stats.count("interrupted_episodes")
        self._running[s] = None

    def _empty_cut(self, s: int, k: int) -> None:
        """``k`` episodes admitted on slot ``s`` were cut before writing a row: counted, as no
        row can carry the flag (an exact-episodes quota is short by them, never refilled)."""
        self.stats.count("interrupted_episodes", k)
        self.stats.count("empty_cut_episodes", k)
        logger.warning("worker-side sampler: %d admitted episode(s) on worker %d cut before their first step", k, s)

    def _refusal(self, p: int) -> str | None:
        return self.manager.restart_policy.refusal(p)

    def _batch(self, s: int, p: int, fields: dict[str, Any], infos: dict[str, np.ndarray] | None,
               env_infos: list[dict] | None, env_versions: dict[int, int]) -> TransitionBatch:
        n = len(fields["rewards"])
        local = fields["episodes"]
        ids = np.empty(n, dtype=np.int64)
        versions = np.empty(n, dtype=np.int64)
        known = self._ids[s]
        for value in np.unique(local).tolist():
            key = (self._incarnation[p], value)
            if key not in known:
                known[key] = self._next_id
                self._next_id += 1
            rows = local == value
            ids[rows] = known[key]
            versions[rows] = env_versions.get(value, self._slot_env_version[s])
            self._slot_env_version[s] = env_versions.get(value, self._slot_env_version[s])
        if infos and not self._info_template:
            self._info_template = {k: v[:1] for k, v in infos.items()}
        batch = TransitionBatch(
            observations=fields["observations"], actions=fields["actions"], rewards=fields["rewards"],
            terminated=fields["terminated"], truncated=fields["truncated"], next_observations=fields["next_observations"],
            worker_ids=np.full(n, s, dtype=np.int64), episode_ids=ids,
            policy_versions=np.full(n, self._sent_version[p], dtype=np.int64), env_versions=versions,
            interrupted=np.zeros(n, dtype=bool), valid=np.ones(n, dtype=bool), agent_infos=infos or {},
            env_infos=_env_infos(env_infos) if env_infos else {},
        )
        if infos is None:  # rows recovered from a dead worker: its policy's infos died with it
            self._recovered.append(batch)
        return batch

    # ------------------------------------------------------------------------------------------
    # ------------------------------------------------------------------------------------------
    # Lifetime

    def _free_arena(self) -> None:
        self._arena = None  # its views first: the mapping cannot close under them
        self._mapping = None
        release = getattr(self, "_release_arena", None)
        if release is not None:
            release()  # once only (weakref.finalize)

    def close(self) -> None:
        """Close the manager (reaps every worker) and free the arena. Idempotent."""
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.close()
        self._free_arena()

    shutdown_worker = close

    def __enter__(self) -> WorkerPolicySampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _progress_of(ref: weakref.ref) -> Callable[[list[int]], int]:
    """The pool's progress hook, holding the sampler weakly (it must not keep the arena alive)."""
    def progress(slots: list[int]) -> int:
        sampler = ref()
        return 0 if sampler is None else sampler._progress(slots)
    return progress


def _release_arena(token: str, mapping: mmap.mmap) -> None:
    """Forget an arena and close its mapping (from ``close`` or when the sampler is collected)."""
    ARENAS.pop(token, None)
    try:
        mapping.close()
    except BufferError:  # a view still alive somewhere: the mapping goes with it
        pass


def _env_infos(infos: list[dict]) -> dict[str, Any]:
    keys = set.intersection(*(set(i) for i in infos)) if infos else set()
    return {k: _stack_or_objects([i[k] for i in infos]) for k in sorted(keys)}
