"""``envmanager.AsyncVectorEnv``: a drop-in for ``gymnasium.vector.AsyncVectorEnv``, on the core.

Same constructor, attributes, methods, errors and results as gymnasium 1.4's class (results
equal ``SyncVectorEnv``'s), without four of its defects: an explicit reset always cancels a
pending autoreset; bad actions are rejected before any worker is sent a step; a step that
timed out stays pending (``step_wait()`` returns *its* results later, never stale ones); and
with ``autoreset_mode=DISABLED`` stepping a finished env raises ``AssertionError`` as
``SyncVectorEnv`` does.

Extras: ``envs_per_worker`` (several envs per process), and EnvPool-style partial batches:
with ``batch_size=B``, ``send(actions, env_ids)`` steps the listed envs and ``recv()`` returns
the first ``B`` to finish, their ids in ``infos["env_id"]``. Under partial batches each env
autoresets on its own, per ``autoreset_mode``, exactly as it would in a one-env vector env.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from copy import deepcopy
from enum import Enum
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.spaces import Space
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_differing_spaces, batch_space, concatenate, create_empty_array, iterate

from envmanager.errors import EnvManagerError, WorkerError, WorkerTimeoutError
from envmanager.manager import SubprocessEnvManager
from envmanager.protocol import EnvironmentCommand as Cmd, StepInfo
from envmanager.vector_utils import check_reset_mask, gymnasium_can_share, leading_dims, tree_map

logger = logging.getLogger(__name__)

__all__ = ["AsyncVectorEnv"]


class AsyncState(Enum):
    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    WAITING_CALL = "call"


class AsyncVectorEnv(VectorEnv):
    """Vectorized environment running each sub-environment in a worker process.

    Arguments are gymnasium's (``worker`` must stay ``None``: workers are envmanager's), plus:

    Args:
        envs_per_worker: sub-environments hosted by one process, stepped as one message.
        batch_size: enable partial batches of this size (``send``/``recv``); default: all envs.
        worker_timeout: deadline in seconds for any one worker answer (the fault model's
            bound on waits that gymnasium leaves unbounded).
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
        envs_per_worker: int = 1,
        batch_size: int | None = None,
        worker_timeout: float = 300.0,
    ) -> None:
        self._manager: SubprocessEnvManager | None = None
        self.closed = False
        self.env_fns = env_fns
        self.shared_memory = shared_memory
        self.copy = copy
        self.context = context
        self.daemon = daemon
        self.worker = worker
        self.observation_mode = observation_mode
        self.autoreset_mode = autoreset_mode if isinstance(autoreset_mode, AutoresetMode) else AutoresetMode(autoreset_mode)
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

        dummy_env = env_fns[0]()
        self.metadata = dict(dummy_env.metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = dummy_env.render_mode
        self.single_action_space = dummy_env.action_space
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
            if not all(isinstance(s, Space) for s in observation_mode):
                raise TypeError(f"Expected both elements of observation_mode to be Spaces, got {observation_mode}")
            self.observation_space, self.single_observation_space = observation_mode
        elif observation_mode == "same":
            self.single_observation_space = dummy_env.observation_space
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        elif observation_mode == "different":
            env_spaces = [env().observation_space for env in env_fns]
            self.single_observation_space = env_spaces[0]
            self.observation_space = batch_differing_spaces(env_spaces)
        else:
            raise ValueError(
                "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and "
                f"batch observation space, actual got {observation_mode}"
            )
        dummy_env.close()
        del dummy_env
        if shared_memory and not gymnasium_can_share(self.single_observation_space):
            raise ValueError(
                "Using `AsyncVector(..., shared_memory=True)` caused an error, you can disable this "
                "feature with `shared_memory=False` however this is slower."
            )

        fns = list(env_fns)
        self._manager = SubprocessEnvManager(
            lambda i: fns[i](),
            self.num_envs,
            envs_per_worker=envs_per_worker,
            context=context,
            shared_memory=shared_memory,
            autoreset_mode=self.autoreset_mode.value,
            timeout=worker_timeout,
            daemon=daemon,
        )
        try:
            self._check_spaces()
        except BaseException:
            self._manager.close()
            raise
        buffers = self._manager.buffers
        # Observations in shared memory are read as one batch, not env by env.
        self._shared_obs = None if buffers is None else buffers.observation
        self._manager.copy_observations = self._shared_obs is None
        self._env_obs: list[Any] = [None] * self.num_envs
        self._observations = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
        self._finished = np.zeros(self.num_envs, dtype=np.bool_)  # for DISABLED: needs a reset
        self._state = AsyncState.DEFAULT
        self._reset_waves: list[dict[int, tuple]] = []  # resets still to send (max_concurrency)
        self._reset_results: list[StepInfo] = []
        self._results: dict[int, StepInfo] = {}  # step results collected so far
        self._queued: dict[int, Any] = {}  # actions waiting for a free slot (max_concurrency)
        self._call: Any = None
        self._outstanding: set[int] = set()  # partial batches: sent, not yet received
        self._action_spaces = {self.num_envs: self.action_space}  # batch spaces by batch size
        self._received: list[StepInfo] = []

    def _check_spaces(self) -> None:
        assert self._manager is not None
        same_obs = self.observation_mode == "same"
        for desc in self._manager.descriptions:
            if same_obs and any(s != self.single_observation_space for s in desc["observation_spaces"]):
                raise RuntimeError(
                    "Some environments have an observation space different from "
                    f"`{self.single_observation_space}`. In order to batch observations, the "
                    "observation spaces from all environments must be equal."
                )
            if any(s != self.single_action_space for s in desc["action_spaces"]):
                raise RuntimeError(
                    f"Some environments have an action space different from `{self.single_action_space}`. "
                    "In order to batch actions, the action spaces from all environments must be equal."
                )

    # ------------------------------------------------------------------------------------------
    # gymnasium API

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        return self.get_attr("np_random")

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None):
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        manager = self._running()
        if seed is None:
            seed = [None] * self.num_envs
        elif isinstance(seed, (int, np.integer)):
            seed = [int(seed) + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise ValueError(
                f"If seeds are passed as a list the length must match num_envs={self.num_envs} but got length={len(seed)}."
            )
        self._assert_default("reset_async")
        mask = np.ones(self.num_envs, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            mask = check_reset_mask(options.pop("reset_mask"), self.num_envs)
        if manager.waiting_worker_ids:  # partial batches: envs still stepping are dropped
            manager.drop_in_flight()
            self._outstanding.clear()
            self._received.clear()
        ids = [i for i in range(self.num_envs) if mask[i]]
        limit = self.max_concurrency or self.num_envs
        # With max_concurrency, envs reset in waves of that many.
        self._reset_waves = [{i: (seed[i], options) for i in ids[k : k + limit]} for k in range(0, len(ids), limit)]
        self._reset_results = []
        manager.send_reset(self._reset_waves[0])
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None):
        manager = self._running()
        if self._state != AsyncState.WAITING_RESET:
            raise NoAsyncCallError("Calling `reset_wait` without any prior call to `reset_async`.", AsyncState.WAITING_RESET.value)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._waiting("reset_wait", timeout):
            while self._reset_waves:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._reset_results += manager.receive_resets(list(self._reset_waves[0]), left)
                self._reset_waves.pop(0)  # only once received: a timeout leaves it to wait for again
                if self._reset_waves:
                    manager.send_reset(self._reset_waves[0])
        results, self._reset_results = self._reset_results, []
        self._state = AsyncState.DEFAULT
        infos: dict[str, Any] = {}
        for info in results:
            i = info.worker_id
            self._env_obs[i] = info.current_result.observation
            self._finished[i] = False
            infos = self._add_info(infos, info.current_result.info, i)
        return self._batch_observations(), infos

    def _batch_observations(self, ids: list[int] | None = None, results: list | None = None) -> Any:
        """The batched observations of all envs (``ids=None``) or of ``ids``, in that order."""
        if self._shared_obs is not None:  # straight from shared memory
            if ids is None:
                return tree_map(np.copy, self._shared_obs) if self.copy else self._shared_obs
            index = np.asarray(ids)
            return tree_map(lambda a: a[index], self._shared_obs)
        if ids is None:
            self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)
            return deepcopy(self._observations) if self.copy else self._observations
        out = create_empty_array(self.single_observation_space, n=len(ids), fn=np.zeros)
        return concatenate(self.single_observation_space, [r.observation for r in results], out)

    def step(self, actions):
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions) -> None:
        manager = self._running()
        self._assert_default("step_async")
        per_env = self._split_actions(actions, self.num_envs)
        if self.autoreset_mode == AutoresetMode.DISABLED and self._finished.any():
            raise AssertionError(
                f"env(s) {np.flatnonzero(self._finished).tolist()} finished their episode; with "
                "autoreset_mode=DISABLED reset them (options={'reset_mask': ...}) before stepping"
            )
        self._queued = dict(enumerate(per_env))
        self._results = {}
        self._send_queued(manager)
        self._state = AsyncState.WAITING_STEP

    def _send_queued(self, manager: SubprocessEnvManager) -> None:
        """Send queued steps, keeping at most ``max_concurrency`` envs stepping at once."""
        limit = self.max_concurrency or self.num_envs
        room = limit - (self.num_envs - len(self._queued) - len(self._results))
        if room <= 0:
            return
        idle = set(manager.idle_worker_ids)
        batch = {}
        for i, action in self._queued.items():
            if len(batch) == room:
                break
            if i in idle:  # its process is free (a neighbour env may still be stepping)
                batch[i] = action
        manager.send_step(batch)
        for i in batch:
            del self._queued[i]

    def step_wait(self, timeout: float | None = None):
        manager = self._running()
        if self._state != AsyncState.WAITING_STEP:
            raise NoAsyncCallError("Calling `step_wait` without any prior call to `step_async`.", AsyncState.WAITING_STEP.value)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._waiting("step_wait", timeout):
            while len(self._results) < self.num_envs:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                for info in manager.receive_steps(left):
                    self._results[info.worker_id] = info
                if self._queued:  # max_concurrency: start queued envs as others finish
                    self._send_queued(manager)
        self._state = AsyncState.DEFAULT
        results = [self._results[i].current_result for i in range(self.num_envs)]
        self._results = {}
        return self._batch(list(range(self.num_envs)), results)

    @contextmanager
    def _waiting(self, what: str, timeout: float | None) -> Iterator[None]:
        """Translate failures while waiting into gymnasium's terms.

        Past the caller's ``timeout``: ``multiprocessing.TimeoutError``, and the call stays
        pending (waiting again picks up its results). Any other failure drops what is in
        flight, so nothing stale surfaces later, and re-raises the env's own exception.
        """
        try:
            yield
        except WorkerTimeoutError as exc:
            if exc.hung or timeout is None:  # a worker missed its own deadline: nothing more comes
                self._abandon()
                raise
            raise multiprocessing.TimeoutError(f"The call to `{what}` has timed out after {timeout} second(s).") from exc
        except EnvManagerError as exc:
            self._abandon()
            _reraise(exc)

    def _abandon(self) -> None:
        """After a failure: drop what is in flight so nothing stale surfaces later."""
        assert self._manager is not None
        try:
            self._manager.drop_in_flight()
        except EnvManagerError:
            logger.warning("could not drain in-flight steps after a failure", exc_info=True)
        self._results, self._queued = {}, {}
        self._reset_waves, self._reset_results = [], []
        self._outstanding.clear()
        self._received.clear()
        self._state = AsyncState.DEFAULT

    def _batch(self, ids: list[int], results: list) -> tuple:
        """Stack per-env results into gymnasium's batched ``(obs, rew, term, trunc, infos)``."""
        infos: dict[str, Any] = {}
        rewards = np.zeros(len(ids), dtype=np.float64)
        terminations = np.zeros(len(ids), dtype=np.bool_)
        truncations = np.zeros(len(ids), dtype=np.bool_)
        for k, (i, r) in enumerate(zip(ids, results)):
            self._env_obs[i] = r.observation
            rewards[k], terminations[k], truncations[k] = r.reward, r.terminated, r.truncated
            self._finished[i] = r.terminated or r.truncated
            infos = self._add_info(infos, r.info, k)
        full = len(ids) == self.num_envs and ids == list(range(self.num_envs))
        obs = self._batch_observations(None if full else ids, results)
        return obs, rewards, terminations, truncations, infos

    def _split_actions(self, actions: Any, n: int) -> list[Any]:
        space = self._action_spaces.get(n)
        if space is None:
            space = self._action_spaces[n] = batch_space(self.single_action_space, n)
        try:
            per_env = list(iterate(space, actions)) if n else []
        except Exception as exc:
            raise ValueError(f"actions do not fit the action space: {exc}") from exc
        # iterate() does not check the batch size of every kind of space: count them.
        if len(per_env) != n or leading_dims(actions) - {n}:
            raise ValueError(f"expected actions for {n} environment(s), got {sorted(leading_dims(actions)) or len(per_env)}")
        return per_env

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        manager = self._running()
        self._assert_default("call_async")
        if name in ("reset", "step", "close", "_setattr", "_check_spaces"):
            raise ValueError(f"Trying to call function `{name}` with `call`, use `{name}` directly instead.")
        self._call = manager.send_request(Cmd.CALL, None, lambda local, own: (local, name, args, kwargs))
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        manager = self._running()
        if self._state != AsyncState.WAITING_CALL:
            raise NoAsyncCallError("Calling `call_wait` without any prior call to `call_async`.", AsyncState.WAITING_CALL.value)
        with self._waiting("call_wait", timeout):
            results = manager.receive_request(self._call, timeout)
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
            _reraise(exc)

    def render(self) -> tuple[Any, ...] | None:
        return self.call("render")

    # ------------------------------------------------------------------------------------------
    # Partial batches (EnvPool style)

    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Queue one step for each env in ``env_ids`` (default: all), ``actions`` row by row.

        An env whose previous result has not been received by ``recv()`` yet is rejected,
        before anything is sent.
        """
        manager = self._running()
        self._assert_default("send")
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in np.asarray(env_ids).reshape(-1)]
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_envs for i in ids):
            raise ValueError(f"env_ids must be distinct ids in [0, {self.num_envs}), got {ids}")
        busy = self._outstanding.intersection(ids)
        if busy:
            raise ValueError(f"env(s) {sorted(busy)} were sent a step whose result was not received yet")
        per_env = self._split_actions(actions, len(ids))
        if self.autoreset_mode == AutoresetMode.DISABLED and self._finished[ids].any():
            raise AssertionError(f"env(s) {[i for i in ids if self._finished[i]]} must be reset before stepping")
        manager.send_step(dict(zip(ids, per_env)))
        self._outstanding.update(ids)

    def recv(self, timeout: float | None = None):
        """The first ``batch_size`` envs to finish: ``(obs, rewards, terminations, truncations,
        infos)`` with ``infos["env_id"]`` giving each row's env."""
        manager = self._running()
        if len(self._outstanding) < self.batch_size:
            raise NoAsyncCallError(
                f"`recv` needs {self.batch_size} envs in flight, only {len(self._outstanding)} were sent", "recv"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._waiting("recv", timeout):
            while len(self._received) < self.batch_size:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._received += manager.receive_steps(left)
        batch, self._received = self._received[: self.batch_size], self._received[self.batch_size :]
        ids = [info.worker_id for info in batch]
        self._outstanding.difference_update(ids)
        obs, rewards, terms, truncs, infos = self._batch(ids, [info.current_result for info in batch])
        infos["env_id"] = np.asarray(ids, dtype=np.int64)
        return obs, rewards, terms, truncs, infos

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        manager, self._manager = self._manager, None
        if manager is None:
            return
        if self._state != AsyncState.DEFAULT and not terminate:
            logger.warning("Calling `close` while waiting for a pending call to `%s` to complete.", self._state.value)
            wait = {AsyncState.WAITING_STEP: "step_wait", AsyncState.WAITING_RESET: "reset_wait",
                    AsyncState.WAITING_CALL: "call_wait"}[self._state]
            self._manager = manager
            try:
                getattr(self, wait)(timeout)
            except (multiprocessing.TimeoutError, Exception):
                terminate = True
            self._manager = None
        manager.close(timeout=0.0 if terminate else (10.0 if timeout is None else timeout))

    def _running(self) -> SubprocessEnvManager:
        if self.closed or self._manager is None:
            raise ClosedEnvironmentError(f"Trying to operate on `{type(self).__name__}`, after a call to `close()`.")
        return self._manager

    def _assert_default(self, what: str) -> None:
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{what}` while waiting for a pending call to `{self._state.value}` to complete.",
                str(self._state.value),
            )

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and getattr(self, "_manager", None) is not None:
            try:
                self.close(terminate=True)
            except Exception:
                pass


def _reraise(exc: EnvManagerError) -> None:
    """Raise an env's own exception (as gymnasium does), chained to the worker's account of it."""
    if isinstance(exc, WorkerError) and exc.cause is not None:
        raise exc.cause from exc
    raise exc
