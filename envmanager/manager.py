"""``SubprocessEnvManager``: environments in worker processes, results as soon as they are ready.

Each worker process gets commands over its own pipe and posts answers on one shared step
queue. ``step()`` queues a step only for workers that are idle, then returns as soon as at
least one has finished. Every wait has a deadline; a dead or hung worker becomes a clear
exception naming it, or is restarted within limits.

The low-level half (``send``/``pump``: requests and :class:`Completion`s) is what the
adapters (gymnasium, SB3, ML-Agents) build on; ``step``/``reset``/``call`` are the
StepInfo-level API on top of it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import time
import weakref
from multiprocessing import resource_tracker
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_ready
from typing import Any

import cloudpickle
import numpy as np
from gymnasium import spaces

from envmanager.errors import (
    EnvManagerError,
    InvalidInputError,
    ManagerClosedError,
    RestartLimitError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from envmanager.protocol import (
    ON_PIPE,
    EnvironmentCommand as Cmd,
    EnvironmentRequest,
    RemoteException,
    StepInfo,
    StepResult,
    StepTimings,
)
from envmanager.restart import RestartPolicy
from envmanager.transport import SharedBuffers, StepQueue, check_value
from envmanager.worker import DISABLED, NEXT_STEP, SAME_STEP, WorkerProcess, WorkerSpec

logger = logging.getLogger(__name__)

__all__ = ["SubprocessEnvManager", "Completion"]

Policy = Callable[[StepInfo], Any]


@dataclass
class Completion:
    """A finished request of one worker process.

    ``items`` are the worker's per-env tuples for STEP/RESET, the payload otherwise.
    ``interrupted`` marks the reset that ends a restart (the request it answers was lost).
    """

    worker: WorkerProcess
    request: EnvironmentRequest | None
    items: Any = None
    error: EnvManagerError | None = None
    posted_at: float = 0.0
    received_at: float = 0.0
    interrupted: bool = False


class SubprocessEnvManager:
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
    ) -> None:
        self._closed = True  # until fully started, so close()/__del__ stay safe
        self._workers: list[WorkerProcess] = []
        self._buffers: SharedBuffers | None = None
        self._queue: StepQueue | None = None
        if not isinstance(n_env, int) or n_env < 1:
            raise InvalidInputError(f"n_env must be a positive int, got {n_env!r}")
        if not isinstance(envs_per_worker, int) or envs_per_worker < 1:
            raise InvalidInputError(f"envs_per_worker must be a positive int, got {envs_per_worker!r}")
        if timeout is None or timeout <= 0:
            raise InvalidInputError(f"timeout must be a positive number of seconds, got {timeout!r}")
        mode = str(getattr(autoreset_mode, "value", autoreset_mode)).lower()
        if mode not in (NEXT_STEP, SAME_STEP, DISABLED):
            raise InvalidInputError(f"unknown autoreset_mode {autoreset_mode!r}")
        try:
            factory = cloudpickle.dumps(env_factory)
        except Exception as exc:
            raise InvalidInputError(f"env_factory cannot be pickled: {exc!r}") from exc
        self._ctx = mp.get_context(context)  # ValueError for unknown methods, as multiprocessing

        self.n_env = n_env
        self.envs_per_worker = envs_per_worker
        self.autoreset_mode = mode
        self.timeout = float(timeout)
        self.policy = policy
        self.restart_policy = RestartPolicy(
            restart_workers, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s
        )
        #: ``(method name, args, kwargs)`` replayed on a restarted worker before its reset.
        self.replay_calls: list[tuple[str, tuple, dict]] = []
        self._seq = 0
        self._use_shared_memory = shared_memory

        # Per-slot state, indexed by worker_id.
        self._last: list[StepInfo | None] = [None] * n_env
        self._in_flight: dict[int, Any] = {}  # worker_id -> action being stepped
        self._done = [False] * n_env  # last result terminated or truncated
        self._needs_reset = [True] * n_env
        self._ready: list[StepInfo] = []  # finished, not yet returned by step()

        # One resource tracker for parent and workers: attaching workers then share it, and it
        # unlinks the shared memory should the parent be killed.
        resource_tracker.ensure_running()
        self._queue = StepQueue(self._ctx)
        self._closed = False
        self._atexit = _close_at_exit(self)
        specs = [
            WorkerSpec(i, tuple(range(start, min(start + envs_per_worker, n_env))), factory, mode, os.getpid())
            for i, start in enumerate(range(0, n_env, envs_per_worker))
        ]
        self._slot_worker = [spec.index for spec in specs for _ in spec.env_ids]
        try:
            for spec in specs:
                self._workers.append(WorkerProcess(self._ctx, spec, self._queue.writer))
            described = self._gather(self._workers, "startup")
            self._describe(described[0])
            if shared_memory:
                self._buffers = SharedBuffers.create(n_env, self.observation_space, self.action_space)
                self._gather(self._send_all(Cmd.ATTACH, self._buffers.layout), "shared memory")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------
    # Description

    def _describe(self, info: dict[str, Any]) -> None:
        self.observation_space: spaces.Space | None = info["observation_space"]
        self.action_space: spaces.Space | None = info["action_space"]
        self.metadata: dict[str, Any] = dict(info["metadata"] or {})
        self.render_mode: str | None = info["render_mode"]
        self.spec = info["spec"]

    @property
    def worker_ids(self) -> list[int]:
        return list(range(self.n_env))

    @property
    def waiting_worker_ids(self) -> list[int]:
        """Slots whose process has a request in flight."""
        return [s for s in range(self.n_env) if self._workers[self._slot_worker[s]].busy]

    @property
    def idle_worker_ids(self) -> list[int]:
        return [s for s in range(self.n_env) if not self._workers[self._slot_worker[s]].busy]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffers(self) -> SharedBuffers | None:
        """The shared-memory buffers (``None`` with ``shared_memory=False``)."""
        return self._buffers

    @property
    def workers(self) -> list[WorkerProcess]:
        return self._workers

    def worker_of(self, worker_id: int) -> WorkerProcess:
        return self._workers[self._slot_worker[worker_id]]

    def set_policy(self, policy: Policy | None) -> None:
        self.policy = policy

    # ------------------------------------------------------------------------------------------
    # StepInfo-level API

    def step(
        self, actions: Mapping[int, Any] | Sequence[Any] | None = None, timeout: float | None = None
    ) -> list[StepInfo]:
        """Queue a step for every idle slot, then return as soon as at least one finished.

        ``actions`` is a mapping ``worker_id -> action`` (idle slots missing from it stay
        idle), a sequence with one action per slot (entries of busy slots are ignored), or
        ``None`` to ask the policy. Everything is checked before any worker is sent anything.
        Raises the first failure of a worker (its other results wait for the next call).
        """
        self._check_open()
        chosen = self._choose_actions(actions)
        self.send_step(chosen)
        return self._collect_steps(timeout)

    def _choose_actions(self, actions: Mapping[int, Any] | Sequence[Any] | None) -> dict[int, Any]:
        idle = [s for s in self.idle_worker_ids if not self._failed(s)]
        if actions is None:
            if self.policy is None and idle:
                raise InvalidInputError("step() without actions needs a policy (set_policy)")
            for slot in idle:
                if self._last[slot] is None:
                    raise InvalidInputError(f"worker {slot} must be reset before it is stepped")
            return {slot: self.policy(self._last[slot]) for slot in idle}  # type: ignore[misc]
        if isinstance(actions, Mapping):
            busy = set(self.waiting_worker_ids)
            for slot in actions:
                if not isinstance(slot, int) or not 0 <= slot < self.n_env:
                    raise InvalidInputError(f"unknown worker id {slot!r} (n_env={self.n_env})")
                if slot in busy:
                    raise InvalidInputError(f"worker {slot} is still stepping; it cannot take an action")
            return dict(actions)
        if len(actions) != self.n_env:
            raise InvalidInputError(f"expected {self.n_env} actions (one per worker), got {len(actions)}")
        return {slot: actions[slot] for slot in idle}

    def _failed(self, slot: int) -> bool:
        return self.worker_of(slot).failure is not None

    def _collect_steps(self, timeout: float | None) -> list[StepInfo]:
        self._wait(lambda: bool(self._ready), timeout, "a step result")
        self._absorb(self.pump(0.0))
        ready, self._ready = self._ready, []
        return ready

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
        self._check_open()
        seeds = _seeds(seed, self.n_env)
        self._drain_in_flight(timeout)
        self._ready.clear()
        self.send_reset({slot: (seeds[slot], options) for slot in range(self.n_env)})
        completions = self._gather(
            [w for w in self._workers if w.busy], "a reset result", timeout, keep=True
        )
        infos: list[StepInfo] = []
        for completion in completions:
            infos.extend(self._step_infos(completion))
        return sorted(infos, key=lambda info: info.worker_id)

    def _drain_in_flight(self, timeout: float | None, keep: bool = False, workers=None) -> None:
        """Wait until no request is in flight (on ``workers``, default all).

        ``keep``: file finished steps as StepInfos for the next ``step()`` (and raise their
        errors); otherwise drop them, errors included (a reset follows).
        """
        busy = [w for w in (self._workers if workers is None else workers) if w.busy]
        if busy:
            completions = self._gather(busy, "the in-flight step", timeout, keep=True, raise_errors=False)
            if keep:
                self._absorb(completions)
        if not keep:
            self._in_flight.clear()

    def call(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``env.<name>(*args, **kwargs)`` (or read it, if not callable) on every slot."""
        return self.call_on(None, name, args, kwargs)

    def call_on(
        self, worker_ids: Sequence[int] | None, name: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """``call`` on the given slots only (``None``: all); results in the order given."""
        return self._request(Cmd.CALL, worker_ids, lambda local, slots: (local, name, args, kwargs or {}))

    def get_attr(self, name: str, worker_ids: Sequence[int] | None = None) -> list[Any]:
        """Read ``env.<name>`` (through wrappers) on the given slots (``None``: all)."""
        return self._request(Cmd.GET_ATTR, worker_ids, lambda local, slots: (local, name))

    def set_attr(self, name: str, values: Any, worker_ids: Sequence[int] | None = None) -> None:
        """Set ``env.<name>``: one value for all given slots, or a list with one per slot."""
        slots = self._slots(worker_ids)
        if not isinstance(values, (list, tuple)):
            values = [values] * len(slots)
        if len(values) != len(slots):
            raise InvalidInputError(f"expected {len(slots)} values (one per worker), got {len(values)}")
        by_slot = dict(zip(slots, values))
        self._request(Cmd.SET_ATTR, slots, lambda local, own: (local, name, [by_slot[s] for s in own]))

    def _slots(self, worker_ids: Sequence[int] | None) -> list[int]:
        if worker_ids is None:
            return list(range(self.n_env))
        slots = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        for slot in slots:
            if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_env:
                raise InvalidInputError(f"unknown worker id {slot!r} (n_env={self.n_env})")
        return [int(s) for s in slots]

    def _request(self, cmd: Cmd, worker_ids: Sequence[int] | None, payload: Callable) -> list[Any]:
        """Send ``cmd`` to the processes hosting ``worker_ids``; answers in the order given.

        Steps in flight on those processes are waited out first and kept for ``step()``.
        """
        slots = self._slots(worker_ids)
        self._check_open()
        by_worker: dict[int, list[int]] = {}
        for slot in dict.fromkeys(slots):
            by_worker.setdefault(self._slot_worker[slot], []).append(slot)
        workers = [self._workers[i] for i in by_worker]
        for w in workers:
            if w.failure is not None:
                raise w.failure
        self._drain_in_flight(None, keep=True, workers=workers)
        for w in workers:
            own = by_worker[w.index]
            self._send(w, cmd, payload([w.env_ids.index(s) for s in own], own))
        completions = self._gather(workers, f"{cmd.name.lower()} results", keep=True)
        answers = {s: item for c in completions for s, item in zip(by_worker[c.worker.index], c.items or [])}
        return [answers.get(s) for s in slots]

    # ------------------------------------------------------------------------------------------
    # Request-level API (for adapters)

    def send_step(self, actions: Mapping[int, Any]) -> None:
        """Check ``actions`` (``worker_id -> action``, idle slots only), then send the steps."""
        self._check_open()
        by_worker: dict[int, list[int]] = {}
        for slot, action in actions.items():
            failure = self.worker_of(slot).failure
            if failure is not None:
                raise failure
            if self._needs_reset[slot]:
                raise InvalidInputError(f"worker {slot} must be reset before it is stepped")
            if self.autoreset_mode == DISABLED and self._done[slot]:
                raise InvalidInputError(
                    f"worker {slot} finished its episode; with autoreset_mode='disabled' reset it first"
                )
            layout = self._buffers.layout.action if self._buffers else None
            if layout is not None:
                why = check_value(layout, action)
                if why:
                    raise InvalidInputError(f"action for worker {slot} {why}")
            by_worker.setdefault(self._slot_worker[slot], []).append(slot)
        for index, slots in by_worker.items():
            w = self._workers[index]
            if w.busy:
                raise InvalidInputError(f"worker(s) {slots} are still stepping")
        for index, slots in by_worker.items():
            w = self._workers[index]
            local = [w.env_ids.index(s) for s in sorted(slots)]
            if self._buffers is not None and self._buffers.action is not None:
                for slot in slots:
                    SharedBuffers.write(self._buffers.action, slot, actions[slot])
                payload = (local, None)
            else:
                payload = (local, [actions[s] for s in sorted(slots)])
            for slot in slots:
                self._in_flight[slot] = actions[slot]
            self._send(w, Cmd.STEP, payload)

    def send_reset(self, seeds_and_options: Mapping[int, tuple[Any, Any]]) -> None:
        """Send a reset for the given slots: ``worker_id -> (seed, options)``."""
        by_worker: dict[int, list[tuple[int, Any, Any]]] = {}
        for slot, (seed, options) in sorted(seeds_and_options.items()):
            w = self.worker_of(slot)
            by_worker.setdefault(w.index, []).append((w.env_ids.index(slot), seed, options))
        for index, items in by_worker.items():
            self._send(self._workers[index], Cmd.RESET, items)

    def _send(self, w: WorkerProcess, cmd: Cmd, payload: Any) -> None:
        self._seq += 1
        try:
            w.send(cmd, self._seq, payload)
        except WorkerDiedError:
            # Noticed through its sentinel on the next pump; the request counts as in flight.
            w.pending = EnvironmentRequest(cmd, self._seq, payload)

    def _send_all(self, cmd: Cmd, payload: Any) -> list[WorkerProcess]:
        for w in self._workers:
            self._send(w, cmd, payload)
        return list(self._workers)

    def result_of(self, completion: Completion, item: tuple) -> StepResult:
        """Turn a worker's per-env tuple into a StepResult, reading shared memory as needed."""
        local, obs, reward, terminated, truncated, info, _ = item
        b = self._buffers
        if b is not None:
            slot = completion.worker.env_ids[local]
            reward, terminated, truncated = float(b.reward[slot]), bool(b.terminated[slot]), bool(b.truncated[slot])
            if b.observation is not None:
                obs = SharedBuffers.read(b.observation, slot)
        return StepResult(obs, reward, terminated, truncated, info)

    def pump(self, timeout: float) -> list[Completion]:
        """Wait up to ``timeout`` for answers or worker deaths; return finished requests.

        Handles startup, restarts and stale answers internally; never blocks past ``timeout``.
        """
        if self._queue is None:
            return []
        watched = {w.sentinel: w for w in self._workers if not w.closing}
        ready = wait_for_ready([self._queue.reader, *watched], timeout)
        completions: list[Completion] = []
        if self._queue.reader in ready or not ready:
            self._drain(completions)
        dead = [w for sentinel, w in watched.items() if sentinel in ready and not w.closing]
        if dead:
            self._drain(completions)  # a worker's last words come before its death
            for w in dead:
                if self._workers[w.index] is w and not w.closing:
                    self._on_failure(w, WorkerDiedError(w.env_ids[0], w.wait_exitcode()), completions)
        return completions

    def _drain(self, completions: list[Completion]) -> None:
        assert self._queue is not None
        while (response := self._queue.get_nowait()) is not None:
            received = time.monotonic()
            w = self._workers[response.worker_index]
            if response.cmd is Cmd.CLOSED or w.pending is None or response.seq != w.pending.seq:
                continue  # a late answer to a request we gave up on, or a farewell
            payload = response.payload
            if payload == ON_PIPE:
                try:
                    payload = w.fetch_large_payload(self.timeout)
                except (EOFError, OSError, TimeoutError) as exc:
                    self._on_failure(w, WorkerDiedError(w.env_ids[0], w.wait_exitcode(), f": {exc!r}"), completions)
                    continue
            request, w.pending = w.pending, None
            if response.cmd is Cmd.ENV_EXITED:
                error = _worker_error(payload)
                self._on_failure(w, error, completions, request)
                continue
            completion = Completion(w, request, payload, None, response.sent_at, received)
            if w.booting:
                self._advance_boot(w, completion, completions)
            else:
                completions.append(completion)

    # ------------------------------------------------------------------------------------------
    # Failures and restarts

    def _on_failure(
        self,
        w: WorkerProcess,
        error: EnvManagerError,
        completions: list[Completion],
        request: EnvironmentRequest | None = None,
    ) -> None:
        request = request or w.pending
        w.pending = None
        refusal = self.restart_policy.refusal(w.index)
        if refusal is not None or self._closed:
            if self.restart_policy.enabled and refusal is not None:
                error = RestartLimitError(w.env_ids[0], refusal, error)
            if isinstance(error, (WorkerDiedError, WorkerTimeoutError)) or not w.alive():
                w.failure = error  # the process is gone or stuck for good
            if not w.alive() or isinstance(error, WorkerTimeoutError):
                w.kill()
            for slot in w.env_ids:
                self._needs_reset[slot] = True
            completions.append(Completion(w, request, None, error))
            return
        logger.warning("restarting worker %d after: %s", w.index, str(error).splitlines()[0])
        self.restart_policy.record(w.index)
        w.kill()
        assert self._queue is not None
        new = WorkerProcess(self._ctx, w.spec, self._queue.writer)
        new.boot = [(Cmd.ATTACH, self._buffers.layout)] if self._buffers else []
        everyone = list(range(len(w.env_ids)))
        new.boot += [(Cmd.CALL, (everyone, n, a, k)) for n, a, k in self.replay_calls]
        new.boot.append((Cmd.RESET, [(i, None, None) for i in range(len(w.env_ids))]))
        new.lost_request = request if request is not None and request.cmd is not Cmd.READY else w.lost_request
        self._workers[w.index] = new

    def _advance_boot(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """Take a restarted worker through attach → replayed calls → reset."""
        if w.boot:
            cmd, payload = w.boot.pop(0)
            self._send(w, cmd, payload)
            return
        completion.interrupted = True
        completion.request = w.lost_request
        w.lost_request, w.boot = None, None
        completions.append(completion)

    def _check_deadlines(self, completions: list[Completion]) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.busy and not w.closing and now - w.sent_at > self.timeout:
                what = "its startup" if w.pending.cmd is Cmd.READY else f"an answer to {w.pending.cmd.name}"
                self._on_failure(w, WorkerTimeoutError(list(w.env_ids), self.timeout, what), completions)

    def _wait(self, done: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Pump until ``done()``; a late worker fails (restart or raise); bounded by ``timeout``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not done():
            now = time.monotonic()
            busy = [w for w in self._workers if w.busy and not w.closing]
            if not busy:
                failure = next((w.failure for w in self._workers if w.failure), None)
                if failure is not None:
                    raise failure
                raise InvalidInputError(f"nothing is in flight: no worker can deliver {what}")
            if now >= deadline:
                late = [s for w in busy for s in w.env_ids]
                raise WorkerTimeoutError(late, self.timeout if timeout is None else timeout, what)
            next_late = min(w.sent_at for w in busy) + self.timeout
            completions = self.pump(max(0.0, min(deadline, next_late) - now))
            self._check_deadlines(completions)
            self._absorb(completions)

    def _gather(
        self,
        workers: list[WorkerProcess],
        what: str,
        timeout: float | None = None,
        keep: bool = False,
        raise_errors: bool = True,
    ) -> list[Any]:
        """Wait until the given workers answered; return their payloads (or Completions)."""
        indices = {w.index for w in workers}
        got: dict[int, Completion] = {}
        errors: list[EnvManagerError] = []

        def done() -> bool:
            return indices <= set(got)

        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not done():
            now = time.monotonic()
            if now >= deadline:
                late = [s for i in indices - set(got) for s in self._workers[i].env_ids]
                raise WorkerTimeoutError(late, self.timeout if timeout is None else timeout, what)
            completions = self.pump(min(deadline - now, 0.25))
            self._check_deadlines(completions)
            for c in completions:
                if c.worker.index in indices and c.worker.index not in got:
                    got[c.worker.index] = c
                    if c.error is not None:
                        errors.append(c.error)
                elif c.request is not None and c.request.cmd is Cmd.STEP:
                    self._absorb([c])
        if errors and raise_errors:
            raise errors[0]
        ordered = [got[i] for i in sorted(got)]
        return ordered if keep else [c.items for c in ordered]

    def _absorb(self, completions: list[Completion]) -> None:
        """File STEP answers (and restart resets) as StepInfos; raise the first error."""
        first_error: EnvManagerError | None = None
        for c in completions:
            if c.error is not None:
                for slot in c.worker.env_ids:
                    self._in_flight.pop(slot, None)
                first_error = first_error or c.error
                continue
            if c.interrupted or (c.request is not None and c.request.cmd is Cmd.STEP):
                self._ready.extend(self._step_infos(c))
        if first_error is not None:
            raise first_error

    def _step_infos(self, c: Completion) -> list[StepInfo]:
        infos = []
        for item in c.items:
            slot = c.worker.env_ids[item[0]]
            result = self.result_of(c, item)
            last = self._last[slot]
            fresh = not c.interrupted and (c.request is None or c.request.cmd is Cmd.RESET)
            timings = StepTimings(item[-1], max(0.0, c.received_at - c.posted_at), max(0.0, c.received_at - c.worker.sent_at))
            info = StepInfo(
                worker_id=slot,
                previous_result=None if fresh or last is None else last.current_result,
                current_result=result,
                action=self._in_flight.pop(slot, None),
                timings=timings,
                interrupted=c.interrupted,
            )
            self._last[slot] = info
            self._needs_reset[slot] = False
            self._done[slot] = result.terminated or result.truncated
            infos.append(info)
        return infos

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the SubprocessEnvManager is closed")

    def close(self, timeout: float = 10.0) -> None:
        """End every worker (politely, then by force) and free shared memory. Idempotent."""
        if getattr(self, "_closed", True) and not getattr(self, "_workers", None):
            self._free()
            return
        self._closed = True
        workers, self._workers = self._workers, []
        for w in workers:
            w.closing = True
            if w.alive():
                try:
                    w.conn.send(EnvironmentRequest(Cmd.CLOSE, -1))
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        while any(w.alive() for w in workers) and time.monotonic() < deadline:
            if self._queue is not None:  # keep the queue flowing so no worker blocks on it
                while self._queue.get_nowait() is not None:
                    pass
            wait_for_ready([w.sentinel for w in workers if w.alive()], 0.05)
        for w in workers:
            w.stop(0.0) if w.alive() else w.kill()
        self._free()

    def _free(self) -> None:
        if getattr(self, "_buffers", None) is not None:
            self._buffers.close()
            self._buffers = None
        if getattr(self, "_queue", None) is not None:
            self._queue.close()
            self._queue = None
        hook = getattr(self, "_atexit", None)
        if hook is not None:
            atexit.unregister(hook)
            self._atexit = None

    def __enter__(self) -> SubprocessEnvManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _close_at_exit(manager: SubprocessEnvManager) -> Callable[[], None]:
    """Close the manager at interpreter exit if the user did not (held weakly)."""
    ref = weakref.ref(manager)

    def close_if_alive() -> None:
        m = ref()
        if m is not None:
            m.close()

    atexit.register(close_if_alive)
    return close_if_alive


def _seeds(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    if isinstance(seed, int):
        return [seed + i for i in range(n)]
    seeds = list(seed)
    if len(seeds) != n:
        raise InvalidInputError(f"expected {n} seeds (one per worker), got {len(seeds)}")
    return seeds


def _worker_error(remote: RemoteException) -> WorkerError:
    return WorkerError(remote.env_index, remote.exc_type, remote.message, remote.traceback, remote.exception)
