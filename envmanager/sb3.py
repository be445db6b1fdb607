"""A Stable-Baselines3 ``VecEnv`` on :class:`~envmanager.SubprocessEnvManager`.

Switch by changing one import::

    # from stable_baselines3.common.vec_env import SubprocVecEnv
    from envmanager.sb3 import SubprocVecEnv

    vec_env = SubprocVecEnv([make_env(i) for i in range(8)])      # same arguments
    vec_env = make_vec_env("CartPole-v1", 8, vec_env_cls=SubprocVecEnv)

Semantics are SB3's ``SubprocVecEnv``: a finished episode is reset at once, its last
observation is in ``info["terminal_observation"]``, ``info["TimeLimit.truncated"]`` is
``truncated and not terminated`` and ``reset_infos[i]`` holds the new episode's reset info;
``seed()``/``set_options()`` apply at the next ``reset()``; env ``i`` gets ``actions[i]`` as
given (checked first, not converted). What changes is underneath: observations and actions
travel in shared memory (actions of the space's own dtype), every wait has a deadline, an exception
in an env arrives with the worker's traceback (``envmanager.WorkerError``), a dead worker is
reported (``WorkerDiedError``) instead of a bare ``EOFError``, and ``close()`` reaps every
process. Rewards come back as ``float32`` (as ``DummyVecEnv``), observations with the dtype
of the observation space.

Extras beyond SB3's signature (keyword-only): ``envs_per_worker`` (``"auto"`` by default), ``shared_memory``,
``timeout``, ``restart_workers`` and the other ``SubprocessEnvManager`` options.
"""

from __future__ import annotations

import multiprocessing as mp
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import cloudpickle
import gymnasium
import numpy as np
from gymnasium import spaces

from envmanager.adapters import env_functions
from envmanager.core.batch import BatchEnvManager
from envmanager.core.layout import SB3
from envmanager.core.results import StepBatch
from envmanager.errors import (
    EnvManagerError,
    InvalidInputError,
    ManagerClosedError,
    RemoteAttributeError,
    remote_attribute_errors,
)
from envmanager.extras import requires_extra
from envmanager.wire.interrupts import DEFERRED, begin, end
from envmanager.wire.shm import tree_map
from envmanager.worker.envs import RESET_INFO

with requires_extra("sb3", __name__):
    from stable_baselines3.common.vec_env import subproc_vec_env
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnv,
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
    )

__all__ = ["SubprocVecEnv", "RemoteAttributeError"]


class SubprocVecEnv(VecEnv):
    """Stable-Baselines3 ``SubprocVecEnv``, running on envmanager's worker processes.

    :param env_fns: functions that build the environments, one per environment.
    :param start_method: ``"fork"``, ``"forkserver"`` or ``"spawn"``; by default
        ``"forkserver"`` where available, else ``"spawn"`` (as SB3).
    :param envs_per_worker: environments hosted by one process, stepped as one message, or
        ``"auto"`` (the default): chosen from one env's step cost measured at start-up in a
        throwaway process (``env_fns[0]()`` built there, its unwrapped env stepped, so a
        ``Monitor`` records nothing; ``envmanager.core.auto``); ``1`` is SB3's layout.
    :param shared_memory: observations and actions in shared memory (when the spaces allow).
    :param timeout: deadline in seconds for any worker answer.
    :param double_buffer: two requests in flight per process, one per half of its envs
        (``SubprocessEnvManager``). Off by default: SB3 steps in lockstep, waiting for both
        halves each step, where double buffering measured 0.65-0.99x with the parent on a
        core of its own.
    :param manager_kwargs: further ``SubprocessEnvManager`` options (``restart_workers``,
        ``max_lifetime_restarts``, ...). An episode cut short by a restart comes back as
        ``done`` with ``info["TimeLimit.truncated"] = True`` and ``info["interrupted"] = True``.
    """

    def __init__(
        self,
        env_fns: list[Callable[[], gymnasium.Env]],
        start_method: str | None = None,
        *,
        envs_per_worker: int | str = "auto",
        shared_memory: bool = True,
        timeout: float = 60.0,
        double_buffer: bool | str = False,
        **manager_kwargs: Any,
    ) -> None:
        self.waiting = False
        self._got: tuple[np.ndarray, dict[int, dict], set[int]] | None = None  # a step_wait's progress: pending, infos, cut
        self._reset_failed = False  # reset() raised: step() refused until the next reset() succeeds
        self.closed = False
        self._manager: BatchEnvManager | None = None
        for fixed in ("autoreset_mode", "context", "policy", "n_env", "env_factory"):
            if fixed in manager_kwargs:
                raise TypeError(f"SubprocVecEnv() does not take {fixed!r}")
        if start_method is None:
            # As SB3: fork is not thread-safe (SB3 issue #217)
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        mp.get_context(start_method)  # ValueError for unknown methods, before anything starts
        env_fns = list(env_fns)
        self._manager = BatchEnvManager(
            _worker_factory(env_fns),
            len(env_fns),
            envs_per_worker=envs_per_worker,
            context=start_method,
            shared_memory=shared_memory,
            autoreset_mode="same_step",
            timeout=timeout,
            double_buffer=double_buffer,
            caller=SB3,
            options_if_given=True,  # as SB3's workers: an env written reset(self, seed=None) runs
            reset_info_apart=True,  # as SB3's workers: the step's info and the reset's, whatever keys they hold
            **manager_kwargs,
        )
        try:
            self.num_envs = len(env_fns)
            self._all = np.arange(self.num_envs)
            self._cut: dict[int, dict] = {}  # episodes cut by a restart while idle, by env
            self._last_obs: Any = None
            observation_space, action_space = self._manager.observation_space, self._manager.action_space
            if observation_space is None or action_space is None:
                raise InvalidInputError("SubprocVecEnv needs envs with an observation_space and an action_space")
            super().__init__(len(env_fns), observation_space, action_space)
            self._per_env_types = _one_per_env_types(action_space)
        except BaseException:
            self.close()
            raise

    @property
    def manager(self) -> BatchEnvManager:
        """The underlying manager (the core's batch level)."""
        if self._manager is None:
            raise ManagerClosedError("the SubprocVecEnv is closed")
        return self._manager

    # ------------------------------------------------------------------------------------------
    # Stepping and resetting

    def reset(self) -> VecEnvObs:
        manager = self.manager
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            manager.drain()  # a step still in flight is cancelled, as VecEnv.reset says
            self.waiting, self._got = False, None
            self._cut = {}
            self._reset_failed = True  # until every env answered its reset
            manager.send_reset(
                # As SB3's worker: options are passed only when there are some.
                {i: (self._seeds[i], self._options[i] or None) for i in range(self.num_envs)}
            )
            batch = manager.receive_reset_batch()
            self._reset_failed = False
            self.reset_infos = [batch.infos.get(i, {}) for i in range(self.num_envs)]
            # Seeds and options are only used once
            self._reset_seeds()
            self._reset_options()
            self._last_obs = self._observations(manager)
            return self._last_obs

    # step_async and step_wait run once per step: per-env Python only for envs that ended or
    # returned an info, numpy on whole arrays otherwise (a call counts: performance guide).

    def step_async(self, actions: np.ndarray) -> None:
        if len(actions) != self.num_envs and not self._composite_batch(actions):  # (a batch's rows: the checker counts them)
            raise InvalidInputError(f"expected {self.num_envs} actions (one per env), got {len(actions)}")
        manager = self._running()
        if self.waiting:  # a step_wait() interrupted (Ctrl-C), or step_async() twice: its results would be dropped unseen
            raise InvalidInputError("step_async() while a step is pending: call step_wait() for its results "
                                    "(or reset() to drop it)")
        if self._reset_failed:  # (the core would name a slot and its batch level; SB3's user can only reset)
            raise InvalidInputError("the last reset() failed (its error said why); call reset() again before stepping")
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            self._take_cut(manager.receive_unreceived())  # results nobody asked for: a restart of an idle worker
            batch, per_slot, as_given = self._as_handed(manager, actions)
            try:
                manager._send_batch(self._all, batch, per_slot=per_slot, as_given=as_given)
            except EnvManagerError:
                if not manager.in_flight():
                    raise
            else:
                self.waiting = True
                return
            # Refused, as send_batch refuses a process with a request in flight before it sends
            # anything: only then is in_flight() (a walk over every process) worth asking.
            manager.wait_idle()  # a worker restarted while idle is still booting
            self._take_cut(manager.receive_unreceived())
            manager._send_batch(self._all, batch, per_slot=per_slot, as_given=as_given)
            self.waiting = True
        finally:
            end()

    def _as_handed(self, manager: BatchEnvManager, actions: Any) -> tuple[Any, bool, bool]:
        """``send_batch``'s ``(actions, per_slot, as_given)`` for a batch of actions: checked
        (bad input reaches no env), then env ``i`` gets ``actions[i]`` as SB3's workers get it —
        through shared memory when the batch is of the space's own dtype and shape (what SB3's
        algorithms give), else each row as it is (a float64 row for a float32 ``Box``, a Python
        ``int`` from a list), not converted."""
        checker = manager.actions
        if self._per_env_types and not self._composite_batch(actions):
            return list(actions), True, False  # one action per env (Dict / Tuple spaces): stacked and checked
        if checker.space is None:  # no array layout (a Text inside, say): a batch is taken apart here, then checked
            return (_batch_rows(self.action_space, actions, self.num_envs) if self._per_env_types else list(actions)), True, False
        checked = checker.batch(actions, self._all)
        if self._per_env_types:  # a batch (a dict / tuple of arrays): its rows, not list(actions) (its keys / items)
            return checked, False, True  # (as given: already checked)
        if type(actions) is np.ndarray and type(checked) is np.ndarray and checked.dtype == actions.dtype \
                and checked.shape == actions.shape:
            return checked, False, True  # (as given: already checked)
        return list(actions), True, True

    def _composite_batch(self, actions: Any) -> bool:
        """Whether ``actions`` for a Dict / Tuple action space are a batch (a dict / tuple of
        arrays, one row per env) rather than one action per env. A sequence of as many items as
        envs is one action per env, as SB3 reads any: a tuple of one Tuple action per env too."""
        kinds = self._per_env_types
        if not kinds or isinstance(actions, kinds):
            return False
        return isinstance(actions, dict) or len(actions) != self.num_envs

    def _take_cut(self, early: StepBatch | None) -> None:
        """What a restart of an idle worker delivered, if anything: its episodes ended where we
        last saw them (``step_wait`` reports them)."""
        if early is not None:
            for i in early.interrupted:
                self._cut[i] = self._interrupted_info(i, early.infos.get(i, {}))

    def step_wait(self) -> VecEnvStepReturn:
        if not self.waiting:
            raise InvalidInputError("step_wait() without a step_async() before it")
        manager = self._running()
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            n = self.num_envs
            try:
                if self._got is None:
                    batch = manager._receive_batch(n)  # every env, as a rule in one batch
                    infos, interrupted = batch.infos, batch.interrupted
                    if len(batch.slots) != n:
                        self._got = (np.ones(n, dtype=np.bool_), {}, set())
                        self._keep(batch)
                if self._got is not None:  # (a fault's path, or a step_wait interrupted before)
                    infos, interrupted = self._receive_rest(manager)
            except EnvManagerError:
                # After a failure the envs must be reset (reset() drops the other results). A Ctrl-C
                # (KeyboardInterrupt) leaves the step pending: step_wait() goes on with it.
                self.waiting, self._got = False, None
                raise
            self.waiting, self._got = False, None
            r = manager.results
            obs = self._observations(manager)
            rewards = r.reward.astype(np.float32)
            dones = r.terminated | r.truncated
            time_limit = r.truncated & ~r.terminated
            if time_limit.ndim > 1:  # flags of shape (1,) (returns.ScalarLayout): one truth per env, as SB3's
                time_limit = time_limit.reshape(n, -1).any(axis=1)
            time_limit = time_limit.tolist()
            step_infos = [{"TimeLimit.truncated": t} for t in time_limit]
            reset_infos = None  # a new list once an env was reset (as SB3's: one kept before is left as it was)
            for i, info in infos.items():
                # An env that ended was reset in its step: the worker's info holds the step's info, its
                # last observation and the reset's info, each apart (it judged ``terminated or truncated``
                # as SB3's does: a list [False] is true there). An env's own info never holds RESET_INFO.
                if RESET_INFO in info:
                    if reset_infos is None:
                        reset_infos = self.reset_infos = list(self.reset_infos)
                    reset_infos[i] = info[RESET_INFO]
                    step_infos[i] = {**info["final_info"], "TimeLimit.truncated": time_limit[i],
                                     "terminal_observation": info["final_obs"]}
                else:  # (a copy: an env may return one dict object for several envs, or keep it)
                    step_infos[i] = {**info, "TimeLimit.truncated": time_limit[i]}
            if interrupted or self._cut:
                self._report_cut(infos, interrupted, rewards, dones, step_infos)
            self._last_obs = obs
            return obs, rewards, dones, step_infos
        finally:
            end()

    def _keep(self, batch: StepBatch) -> None:
        """What a batch brought, kept on ``_got`` until every env came (a Ctrl-C loses nothing)."""
        assert self._got is not None
        pending, infos, interrupted = self._got
        pending[batch.slots] = False
        infos.update(batch.infos)
        interrupted |= batch.interrupted

    def _receive_rest(self, manager: BatchEnvManager) -> tuple[dict[int, dict], frozenset[int]]:
        """The envs still missing (``_got``), batch by batch (a fault's path)."""
        assert self._got is not None
        pending, infos, interrupted = self._got
        while pending.any():
            self._keep(manager.receive_batch(int(pending.sum())))
        return dict(infos), frozenset(interrupted)

    def _report_cut(self, infos: dict[int, dict], interrupted: Collection[int], rewards: np.ndarray,
                    dones: np.ndarray, step_infos: list[dict]) -> None:
        """Episodes a restart cut short: each ends here, truncated where we last saw it."""
        for i in interrupted:  # the worker was restarted during the step
            step_infos[i] = self._interrupted_info(i, infos.get(i, {}))  # a fresh reset: not done
            rewards[i], dones[i] = 0.0, True
        for i, info in self._cut.items():  # restarted while idle, then stepped (see step_async)
            rewards[i], dones[i], step_infos[i] = 0.0, True, info
        self._cut = {}

    def _interrupted_info(self, i: int, reset_info: dict) -> dict:
        """An episode cut short by a restart: truncated where we last saw it."""
        self.reset_infos = [*self.reset_infos[:i], reset_info, *self.reset_infos[i + 1:]]  # a new list, as above
        terminal = _row(self._last_obs, i)
        return {"TimeLimit.truncated": True, "terminal_observation": terminal, "interrupted": True}

    def _observations(self, m: BatchEnvManager) -> VecEnvObs:
        """Every env's observation as SB3 stacks them, copied once from the results."""
        obs = m.results.observation
        if type(obs) is np.ndarray:  # the usual case: one array (C-contiguous, as np.copy makes it)
            return obs.copy()
        if m.observation_list is None:
            return tree_map(np.copy, obs)
        return _stack_obs(list(m.observation_list), self.observation_space)

    def _running(self) -> BatchEnvManager:
        """``manager`` without the property's call (the step's hot path)."""
        manager = self._manager
        if manager is None:
            raise ManagerClosedError("the SubprocVecEnv is closed")
        return manager

    # ------------------------------------------------------------------------------------------
    # Reaching the envs

    def _ids(self, indices: VecEnvIndices) -> list[int] | None:
        """Env ids for ``indices`` read as SB3 does: ``None`` is every env, an int is one env,
        and each index picks from the list of envs as Python list indexing does (``-1`` is the
        last env, out of range is an ``IndexError``). NumPy integers count as ints."""
        if indices is None:
            return None
        if isinstance(indices, np.integer):
            indices = int(indices)
        envs = range(self.num_envs)
        return [envs[i] for i in self._get_indices(indices)]

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """Return attribute from vectorized environment (see base class)."""
        with remote_attribute_errors():
            return self.manager.get_attr(attr_name, self._ids(indices))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set attribute inside vectorized environments (see base class).

        As SB3: ``setattr`` on the outermost env object (not through wrappers).
        """
        self._call(indices, env_functions.set_outer_attr, attr_name, value)

    def has_attr(self, attr_name: str) -> bool:
        """Check if an attribute exists for a vectorized environment. (see base class)."""
        return all(self._call(None, env_functions.has_attr, attr_name))

    def env_method(self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any) -> list[Any]:
        """Call instance methods of vectorized environments."""
        with remote_attribute_errors():
            return self.manager.call_on(self._ids(indices), method_name, method_args, method_kwargs)

    def env_is_wrapped(self, wrapper_class: type[gymnasium.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        """Check if worker environments are wrapped with a given wrapper"""
        return self._call(indices, env_functions.is_wrapped, _ByValue(wrapper_class))

    def _call(self, indices: VecEnvIndices, function: Callable[..., Any], *args: Any) -> list[Any]:
        with remote_attribute_errors():
            return self.manager.call_on(self._ids(indices), function, args)

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None for _ in range(self.num_envs)]
        return self.manager.call("render")

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close(self) -> None:
        """End every worker (a step in flight is abandoned) and free shared memory. Idempotent."""
        if self.closed:
            return
        if self._manager is not None:
            self._manager.close()
        self.waiting = False
        self.closed = True


# SB3 branches on ``isinstance(venv, SubprocVecEnv)`` (``VecVideoRecorder`` takes the env's own
# metadata, its ``render_fps``, only for its vec envs): ours is one to such checks.
subproc_vec_env.SubprocVecEnv.register(SubprocVecEnv)


# ----------------------------------------------------------------------------------------------
# Helpers


def _one_per_env_types(space: spaces.Space) -> tuple[type, ...]:
    """The types of a list of one action per env for a Dict / Tuple space (as SB3's own tests
    send them), rather than a batch of dicts / tuples of arrays; none for other spaces."""
    if isinstance(space, spaces.Dict):
        return (list, tuple)
    return (list,) if isinstance(space, spaces.Tuple) else ()


def _batch_rows(space: spaces.Space, batch: Any, n: int) -> list[Any]:
    """Env ``i``'s action, for each of ``n`` envs, from a batch for a Dict / Tuple space (a dict /
    tuple of per-env sequences, nested as the space is); a batch of another shape is refused."""
    if isinstance(space, spaces.Dict):
        if not isinstance(batch, dict) or set(batch) != set(space.spaces):
            raise InvalidInputError(f"a batch of Dict actions must be a dict with the keys {list(space.spaces)}")
        columns = {key: _batch_rows(sub, batch[key], n) for key, sub in space.spaces.items()}
        return [{key: column[i] for key, column in columns.items()} for i in range(n)]
    if isinstance(space, spaces.Tuple):
        if not isinstance(batch, tuple) or len(batch) != len(space.spaces):
            raise InvalidInputError(f"a batch of Tuple actions must be a tuple of {len(space.spaces)} items")
        parts = [_batch_rows(sub, item, n) for sub, item in zip(space.spaces, batch, strict=True)]
        return [tuple(part[i] for part in parts) for i in range(n)]
    if not hasattr(batch, "__len__") or len(batch) != n:
        raise InvalidInputError(f"expected a row per env ({n}) in each part of a batch of actions, got {batch!r:.80}")
    return list(batch)


def _stack_obs(obs_list: list[Any], space: spaces.Space) -> VecEnvObs:
    """SB3's stacking (an array, or a dict / tuple of arrays with the env index first), in the
    dtype of the observation space, as ``DummyVecEnv`` returns it."""
    if isinstance(space, spaces.Dict):
        return {key: _stack([o[key] for o in obs_list], sub) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_stack([o[n] for o in obs_list], sub) for n, sub in enumerate(space.spaces))
    return _stack(obs_list, space)


def _stack(values: list[Any], space: spaces.Space) -> np.ndarray:
    stacked = np.stack(values)
    dtype = getattr(space, "dtype", None)
    if dtype is not None and stacked.dtype != object:
        stacked = stacked.astype(dtype, copy=False)
    return stacked


def _row(obs: VecEnvObs, i: int) -> Any:
    """Env ``i``'s observation out of a stacked batch (a copy)."""
    if obs is None:
        return None
    if isinstance(obs, dict):
        return {key: np.copy(value[i]) for key, value in obs.items()}
    if isinstance(obs, tuple):
        return tuple(np.copy(value[i]) for value in obs)
    return np.copy(obs[i])


class _ByValue:
    """Send ``obj`` through the (plain-pickle) pipe with cloudpickle, so that a class defined in
    ``__main__`` or a notebook reaches ``spawn`` / ``forkserver`` workers too. Unpickles as
    ``obj`` itself: the worker never sees this class."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple:
        return (cloudpickle.loads, (cloudpickle.dumps(self.obj),))


def _worker_factory(env_fns: list[Callable[[], Any]]) -> Callable[[int], Any]:
    """The ``env_factory`` that runs in the workers.

    Everything it uses is defined in here, so cloudpickle ships it by value: the worker code
    needs gymnasium and the user's env code, not this module nor stable_baselines3 / torch
    (except to convert an OpenAI Gym env, SB3's ``_patch_env``). Under spawn / forkserver a
    worker still imports what the main script imports at top level, as with SB3's own.
    """

    def make_env(worker_id: int) -> Any:
        env = env_fns[worker_id]()
        if not isinstance(env, gymnasium.Env):
            from stable_baselines3.common.vec_env.patch_gym import _patch_env

            env = _patch_env(env)
        return env

    return make_env
