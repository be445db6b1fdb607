"""``SubprocessEnvManager``, the StepInfo level: ``step()`` queues a step for every idle slot,
then returns as soon as at least one has finished, as ``StepInfo``\\ s. Every wait has a
deadline; a dead or hung worker becomes a clear exception naming it, or is restarted within
limits. The batch level it is built on, which the adapters use, is ``envmanager.core.batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envmanager.core.arguments import seeds_for
from envmanager.core.batch import BatchEnvManager
from envmanager.core.layout import STEP_INFO
from envmanager.core.restart import MAX_LIFETIME_RESTARTS, RATE_LIMIT_N, RATE_LIMIT_PERIOD_S
from envmanager.core.results import StepBatch, StepInfo, StepResult, StepTimings
from envmanager.errors import InvalidInputError
from envmanager.wire import shm
from envmanager.wire.interrupts import DEFERRED, begin, end
from envmanager.worker.envs import NEXT_STEP

__all__ = ["SubprocessEnvManager"]

Policy = Callable[[StepInfo], Any]


class SubprocessEnvManager(BatchEnvManager):
    """Run ``n_env`` environments in worker processes; step the idle ones, return the finished.

    Args:
        env_factory: ``env_factory(worker_id) -> env``, a gymnasium-style env. Cloudpickled.
        n_env: number of environment slots (``worker_id`` 0 .. n_env-1).
        envs_per_worker: slots hosted by one process (stepped together, as one message), or
            ``"auto"``: chosen from one env's step cost measured at start-up (``core.auto``).
            Default 1: a slot's crash or hang touches only that slot (the drop-ins: ``"auto"``).
        context: multiprocessing start method: ``"fork"``, ``"forkserver"``, ``"spawn"``; by
            default ``"fork"`` on Linux, ``"spawn"`` on macOS and Windows (``platforms``).
        shared_memory: keep observations, rewards, flags and actions in shared memory.
        autoreset_mode: gymnasium's ``"next_step"`` (default), ``"same_step"`` or ``"disabled"``.
        timeout: deadline in seconds for any one worker answer (startup, step, reset, call).
        restart_workers: restart a worker process that dies, hangs or raises, within the limits
            ``max_lifetime_restarts`` and ``restarts_rate_limit_n`` per
            ``restarts_rate_limit_period_s`` (ML-Agents' defaults 10, 1, 60 s), counted per
            process (with ``envs_per_worker=k``, one quota for its k slots).
        policy: ``policy(step_info) -> action``, used by ``step()`` when no actions are given.
        daemon: start workers as daemonic processes (they cannot start multiprocessing children).
        spin_s: the most seconds an idle worker polls for its next command before it blocks, and
            the parent for the next answer (each about twice its typical wait: ``wire.spin``).
            Default: 2 ms when every worker process and the parent have a core of their own (this
            process's CPU affinity), else 0 (spinning processes outnumbering the cores slow all).
        double_buffer: split each process's slots into two lanes, each answered on its own: the
            worker steps one half while the parent turns the other around (pays where the parent
            has a core of its own); ``"auto"``: on when usable cores outnumber worker processes.
        generations: each slot's generation to go on from: a manager in place of a lost one (a
            Ray node's players) counts their restarts so far, the last one just now.
    """

    def __init__(
        self,
        env_factory: Callable[[int], Any],
        n_env: int = 1,
        *,
        envs_per_worker: int | str = 1,
        context: str | None = None,
        shared_memory: bool = True,
        autoreset_mode: str | Any = NEXT_STEP,
        timeout: float = 60.0,
        restart_workers: bool = False,
        max_lifetime_restarts: int = MAX_LIFETIME_RESTARTS,
        restarts_rate_limit_n: int = RATE_LIMIT_N,
        restarts_rate_limit_period_s: float = RATE_LIMIT_PERIOD_S,
        policy: Policy | None = None,
        daemon: bool = True,
        spin_s: float | None = None,
        double_buffer: bool | str = False,
        generations: Sequence[int] | None = None,
    ) -> None:
        self.policy = policy
        self._last: list[StepInfo | None] = [None] * (n_env if isinstance(n_env, int) and n_env > 0 else 0)
        self._actions: dict[int, Any] = {}  # slot -> action being stepped (for StepInfo.action)
        self._ready: list[StepInfo] = []  # results taken early (see ``_absorb``), not returned yet
        super().__init__(
            env_factory, n_env, envs_per_worker=envs_per_worker, context=context, shared_memory=shared_memory,
            autoreset_mode=autoreset_mode, timeout=timeout, restart_workers=restart_workers,
            max_lifetime_restarts=max_lifetime_restarts, restarts_rate_limit_n=restarts_rate_limit_n,
            restarts_rate_limit_period_s=restarts_rate_limit_period_s, daemon=daemon, spin_s=spin_s,
            double_buffer=double_buffer, caller=STEP_INFO, generations=generations,
        )

    def set_policy(self, policy: Policy | None) -> None:
        self.policy = policy

    @property
    def idle_worker_ids(self) -> list[int]:
        """Slots that can be sent a step now: nothing in flight on their process."""
        self._absorb()
        return super().idle_worker_ids

    def _absorb(self) -> None:
        """Turn step results that arrived into StepInfos now (copies), so their slots can be
        stepped again before the caller receives them — as when a worker restarted while idle."""
        if self._state.arrived and self._pool is not None:  # (no wait, no error raised: ``idle_worker_ids`` asks)
            try:
                begin()  # a Ctrl-C between handing them out and keeping them waits (``interrupts``)
                self._ready += self._step_infos(self._state.hand_out())
            finally:
                end()

    # ------------------------------------------------------------------------------------------
    # Stepping

    def step(self, actions: Mapping[int, Any] | Sequence[Any] | None = None, timeout: float | None = None) -> list[StepInfo]:
        """Queue a step for every idle slot, then return as soon as at least one finished
        (docs/guide/step-semantics.md). ``actions``: a mapping ``worker_id -> action`` (idle slots
        missing from it stay idle), a sequence with one per slot (busy slots' entries are ignored),
        or ``None`` to ask the policy. All is checked before any worker is sent anything. Raises
        the first failure of a worker (its other results wait for the next call)."""
        self.send_step(self._choose_actions(actions))
        return self.receive_steps(timeout)

    def _choose_actions(self, actions: Mapping[int, Any] | Sequence[Any] | None) -> dict[int, Any]:
        if isinstance(actions, Mapping):  # send_step checks the rest
            return actions if isinstance(actions, dict) else dict(actions)
        idle = [s for s in self.idle_worker_ids if self.failure_of(s) is None]
        if actions is None:
            if self.policy is None and idle:
                raise InvalidInputError("step() without actions needs a policy (set_policy)")
            for slot in idle:
                if self._last[slot] is None:
                    raise InvalidInputError(f"worker {slot} must be reset before it is stepped")
            return {slot: self.policy(self._last[slot]) for slot in idle}  # type: ignore[misc, arg-type]
        if isinstance(actions, (str, bytes)) or not hasattr(actions, "__len__"):
            raise InvalidInputError(f"actions must be a mapping or a sequence with one action per worker, got {actions!r:.60}")
        if len(actions) != self.n_env:
            raise InvalidInputError(f"expected {self.n_env} actions (one per worker), got {len(actions)}")
        return {slot: actions[slot] for slot in idle}

    def send_step(self, actions: Mapping[int, Any]) -> None:
        """Check ``actions`` (``worker_id -> action``, idle slots only), then send the steps."""
        if not actions:
            _ = self.pool  # raises if closed
            return
        try:
            begin()  # a Ctrl-C between sending and noting the actions waits (``interrupts``)
            self._absorb()
            slots = sorted(self.slots(list(actions)))  # checked; in slot order: one cached send plan per set of slots
            self._send_batch(slots, [actions[s] for s in slots], per_slot=True)
            self._actions.update(actions)
        finally:
            end()

    def receive_steps(self, timeout: float | None = None, min_count: int = 1) -> list[StepInfo]:
        """Wait (bounded by ``timeout``, default the manager's) until ``min_count`` steps finished,
        take whatever else finished, and return them. Raises the first failed step."""
        try:
            begin()  # a Ctrl-C between taking the batch and returning its StepInfos waits (``interrupts``)
            self._absorb()
            batch = self._receive_batch(max(0, min_count - len(self._ready)), timeout)
            out, self._ready = self._ready + self._step_infos(batch), []
            return out
        finally:
            end()

    def _step_infos(self, batch: StepBatch) -> list[StepInfo]:
        """StepInfos for a batch: the per-env objects of this level, read from the results."""
        r = self.results
        obs_tree, obs_list = r.observation, self.observation_list
        rewards, terms, truncs = r.reward.tolist(), r.terminated.tolist(), r.truncated.tolist()
        infos, interrupted, resets = batch.infos, batch.interrupted, batch.resets
        generations = self._state.generation_list  # batch.generations' rows, as ints (it is no copy: the same now)
        last, actions = self._last, self._actions
        out = []
        timings = self._state.timings
        for slot in batch.slots.tolist():
            obs = obs_list[slot] if obs_list is not None else shm.read(obs_tree, slot)
            result = StepResult(obs, rewards[slot], terms[slot], truncs[slot], infos.get(slot, {}))
            fresh = slot in resets and slot not in interrupted
            previous = last[slot]
            info = StepInfo(slot, None if fresh or previous is None else previous.current_result, result,
                            actions.pop(slot, None), StepTimings(*timings(slot)), slot in interrupted, generations[slot])
            last[slot] = info
            out.append(info)
        return out

    # ------------------------------------------------------------------------------------------
    # Resetting

    def reset(self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None,
              timeout: float | None = None) -> list[StepInfo]:
        """Reset every slot and return their StepInfos (``previous_result`` is ``None``). Steps in
        flight are waited out (with the deadline) and their results dropped, never returned later.
        ``seed``: one int (slot ``i`` gets ``seed + i``), a list with one per slot, or ``None``."""
        seeds = seeds_for(seed, self.n_env)
        with DEFERRED:  # (its waits stay interruptible; a reset() cut short is called again)
            self.drop_in_flight(timeout)
            self.send_reset({slot: (seeds[slot], options) for slot in range(self.n_env)})
            return self.receive_resets(None, timeout)

    def drop_in_flight(self, timeout: float | None = None) -> None:
        """Wait out every request in flight and drop the results, errors included."""
        self.drain(timeout)
        self._actions.clear()
        self._ready.clear()

    def receive_resets(self, worker_ids: Sequence[int] | None = None, timeout: float | None = None) -> list[StepInfo]:
        """Wait for the resets sent to ``worker_ids`` (default: every reset in flight); their
        StepInfos sorted by worker id. Answers that arrive before a timeout are kept."""
        with DEFERRED:  # a Ctrl-C between taking the resets and returning their StepInfos waits
            batch = self.receive_reset_batch(worker_ids, timeout)
            for slot in batch.slots.tolist():
                self._actions.pop(slot, None)
            return self._step_infos(batch)
