"""``Sampler``: trajectories from envs in worker processes, for a learner.

The policy lives in the parent: one batched ``get_actions(observations, worker_ids)`` call over
whichever slots are ready. Built on the core's batch level with autoreset off, so the sampler
decides when an episode starts: where env updates apply and exact-episode admission is decided
(``envmanager.sampler.episodes``). Each slot's episode is one record (``envmanager.sampler.slots``),
moved only by what the core hands back: an answer, an answer from a restarted process (the
episode is cut, kept and flagged), or an error (the episode failed; the error is raised).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from envmanager.core.arguments import is_count, positive_count, seeds_for
from envmanager.core.batch import BatchEnvManager
from envmanager.core.supervisor import GiveUp
from envmanager.core.updates import apply as apply_updates
from envmanager.errors import EnvManagerError, InvalidInputError
from envmanager.sampler.batches import EpisodeBatch, Step, TransitionBatch, stack_values, take_rows
from envmanager.sampler.episodes import EpisodeQuotas, Goal, SampleCount, StepCount, spread
from envmanager.sampler.learner import LearnerFeed, feed_fragments
from envmanager.sampler.slots import Closed, EpisodeIds, EpisodeSlots, EpisodeState, Outcome, failed_slots, raise_given_up
from envmanager.sampler.stats import Stats
from envmanager.sampler.versions import SamplerBase, Versions
from envmanager.wire import shm
from envmanager.wire.interrupts import DEFERRED, begin, end
from envmanager.worker.envs import DISABLED

logger = logging.getLogger(__name__)

__all__ = ["Sampler", "apply_agent_update", "exact_quotas"]

_T = TypeVar("_T")

NONE, STARTING, READY, STEPPING = EpisodeState.NONE, EpisodeState.STARTING, EpisodeState.READY, EpisodeState.STEPPING


class Sampler(SamplerBase):
    """Collect transitions or whole episodes with a parent-side policy.

    Args:
        envs: ``env_factory(worker_id) -> env``, or a ``BatchEnvManager`` built with
            ``autoreset_mode="disabled"`` (not closed by the sampler).
        n_workers: env slots (with a factory).
        policy: an object with ``get_actions(observations, worker_ids)``, or such a callable;
            returns the actions (first axis over the given slots) or ``(actions, agent_infos)``
            with ``agent_infos`` a dict of arrays.
        seed: slot ``i``'s first reset gets ``seed + i`` (or a list with one seed per slot);
            later resets continue the env's RNG.
        log_interval: seconds between one-line summaries through ``logging`` (``None``: never).
        progress: show a tqdm progress bar (an optional extra) on collections of at least
            ``progress`` steps or episodes (``None``: never).
        episode_ids: how episodes are numbered (``EpisodeIds``; default: the ``k``-th episode
            of slot ``s`` is ``k * n_workers + s``).
        manager_options: passed to ``BatchEnvManager`` (``envs_per_worker``, ``timeout``,
            ``restart_workers``, ``context``, ...).
    """

    def __init__(self, envs: Callable[[int], Any] | BatchEnvManager, n_workers: int | None = None, policy: Any = None, *,
                 seed: int | Sequence[int | None] | None = None, log_interval: float | None = None,
                 progress: int | None = None, episode_ids: EpisodeIds = EpisodeIds(), **manager_options: Any) -> None:
        self._owns_manager = not isinstance(envs, BatchEnvManager)
        if isinstance(envs, BatchEnvManager):
            if manager_options or n_workers not in (None, envs.n_env):
                raise InvalidInputError("with a manager, give neither n_workers nor manager options")
            if envs.autoreset_mode != DISABLED:
                raise InvalidInputError(
                    "the sampler decides when episodes start: build the manager with autoreset_mode='disabled'")
            n = envs.n_env
        elif not isinstance(n_workers, int) or n_workers < 1:
            raise InvalidInputError(f"n_workers must be a positive int, got {n_workers!r}")
        else:
            n = n_workers
        self.n_workers = n
        self.stats = Stats("sampler", log_interval)
        #: One record per slot: the episode it runs (see ``envmanager.sampler.slots``).
        self.episodes = EpisodeSlots(seeds_for(seed, n), self.stats, episode_ids)
        self.manager = envs if isinstance(envs, BatchEnvManager) else BatchEnvManager(
            envs, n, autoreset_mode=DISABLED, **manager_options)
        answered = self.manager.answered_generations
        for slot in range(n):  # the envs as their latest answers say (a process restarted at start-up, a manager used before)
            self.episodes.replaced(slot, int(answered[slot]))
        self.stats.count_total("worker_restarts", self.manager.restarts)  # (noted: the first call only notes it)
        self.policy = policy
        self.progress = progress
        self.versions = Versions(n)
        self._acting_version = 0

    # ------------------------------------------------------------------------------------------
    # Versions and updates

    def update(self, agent_update: Any = None, env_update: Any = None, version: int | None = None) -> tuple[int, int]:
        """Queue a new policy and/or env update; returns ``(policy_version, env_version)``.

        ``agent_update`` goes to the policy's ``set_param_values`` / ``load_state_dict``, or
        replaces it, before the next action choice (thread-safe: a learner thread may call this);
        ``version`` defaults to one more. ``env_update``: a picklable ``fn(env)``, or one per
        worker, run before each slot's next episode starts (a restarted worker reruns them all).
        One that does not pickle raises ``InvalidInputError`` and changes no version.
        """
        return self.versions.update(agent_update, env_update, version)

    def _apply_agent_update(self) -> None:
        pending = self.versions.take_agent()
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
        positive_count("num_samples", num_samples)
        self.update(agent_update, env_update)
        logger.debug("obtain_samples itr=%s num_samples=%d", itr, num_samples)
        return self._collect(SampleCount(self.n_workers, num_samples, self.episodes.recorded_running), self._episodes)

    def obtain_exact_episodes(self, n_eps_per_worker: int | Sequence[int], agent_update: Any = None,
                              env_update: Any = None) -> EpisodeBatch:
        """Exactly ``n_eps_per_worker`` episodes from each slot (an int, or one per slot), each
        started during this call, in (worker, admission) order (unbiased: ``episodes``)."""
        quotas = exact_quotas(n_eps_per_worker, self.n_workers)
        self.update(agent_update, env_update)
        return self._collect(EpisodeQuotas(quotas), self._episodes)

    def obtain_episodes(self, n: int, per_worker: bool = False, agent_update: Any = None, env_update: Any = None) -> EpisodeBatch:
        """``n`` episodes in all (quotas spread over the slots before collection starts), or
        ``n`` per worker with ``per_worker=True``."""
        positive_count("n", n)
        return self.obtain_exact_episodes(n if per_worker else spread(n, self.n_workers), agent_update, env_update)

    def obtain_steps(self, n: int, agent_update: Any = None, env_update: Any = None) -> TransitionBatch:
        """Exactly ``n`` transitions, in worker order; episodes still running continue in the
        next ``obtain_steps`` (same episode ids)."""
        positive_count("n", n)
        self.update(agent_update, env_update)
        return self._collect(StepCount(self.n_workers, n), self._steps)

    def stream(self, fragment_steps: int, feed: LearnerFeed | None = None, max_batches_waiting: int = 2,
               max_fragments: int | None = None) -> Iterator[TransitionBatch]:
        """Fragments of ``fragment_steps`` transitions, as they are collected (``feed_fragments``:
        with ``feed``, put into it, with back-pressure). Policy updates apply between steps."""
        positive_count("fragment_steps", fragment_steps)

        def fragment() -> TransitionBatch:
            batch = self.obtain_steps(fragment_steps)
            self.stats.count("fragments")
            return batch

        yield from feed_fragments(fragment, self.stats, feed, max_batches_waiting, max_fragments)

    # ------------------------------------------------------------------------------------------
    # The collection loop

    def _collect(self, goal: Goal, hand_out: Callable[[Goal], _T]) -> _T:
        """Step until ``goal`` is done and return ``hand_out(goal)``. Episodes from before run out
        unrecorded, except ``obtain_steps``'s own. A call that raises drops what it recorded
        (``dropped_steps``) and records no further on the running episodes, so none has a gap."""
        raise_given_up(self.manager, self.episodes)
        if not goal.record_partial:
            self._apply_agent_update()
            self.episodes.stop_recording()
        bar = self._progress_bar(goal)
        try:
            try:
                self._run(goal, bar)
            finally:
                if bar is not None:
                    bar.close()
            with DEFERRED:  # (a Ctrl-C before it is raised as in the collection; in it, held until they are out)
                if goal.empty_cut:  # admitted episodes cut before their first step: nothing to hand out, but counted
                    self.stats.count("empty_cut_episodes", goal.empty_cut)
                    logger.warning("sampler: %d admitted episode(s) were cut by a worker restart before their first step",
                                   goal.empty_cut)
                return hand_out(goal)
        except BaseException as exc:
            dropped = sum(len(steps) for per_slot in goal.episodes for steps, _ in per_slot)
            if dropped:
                self.stats.count("dropped_steps", dropped)
            self.let_running_go()
            if isinstance(exc, EnvManagerError):  # a process given up: the first one's error, as every later call raises
                raise_given_up(self.manager, self.episodes)
            raise

    def let_running_go(self) -> None:
        """After a call that raised: the episodes running go on unrecorded, so no episode's rows
        have a gap (their steps recorded are dropped, counted)."""
        self.episodes.stop_recording()

    def _progress_bar(self, goal: Goal) -> Any:
        _, total, unit = goal.progress()
        if self.progress is None or total < self.progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            logger.info("progress bars need tqdm (pip install tqdm)")
            return None
        return tqdm(total=total, unit=unit, desc="sampling", leave=False)

    def _run(self, goal: Goal, bar: Any) -> None:
        m = self.manager
        while not goal.done():
            if goal.record_partial:
                self._apply_agent_update()
            readmitted = goal.empty_cut
            self._start(goal)
            self._take_resets(goal)
            self._act(goal)
            if not self.episodes.in_state(STARTING, STEPPING) and not m.in_flight() and not m.unreceived():
                if goal.done():
                    break
                if goal.empty_cut > readmitted:  # cut before their first step: admitted again (a restart each)
                    continue
                raise EnvManagerError("sampler: nothing is running and the collection is not done")
            self._receive(goal)
            self.stats.maybe_log()
            if bar is not None:
                bar.update(goal.progress()[0] - bar.n)
        while self.episodes.in_state(STEPPING) or m.unreceived():  # run-outs in flight: nothing left half-sent
            self._receive(goal)

    def _start(self, goal: Goal) -> None:
        """Admitted episodes start on idle slots: env updates applied, then their resets sent."""
        with DEFERRED:  # (the updates' waits stay interruptible: a Ctrl-C there lets the episodes started here go)
            m, episodes = self.manager, self.episodes
            starting = [s for s in m.idle_worker_ids if episodes[s].state is NONE and goal.admit(s)]
            try:
                resets = {}
                error: EnvManagerError | None = None
                restarted: set[int] = set()  # processes a fault here restarted: their episodes are cut before they begin
                process = m.slot_process
                for slot in starting:
                    episodes.start(slot, recording=True)
                    if process[slot] in restarted:
                        self._replaced(slot, None, goal)
                        continue
                    have = episodes[slot].env_version
                    due = self.versions.env_updates.due(slot, have)
                    if due.updates:
                        try:
                            m.call_on([slot], apply_updates, (due, have))
                        except EnvManagerError as exc:  # the update raised, or the process failed meanwhile
                            try:
                                self._fault(slot, exc, goal)
                                restarted.add(process[slot])
                            except EnvManagerError as final:
                                error = error or final
                            continue
                    episodes[slot].applied(due.version)
                    resets[slot] = (episodes[slot].take_seed(), None)
                # Its process restarted meanwhile (a neighbour's fault here, or a death the updates' waits
                # found): its fresh reset is on its way, so the episode is cut before it began.
                idle = set(m.idle_worker_ids) if resets else set()
                for slot in list(resets):
                    if process[slot] in restarted or slot not in idle:
                        del resets[slot]
                        self._replaced(slot, None, goal)
            except BaseException:  # (a Ctrl-C in the updates' waits) nothing sent: the episodes never began
                for slot in starting:  # (those not started yet are NONE)
                    if episodes[slot].state is STARTING:
                        episodes.close(slot, Outcome.DISCARDED)
                raise
            m.send_reset(resets)  # the others start all the same: the next call takes their resets
        if error is not None:
            raise error

    def _take_resets(self, goal: Goal) -> None:
        """Every reset sent: the episode is ready, or cut by a restart before its first step."""
        starting = self.episodes.in_state(STARTING)
        if not starting:
            return
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            for slot in self._answered(self.manager.receive_reset_batch, starting, goal)[1]:
                self.episodes[slot].ready(self._read_observation(slot))

    def _answered(self, receive: Callable[[Any], Any], arg: Any, goal: Goal) -> tuple[Any, list[int]]:
        """The batch ``receive(arg)`` hands out, and its slots whose env is the one their record
        knows (the others' episodes are cut). An error fails the episodes it names."""
        try:
            batch = receive(arg)
        except EnvManagerError as exc:
            for slot in failed_slots(exc):
                if 0 <= slot < self.n_workers:
                    self.episodes.close(slot, Outcome.FAILED)
            raise
        generations = batch.generations
        assert generations is not None  # (the manager's array: every batch it hands out has it)
        current = []
        for slot in batch.slots.tolist():
            if slot in batch.interrupted or generations[slot] != self.episodes[slot].generation:
                self._replaced(slot, int(generations[slot]), goal)
            else:
                current.append(slot)
        return batch, current

    def _act(self, goal: Goal) -> None:
        """One batched policy call over the ready slots (run-outs, and recorded ones within
        the goal's budget); the actions recorded are the ones the envs get."""
        episodes = self.episodes
        ready = episodes.in_state(READY)
        if not ready:
            return
        idle = set(self.manager.idle_worker_ids)  # not a slot whose restart's answer is still to come
        ready = [s for s in ready if s in idle]
        running_out = [s for s in ready if not episodes[s].recording]
        recording = [s for s in ready if episodes[s].recording]
        budget = goal.step_budget(sum(1 for s in episodes.in_state(STEPPING) if episodes[s].recording))
        slots = sorted(running_out + (recording if budget is None else recording[: max(budget, 0)]))
        if not slots:
            return
        observations = [episodes[s].observation for s in slots]
        get_actions = getattr(self.policy, "get_actions", self.policy)
        if get_actions is None:
            raise InvalidInputError("the sampler needs a policy (get_actions(observations, worker_ids))")
        ids = np.array(slots, dtype=np.int64)
        with self.stats.timer("policy"):
            out = get_actions(stack_values(observations), ids)
        actions, agent_infos = out if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else (out, {})
        for key, value in agent_infos.items():
            if len(value) != len(slots):
                raise InvalidInputError(f"agent info {key!r} has {len(value)} rows for {len(slots)} workers")
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            sent = self.manager._send_batch(ids, actions)  # checked: nothing is sent if they do not fit
            version = self._acting_version
            for i, slot in enumerate(slots):
                info = {k: v[i] for k, v in agent_infos.items()}
                episodes[slot].step_sent((observations[i], take_rows(sent, i), info, version))
        finally:
            end()

    def _receive(self, goal: Goal) -> None:
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            with self.stats.timer("wait"):
                batch, answered = self._answered(self.manager.receive_batch, 1, goal)
            r = self.manager.results
            for slot in answered:
                record = self.episodes[slot]
                if record.state is not STEPPING or record.sent is None:
                    continue
                observation, action, agent_info, version = record.sent
                next_obs = self._read_observation(slot)
                terminated, truncated = bool(r.terminated[slot]), bool(r.truncated[slot])
                self.stats.count("env_steps")
                if record.recording:
                    record.record(Step(
                        observation, action, r.reward[slot].item(), terminated, truncated, next_obs, slot,  # (shape (1,) too)
                        record.episode_id, version, record.env_version, agent_info, batch.infos.get(slot, {}),
                    ))
                    goal.recorded_step(slot)
                else:
                    self.stats.count("discarded_steps")
                if terminated or truncated:
                    self._book(slot, self.episodes.close(slot, Outcome.ENDED), goal)
                else:
                    record.ready(next_obs)
        finally:
            end()

    # ------------------------------------------------------------------------------------------
    # Faults: one path (the pool's), three outcomes for a record

    def _book(self, slot: int, closed: Closed, goal: Goal) -> None:
        """An episode the record closed, booked in the goal if this call admitted it."""
        if closed.recording and closed.episode_id >= 0 and closed.outcome is not Outcome.FAILED:
            if closed.outcome is Outcome.CUT and not closed.steps and closed.taken:
                return  # cut after an earlier call handed its steps out: not one cut before its first step
            goal.finished(slot, closed.steps, closed.outcome is Outcome.CUT)
            if closed.outcome is Outcome.ENDED:
                self.stats.count("episodes")

    def _replaced(self, slot: int, generation: int | None, goal: Goal) -> None:
        """The slot's env is of another ``generation`` than its record (``None``: its process was
        restarted, and its fresh reset will carry it): its episode is cut."""
        cut = self.episodes.replaced(slot, generation)
        if cut is not None:
            self._book(slot, cut, goal)
            self.stats.count_total("worker_restarts", self.manager.restarts)

    def _fault(self, slot: int, error: EnvManagerError, goal: Goal) -> None:
        """``error`` came from an env update on ``slot``: the supervisor decides. Absorbed by a
        restart (the episode cut), or raised (the episode failed)."""
        decision = self.manager.fault([slot], error, seen={slot: self.episodes[slot].generation})
        if isinstance(decision, GiveUp):
            self.episodes.close(slot, Outcome.FAILED)
            raise decision.error
        self._replaced(slot, None, goal)

    def _read_observation(self, slot: int) -> Any:
        m = self.manager
        return m.observation_list[slot] if m.observation_list is not None else shm.read(m.results.observation, slot)

    def _steps(self, goal: Goal) -> TransitionBatch:
        """What ``obtain_steps`` hands out: the steps recorded, in worker order."""
        steps: list[Step] = []
        for slot in range(self.n_workers):
            for episode, _ in goal.episodes[slot]:
                steps += episode
            steps += self.episodes[slot].take_steps()  # the running episode's steps so far: it goes on next call
        return TransitionBatch.from_steps(steps)

    def _episodes(self, goal: Goal) -> EpisodeBatch:
        episodes = [(TransitionBatch.from_steps(steps), cut) for per_slot in goal.episodes for steps, cut in per_slot]
        if not episodes:
            raise EnvManagerError("sampler: every admitted episode was cut by a worker restart before its first step")
        return EpisodeBatch.from_transitions([e for e, _ in episodes], [cut for _, cut in episodes])

    def close(self) -> None:
        """Close the manager if the sampler built it (reaps every worker). Idempotent."""
        if self._owns_manager:
            self.manager.close()


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


def exact_quotas(n_eps_per_worker: Any, n_workers: int) -> list[int]:
    """The episodes asked of each slot (an int, or one per slot; the ``RaySampler``'s too)."""
    quotas = list(n_eps_per_worker) if isinstance(n_eps_per_worker, Iterable) else [n_eps_per_worker] * n_workers
    if len(quotas) != n_workers or not all(is_count(q) for q in quotas) or not sum(quotas):
        raise InvalidInputError(f"n_eps_per_worker must be a non-negative int or {n_workers} of them, not all 0")
    return [int(q) for q in quotas]
