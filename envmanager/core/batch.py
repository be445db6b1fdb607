"""The batch level of the core: send a batch of actions for a set of env slots; receive the
slots that finished, whose results are rows of shared arrays. Every adapter is built on it.

A batch of actions is checked once and written into shared memory with one numpy operation per
array, then asked for on the step board where every process has a core (``envmanager.wire.mailbox``),
elsewhere in fixed binary headers; per-env Python runs only for non-empty infos or per-env
``StepInfo``. Slot states, how long a result stays valid, lanes and restarts: docs/architecture.md
(State).

Why one module: the step and reset paths share the slot states, the plans, the joining of a
restart on its way back and the waits (split, the reset path stubbed five of the manager's
attributes and methods).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from envmanager.core import waiting
from envmanager.core.actions import ActionChecker
from envmanager.core.arguments import check_arguments
from envmanager.core.auto import AUTO, choose_double_buffer, choose_layout
from envmanager.core.calls import CallRequest, EnvCalls
from envmanager.core.completion import Completion
from envmanager.core.cores import machine_cores
from envmanager.core.layout import BATCH, Caller
from envmanager.core.plans import BatchPlans, refuse_slots, reset_plan, row_of, slot_array
from envmanager.core.platforms import mailbox_enabled
from envmanager.core.pool import WorkerPool, get_context, make_specs
from envmanager.core.process import ProcessState, WorkerProcess
from envmanager.core.restart import MAX_LIFETIME_RESTARTS, RATE_LIMIT_N, RATE_LIMIT_PERIOD_S, RestartPolicy
from envmanager.core.results import StepBatch
from envmanager.core.slots import IDLE, IDLE_BYTES, IN_FLIGHT, SlotState, SlotStatus
from envmanager.core.supervisor import Decision, GiveUp, Supervisor
from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError, failed_slots
from envmanager.wire import factory as packed_factory
from envmanager.wire import shm
from envmanager.wire.interrupts import DEFERRED, begin, end
from envmanager.wire.messages import EnvFunction, GetAttr, Ready, Reset, Step, lanes_of
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.worker.envs import DISABLED, NEXT_STEP

__all__ = ["BatchEnvManager", "SlotStatus"]


_CALLS = (Cmd.CALL, Cmd.GET_ATTR, Cmd.SET_ATTR)
#: The most a waiter spins before it blocks, where every process and the parent have a core of
#: their own: the spins are sized from the waits seen (``envmanager.wire.spin``), this caps them.
SPIN_CAP_S = 2e-3


class BatchEnvManager:
    """Env slots in worker processes, stepped, reset and received as batches.

    Takes ``SubprocessEnvManager``'s arguments (documented there), plus: ``check_spaces``, called
    with every slot's observation and action spaces before shared memory is laid out (what it
    raises ends the construction: an adapter's rules and messages come before the core's);
    ``info_columns``: the caller batches infos, so they travel as columns where they fit
    (``receive_batch(info_columns=True)``; a dict per env made from columns costs more than
    unpickling dicts); ``caller``: who steps the envs, for ``envs_per_worker="auto"``;
    ``inherit_factory``: under ``fork`` the workers inherit ``env_factory`` instead of unpickling
    it, as gymnasium's ``AsyncVectorEnv`` does; ``options_if_given``: envs are reset with
    ``options=`` only when there are some (SB3's workers); ``reset_info_apart``: a same-step
    autoreset's info is ``{"final_info": step info, "final_obs": obs, RESET_INFO: reset info}``
    (SB3's), not gymnasium's merge, where the reset info's keys win.
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
        daemon: bool = True,
        spin_s: float | None = None,
        check_spaces: Callable[[list[Any], list[Any]], None] | None = None,
        double_buffer: bool | str = False,
        info_columns: bool = False,
        caller: Caller = BATCH,
        generations: Sequence[int] | None = None,
        inherit_factory: bool = False,
        options_if_given: bool = False,
        reset_info_apart: bool = False,
    ) -> None:
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None  # (``_pool``'s close once this manager is garbage)
        ctx = get_context(context)
        factory, mode = check_arguments(env_factory, n_env, envs_per_worker, timeout, autoreset_mode,
                                        inherit_factory and ctx.get_start_method() == "fork")
        self._packed_factory = factory  # forgotten at close (``wire.factory``)

        self.n_env = n_env = int(n_env)
        if envs_per_worker == AUTO:  # one env stepped in a throwaway process, within deadlines; the model's best
            envs_per_worker, chosen = choose_layout(factory, n_env, context=ctx, daemon=daemon, start_timeout=timeout,
                                                    caller=caller, double_buffer=double_buffer)
            double_buffer = chosen if double_buffer == AUTO else double_buffer
        self.envs_per_worker = int(envs_per_worker)
        self.autoreset_mode = mode
        self._disabled = mode == DISABLED  # (asked per batch)
        self.timeout = float(timeout)
        self._state = SlotState(n_env)
        self._restarts_seen = 0  # the supervisor's count at the last look for restarts (``_void_overwritten``)
        self._restarting = False  # a restart was on its way back at that look
        #: Per-slot state (see the module doc).
        self.status = self._state.status

        n_procs = -(-n_env // self.envs_per_worker)
        #: Whether each process's slots form two lanes, each answered on its own.
        self.double_buffer = choose_double_buffer(n_procs, self.envs_per_worker, asked=double_buffer)
        if spin_s is None:  # spinning pays only where every process and the parent have a core (WorkerPool
            # looks again, per process, while they run)
            spin_s = SPIN_CAP_S if n_procs + 1 <= machine_cores() else 0.0
        specs = make_specs(factory, n_env, self.envs_per_worker, mode, spin_s, info_columns, self.double_buffer,
                           options_if_given, reset_info_apart)
        #: The process hosting each slot, and the slot's index among that process's envs.
        self.slot_process = np.array([spec.index for spec in specs for _ in spec.env_ids])
        self.slot_local = np.array([local for spec in specs for local in range(len(spec.env_ids))])
        self._slot_process_list: list[int] = self.slot_process.tolist()  # for per-slot Python loops
        self._slot_local_list: list[int] = self.slot_local.tolist()
        #: Each slot's lane as a bit mask: 1, or with double buffering 1 (first half of its
        #: process's envs) or 2 (second half).
        self.slot_lanes = lanes_of([len(spec.env_ids) for spec in specs], self.double_buffer)
        self._plans = BatchPlans(self._slot_process_list, self._slot_local_list, self.slot_lanes)  # send_batch's split
        restarts = RestartPolicy(restart_workers, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s)
        try:
            # With a core each, workers and parent spin as long as their waits typically take (a
            # blocked reader wakes tens of us late; its writer pays ~10 us: performance guide).
            self._pool = WorkerPool(specs, ctx, self.timeout, restarts, daemon, shared_memory=bool(shared_memory),
                                    mailbox=bool(shared_memory) and mailbox_enabled(spin_s > 0), parent_spin_s=spin_s,
                                    generations=None if generations is None else [int(g) for g in generations])
            # The registry holds the pool, so its pipes are never garbage with the manager: the gc
            # finalizes in any order (a pipe closed first: CLOSE never sent, the worker killed).
            self._finalizer = weakref.finalize(self, self._pool.close)
            self._finalizer.atexit = False  # (at exit the pool closes itself: ``pool._close_at_exit``)
            self._restarts_seen = self._pool.supervisor.restarts
            readies: list[Ready] = [c.answer for c in self._pool.gather(self._pool.processes, "startup")]
            for r in readies:  # each env's generation, as its process answered
                self._state.stamp(r.env_ids, r.generations)
            #: Every slot's spaces, as its env reported them.
            self.observation_spaces = [s for r in readies for s in r.observation_spaces]
            self.action_spaces = [s for r in readies for s in r.action_spaces]
            #: Per slot: whether its env raises gymnasium's ``ResetNeeded`` if stepped before a reset.
            self.order_enforced = [e for r in readies for e in (r.order_enforced or (True,) * len(r.env_ids))]
            if check_spaces is not None:  # the caller's rules (and errors) come before the layout's
                check_spaces(self.observation_spaces, self.action_spaces)
            first = readies[0]
            self.observation_space: spaces.Space | None = first.observation_spaces[0]
            self.action_space: spaces.Space | None = first.action_spaces[0]
            self.metadata: dict[str, Any] = dict(first.metadata or {})
            self.render_mode: str | None = first.render_mode
            self.spec = first.spec
            self.shared_memory = bool(shared_memory)
            if shared_memory:
                shm.check_one_layout(self.observation_spaces, self.action_spaces)
                self.results = self._pool.share_buffers(n_env, self.observation_space, self.action_space)
            else:  # the parent's copy of results that travel pickled; one layout for all, or a list
                layout = shm.array_layout(self.observation_space)
                one_layout = all(shm.array_layout(s) == layout for s in self.observation_spaces)
                self.results = shm.SharedBuffers.private(n_env, self.observation_space if one_layout else None, None)
            #: Observations whose space has no array layout, by slot (else ``results.observation``).
            self.observation_list: list[Any] | None = [None] * n_env if self.results.observation is None else None
            self._state.attach(self.results, self.observation_list, self._pool.mailboxes)
            self.actions = ActionChecker(self.action_space if shm.array_layout(self.action_space) is not None else None)
            self._calls = EnvCalls(self)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------
    # State

    @property
    def pool(self) -> WorkerPool:
        pool = self._pool
        if pool is None or pool.closed:
            raise ManagerClosedError("the SubprocessEnvManager is closed")
        return pool

    @property
    def closed(self) -> bool:
        return self._pool is None or self._pool.closed

    def closed_meanwhile(self, exc: Exception) -> None:
        """Raise ``ManagerClosedError`` for ``exc`` if another thread's ``close()`` came during a
        call (what the call reached for was gone: an ``IndexError``, say); else nothing."""
        if self.closed and not isinstance(exc, EnvManagerError):
            raise ManagerClosedError("the SubprocessEnvManager was closed by another thread during the call") from exc

    @property
    def buffers(self) -> shm.SharedBuffers | None:
        """The shared-memory arrays (``None`` with ``shared_memory=False``)."""
        _ = self.pool  # raises if closed
        return self.results if self.results.shared else None

    @property
    def restart_policy(self) -> RestartPolicy:
        return self.pool.supervisor.policy

    @property
    def supervisor(self) -> Supervisor:
        """The pool's supervisor: restart decisions, the processes given up, deadlines."""
        return self.pool.supervisor

    @property
    def restarts(self) -> int:
        """Restarts so far, of every process (an env rebuilt in place counts as one)."""
        return self.pool.supervisor.restarts

    @property
    def processes(self) -> list[WorkerProcess]:
        """The worker processes (a process hosts ``envs_per_worker`` slots)."""
        return self.pool.processes

    def process_of(self, worker_id: int) -> WorkerProcess:
        """The process hosting slot ``worker_id`` (ML-Agents' name for a slot)."""
        return self.pool.processes[self._slot_process_list[worker_id]]

    workers, worker_of = processes, process_of  # their names before 0.3 (``worker_id`` is a slot, these are processes)

    @property
    def worker_ids(self) -> list[int]:
        return list(range(self.n_env))

    @property
    def idle_worker_ids(self) -> list[int]:
        """Slots with nothing in flight or waiting to be received, and not on a process coming
        back from a restart (its fresh reset is on its way to them). A failed process's slots
        count as idle: stepping them raises its error."""
        idle = self.status <= IDLE
        booting = self._booting_slots()
        if booting:  # (rare: no fancy index on every call)
            idle[booting] = False
        return idle.nonzero()[0].tolist()

    def in_flight(self) -> bool:
        """Whether any process has a request or a step in flight (a restart on its way back, say)."""
        return any(w.busy for w in self.pool.processes)

    def unreceived(self) -> bool:
        """Whether results arrived that nobody received yet (a restart of an idle worker)."""
        return bool(self._state.arrived)

    @property
    def waiting_worker_ids(self) -> list[int]:
        """Slots in flight (a step or a reset), or on a process coming back from a restart."""
        waiting = self.status == IN_FLIGHT
        booting = self._booting_slots()
        if booting:
            waiting[booting] = True
        return waiting.nonzero()[0].tolist()

    @property
    def resets_in_flight(self) -> list[int]:
        """Slots sent a reset whose answer is not taken yet (``receive_resets`` takes it)."""
        return sorted(self._state.owed_resets)

    def _booting_slots(self) -> list[int]:
        """The slots of processes coming back from a restart (each gets its fresh reset)."""
        return [s for w in self.pool.processes if w.boot is not None for s in w.env_ids]

    @property
    def replay_calls(self) -> list[tuple[str, tuple, dict]]:
        """What ``set_replay_calls`` set (a copy)."""
        return list(self.pool.replay_calls)

    def set_replay_calls(self, calls: Sequence[tuple[str, tuple, dict]]) -> None:
        """``(method, args, kwargs)`` to call on a restarted process's envs before its reset."""
        self.pool.replay_calls = list(calls)

    def restart_count(self, worker_id: int) -> int:
        """How often the process hosting ``worker_id`` was restarted or had an env rebuilt (quotas are per process)."""
        return self.pool.supervisor.restart_count(self._slot_process_list[worker_id])

    def generation(self, worker_id: int) -> int:
        """How many times ``worker_id``'s env was replaced (its process restarted, or the env rebuilt
        in place), as the supervisor decided; answers carry theirs."""
        return self.pool.supervisor.generation(worker_id)

    @property
    def answered_generations(self) -> np.ndarray:
        """Each slot's generation as its latest answer carried it: the array ``StepBatch.generations`` is."""
        return self._state.generations

    def report_failure(self, worker_id: int, error: EnvManagerError) -> EnvManagerError | None:
        """A failure of ``worker_id``'s env the caller found in an answer (an env update that raised
        in a call), handled as the pool's own: ``None`` if its process is restarted (its fresh reset
        comes back ``interrupted``), else the error to raise (``RestartLimitError`` past the limits;
        the error itself with restarts off)."""
        decision = self.fault([worker_id], error)
        return decision.error if isinstance(decision, GiveUp) else None

    def rebuild_envs(self, worker_ids: Sequence[int], error: EnvManagerError) -> EnvManagerError | None:
        """The envs of ``worker_ids`` (one process's) raised inside a call their process answered (a
        worker-side rollout): ``None`` if each is rebuilt in place (``generation`` raised now; remade by
        the caller's next call there, ``envs_here().rebuild``) or the process restarted; else the error."""
        decision = self.fault(worker_ids, error, rebuild=True)
        return decision.error if isinstance(decision, GiveUp) else None

    def fault(self, worker_ids: Sequence[int], error: EnvManagerError, rebuild: bool = False,
              seen: dict[int, int] | None = None) -> Decision:
        """``report_failure`` (``rebuild``: ``rebuild_envs``) returning the supervisor's decision
        (``Restart``, ``Rebuild``, ``GiveUp``); ``seen``: the generations (slot -> generation)
        the failure was found at: if one was replaced since, that restart is the answer."""
        slots = self.slots(worker_ids)
        if len({self._slot_process_list[s] for s in slots}) != 1:
            raise InvalidInputError(f"a failure is reported for the envs of one process, got worker ids {slots}")
        return self.pool.fault(self._slot_process_list[slots[0]], error, tuple(slots) if rebuild else (), seen)

    def first_failure(self) -> EnvManagerError | None:
        """The error of the process given up first (the one a caller saw first), or ``None``."""
        first = self.pool.supervisor.first_failure()
        return None if first is None else first[1]

    def failure_of(self, worker_id: int) -> EnvManagerError | None:
        """The error of the process hosting ``worker_id`` if it failed for good, else ``None``."""
        return self.process_of(worker_id).failure

    # ------------------------------------------------------------------------------------------
    # Stepping

    def send_batch(self, slots: Sequence[int] | np.ndarray, actions: Any, per_slot: bool = False, as_given: bool = False) -> Any:
        """Check ``actions`` for ``slots`` and send them, one request per process; returns the batch as
        the envs get it (in the space's dtype; rows in ``slots`` order). ``actions``: a batch whose first
        axis runs over ``slots``, or with ``per_slot=True`` one action per slot (docs/guide/batch-level.md).
        All is checked before the first send: bad input reaches no worker.

        ``as_given=True``: no check against the space; every env gets exactly what it is given (the
        gymnasium drop-in, whose envs judge their actions as gymnasium's do). Per-slot actions then
        travel pickled; a batch must come from ``actions.exact`` (written to shared memory unchanged).
        """
        try:
            begin()  # from the first slot marked in flight to the last request sent a Ctrl-C waits (``interrupts``)
            return self._send_batch(slots, actions, per_slot, as_given)
        finally:
            end()

    def _send_batch(self, slots: Sequence[int] | np.ndarray, actions: Any, per_slot: bool = False,
                    as_given: bool = False) -> Any:
        """``send_batch`` for a caller in a section of its own (the drop-ins' steps: a section nested
        in theirs costs ~0.3 µs a call)."""
        try:
            pool = self.pool
            if type(slots) is not np.ndarray or slots.dtype != np.int64 or slots.ndim != 1:
                slots = slot_array(slots)
            n = slots.size
            if n == 0:
                return
            plan = self._plans.get(slots)
            status = self.status[slots]
            if n > len(IDLE_BYTES) or status.tobytes() != IDLE_BYTES[:n]:  # one compare, not numpy's all()
                refuse_slots(slots, status, self.process_of)
            if pool.supervisor.first_failure() is not None:  # (a failed process's slots may look idle)
                workers = pool.processes
                for index, _, _, _, _ in plan.requests:
                    if workers[index].state is ProcessState.FAILED:  # (given up; its error recorded before)
                        raise workers[index].failure  # type: ignore[misc]
            shared = self.results.action
            pickled = as_given and per_slot  # each as given: no array layout to write them into
            written = shared is not None and not pickled  # into shared memory, one numpy operation per array
            board = written and pool.mailboxes is not None  # then asked for on the step board
            if self._disabled:
                ended = self.results.terminated[slots] | self.results.truncated[slots]
                if ended.any():
                    first = int(np.flatnonzero(ended.reshape(len(slots), -1).any(axis=1))[0])  # (flags of any shape)
                    raise InvalidInputError(
                        f"worker {int(slots[first])} finished its episode; with autoreset_mode='disabled' reset it first")
            checker = self.actions
            if as_given and not per_slot:
                batch = actions  # (from ``actions.exact``)
            elif as_given or checker.space is None:  # each as given, or a space with no array layout: pickled
                batch = list(actions)
                if len(batch) != n:
                    raise InvalidInputError(f"expected {n} actions, got {len(batch)}")
            else:
                batch = checker.stack(list(actions), slots.tolist()) if per_slot else checker.batch(actions, slots)
            entries, joined = plan.requests, None
            if pool.supervisor.restarts and any(pool.processes[e[0]].boot is not None for e in entries):
                # A process on its way back from a restart: its boot answers these slots (``join_boot``).
                joined = [e for e in entries if pool.processes[e[0]].boot is not None]
                entries = [e for e in entries if pool.processes[e[0]].boot is None]
            requests = []
            if written:
                if type(shared) is np.ndarray:
                    shared[slots] = batch
                else:
                    shm.write(shared, slots, batch)
                if not board:
                    requests = [pool.prepare_raw_step(body, process_slots) for _, _, process_slots, _, body in entries]
            else:
                try:  # encode everything before the first send: nothing half-sent
                    space = None if pickled else checker.space
                    requests = [
                        pool.prepare(Cmd.STEP, Step(locals_, [row_of(batch, k, space) for k in rows]), process_slots)
                        for _, _, process_slots, (locals_, rows), _ in entries
                    ]
                except Exception as exc:
                    raise InvalidInputError(f"actions cannot be sent: {exc!r}") from exc
            self._state.sent(slots)
            for index, _, own, _, _ in joined or ():  # never sent: the boot's fresh reset answers them
                pool.join_boot(index, Cmd.STEP, tuple(own))
            now = time.monotonic()
            if not board:
                workers = pool.processes
                for entry, request in zip(entries, requests, strict=True):
                    workers[entry[0]].send(request, now)
            elif joined is None:
                pool.post_steps(slots, plan.processes, now)
            elif entries:
                posted = np.array([s for e in entries for s in e[2]], dtype=np.int64)
                pool.post_steps(posted, np.array([e[0] for e in entries], dtype=np.int64), now)
            return batch
        except Exception as exc:
            self.closed_meanwhile(exc)  # (another thread's close() took what the call reached for)
            raise

    def receive_batch(self, min_count: int = 1, timeout: float | None = None, info_columns: bool = False) -> StepBatch:
        """Wait until ``min_count`` slots finished a step, take whatever else finished, and hand
        them out. Raises the first failed step (results that arrived with it stay for the next
        call). With nothing in flight that could finish, returns what arrived or raises at once.
        ``info_columns=True``: infos that came as columns stay so (``StepBatch.info_columns``).
        ``timeout=None``: only the manager's deadline per answer (a process past it is hung:
        restarted, or ``WorkerTimeoutError(hung=True)``); a number bounds this wait too."""
        try:
            begin()  # a Ctrl-C between taking answers and handing them out waits (``interrupts``)
            return self._receive_batch(min_count, timeout, info_columns)
        finally:
            end()

    def _receive_batch(self, min_count: int = 1, timeout: float | None = None, info_columns: bool = False) -> StepBatch:
        """``receive_batch`` for a caller in a section of its own (as ``_send_batch``)."""
        state = self._state
        self._take(self.pool.wait(0.0))  # what has come: a busy parent's usual case, with no wait
        if len(state.arrived) < min_count and not state.step_errors:
            self.wait_for(lambda: len(state.arrived) >= min_count or bool(state.step_errors), timeout,
                          "a step result", self._busy_slots, enough=lambda: bool(state.arrived),
                          can_finish=self._any_busy)
        if state.step_errors:
            raise state.first_error()
        return state.hand_out(info_columns)

    def receive_unreceived(self) -> StepBatch | None:
        """What arrived with nobody to receive it (a worker restarted while idle: its fresh reset,
        ``interrupted``) and whatever else came, as ``receive_batch(0)``; ``None`` if nothing did."""
        return self.receive_batch(0) if self._state.arrived else None

    def timings(self, worker_id: int) -> tuple[float, float, float]:
        """``(env, queued, round_trip)`` seconds of the slot's latest answer (see ``StepTimings``)."""
        return self._state.timings(worker_id)

    # ------------------------------------------------------------------------------------------
    # Resetting (the parent's half of RESET)

    def allow_step_before_reset(self, worker_ids: Sequence[int]) -> None:
        """Let these slots be stepped before their first reset (call it before any reset): their
        envs decide what that means (gymnasium's AsyncVectorEnv steps an env without
        ``OrderEnforcing``). A slot whose env fails needs a reset as always."""
        self._state.allow_steps(self.slots(worker_ids))

    def send_reset(self, seeds_and_options: Mapping[int, tuple[Any, Any]]) -> None:
        """Send a reset for the given slots: ``worker_id -> (seed, options)``."""
        try:
            pool = self.pool
            slots = np.array(sorted(self.slots(list(seeds_and_options))), dtype=np.int64)
            if slots.size == 0:
                return
            plan = reset_plan(seeds_and_options, slots.tolist(), self.process_of, self.slot_local, self.status)
            try:  # encode everything before the first send
                outgoing = [(index, message, pool.prepare(Cmd.RESET, message, own)) for index, message, own in plan]
            except Exception as exc:
                raise InvalidInputError(f"reset seeds or options cannot be sent: {exc!r}") from exc
            with DEFERRED:  # a Ctrl-C waits for every reset to be sent
                self._state.sent(slots, reset=True, asked=dict(seeds_and_options))
                for index, message, request in outgoing:
                    if pool.processes[index].boot is not None:  # on its way back from a restart: its boot resets them
                        pool.join_boot(index, Cmd.RESET, request.slots, message)
                    else:
                        pool.processes[index].send(request)
        except Exception as exc:
            self.closed_meanwhile(exc)
            raise

    def receive_reset_batch(self, worker_ids: Sequence[int] | None = None, timeout: float | None = None) -> StepBatch:
        """Wait for the resets sent to ``worker_ids`` (default: every reset in flight) and hand
        them out, sorted by slot. Raises the first failed reset (that slot needs a new reset);
        the others, and answers that arrive before a timeout, are kept, so a later call picks up
        where this one stopped."""
        state = self._state
        wanted = set(state.owed_resets) if worker_ids is None else set(self.slots(worker_ids))
        if not wanted <= state.owed_resets.keys():  # (a failed reset is no longer owed, but its error still waits to be raised)
            unsent = wanted - state.owed_resets.keys() - {s for e in state.reset_errors for s in failed_slots(e)}
            if unsent:
                raise InvalidInputError(f"no reset was sent to worker(s) {sorted(unsent)}")
        with DEFERRED:  # a Ctrl-C between taking answers and handing them out waits (``interrupts``)
            self.wait_for(lambda: wanted.isdisjoint(state.owed_resets.keys() - state.arrived_resets) or bool(state.reset_errors),
                          timeout, "a reset result", lambda: sorted(wanted & (state.owed_resets.keys() - state.arrived_resets)))
            if state.reset_errors:
                raise state.first_error(reset=True)
            return state.hand_out(resets=wanted)

    # ------------------------------------------------------------------------------------------
    # Env calls (``EnvCalls`` sends them and keeps their answers)

    def call(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``env.<name>(*args, **kwargs)`` (or read it, if not callable) on every slot."""
        return self.call_on(None, name, args, kwargs)

    def call_on(self, worker_ids: Sequence[int] | None, name: str | Callable[..., Any], args: tuple = (),
                kwargs: dict | None = None) -> list[Any]:
        """``call`` on the given slots only (``None``: all), results in that order; ``name`` may
        be a function, run in the worker as ``name(env, *args, **kwargs)``."""
        return self._calls.receive(self._calls.send_call(worker_ids, name, args, kwargs))

    def get_attr(self, name: str, worker_ids: Sequence[int] | None = None) -> list[Any]:
        """Read ``env.<name>`` (through wrappers) on the given slots (``None``: all)."""
        return self._calls.receive(self._calls.send(Cmd.GET_ATTR, worker_ids, lambda local, own: GetAttr(local, name)))

    def set_attr(self, name: str, values: Any, worker_ids: Sequence[int] | None = None) -> None:
        """Set ``env.<name>``: one value for all given slots, or a list with one per slot."""
        self._calls.set_attr(name, values, worker_ids)

    def send_call(self, name: str | EnvFunction | Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                  worker_ids: Sequence[int] | None = None) -> CallRequest:
        """Send ``call_on`` without waiting (``name`` as there); ``receive_call`` collects the answers."""
        return self._calls.send_call(worker_ids, name, args, kwargs)

    def receive_call(self, request: CallRequest, timeout: float | None = None) -> list[Any]:
        """The answers to ``send_call``, in the order of its worker ids; answers that arrive
        before a timeout are kept for the next try."""
        return self._calls.receive(request, timeout)

    def call_ready(self, request: CallRequest) -> bool:
        """Whether every answer to ``send_call``'s ``request`` arrived (answers are taken by any
        wait: ``wait_for(lambda: manager.call_ready(r), ...)`` waits for one of several calls)."""
        return self._calls.ready(request)

    # ------------------------------------------------------------------------------------------
    # Waiting

    def wait_for(self, done: Callable[[], bool], timeout: float | None, what: str, late: Callable[[], list[int]],
                 enough: Callable[[], bool] = lambda: False, can_finish: Callable[[], bool] | None = None) -> None:
        """Take answers until ``done()``; ``late()`` names the slots whose processes may still make it
        done. Raises at once when nothing in flight can (unless ``enough()``; ``can_finish()``: a
        cheaper test, asked before ``late()``). See ``envmanager.core.waiting``."""
        waiting.wait_for(self.pool, self._take, self._slot_process_list, done, timeout, what, late, enough, can_finish)

    def _busy_slots(self) -> list[int]:
        """Slots whose process has a request in flight (a restart coming back, say)."""
        return [s for w in self.pool.processes if w.busy and w.watched for s in w.env_ids]

    def _any_busy(self) -> bool:
        """``_busy_slots`` without naming them: it stops at the first."""
        return any(w.busy and w.watched for w in self.pool.processes)

    def watch_progress(self, progress: Callable[[list[int]], int] | None) -> None:
        """Let calls that keep working outlive the deadline: ``progress(slots)`` is a count
        that grows while a call on those slots works (0 when sent); such a call is hung only
        once it has not grown for the deadline (``WorkerPool.progress``). ``None``: off."""
        self.pool.progress = progress

    def wait_idle(self, worker_ids: Sequence[int] | None = None, timeout: float | None = None) -> None:
        """Wait until the processes hosting ``worker_ids`` (default: all) have nothing in flight
        (a restart, say); what finishes meanwhile is kept for ``receive_batch``."""
        self._wait_idle(sorted({self._slot_process_list[s] for s in self.slots(worker_ids)}), timeout,
                        "the requests in flight")

    def _wait_idle(self, procs: Sequence[int], timeout: float | None, what: str) -> None:
        pool = self.pool

        def busy() -> list[WorkerProcess]:
            return [pool.processes[i] for i in procs if pool.processes[i].busy]

        self.wait_for(lambda: not busy(), timeout, what, lambda: [s for w in busy() for s in w.env_ids])

    def drain(self, timeout: float | None = None) -> list[EnvManagerError]:
        """Wait out every request in flight and drop every result not handed out, errors too:
        nothing stale surfaces later. Slots with dropped results count as handed out. Returns
        the dropped step and reset errors (for a caller that reports every failure)."""
        self._wait_idle(range(len(self.pool.processes)), timeout, "the in-flight steps")
        self._calls.clear()
        return self._state.drop()

    # ------------------------------------------------------------------------------------------
    # The parent's half of every answer (steps and resets: ``envmanager.core.slots``)

    def _take(self, completions: list[Completion]) -> None:
        """File what the pool delivered: call answers to the calls, the rest to the slots, each
        with the generation its worker stamped on it (``StepBatch.generations``)."""
        state = self._state
        for c in completions:
            if c.request is not None and c.request.cmd in _CALLS:
                self._calls.file(c)
            else:
                state.file(c)
        # The step board's answers: a replaced process answers through the ring first (its fresh
        # reset, ``interrupted``), so these come from the generation the slots already have.
        for slots in self._pool.take_steps():  # type: ignore[union-attr]
            state.file_steps(slots)
        if self._restarting or self._pool.supervisor.restarts != self._restarts_seen:  # type: ignore[union-attr]
            self._restarting = self._void_overwritten()

    def _void_overwritten(self) -> bool:
        """Once a restart's fresh reset is sent it may overwrite its slots' rows: what arrived for
        them and was not handed out is void and joins the boot (``SlotState.void``; voided resets
        with their seeds and options), answered ``interrupted`` or cut short with the process.
        Before that (a later wait, in a later call) it is handed out as it is. Returns whether a
        restart is still on its way back (looked at again on every take until none is)."""
        pool = self._pool
        assert pool is not None
        self._restarts_seen = pool.supervisor.restarts
        booting = False
        for w in pool.processes:
            if w.boot is None or w.boot.startup:
                continue
            booting = True
            if not w.boot.resetting:
                continue
            steps, resets = self._state.void(w.env_ids)
            if steps:
                pool.join_boot(w.index, Cmd.STEP, tuple(steps))
            if resets:
                slots, seeds, options = zip(*resets, strict=True)
                pool.join_boot(w.index, Cmd.RESET, slots, Reset(tuple(self._slot_local_list[s] for s in slots), seeds, options))
        return booting

    def slots(self, worker_ids: Sequence[int] | int | None) -> list[int]:
        """``worker_ids`` checked (``None``: every slot); each must be in ``range(n_env)``."""
        if worker_ids is None:
            return list(range(self.n_env))
        ids = [worker_ids] if isinstance(worker_ids, (int, np.integer)) else list(worker_ids)
        for slot in ids:
            if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self.n_env:
                raise InvalidInputError(f"unknown worker id {slot!r} (n_env={self.n_env})")
        return [int(s) for s in ids]

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close(self, timeout: float = 10.0) -> None:
        """End every worker (politely, then by force) and free shared memory. Idempotent."""
        pool = self._pool
        if pool is not None:
            pool.close(timeout)  # a close cut short (Ctrl-C) leaves ``_pool`` set: the next close() finishes it
            if not pool.owned:  # a copy in a child forked with os.fork: it dropped its references only (workers
                return  # and shared memory are the parent's); ``_pool`` kept, so a later close() comes here again
            self._pool = None
            if self._finalizer is not None:
                self._finalizer.detach()  # (the registry lets the closed pool go)
        packed_factory.forget(getattr(self, "_packed_factory", b""))
        results = getattr(self, "results", None)
        if results is not None:
            results.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
