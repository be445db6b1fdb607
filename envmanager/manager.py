"""``SubprocessEnvManager``: environments in worker processes, results as soon as they are ready.

Each worker process gets commands over its own pipe and posts answers on one shared step
queue (see ``pool`` and ``transport``). ``step()`` queues a step only for workers that are
idle, then returns as soon as at least one has finished. Every wait has a deadline; a dead or
hung worker becomes a clear exception naming it, or is restarted within limits.

Besides ``step``/``reset``/``call`` (StepInfo level), the manager offers a request level —
``send_step``/``receive_steps``, ``send_reset``/``receive_resets`` — for adapters that
schedule their own waits (gymnasium, SB3, ML-Agents).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
import numpy as np
from gymnasium import spaces

from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError, SpaceMismatchError, WorkerTimeoutError
from envmanager.env_calls import EnvCalls
from envmanager.pool import Completion, WorkerPool, get_context, make_specs
from envmanager.protocol import EnvironmentCommand as Cmd, StepInfo, StepResult, StepTimings, encode_payload
from envmanager.restart import RestartPolicy
from envmanager.transport import SharedBuffers, array_layout, check_value
from envmanager.worker import DISABLED, NEXT_STEP, SAME_STEP, WorkerProcess

logger = logging.getLogger(__name__)

__all__ = ["SubprocessEnvManager", "Completion"]

Policy = Callable[[StepInfo], Any]


class SubprocessEnvManager(EnvCalls):
    """Run ``n_env`` environments in worker processes; step the idle ones, return the finished.

    Args:
        env_factory: ``env_factory(worker_id) -> env``, a gymnasium-style env. Cloudpickled.
        n_env: number of environment slots (``worker_id`` 0 .. n_env-1).
        envs_per_worker: slots hosted by one process (stepped together, as one message).
        context: multiprocessing start method: ``"fork"``, ``"forkserver"``, ``"spawn"``.
        shared_memory: keep observations, rewards, flags and actions in shared memory.
        autoreset_mode: gymnasium's ``"next_step"`` (default), ``"same_step"`` or ``"disabled"``.
        timeout: deadline in seconds for any one worker answer (startup, step, reset, call).
        restart_workers: restart a worker that dies, hangs or raises, within the limits
            ``max_lifetime_restarts`` and ``restarts_rate_limit_n`` per
            ``restarts_rate_limit_period_s`` (ML-Agents' defaults 10, 1, 60 s).
        policy: ``policy(step_info) -> action``, used by ``step()`` when no actions are given.
        daemon: start workers as daemonic processes (they cannot start multiprocessing children).
        spin_s: seconds an idle worker polls for its next command before it blocks. Default:
            50 µs when every worker process and the parent have a core of their own, else 0
            (spinning processes that outnumber the cores slow everything down).
    """

    def __init__(
        self,
        env_factory: Callable[[int], Any],
        n_env: int = 1,
        *,
        envs_per_worker: int = 1,
        context: str | None = None,
        shared_memory: bool = True,
        autoreset_mode: str | Any = NEXT_STEP,
        timeout: float = 60.0,
        restart_workers: bool = False,
        max_lifetime_restarts: int = 10,
        restarts_rate_limit_n: int = 1,
        restarts_rate_limit_period_s: float = 60.0,
        policy: Policy | None = None,
        daemon: bool = True,
        spin_s: float | None = None,
    ) -> None:
        self._pool: WorkerPool | None = None
        if not isinstance(n_env, int) or n_env < 1:
            raise InvalidInputError(f"n_env must be a positive int, got {n_env!r}")
        if not isinstance(envs_per_worker, int) or envs_per_worker < 1:
            raise InvalidInputError(f"envs_per_worker must be a positive int, got {envs_per_worker!r}")
        if timeout is None or timeout <= 0:
            raise InvalidInputError(f"timeout must be a positive number of seconds, got {timeout!r}")
        modes = {m.replace("_", ""): m for m in (NEXT_STEP, SAME_STEP, DISABLED)}
        mode = modes.get(str(getattr(autoreset_mode, "value", autoreset_mode)).lower().replace("_", ""), "")
        if not mode:  # accepts "next_step" and gymnasium's AutoresetMode.NEXT_STEP alike
            raise InvalidInputError(f"unknown autoreset_mode {autoreset_mode!r}")
        try:
            factory = cloudpickle.dumps(env_factory)
        except Exception as exc:
            raise InvalidInputError(f"env_factory cannot be pickled: {exc!r}") from exc
        ctx = get_context(context)

        self.n_env = n_env
        self.envs_per_worker = envs_per_worker
        self.autoreset_mode = mode
        self.timeout = float(timeout)
        self.policy = policy
        #: Copy each observation out of shared memory into its StepResult. An adapter that reads
        #: the shared batch itself (``buffers.observation``) turns this off: results then carry
        #: ``observation=None`` when the observation lives in shared memory.
        self.copy_observations = True
        # Per-slot state, indexed by worker_id.
        self._last: list[StepInfo | None] = [None] * n_env
        self._in_flight: dict[int, Any] = {}  # worker_id -> action being stepped
        self._done = [False] * n_env  # last result terminated or truncated
        self._needs_reset = [True] * n_env
        self._ready: list[StepInfo] = []  # finished steps, not yet returned
        self._step_errors: list[EnvManagerError] = []  # failed steps, not yet raised
        self._answers: dict[int, Completion] = {}  # finished resets and calls by worker index
        self._resets_owed: set[int] = set()  # worker indices sent a reset not yet received

        n_procs = -(-n_env // envs_per_worker)
        if spin_s is None:  # spinning only pays when every process (and the parent) has a core
            spin_s = 50e-6 if n_procs + 1 <= (os.cpu_count() or 1) else 0.0
        specs = make_specs(factory, n_env, envs_per_worker, mode, spin_s)
        self._slot_worker = [spec.index for spec in specs for _ in spec.env_ids]
        self._slot_local = [local for spec in specs for local in range(len(spec.env_ids))]
        restarts = RestartPolicy(restart_workers, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s)
        try:
            self._pool = WorkerPool(specs, ctx, self.timeout, restarts, daemon)
            described = self._pool.gather(self._pool.workers, "startup")
            #: What each worker process reported about its envs (spaces, metadata, ...).
            self.descriptions: list[dict[str, Any]] = [c.items for c in described]
            self._describe(self.descriptions[0])
            if shared_memory:
                self._check_one_layout()
                self._pool.attach_buffers(SharedBuffers.create(n_env, self.observation_space, self.action_space))
        except BaseException:
            self.close()
            raise

    def _check_one_layout(self) -> None:
        """Shared memory lays out every slot alike: all envs' spaces must have one layout."""
        for kind in ("observation", "action"):
            first = array_layout(getattr(self, f"{kind}_space"))
            for desc in self.descriptions:
                for local, space in enumerate(desc[f"{kind}_spaces"]):
                    if array_layout(space) != first:
                        raise SpaceMismatchError(
                            f"worker {desc['env_ids'][local]} has "
                            f"{kind} space {space}, unlike worker 0's {getattr(self, f'{kind}_space')}; shared "
                            "memory needs one layout for all (pass shared_memory=False)"
                        )

    def _describe(self, info: dict[str, Any]) -> None:
        self.observation_space: spaces.Space | None = info["observation_space"]
        self.action_space: spaces.Space | None = info["action_space"]
        self.metadata: dict[str, Any] = dict(info["metadata"] or {})
        self.render_mode: str | None = info["render_mode"]
        self.spec = info["spec"]
        self._action_layout = array_layout(self.action_space)  # to check actions, shared or not

    # ------------------------------------------------------------------------------------------
    # State

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None or self._pool.queue is None:
            raise ManagerClosedError("the SubprocessEnvManager is closed")
        return self._pool

    @property
    def closed(self) -> bool:
        return self._pool is None or self._pool.queue is None

    @property
    def restart_policy(self) -> RestartPolicy:
        return self.pool.restart_policy

    @property
    def replay_calls(self) -> list[tuple[str, tuple, dict]]:
        """``(method, args, kwargs)`` called on a restarted worker's envs before its reset."""
        return self.pool.replay_calls

    @property
    def buffers(self) -> SharedBuffers | None:
        """The shared-memory buffers (``None`` with ``shared_memory=False``)."""
        return self.pool.buffers

    @property
    def workers(self) -> list[WorkerProcess]:
        return self.pool.workers

    def worker_of(self, worker_id: int) -> WorkerProcess:
        return self.pool.workers[self._slot_worker[worker_id]]

    @property
    def worker_ids(self) -> list[int]:
        return list(range(self.n_env))

    @property
    def waiting_worker_ids(self) -> list[int]:
        """Slots whose process has a request in flight."""
        return [s for s in range(self.n_env) if self.worker_of(s).busy]

    @property
    def idle_worker_ids(self) -> list[int]:
        return [s for s in range(self.n_env) if not self.worker_of(s).busy]

    def set_policy(self, policy: Policy | None) -> None:
        self.policy = policy

    # ------------------------------------------------------------------------------------------
    # Stepping

    def step(
        self, actions: Mapping[int, Any] | Sequence[Any] | None = None, timeout: float | None = None
    ) -> list[StepInfo]:
        """Queue a step for every idle slot, then return as soon as at least one finished.

        ``actions`` is a mapping ``worker_id -> action`` (idle slots missing from it stay
        idle), a sequence with one action per slot (entries of busy slots are ignored), or
        ``None`` to ask the policy. Everything is checked before any worker is sent anything.
        Raises the first failure of a worker (its other results wait for the next call).
        """
        self.send_step(self._choose_actions(actions))
        return self.receive_steps(timeout)

    def _choose_actions(self, actions: Mapping[int, Any] | Sequence[Any] | None) -> dict[int, Any]:
        if isinstance(actions, Mapping):  # send_step checks the rest
            n = self.n_env
            for slot in actions:
                if not isinstance(slot, (int, np.integer)) or not 0 <= slot < n:
                    raise InvalidInputError(f"unknown worker id {slot!r} (n_env={n})")
            return actions if isinstance(actions, dict) else dict(actions)
        self.pool  # raises if closed
        idle = [s for s in self.idle_worker_ids if self.worker_of(s).failure is None]
        if actions is None:
            if self.policy is None and idle:
                raise InvalidInputError("step() without actions needs a policy (set_policy)")
            for slot in idle:
                if self._last[slot] is None:
                    raise InvalidInputError(f"worker {slot} must be reset before it is stepped")
            return {slot: self.policy(self._last[slot]) for slot in idle}  # type: ignore[misc]
        if len(actions) != self.n_env:
            raise InvalidInputError(f"expected {self.n_env} actions (one per worker), got {len(actions)}")
        return {slot: actions[slot] for slot in idle}

    def send_step(self, actions: Mapping[int, Any]) -> None:
        """Check ``actions`` (``worker_id -> action``, idle slots only), then send the steps."""
        pool = self.pool
        workers, slot_worker, slot_local = pool.workers, self._slot_worker, self._slot_local
        buffers = pool.buffers
        layout = self._action_layout
        by_worker: dict[int, list[int]] = {}
        for slot, action in actions.items():
            w = workers[slot_worker[slot]]
            if w.failure is not None:
                raise w.failure
            if w.pending is not None:
                raise InvalidInputError(f"worker {slot} is still stepping; it cannot take an action")
            if self._needs_reset[slot]:
                raise InvalidInputError(f"worker {slot} must be reset before it is stepped")
            if self._done[slot] and self.autoreset_mode == DISABLED:
                raise InvalidInputError(
                    f"worker {slot} finished its episode; with autoreset_mode='disabled' reset it first"
                )
            if layout is not None and (why := check_value(layout, action)):
                raise InvalidInputError(f"action for worker {slot} {why}")
            by_worker.setdefault(w.index, []).append(slot)
        in_shm = buffers is not None and buffers.action is not None
        outgoing = []
        try:  # everything that can fail happens before the first send: nothing half-sent
            for index, slots in by_worker.items():
                if len(slots) > 1:
                    slots.sort()
                if in_shm:
                    for slot in slots:
                        SharedBuffers.write(buffers.action, slot, actions[slot])  # type: ignore[union-attr]
                payload = ([slot_local[s] for s in slots], None if in_shm else [actions[s] for s in slots])
                outgoing.append((workers[index], slots, encode_payload(payload)))
        except Exception as exc:
            raise InvalidInputError(f"actions cannot be sent: {exc!r}") from exc
        in_flight = self._in_flight
        for w, slots, payload in outgoing:
            for slot in slots:
                in_flight[slot] = actions[slot]
            pool.send(w, Cmd.STEP, payload)

    def receive_steps(self, timeout: float | None = None, min_count: int = 1) -> list[StepInfo]:
        """Wait (bounded by ``timeout``, default the manager's) until ``min_count`` steps finished,
        take whatever else finished, and return them. Raises the first failed step."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pool = self.pool
        self._absorb(pool.poll(0.0))
        while len(self._ready) < min_count and not self._step_errors:
            now = time.monotonic()
            if now >= deadline or not any(w.pending is not None and not w.closing for w in pool.workers):
                busy = [w for w in pool.workers if w.busy and not w.closing]
                if busy:
                    raise WorkerTimeoutError([s for w in busy for s in w.env_ids], limit, "a step result", hung=False)
                failure = next((w.failure for w in pool.workers if w.failure), None)
                if failure is not None:
                    raise failure
                if self._ready:
                    break
                raise InvalidInputError("no step is in flight: nothing can finish")
            self._absorb(pool.poll(deadline - now))
        if self._step_errors:
            raise self._step_errors.pop(0)
        ready, self._ready = self._ready, []
        return ready

    def _absorb(self, completions: list[Completion]) -> None:
        """File finished steps as StepInfos, failed ones as errors, resets by worker."""
        for c in completions:
            if c.interrupted and c.cmd is Cmd.RESET:  # a restart answered a reset: for its caller
                self._answers[c.worker.index] = c
            elif c.interrupted or c.cmd is Cmd.STEP or c.request is None:
                if c.error is not None:
                    for slot in c.worker.env_ids:
                        self._in_flight.pop(slot, None)
                        self._needs_reset[slot] = True
                    self._step_errors.append(c.error)
                else:
                    self._ready.extend(self._step_infos(c))
            elif c.request is not None:
                self._answers[c.worker.index] = c

    def _step_infos(self, c: Completion) -> list[StepInfo]:
        """Turn a worker's answer into StepInfos (reading shared memory) and note the new state."""
        infos = []
        fresh = not c.interrupted and c.cmd is not Cmd.STEP
        env_ids = c.worker.env_ids
        queued = max(0.0, c.received_at - c.posted_at)
        round_trip = max(0.0, c.received_at - c.worker.sent_at)
        b = self.pool.buffers
        shared_obs = b.observation if b is not None and self.copy_observations else None
        last_infos, in_flight = self._last, self._in_flight
        for local, obs, reward, terminated, truncated, info, env_time in c.items:
            slot = env_ids[local]
            if b is not None:
                reward, terminated, truncated = float(b.reward[slot]), bool(b.terminated[slot]), bool(b.truncated[slot])
                if shared_obs is not None:
                    obs = SharedBuffers.read(shared_obs, slot)
            result = StepResult(obs, reward, terminated, truncated, info)
            last = last_infos[slot]
            step_info = StepInfo(
                slot,
                None if fresh or last is None else last.current_result,
                result,
                in_flight.pop(slot, None),
                StepTimings(env_time, queued, round_trip),
                c.interrupted,
            )
            last_infos[slot] = step_info
            self._needs_reset[slot] = False
            self._done[slot] = terminated or truncated
            infos.append(step_info)
        return infos

    # ------------------------------------------------------------------------------------------
    # Resetting

    def reset(
        self,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[StepInfo]:
        """Reset every slot and return their StepInfos (``previous_result`` is ``None``).

        Steps still in flight are waited out (with the deadline) and their results dropped;
        they are never returned later. ``seed`` is one int (slot ``i`` gets ``seed + i``), a
        list with one seed per slot, or ``None``.
        """
        seeds = _seeds(seed, self.n_env)
        self.drop_in_flight(timeout)
        self.send_reset({slot: (seeds[slot], options) for slot in range(self.n_env)})
        return self.receive_resets(None, timeout)

    def wait_idle(self, worker_ids: Sequence[int] | None = None, timeout: float | None = None) -> None:
        """Wait until the processes hosting ``worker_ids`` (default: all) have nothing in flight
        (a restart, say); steps that finish meanwhile are kept for ``receive_steps``."""
        pool = self.pool
        self._absorb(pool.poll(0.0))  # notice a death (and so a restart) that already happened
        workers = {pool.workers[self._slot_worker[s]].index for s in self._slots(worker_ids)}
        busy = [pool.workers[i] for i in sorted(workers) if pool.workers[i].busy]
        if busy:
            pool.gather_quietly(busy, "the requests in flight", timeout, sink=self._absorb)

    def drop_in_flight(self, timeout: float | None = None) -> None:
        """Wait out every request in flight and drop the results, errors included."""
        pool = self.pool
        busy = [w for w in pool.workers if w.busy]
        if busy:
            pool.gather_quietly(busy, "the in-flight steps", timeout, sink=self._absorb)
        self._ready.clear()
        self._step_errors.clear()
        self._in_flight.clear()
        self._answers.clear()
        self._resets_owed.clear()

    def send_reset(self, seeds_and_options: Mapping[int, tuple[Any, Any]]) -> None:
        """Send a reset for the given slots: ``worker_id -> (seed, options)``."""
        pool = self.pool
        by_worker: dict[int, list[tuple[int, Any, Any]]] = {}
        for slot, (seed, options) in sorted(seeds_and_options.items()):
            w = self.worker_of(slot)
            if w.failure is not None:
                raise w.failure
            if w.busy:
                raise InvalidInputError(f"worker {slot} is busy; it cannot be reset now")
            by_worker.setdefault(w.index, []).append((self._slot_local[slot], seed, options))
        try:
            outgoing = [(index, encode_payload(items)) for index, items in by_worker.items()]
        except Exception as exc:
            raise InvalidInputError(f"reset seeds or options cannot be sent: {exc!r}") from exc
        for index, payload in outgoing:
            w = pool.workers[index]
            for slot in w.env_ids:
                self._in_flight.pop(slot, None)
            self._answers.pop(index, None)
            self._resets_owed.add(index)
            pool.send(w, Cmd.RESET, payload)

    def receive_resets(self, worker_ids: Sequence[int] | None = None, timeout: float | None = None) -> list[StepInfo]:
        """Wait for the resets sent to ``worker_ids`` (default: every reset in flight).

        Answers that arrive before a timeout are kept, so a later call picks up where this
        one stopped. Returns StepInfos sorted by worker id.
        """
        if worker_ids is None:
            indices = set(self._resets_owed)
        else:
            indices = {self._slot_worker[s] for s in self._slots(worker_ids)}
            if not indices <= self._resets_owed:
                raise InvalidInputError(f"no reset was sent to worker(s) {sorted(worker_ids)}")
        completions = self._await_answers(indices, timeout, "a reset result")
        self._resets_owed -= indices
        for c in completions:
            if c.error is not None:
                for slot in c.worker.env_ids:
                    self._needs_reset[slot] = True
                raise c.error
        infos = [info for c in completions for info in self._step_infos(c)]
        return sorted(infos, key=lambda info: info.worker_id)

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close(self, timeout: float = 10.0) -> None:
        """End every worker (politely, then by force) and free shared memory. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout)

    def __enter__(self) -> SubprocessEnvManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _seeds(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    if isinstance(seed, (int, np.integer)):
        return [int(seed) + i for i in range(n)]
    seeds = list(seed)
    if len(seeds) != n:
        raise InvalidInputError(f"expected {n} seeds (one per worker), got {len(seeds)}")
    return seeds
