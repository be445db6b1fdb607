"""``envmanager.AsyncVectorEnv``: a drop-in for ``gymnasium.vector.AsyncVectorEnv``, on the core.

Same constructor, attributes, methods, errors and results as gymnasium 1.4's class (results
equal ``SyncVectorEnv``'s; each env gets its action as gymnasium hands it over, see
``gymnasium_actions``), without five of its defects: an explicit reset always cancels a
pending autoreset; actions of the wrong number are rejected before any worker is sent a
step; a step that timed out stays pending (``step_wait()`` returns *its* results
later, never stale ones); with ``autoreset_mode=DISABLED`` stepping a finished env raises
``AssertionError`` as ``SyncVectorEnv`` does; and with shared memory OneOf observations are
the envs' own (gymnasium's stay as they were when it was built).

Extras: ``envs_per_worker`` (several envs per process; ``"auto"`` by default), and EnvPool-style partial batches:
with ``batch_size=B``, ``send(actions, env_ids)`` steps the listed envs and ``recv()`` returns
the first ``B`` to finish, their ids in ``infos["env_id"]``. Under partial batches each env
autoresets on its own, per ``autoreset_mode``, exactly as it would in a one-env vector env.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import logger as gym_logger
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, ResetNeeded
from gymnasium.spaces import Space
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

from envmanager.adapters.gymnasium_actions import Actions, HandedActions
from envmanager.adapters.gymnasium_errors import raise_as_gymnasium, reraise
from envmanager.adapters.gymnasium_partial import PartialBatches
from envmanager.adapters.gymnasium_utils import (
    AsyncState,
    batched_infos,
    check_observation_mode,
    check_reset_mask,
    check_shareable,
    observation_spaces_of,
    space_check,
)
from envmanager.core.arguments import seeds_for
from envmanager.core.batch import BatchEnvManager
from envmanager.core.deadline import Deadline
from envmanager.core.layout import VECTOR, VECTOR_PARTIAL
from envmanager.core.slots import NEEDS_RESET
from envmanager.errors import EnvManagerError, InvalidInputError, WorkerError, WorkerTimeoutError
from envmanager.wire.interrupts import DEFERRED, begin, end
from envmanager.wire.shm import tree_map

logger = logging.getLogger(__name__)

__all__ = ["AsyncVectorEnv"]

# The two states every step passes, read once: an enum member read off its class is 60 ns on 3.11.
_DEFAULT, _WAITING_STEP = AsyncState.DEFAULT, AsyncState.WAITING_STEP

#: Observations of at least this many bytes an env are copied out as each process answers (``copy=True``).
COPY_AHEAD_BYTES = 16 * 1024


class AsyncVectorEnv(VectorEnv):
    """Vectorized environment running each sub-environment in a worker process.

    Arguments are gymnasium's (``worker`` must stay ``None``: workers are envmanager's), plus:

    Args:
        envs_per_worker: sub-environments hosted by one process, stepped as one message, or
            ``"auto"`` (the default): chosen from one env's step cost measured at start-up in
            a throwaway process (``env_fns[0]()`` built there, its unwrapped env stepped) --
            even CPU-bound envs laid out as the model of this machine predicts fastest
            (``envmanager.core.layout``), uneven or waiting ones get a process each
            (``envmanager.core.auto``); ``1`` is gymnasium's layout. Any layout takes partial
            batches: an env is sent its step as soon as it is back, whatever its process's
            other envs do.
        batch_size: enable partial batches of this size (``send``/``recv``); default: all envs.
        worker_timeout: deadline in seconds for any one worker answer (the fault model's
            bound on waits that gymnasium leaves unbounded).
        double_buffer: two requests in flight per process, one per half of its envs (see
            ``SubprocessEnvManager``); ``"auto"`` (the default): on only with partial batches
            (``send``/``recv``), where a process hosts 2+ envs and the parent has a core of its
            own (more usable cores than worker processes). Lockstep ``step()`` waits for both
            halves anyway: there it measured 0.65-0.99x, so ``"auto"`` leaves it off.
        dummy_env: build ``env_fns[0]()`` in this process to read the spaces, ``metadata`` and
            ``render_mode`` (and with ``observation_mode="different"`` every env, to read its
            space), then close it, as gymnasium does. By default (``False``) they come from the
            first worker, as SB3's ``SubprocVecEnv`` takes them: no env is ever built here, so
            an env that can only be built where a GPU context, a licence or a simulator is
            (a worker) runs, and a heavy env is not built once more.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        shared_memory: bool = True,
        copy: bool = True,
        context: str | None = None,
        daemon: bool = True,
        worker: Callable | None = None,
        observation_mode: str | Space = "same",
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        max_concurrency: int | None = None,
        *,
        envs_per_worker: int | str = "auto",
        batch_size: int | None = None,
        worker_timeout: float = 300.0,
        double_buffer: bool | str = "auto",
        dummy_env: bool = False,
    ) -> None:
        self._manager: BatchEnvManager | None = None
        self.closed = False
        self.env_fns = env_fns
        self.shared_memory = shared_memory
        self.copy = copy
        self.context = context
        self.daemon = daemon
        self.worker = worker
        self.observation_mode = observation_mode
        self.autoreset_mode = autoreset_mode if isinstance(autoreset_mode, AutoresetMode) else AutoresetMode(autoreset_mode)
        self._disabled = self.autoreset_mode == AutoresetMode.DISABLED  # (asked per step)
        if max_concurrency is not None:
            if not isinstance(max_concurrency, (int, np.integer)) or isinstance(max_concurrency, bool):
                raise ValueError(f"`max_concurrency` must be an integer or None, got {type(max_concurrency)}.")
            if max_concurrency < 1:
                raise ValueError(f"`max_concurrency` must be a positive or None, got {max_concurrency}.")
        self.max_concurrency = max_concurrency
        if worker is not None:
            raise ValueError("envmanager.AsyncVectorEnv runs its own workers; a custom `worker` is not supported.")
        self.num_envs = len(env_fns)
        self.batch_size = self.num_envs if batch_size is None else int(batch_size)
        if not 1 <= self.batch_size <= self.num_envs:
            raise ValueError(f"`batch_size` must be in [1, {self.num_envs}], got {batch_size}")

        check_observation_mode(observation_mode)
        parent = _ParentEnv(env_fns, observation_mode, shared_memory) if dummy_env else None

        fns = list(env_fns)
        if double_buffer == "auto" and self.batch_size == self.num_envs:
            double_buffer = False  # lockstep: both halves are waited for each step (see the docstring)
        try:
            self._manager = self._start(fns, envs_per_worker, worker_timeout, double_buffer, parent)
        except WorkerError as exc:  # an env that could not be built: its own exception, as gymnasium's would be
            reraise(exc)
        # What the first env is: the parent's copy's (dummy_env=True), else the first worker's.
        first: Any = parent if parent is not None else self._manager
        self.metadata = dict(first.metadata or {})
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = first.render_mode
        if parent is not None:
            self.single_observation_space, self.observation_space = parent.observation_spaces
        self.single_action_space = first.action_space
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        # Envs that would not refuse a step before reset themselves are stepped, as gymnasium does.
        self._manager.allow_step_before_reset([i for i, enforced in enumerate(self._manager.order_enforced) if not enforced])
        self._actions_in = Actions(self.single_action_space, self._manager.actions)
        # Big observations (an Atari frame: 100 KB an env) are copied out as each process answers, so
        # only the last ones' copies wait after the step: there the copy is most of the parent's work.
        obs = self._manager.results.observation
        self._copy_ahead = (copy and self._manager.shared_memory and type(obs) is np.ndarray and obs.ndim > 1
                            and obs[0].nbytes >= COPY_AHEAD_BYTES)
        self._all = np.arange(self.num_envs)
        self._all_list: list[int] = self._all.tolist()
        self._observations: Any = None  # the batch returned with copy=False and no array layout
        self._state = AsyncState.DEFAULT
        self._reset_waves: list[list[int]] = []  # resets still to receive (max_concurrency)
        self._reset_sent: tuple[list[int | None], Any] = ([], None)
        self._reset_infos: dict[int, dict] = {}
        self._stepping = np.zeros(self.num_envs, dtype=np.bool_)  # max_concurrency: sent this step, not yet answered
        self._left = 0  # how many (``_stepping.sum()``, kept as a Python int: step_wait's loop tests it)
        self._queued: list[int] = []  # max_concurrency: envs whose step waits for room
        self._actions: HandedActions | None = None  # max_concurrency: the actions of the step in progress
        self._step_infos: dict[int, dict] = {}
        self._step_columns: list = []  # infos that came as columns (``InfoBlock``s)
        self._call: Any = None
        self._partial = PartialBatches()  # send / recv's state
        self._copied: np.ndarray | None = None  # copy-ahead rows of the step in progress (kept across step_wait calls)
        self._stale = False  # an abandoned call left steps in flight: drained before the next call
        self._pending_by: int | None = None  # the thread that made the pending call (``_state``)

    def _start(self, fns: list[Callable[[], gym.Env]], envs_per_worker: int | str, worker_timeout: float,
               double_buffer: bool | str, parent: _ParentEnv | None) -> BatchEnvManager:
        """The worker processes, their envs built there; their spaces checked by gymnasium's rules."""
        return BatchEnvManager(
            lambda i: fns[i](),
            self.num_envs,
            envs_per_worker=envs_per_worker,
            context=self.context,
            shared_memory=self.shared_memory,
            autoreset_mode=self.autoreset_mode.value,
            timeout=worker_timeout,
            daemon=self.daemon,
            check_spaces=parent.check if parent is not None else self._take_spaces,
            double_buffer=double_buffer,
            info_columns=True,  # gymnasium batches infos: a few numpy operations per key, not _add_info per env
            caller=VECTOR if self.batch_size == self.num_envs else VECTOR_PARTIAL,
            inherit_factory=True,  # under fork env_fns are not pickled, as gymnasium's are not
        )

    def _take_spaces(self, observation_spaces: list[Space], action_spaces: list[Space]) -> None:
        """The spaces every worker reported, before shared memory is laid out: the first env's
        are this vector env's, judged by gymnasium's rules (its errors, its words)."""
        self.single_observation_space, self.observation_space = observation_spaces_of(
            self.observation_mode, observation_spaces[0], lambda: observation_spaces, self.num_envs)
        check_shareable(self.shared_memory, self.single_observation_space)
        space_check(self.observation_mode, self.single_observation_space, action_spaces[0])(observation_spaces, action_spaces)

    # ------------------------------------------------------------------------------------------
    # gymnasium API

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]  # gymnasium's AsyncVectorEnv: one per env
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]  # read-only, as gymnasium's AsyncVectorEnv's
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]  # one per env, as gymnasium's
        return self.get_attr("np_random")

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None):
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        manager = self._running()
        if seed is not None and not isinstance(seed, int):
            len(seed)  # an int or a list, as gymnasium's: a numpy integer, a float or a generator is its TypeError
        try:
            seeds = seeds_for(seed, self.num_envs)
        except InvalidInputError:
            raise ValueError(
                f"If seeds are passed as a list the length must match num_envs={self.num_envs} but got length={len(seed)}."  # type: ignore[arg-type]
            ) from None
        self._assert_default("reset_async")
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            self._drain_stale(manager)
            ids = self._all
            if options is not None and "reset_mask" in options:
                ids = np.flatnonzero(check_reset_mask(options.pop("reset_mask"), self.num_envs))
            if self._partial.pending() and ids.size < self.num_envs:  # a masked reset: the other envs step on
                self._partial.reset_some(manager, ids.tolist())
            elif self._partial.pending():  # partial batches: envs still stepping are dropped
                for error in manager.drain():  # their errors too: said here, not lost
                    logger.warning("reset() dropped a step no recv() returned, which failed: %s", error)
                self._partial.clear()
            ids = ids.tolist()
            limit = self.max_concurrency or self.num_envs
            # With max_concurrency, envs reset in waves of that many.
            self._reset_waves = [ids[k : k + limit] for k in range(0, len(ids), limit)]
            self._reset_sent = (seeds, options)
            self._reset_infos = {}
            self._send_reset_wave(manager)
            self._state, self._pending_by = AsyncState.WAITING_RESET, threading.get_ident()

    def _send_reset_wave(self, manager: BatchEnvManager) -> None:
        seeds, options = self._reset_sent
        manager.send_reset({i: (seeds[i], options) for i in self._reset_waves[0]})

    def reset_wait(self, timeout: float | None = None):
        manager = self._running()
        if self._state != AsyncState.WAITING_RESET:
            raise NoAsyncCallError("Calling `reset_wait` without any prior call to `reset_async`.",
                                   AsyncState.WAITING_RESET.value)
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            deadline = None if timeout is None else Deadline(timeout)
            try:
                while self._reset_waves:
                    batch = manager.receive_reset_batch(self._reset_waves[0], None if deadline is None else deadline.left())
                    self._reset_infos.update(batch.infos)
                    self._reset_waves.pop(0)  # only once received: a timeout leaves it to wait for again
                    if self._reset_waves:
                        self._send_reset_wave(manager)
            except EnvManagerError as exc:
                raise_as_gymnasium("reset_wait", timeout, exc, lambda: self._abandon(deadline))
            self._state = AsyncState.DEFAULT
            dicts, self._reset_infos = self._reset_infos, {}
            infos = batched_infos(dicts, (), self.num_envs, self._add_info, "reset") if dicts else {}
            return self._observations_of(None), infos

    def _observations_of(self, ids: np.ndarray | None) -> Any:
        """The batched observations of every env (``ids=None``) or of ``ids``, in that order."""
        m = self._manager
        assert m is not None
        if m.observation_list is None:  # arrays: shared memory, or the parent's copy
            obs = m.results.observation
            # One array (a Box, Discrete, ... space): one call, not a tree_map (np.copy's order).
            if ids is None:
                if not self.copy:  # this env's own arrays, overwritten by the next call (gymnasium's ``observations``)
                    return obs
                return obs.copy(order="K") if type(obs) is np.ndarray else tree_map(np.copy, obs)
            return obs[ids] if type(obs) is np.ndarray else tree_map(lambda a: a[ids], obs)
        values = m.observation_list if ids is None else [m.observation_list[i] for i in ids.tolist()]
        space = self.single_observation_space
        if ids is None:  # written into the same arrays each call, as gymnasium's ``observations`` (copy=False returns them)
            out: Any = self._observations
            if out is None:
                out = create_empty_array(space, n=self.num_envs, fn=np.zeros)
            self._observations = concatenate(space, values, out)
            return deepcopy(self._observations) if self.copy else self._observations
        batch: Any = create_empty_array(space, n=len(values), fn=np.zeros)
        return concatenate(space, values, batch)

    def step(self, actions):
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions) -> None:
        manager = self._manager
        if manager is None or self.closed or self._state is not _DEFAULT:  # (one test on the hot path)
            manager = self._running()
            self._assert_default("step_async")
        if self._partial.outstanding:  # (an attribute test on the hot path, no call)
            self._partial.refuse_step("step_async")
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            if self._stale:
                self._drain_stale(manager)
            self._step_infos, self._step_columns = {}, []
            handed = self._hand_over(manager, actions, self._all)
            if self.max_concurrency is None or self.max_concurrency >= self.num_envs:
                self._send(manager, self._all, handed)
                self._left = self.num_envs
            else:  # checked whole, then sent as room frees up
                self._actions, self._queued = handed.kept(), list(range(self.num_envs))
                self._send_queued(manager)
            self._state, self._pending_by = _WAITING_STEP, threading.get_ident()
        finally:
            end()

    def _hand_over(self, manager: BatchEnvManager, actions: Any, ids: np.ndarray) -> HandedActions:
        """What each env in ``ids`` gets, as gymnasium hands it over; everything that would be
        refused is refused here, before anything is sent."""
        if self._disabled:
            self._check_not_ended(manager, ids)
        handed = self._actions_in.hand_over(actions, ids.size)  # iterate()'s errors, as gymnasium's
        # gymnasium's env says so when stepped; we say it before sending. ``status`` is one byte
        # per slot: ``in`` on its bytes (0.2 us), not numpy's ``in`` on the array (2 us).
        status = manager.status if ids is self._all else manager.status[ids]
        if NEEDS_RESET in status.tobytes():
            for slot in ids[status == NEEDS_RESET].tolist():  # a process given up: its error, as reset() raises
                failure = manager.failure_of(slot)
                if failure is not None:
                    raise failure
            raise ResetNeeded("Cannot call env.step() before calling env.reset()")
        return handed

    @staticmethod
    def _send(manager: BatchEnvManager, ids: np.ndarray, handed: HandedActions) -> None:
        if handed.per_env is not None:
            manager._send_batch(ids, handed.per_env, per_slot=True, as_given=True)
        else:
            manager._send_batch(ids, handed.batch, as_given=True)

    @staticmethod
    def _check_not_ended(manager: BatchEnvManager, ids: np.ndarray) -> None:
        """As ``SyncVectorEnv``: stepping a finished env without autoreset is an error."""
        r = manager.results
        ended = r.terminated[ids] | r.truncated[ids]
        if ended.any():
            if ended.ndim > 1:  # flags of shape (1,) (``envmanager.wire.returns``): one per env
                ended = ended.reshape(len(ids), -1).any(axis=1)
            raise AssertionError(
                f"env(s) {ids[ended].tolist()} finished their episode; with autoreset_mode=DISABLED reset "
                "them (options={'reset_mask': ...}) before stepping"
            )

    def _send_queued(self, manager: BatchEnvManager) -> None:
        """Send queued steps, keeping at most ``max_concurrency`` envs stepping at once."""
        room = (self.max_concurrency or self.num_envs) - self._left
        idle = set(manager.idle_worker_ids)
        chosen = [i for i in self._queued if i in idle][: max(0, room)]
        if not chosen:
            return
        rows = np.asarray(chosen)
        assert self._actions is not None
        self._send(manager, rows, self._actions.rows(rows))
        self._stepping[rows] = True
        self._left += len(chosen)
        self._queued = [i for i in self._queued if i not in set(chosen)]

    def step_wait(self, timeout: float | None = None):
        manager = self._manager
        if manager is None or self.closed or self._state is not _WAITING_STEP:  # (one test on the hot path)
            manager = self._running()
            if self._state != AsyncState.WAITING_STEP:
                raise NoAsyncCallError("Calling `step_wait` without any prior call to `step_async`.",
                                       AsyncState.WAITING_STEP.value)
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            deadline = None if timeout is None else Deadline(timeout)
            copied = self._copied
            if copied is None and self._copy_ahead:  # kept on self: a step_wait that times out or is interrupted goes on later
                copied = self._copied = np.empty_like(manager.results.observation)
            # The loop tests a count, not numpy reductions of ``_stepping`` (3 calls each; a call
            # counts: the performance guide's "Function calls per env-step").
            try:
                while self._left or self._queued:
                    wanted = 1 if self._queued or copied is not None else self._left
                    batch = manager._receive_batch(wanted, None if deadline is None else deadline.left(), info_columns=True)
                    slots = batch.slots
                    if copied is not None:  # while the others still step
                        observation: np.ndarray = manager.results.observation  # type: ignore[assignment]
                        for slot in slots.tolist():
                            copied[slot] = observation[slot]
                    if self._actions is None:
                        # Every env was sent at once, so each was idle with nothing unreceived
                        # (send_batch refuses any other): a batch holds envs of this step only, each once.
                        self._left -= slots.size
                    else:  # max_concurrency: an env sent by ``send()`` may come back meanwhile
                        self._left -= int(np.count_nonzero(self._stepping[slots]))
                        self._stepping[slots] = False
                    if batch.infos:
                        self._step_infos.update(batch.infos)
                    if batch.info_columns:
                        self._step_columns += batch.info_columns
                    if self._queued:  # max_concurrency: start queued envs as others finish
                        self._send_queued(manager)
            except EnvManagerError as exc:
                raise_as_gymnasium("step_wait", timeout, exc, lambda: self._abandon(deadline))
            self._state = _DEFAULT
            self._copied = None
            r = manager.results
            dicts, columns = self._step_infos, self._step_columns
            self._step_infos, self._step_columns, self._actions = {}, [], None
            infos = batched_infos(dicts, columns, self.num_envs, self._add_info) if dicts or columns else {}
            observations = copied if copied is not None else self._observations_of(None)
            return observations, r.reward.copy(), r.terminated.copy(), r.truncated.copy(), infos
        finally:
            end()

    def _abandon(self, deadline: Deadline | None = None) -> list[EnvManagerError]:
        """After a failure (``gymnasium_failures``): drop what is in flight so nothing stale surfaces later; return the
        errors of the other envs that failed meanwhile. The state is cleared first (a Ctrl-C in the drain leaves
        nothing half-done); the drain is bounded by the caller's ``deadline``: what it could not wait out is
        drained at the start of the next call (``_stale``)."""
        self._stepping[:] = False
        self._left = 0
        self._queued, self._actions, self._step_infos, self._step_columns = [], None, {}, []
        self._reset_waves, self._reset_infos = [], {}
        self._partial.clear()
        self._copied = None
        self._state = AsyncState.DEFAULT
        if self._manager is None or self._manager.closed:  # closed meanwhile (close() from another thread)
            return []
        self._stale = True
        dropped: list[EnvManagerError] = []
        try:
            dropped = self._manager.drain(None if deadline is None else deadline.left())
            self._stale = False
        except WorkerTimeoutError as exc:
            if exc.hung:
                logger.warning("could not drain in-flight steps after a failure", exc_info=True)
        except EnvManagerError:
            logger.warning("could not drain in-flight steps after a failure", exc_info=True)
        return dropped

    def _drain_stale(self, manager: BatchEnvManager) -> None:
        """Steps an abandoned call left in flight: waited out and dropped (their errors said here)."""
        if self._stale:
            for error in manager.drain():
                logger.warning("a step abandoned after a failure failed too: %s", error)
            self._stale = False

    def _end_call(self) -> list[EnvManagerError]:
        """A call that failed: nothing else was in flight with it (``call_async`` waited the steps out and
        keeps their results for ``recv``), so only the call ends."""
        self._call, self._state = None, AsyncState.DEFAULT
        return []

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        manager = self._running()
        self._assert_default("call_async")
        self._drain_stale(manager)
        if name in ("reset", "step", "close", "_setattr", "_check_spaces"):
            raise ValueError(f"Trying to call function `{name}` with `call`, use `{name}` directly instead.")
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            self._call = manager.send_call(name, args, kwargs)
            self._state, self._pending_by = AsyncState.WAITING_CALL, threading.get_ident()

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        manager = self._running()
        if self._state != AsyncState.WAITING_CALL:
            raise NoAsyncCallError("Calling `call_wait` without any prior call to `call_async`.", AsyncState.WAITING_CALL.value)
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            try:
                results = manager.receive_call(self._call, timeout)
            except EnvManagerError as exc:
                raise_as_gymnasium("call_wait", timeout, exc, self._end_call)
            self._state = AsyncState.DEFAULT
            return tuple(results)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        manager = self._running()
        if not isinstance(values, (list, tuple)):
            values = [values for _ in range(self.num_envs)]
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        self._assert_default("set_attr")
        try:
            manager.set_attr(name, list(values))
        except EnvManagerError as exc:
            reraise(exc)

    def render(self) -> tuple[Any, ...] | None:
        return self.call("render")

    # ------------------------------------------------------------------------------------------
    # Partial batches (EnvPool style)

    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Queue one step for each env in ``env_ids`` (default: all), ``actions`` row by row.

        An env whose previous result has not been received by ``recv()`` yet is rejected,
        before anything is sent.
        """
        self._partial.send(self, actions, env_ids)

    def recv(self, timeout: float | None = None):
        """The first ``batch_size`` envs to finish: ``(obs, rewards, terminations, truncations,
        infos)`` with ``infos["env_id"]`` giving each row's env."""
        return self._partial.recv(self, timeout)

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        manager = self._manager
        if manager is None:
            return
        if manager.closed:  # a close cut short (a second Ctrl-C): finish it, nothing to wait for
            self._state = AsyncState.DEFAULT
        if self._state != AsyncState.DEFAULT:  # gymnasium's warning, a UserWarning
            gym_logger.warn(f"Calling `close` while waiting for a pending call to `{self._state.value}` to complete.")
        if self._state != AsyncState.DEFAULT and self._pending_by != threading.get_ident():
            terminate = True  # another thread's call, under way there: it ends with ManagerClosedError
        if self._state != AsyncState.DEFAULT and not terminate:
            wait = {AsyncState.WAITING_STEP: "step_wait", AsyncState.WAITING_RESET: "reset_wait",
                    AsyncState.WAITING_CALL: "call_wait"}[self._state]
            try:
                getattr(self, wait)(timeout)
            except (multiprocessing.TimeoutError, Exception):
                terminate = True
        # ``_manager`` is dropped only once closed: a close cut short (Ctrl-C) is finished by the next close()
        manager.close(timeout=0.0 if terminate else (10.0 if timeout is None else timeout))
        self._manager = None

    def _running(self) -> BatchEnvManager:
        if self.closed or self._manager is None:
            raise ClosedEnvironmentError(f"Trying to operate on `{type(self).__name__}`, after a call to `close()`.")
        return self._manager

    def _assert_default(self, what: str) -> None:
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                # gymnasium 1.4's wording, down to the missing full stop for reset_async
                f"Calling `{what}` while waiting for a pending call to `{self._state.value}` to complete"
                + ("" if what == "reset_async" else "."),
                str(self._state.value),
            )

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and getattr(self, "_manager", None) is not None:
            try:
                self.close(terminate=True)
            except Exception:
                pass


class _ParentEnv:
    """``dummy_env=True``: ``env_fns[0]()`` built in this process and closed, as gymnasium's
    constructor does, for its spaces, ``metadata`` and ``render_mode``; with ``"different"``
    every env built here for its observation space. Checks the workers' spaces against them."""

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], observation_mode: Any, shared_memory: bool) -> None:
        env = env_fns[0]()
        self.metadata = dict(env.metadata)
        self.render_mode = env.render_mode
        self.action_space = env.action_space
        self.observation_mode = observation_mode
        self.observation_spaces = observation_spaces_of(
            observation_mode, env.observation_space, lambda: [fn().observation_space for fn in env_fns], len(env_fns))
        env.close()
        check_shareable(shared_memory, self.observation_spaces[0])

    def check(self, observation_spaces: list[Space], action_spaces: list[Space]) -> None:
        space_check(self.observation_mode, self.observation_spaces[0], self.action_space)(observation_spaces, action_spaces)
