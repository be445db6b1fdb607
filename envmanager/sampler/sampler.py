"""``Sampler``: trajectories from envs in worker processes, for a learner.

The policy lives in the parent: one batched ``get_actions(observations, worker_ids)`` call over
whichever slots are ready (first-ready, partial batches). Built on the core's batch level
(``send_batch`` / ``receive_batch``, ``send_reset`` / ``receive_reset_batch``) with autoreset
off, so the sampler decides when an episode starts: that is where env updates are applied and
where exact-episode admission is decided (see ``envmanager.sampler.episodes``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np

from envmanager.core.batch import BatchEnvManager, seeds_for
from envmanager.errors import EnvManagerError, InvalidInputError
from envmanager.sampler.batches import EpisodeBatch, Step, TransitionBatch, stack_values
from envmanager.sampler.episodes import EpisodeQuotas, Plan, SampleCount, StepCount, spread
from envmanager.sampler.learner import feed_fragments
from envmanager.sampler.stats import Stats
from envmanager.wire import shm
from envmanager.worker.envs import DISABLED

if TYPE_CHECKING:
    from envmanager.sampler.learner import LearnerFeed

logger = logging.getLogger(__name__)

__all__ = ["Sampler"]


def _apply_env_update(env: Any, update: bytes) -> None:
    """Run in the worker: ``update(env)`` at an episode boundary (cloudpickled: closures too)."""
    cloudpickle.loads(update)(env)


def _row(value: Any, i: int) -> Any:
    if isinstance(value, dict):
        return {k: _row(v, i) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_row(v, i) for v in value)
    return value[i]


class Sampler:
    """Collect transitions or whole episodes with a parent-side policy.

    Args:
        envs: ``env_factory(worker_id) -> env``, or a ``BatchEnvManager`` built with
            ``autoreset_mode="disabled"`` (not closed by the sampler).
        n_workers: env slots (with a factory).
        policy: an object with ``get_actions(observations, worker_ids)``, or such a callable;
            returns the actions (first axis over the given slots) or ``(actions, agent_infos)``
            with ``agent_infos`` a dict of arrays.
        seed: slot ``i``'s first reset gets ``seed + i``; later resets continue the env's RNG.
        log_interval: seconds between one-line summaries through ``logging`` (``None``: never).
        progress: show a tqdm progress bar (an optional extra) on collections of at least
            ``progress`` steps or episodes (``None``: never).
        manager_options: passed to ``BatchEnvManager`` (``envs_per_worker``, ``timeout``,
            ``restart_workers``, ``context``, ...).
    """

    def __init__(self, envs: Callable[[int], Any] | BatchEnvManager, n_workers: int | None = None, policy: Any = None, *,
                 seed: int | None = None, log_interval: float | None = None, progress: int | None = None,
                 **manager_options: Any) -> None:
        if isinstance(envs, BatchEnvManager):
            if manager_options or n_workers not in (None, envs.n_env):
                raise InvalidInputError("with a manager, give neither n_workers nor manager options")
            if envs.autoreset_mode != DISABLED:
                raise InvalidInputError("the sampler decides when episodes start: build the manager with autoreset_mode='disabled'")
            self.manager, self._owns_manager = envs, False
        else:
            if not isinstance(n_workers, int) or n_workers < 1:
                raise InvalidInputError(f"n_workers must be a positive int, got {n_workers!r}")
            self.manager = BatchEnvManager(envs, n_workers, autoreset_mode=DISABLED, **manager_options)
            self._owns_manager = True
        n = self.n_workers = self.manager.n_env
        self.policy = policy
        self.progress = progress
        self.stats = Stats("sampler", log_interval)
        self._lock = threading.Lock()  # guards pending updates (update() may come from a learner thread)
        self._latest_policy_version = 0
        self._acting_version = 0
        self._pending_agent: tuple[int, Any] | None = None
        self.env_version = 0
        self._pending_env: list[list[tuple[int, Callable[[Any], Any]]]] = [[] for _ in range(n)]
        self._slot_env_version = [0] * n
        self._applied_env: list[tuple[int, Callable[[Any], Any]] | None] = [None] * n  # replayed after a restart
        self._seeds = seeds_for(seed, n)
        self._obs: list[Any] = [None] * n  # None: the slot has no episode running
        self._recording = [False] * n  # whether the running episode is admitted by this call
        self._steps: list[list[Step]] = [[] for _ in range(n)]
        self._episode_id = [-1] * n
        #: Ids of the episodes a worker restart cut, in the order seen: their steps still held are
        #: flagged ``interrupted``, but steps a ``stream`` already handed out cannot be recalled.
        self.cut_episodes: list[int] = []
        self._next_episode_id = 0
        self._sent: dict[int, tuple[Any, Any, dict[str, Any], int]] = {}  # slot -> (obs, action, agent info, version)

    # ------------------------------------------------------------------------------------------
    # Versions and updates

    @property
    def policy_version(self) -> int:
        """The newest policy version (applied before the next action is chosen)."""
        return self._latest_policy_version

    def update(self, agent_update: Any = None, env_update: Any = None, version: int | None = None) -> tuple[int, int]:
        """Queue a new policy and/or env update; returns ``(policy_version, env_version)``.

        ``agent_update`` goes to ``policy.set_param_values`` (or ``load_state_dict``) if the
        policy has one, else it replaces the policy; it applies before the next action choice
        (thread-safe: a learner thread may call this). ``version`` sets the policy version
        (default: one more). ``env_update``: a picklable ``fn(env)``, or a list with one per
        worker, run in the worker before each slot's next episode starts, never mid-episode.
        """
        with self._lock:
            if env_update is not None:
                updates = list(env_update) if isinstance(env_update, (list, tuple)) else [env_update] * self.n_workers
                if len(updates) != self.n_workers or not all(u is None or callable(u) for u in updates):
                    raise InvalidInputError(f"env_update must be a callable fn(env) or a list of {self.n_workers} of them")
                self.env_version += 1
                for slot, u in enumerate(updates):
                    if u is not None:
                        self._pending_env[slot].append((self.env_version, u))
            if agent_update is not None:
                self._latest_policy_version = self._latest_policy_version + 1 if version is None else int(version)
                self._pending_agent = (self._latest_policy_version, agent_update)
            return self._latest_policy_version, self.env_version

    def _apply_agent_update(self) -> None:
        with self._lock:
            pending, self._pending_agent = self._pending_agent, None
        if pending is None:
            return
        version, update = pending
        self.policy = apply_agent_update(self.policy, update)
        self._acting_version = version
        self.stats.count("policy_updates")

    # ------------------------------------------------------------------------------------------
    # garage's interface, and more

    def obtain_samples(self, itr: int, num_samples: int, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """Whole episodes until at least ``num_samples`` steps (garage). ``itr`` is for logs."""
        _positive("num_samples", num_samples)
        self.update(agent_update, env_update)
        logger.debug("obtain_samples itr=%s num_samples=%d", itr, num_samples)
        return self._episodes(self._collect(SampleCount(self.n_workers, num_samples)))

    def obtain_exact_episodes(self, n_eps_per_worker: int | Sequence[int], agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """Exactly ``n_eps_per_worker`` episodes from each slot (an int, or one per slot), each
        started during this call, in (worker, admission) order. Unbiased: see ``episodes``."""
        quotas = [n_eps_per_worker] * self.n_workers if isinstance(n_eps_per_worker, (int, np.integer)) else list(n_eps_per_worker)
        if len(quotas) != self.n_workers or not all(isinstance(q, (int, np.integer)) and q >= 0 for q in quotas) or not sum(quotas):
            raise InvalidInputError(f"n_eps_per_worker must be a non-negative int or {self.n_workers} of them, not all 0")
        self.update(agent_update, env_update)
        return self._episodes(self._collect(EpisodeQuotas([int(q) for q in quotas])))

    def obtain_episodes(self, n: int, per_worker: bool = False, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """``n`` episodes in all (quotas spread over the slots before collection starts), or
        ``n`` per worker with ``per_worker=True``."""
        _positive("n", n)
        return self.obtain_exact_episodes(n if per_worker else spread(n, self.n_workers), agent_update, env_update)

    def obtain_steps(self, n: int, agent_update: Any = None, env_update: Any = None) -> TransitionBatch:
        """Exactly ``n`` transitions, in worker order; episodes still running continue in the
        next ``obtain_steps`` (same episode ids)."""
        _positive("n", n)
        self.update(agent_update, env_update)
        plan = self._collect(StepCount(self.n_workers, n))
        steps: list[Step] = []
        for slot in range(self.n_workers):
            for episode, _ in plan.episodes[slot]:
                steps += episode
            steps += self._steps[slot]
            self._steps[slot] = []
        return TransitionBatch.from_steps(steps)

    def stream(self, fragment_steps: int, feed: LearnerFeed | None = None, max_batches_waiting: int = 2,
               max_fragments: int | None = None) -> Iterator[TransitionBatch]:
        """Fragments of ``fragment_steps`` transitions, as they are collected. With ``feed``,
        each fragment is put into the learner feed first; collection pauses while the learner
        has ``max_batches_waiting`` batches waiting (Sample Factory's back-pressure: policy lag
        stays bounded). Policy updates published meanwhile apply between steps."""
        _positive("fragment_steps", fragment_steps)

        def fragment() -> TransitionBatch:
            batch = self.obtain_steps(fragment_steps)
            self.stats.count("fragments")
            return batch

        yield from feed_fragments(fragment, self.stats, feed, max_batches_waiting, max_fragments)

    # ------------------------------------------------------------------------------------------
    # The collection loop

    def _collect(self, plan: Plan) -> Plan:
        """Step until ``plan`` is done; episodes running from before are not admitted (they run
        out unrecorded, counted as ``discarded_steps``), except that ``obtain_steps`` continues
        its own."""
        if not plan.record_partial:
            self._apply_agent_update()
            for slot in range(self.n_workers):
                self._recording[slot] = False
        bar = self._progress_bar(plan)
        try:
            self._run(plan, bar)
        finally:
            if bar is not None:
                bar.close()
        return plan

    def _progress_bar(self, plan: Plan) -> Any:
        _, total, unit = plan.progress()
        if self.progress is None or total < self.progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            logger.info("progress bars need tqdm (pip install tqdm)")
            return None
        return tqdm(total=total, unit=unit, desc="sampling", leave=False)

    def _run(self, plan: Plan, bar: Any) -> None:
        m = self.manager
        while not plan.done():
            if plan.record_partial:
                self._apply_agent_update()
            idle = [s for s in m.idle_worker_ids if s not in self._sent and m.failure_of(s) is None]
            starting = [s for s in idle if self._obs[s] is None and plan.admit(s)]
            if starting:
                self._start_episodes(starting)
            running = [s for s in idle if self._obs[s] is not None]
            ready = [s for s in running if not self._recording[s]]  # running out (unrecorded)
            recording = [s for s in running if self._recording[s]]
            budget = plan.step_budget(sum(1 for s in self._sent if self._recording[s]))
            ready += recording if budget is None else recording[: max(budget, 0)]
            if ready:
                self._act(sorted(ready))
            if not self._sent and not m.in_flight() and not m.unreceived():
                if plan.done():
                    break
                failed = next((m.failure_of(s) for s in range(self.n_workers) if m.failure_of(s) is not None), None)
                raise failed or EnvManagerError("sampler: nothing is running and the collection is not done")
            self._receive(plan)
            self.stats.maybe_log()
            if bar is not None:
                bar.update(plan.progress()[0] - bar.n)
        while self._sent:  # run-outs still in flight: take them, so nothing is left half-sent
            self._receive(plan)

    def _start_episodes(self, slots: list[int]) -> None:
        m = self.manager
        for slot in slots:
            with self._lock:
                updates, self._pending_env[slot] = self._pending_env[slot], []
            for version, update in updates:
                m.call_on([slot], _apply_env_update, (cloudpickle.dumps(update),))
                self._slot_env_version[slot] = version
                self._applied_env[slot] = (version, update)
        m.send_reset({s: (self._seeds[s], None) for s in slots})
        for s in slots:
            self._seeds[s] = None
        m.receive_reset_batch(slots)
        for s in slots:
            self._obs[s] = self._read_observation(s)
            self._recording[s] = True
            self._steps[s] = []
            self._episode_id[s] = self._next_episode_id
            self._next_episode_id += 1
        self.stats.count("episodes_started", len(slots))

    def _read_observation(self, slot: int) -> Any:
        m = self.manager
        return m.observation_list[slot] if m.observation_list is not None else shm.read(m.results.observation, slot)

    def _act(self, slots: list[int]) -> None:
        observations = [self._obs[s] for s in slots]
        ids = np.array(slots, dtype=np.int64)
        get_actions = getattr(self.policy, "get_actions", self.policy)
        if get_actions is None:
            raise InvalidInputError("the sampler needs a policy (get_actions(observations, worker_ids))")
        with self.stats.timer("policy"):
            out = get_actions(stack_values(observations), ids)
        actions, agent_infos = out if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else (out, {})
        self.manager.send_batch(ids, actions)
        version = self._acting_version
        for i, slot in enumerate(slots):
            self._sent[slot] = (observations[i], _row(actions, i), {k: v[i] for k, v in agent_infos.items()}, version)

    def _receive(self, plan: Plan) -> None:
        m = self.manager
        with self.stats.timer("wait"):
            batch = m.receive_batch(1)
        r = m.results
        for slot in batch.slots.tolist():
            sent = self._sent.pop(slot, None)
            if slot in batch.interrupted:  # a restarted worker: the episode was cut; keep it, flagged
                self._replay_env_update(slot)
                if self._recording[slot] and self._obs[slot] is not None:
                    for step in self._steps[slot]:
                        step.interrupted = True
                    plan.finished(slot, self._steps[slot], True)
                    self.stats.count("interrupted_episodes")
                    self.cut_episodes.append(self._episode_id[slot])
                self._end_episode(slot)
                continue
            if sent is None:
                continue
            observation, action, agent_info, version = sent
            next_obs = self._read_observation(slot)
            terminated, truncated = bool(r.terminated[slot]), bool(r.truncated[slot])
            self.stats.count("env_steps")
            if self._recording[slot]:
                self._steps[slot].append(Step(
                    observation, action, float(r.reward[slot]), terminated, truncated, next_obs, slot,
                    self._episode_id[slot], version, self._slot_env_version[slot], agent_info, batch.infos.get(slot, {}),
                ))
                plan.recorded_step(slot)
            else:
                self.stats.count("discarded_steps")
            if terminated or truncated:
                if self._recording[slot]:
                    plan.finished(slot, self._steps[slot], False)
                    self.stats.count("episodes")
                self._end_episode(slot)
            else:
                self._obs[slot] = next_obs

    def _replay_env_update(self, slot: int) -> None:
        """A restarted worker has fresh envs: the latest env update applied to the slot goes
        again before its next episode (updates queued since follow it)."""
        applied = self._applied_env[slot]
        if applied is not None:
            with self._lock:
                if all(version > applied[0] for version, _ in self._pending_env[slot]):
                    self._pending_env[slot].insert(0, applied)

    def _end_episode(self, slot: int) -> None:
        self._obs[slot] = None
        self._recording[slot] = False
        self._steps[slot] = []

    def _episodes(self, plan: Plan) -> EpisodeBatch:
        episodes = [(TransitionBatch.from_steps(steps), cut) for per_slot in plan.episodes for steps, cut in per_slot if steps]
        empty_cut = sum(1 for per_slot in plan.episodes for steps, cut in per_slot if not steps)
        if empty_cut:  # cut before their first step: nothing to hand out, but counted
            logger.warning("sampler: %d admitted episode(s) were cut by a worker restart before their first step", empty_cut)
        if not episodes:
            raise EnvManagerError("sampler: every admitted episode was cut by a worker restart before its first step")
        return EpisodeBatch.from_transitions([e for e, _ in episodes], [cut for _, cut in episodes])

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def shutdown_worker(self) -> None:
        """garage's name for ``close``."""
        self.close()

    def close(self) -> None:
        """Close the manager if the sampler built it (reaps every worker). Idempotent."""
        if self._owns_manager:
            self.manager.close()

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def apply_agent_update(policy: Any, update: Any) -> Any:
    """The policy after an ``agent_update``: weights loaded into it (garage's
    ``set_param_values``, or torch's ``load_state_dict``), or the update itself, a new policy."""
    if hasattr(policy, "set_param_values"):
        policy.set_param_values(update)
        return policy
    if hasattr(policy, "load_state_dict"):
        policy.load_state_dict(update)
        return policy
    return update


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
