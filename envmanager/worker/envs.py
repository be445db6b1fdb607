"""The envs of one worker process and what each request does to them (the worker's half of
every command in ``envmanager.wire.messages``)."""

from __future__ import annotations

import logging
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
from gymnasium import Wrapper
from gymnasium.wrappers import OrderEnforcing

from envmanager.wire import factory as packed_factory
from envmanager.wire import returns, shm
from envmanager.wire.info_columns import to_columns
from envmanager.wire.marks import CALL, CLOSE, FACTORY, GET_ATTR, RESET, SET_ATTR, STEP, WorkerMarks, mark
from envmanager.wire.messages import (
    Attach,
    Call,
    EnvFunction,
    GetAttr,
    Ready,
    Rebuild,
    RemoteException,
    Reset,
    SetAttr,
    Step,
    Stepped,
    Values,
)
from envmanager.wire.returns import PLAIN_SCALARS

logger = logging.getLogger(__name__)

NEXT_STEP, SAME_STEP, DISABLED = "next_step", "same_step", "disabled"
_new = tuple.__new__  # a NamedTuple made without its constructor's overhead (once per request)

#: The key of a same-step autoreset's reset info when it is kept apart (``reset_info_apart``): no
#: env's own key, so an info that holds it is one the worker made.
RESET_INFO = "envmanager.reset_info"

__all__ = ["WorkerEnvs", "remote_exception", "marks_here", "envs_here", "NEXT_STEP", "SAME_STEP", "DISABLED", "RESET_INFO"]

_here = WorkerMarks(None, 0)  # this process's record (a worker's, once its envs exist; else nowhere)


_envs_here: WorkerEnvs | None = None  # this worker process's envs (None outside a worker)


def envs_here() -> WorkerEnvs | None:
    """This worker process's envs, for code that runs inside a request and must remake one the
    parent decided to rebuild in place (a worker-side rollout); ``None`` outside a worker."""
    return _envs_here


def marks_here() -> WorkerMarks:
    """This worker process's record of which env is in which call, for code that runs env
    calls itself inside a request (a worker-side rollout); outside a worker, a record nobody reads."""
    return _here


class Stopped(SystemExit):
    """The worker was told to stop (SIGTERM: the parent, or the watch on it): it closes its envs
    and exits. Any other ``SystemExit`` or ``KeyboardInterrupt`` is an env's, reported as its error."""


#: What an env's call may raise that is reported as its error (the worker serves on): an env's
#: ``sys.exit()`` or ``KeyboardInterrupt`` too, never the worker's own ``Stopped``.
ENV_RAISES = (Exception, KeyboardInterrupt, SystemExit)


class WorkerEnvs:
    """The envs of one worker process (slots ``env_ids``), with gymnasium's autoreset rules.

    Each handler takes a request message and returns its answer message. A step or reset
    goes on past an env that raises: the others deliver, the failure is reported by position.
    Every step, reset and rebuild answer is stamped with its envs' generations (``stamp``).
    """

    def __init__(self, env_ids: tuple[int, ...], factory: bytes, autoreset_mode: str, file: shm.SharedFile | None = None,
                 info_columns: bool = False, marks: WorkerMarks | None = None, generations: tuple[int, ...] = (),
                 options_if_given: bool = False, reset_info_apart: bool = False) -> None:
        self.env_ids = env_ids
        #: Reset with ``options=`` only when there are some, as SB3's workers (an env written
        #: ``reset(self, seed=None)`` runs there); gymnasium's always pass them.
        self.options_if_given = options_if_given
        #: A same-step autoreset's reset info kept apart (under ``RESET_INFO``), as SB3's workers keep
        #: it: gymnasium's merge lets a reset info's ``final_info`` / ``final_obs`` replace the step's.
        self.reset_info_apart = reset_info_apart
        #: Each env's generation, as the parent told it (at the start, and with each rebuild).
        self.generations = list(generations) or [0] * len(env_ids)
        self._stamps: dict[tuple[int, ...], tuple[int, ...]] = {}  # by a request's locals: their generations
        self.info_columns = info_columns  # the parent batches infos: columns where they fit
        self.factory = factory
        self._factory: Callable[[int], Any] | None = None  # unpickled once
        self.autoreset_mode = autoreset_mode
        self.envs: list[Any] = []
        self.autoreset = [False] * len(env_ids)
        self.buffers: shm.SharedBuffers | None = None
        self.file = file  # the shared memory this process was started with (ATTACH maps it)
        # A request's envs by their locals: their slots.
        self._slots: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._next_step, self._same_step = autoreset_mode == NEXT_STEP, autoreset_mode == SAME_STEP
        self.current = env_ids[0]  # the slot being worked on, so an exception can name it
        # Which env is in which call, for the parent to read should this process hang or die
        # (``envmanager.wire.marks``): one store of a precomputed word before each env's call.
        global _here, _envs_here
        self.marks = _here = marks if marks is not None else WorkerMarks(None, 0)
        _envs_here = self
        self._words, self._at = self.marks.words, self.marks.at
        self._steps = [mark(s, STEP) for s in env_ids]  # by local index
        self._resets = [mark(s, RESET) for s in env_ids]

    def stamp(self, locals_: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The generations of the envs at ``locals_``, as an answer carries them."""
        key = tuple(locals_)
        stamp = self._stamps.get(key)
        if stamp is None:
            stamp = self._stamps[key] = tuple(self.generations[i] for i in key)
        return stamp

    def unmark(self) -> None:
        """The request is done: no env is in a call (the main loop inlines this)."""
        self._words[self._at] = 0

    def build(self) -> Ready:
        """Make the envs with the user's factory (``close`` closes those already made)."""
        for slot in self.env_ids:
            self.envs.append(self._make(slot))
        first = self.envs[0]
        spec = getattr(first, "spec", None)
        try:  # a spec naming a wrapper made with a lambda does not pickle: it is only a nicety
            pickle.dumps(spec)
        except Exception:
            spec = None
        return Ready(
            self.env_ids,
            tuple(getattr(e, "observation_space", None) for e in self.envs),
            tuple(getattr(e, "action_space", None) for e in self.envs),
            getattr(first, "metadata", None) or {},
            getattr(first, "render_mode", None),
            spec,
            tuple(order_enforced(e) for e in self.envs),
            tuple(self.generations),
        )

    def _reset(self, env: Any, seed: Any, options: Any) -> Any:
        if options is None and self.options_if_given:
            return env.reset(seed=seed)
        return env.reset(seed=seed, options=options)

    def _make(self, slot: int) -> Any:
        """One env from the user's factory, checked (marked as in ``env_factory``)."""
        make: Callable[[int], Any] = self._factory if self._factory is not None else packed_factory.load(self.factory)
        self._factory = make
        self.current = slot
        self._words[self._at] = mark(slot, FACTORY)
        env = make(slot)
        if not (hasattr(env, "step") and hasattr(env, "reset")):
            raise TypeError(
                f"env_factory({slot}) returned {type(env).__name__} {env!r:.80}, not an environment "
                "(an object with reset() and step(), such as a gymnasium.Env)"
            )
        return env

    # -- REBUILD (the parent's half: ``envmanager.core.rebuild``) ------------------------------
    def rebuild(self, request: Rebuild) -> Stepped:
        """Remake the envs at ``request.locals`` (they raised): close each (best effort), make
        it again from the factory with its slot, replay ``request.calls`` on it, reset it with
        its seed and options; it is of ``request.generations`` from now on. Anything raised
        here fails the whole request: the parent then restarts the process."""
        for i, generation in zip(request.locals, request.generations, strict=True):
            self.generations[i] = generation
        self._stamps.clear()
        out = _Answer(len(request.locals), self.buffers, "reset")
        for n, (i, seed, options) in enumerate(zip(request.locals, request.seeds, request.options, strict=True)):
            slot = self.current = self.env_ids[i]
            start = time.perf_counter()
            try:
                self._words[self._at] = mark(slot, CLOSE)
                self.envs[i].close()
            except Exception:  # a broken env may not close: it is replaced all the same
                logger.warning("closing env %d before rebuilding it failed", slot, exc_info=True)
            self.envs[i] = env = self._make(slot)
            self.autoreset[i] = False
            for name, args, kwargs in request.calls:  # what a restarted process's envs get before their reset
                self.marks.name(name)
                attr = _get_attr(self._env(i, CALL), name)
                if callable(attr):
                    attr(*args, **kwargs)
            self._words[self._at] = self._resets[i]
            # As SB3's worker: options only when there are some (an env's reset may take only seed)
            obs, info = self._reset(env, seed, options)
            out.add(n, slot, obs, None, info, time.perf_counter() - start)
        return out.answer(self.stamp(request.locals))

    # -- STEP and RESET ---------------------------------------------------------------------
    def step(self, request: Step, columns: bool | None = None) -> Stepped:
        """Step the envs at ``request.locals``; their infos as columns where they fit when
        ``columns`` (default: as the parent asked, ``info_columns``), else as dicts."""
        b = self.buffers
        if request.actions is None and b is not None and type(b.action) is np.ndarray and type(b.observation) is np.ndarray:
            return self._step_shared(request.locals, b, b.action, b.observation,
                                     self.info_columns if columns is None else columns)
        actions, envs, mode = request.actions, self.envs, self.autoreset_mode
        words, at = self._words, self._at
        out = _Answer(len(request.locals), b, "step")
        for n, i in enumerate(request.locals):
            slot = self.current = self.env_ids[i]
            start = time.perf_counter()
            try:
                action = actions[n] if actions is not None else shm.read(b.action, slot)  # type: ignore[union-attr]
                env = envs[i]
                if self.autoreset[i] and mode == NEXT_STEP:
                    words[at] = self._resets[i]
                    obs, info = env.reset()
                    scalars, terminated, truncated = None, False, False  # None: a reset's zeros
                else:
                    words[at] = self._steps[i]
                    obs, reward, terminated, truncated, info = env.step(action)
                    if (terminated or truncated) and mode == SAME_STEP:
                        final = {"final_info": info, "final_obs": obs}  # (AsyncVectorEnv's order)
                        words[at] = self._resets[i]
                        obs, info = env.reset()
                        info = {**final, RESET_INFO: info} if self.reset_info_apart else {**final, **info}
                    scalars = (reward, terminated, truncated)
                self.autoreset[i] = bool(terminated or truncated)
                out.add(n, slot, obs, scalars, info, time.perf_counter() - start)
            except Stopped:
                raise
            except ENV_RAISES as exc:
                out.failed(n, remote_exception(slot, returns.refused_here(exc, slot, "step")), time.perf_counter() - start)
        return out.answer(self.stamp(request.locals))

    def _step_shared(self, locals_: tuple[int, ...], b: shm.SharedBuffers, action: np.ndarray,
                     observation: np.ndarray, columns: bool) -> Stepped:
        """The hot path: each env's action read from shared memory and its results written back as
        soon as it has stepped, as gymnasium writes them (``envmanager.wire.returns``): one
        assignment per array and env where the env returned what the arrays hold (the usual
        case), gymnasium's rules otherwise; rewards and flags travel in the answer until the
        parent has decided their shapes (the first step), or where each is more than one element.
        ``action`` and ``observation`` are ``b``'s, each one array. One clock read per env: each
        env's time runs from the end of the one before."""
        slots = self._slots.get(locals_)
        if slots is None:
            if len(self._slots) >= 64:  # partial batches can name up to 2**k - 1 sets of slots
                self._slots.clear()
            slots = self._slots[locals_] = tuple(self.env_ids[i] for i in locals_)
        n = len(locals_)
        times = [0.0] * n
        infos: dict[int, dict] = {}
        failures: dict[int, RemoteException] = {}
        envs, autoreset, next_step, same_step = self.envs, self.autoreset, self._next_step, self._same_step
        words, at, steps = self._words, self._at, self._steps
        layout = b.scalars
        zeros = layout.begin()  # rewards and flags: in the shapes the parent decided at the first step
        travelling: list[Any] | None = [None] * n if layout.travelling else None
        plain = travelling is None and layout.plain  # one scalar each: written as they come when plain
        rewards, terminated, truncated = b.reward, b.terminated, b.truncated
        row_shape, row_dtype = observation.shape[1:], observation.dtype
        rows_are_arrays = action.ndim > 1  # (a row of a 1-d array is a scalar: nothing to copy)
        clock = time.perf_counter
        start = clock()
        for k, i in enumerate(locals_):
            slot = slots[k]
            try:
                env = envs[i]
                if autoreset[i] and next_step:
                    words[at] = self._resets[i]
                    obs, info = env.reset()
                    reward, term, trunc = zeros  # in the shapes of the first step's (returns.ScalarLayout)
                    fresh = True
                else:
                    words[at] = steps[i]  # the one store per env: "slot i is in step()"
                    # A copy of an array row: the env may keep its action.
                    obs, reward, term, trunc, info = env.step(action[slot].copy() if rows_are_arrays else action[slot])
                    if (term or trunc) and same_step:
                        final = {"final_info": info, "final_obs": obs}  # (AsyncVectorEnv's order)
                        words[at] = self._resets[i]
                        obs, info = env.reset()
                        info = {**final, RESET_INFO: info} if self.reset_info_apart else {**final, **info}
                    fresh = False
                autoreset[i] = bool(term or trunc)
            except Stopped:
                raise
            except ENV_RAISES as exc:
                self.current = slot
                failures[k] = remote_exception(slot, returns.refused_here(exc, slot, "step"))
            else:
                try:  # what it returned, into its rows; what does not fit fails it, naming the value
                    if type(obs) is np.ndarray and obs.shape == row_shape and obs.dtype == row_dtype:
                        observation[slot] = obs
                    else:
                        returns.write_observation(observation, slot, obs, "step")
                    if travelling is not None:
                        travelling[k] = None if fresh else (reward, term, trunc)
                    elif plain and type(reward) in PLAIN_SCALARS and type(term) in PLAIN_SCALARS and type(trunc) in PLAIN_SCALARS:
                        rewards[slot], terminated[slot], truncated[slot] = reward, term, trunc
                    else:
                        layout.put(slot, reward, term, trunc)
                except Stopped:
                    raise
                except ENV_RAISES as exc:
                    self.current = slot
                    failures[k] = remote_exception(slot, exc)
                else:
                    if info:
                        infos[slot] = info
            end = clock()
            times[k], start = end - start, end
        # Every env said the same kind of thing (and rewards and flags are in shared memory):
        if columns and n > 1 and len(infos) == n and not failures and travelling is None:
            packed = to_columns([infos[s] for s in slots])
            if packed is not None:
                return _new(Stepped, (times, None, None, None, None, packed, self.stamp(locals_)))
        return _new(Stepped, (times, infos or None, failures or None, None, travelling, None, self.stamp(locals_)))

    def reset(self, request: Reset) -> Stepped:
        out = _Answer(len(request.locals), self.buffers, "reset")
        for n, (i, seed, options) in enumerate(zip(request.locals, request.seeds, request.options, strict=True)):
            slot = self.current = self.env_ids[i]
            start = time.perf_counter()
            try:
                self._words[self._at] = self._resets[i]
                env = self.envs[i]  # (options only when there are some, as SB3's worker)
                obs, info = self._reset(env, seed, options)
                self.autoreset[i] = False
                out.add(n, slot, obs, None, info, time.perf_counter() - start)
            except Stopped:
                raise
            except ENV_RAISES as exc:
                out.failed(n, remote_exception(slot, returns.refused_here(exc, slot, "reset")), time.perf_counter() - start)
        return out.answer(self.stamp(request.locals))

    # -- reaching into the envs -------------------------------------------------------------
    def call(self, request: Call) -> Values:
        args, kwargs = request.args, request.kwargs or {}
        if isinstance(request.target, EnvFunction):
            fn = cloudpickle.loads(request.target)
            self.marks.name(getattr(fn, "__name__", "call"))
            return Values([fn(self._env(i, CALL), *args, **kwargs) for i in request.locals])
        values = []
        self.marks.name(request.target)
        for i in request.locals:
            attr = _get_attr(self._env(i, CALL), request.target)
            values.append(attr(*args, **kwargs) if callable(attr) else attr)
        return Values(values)

    def get_attr(self, request: GetAttr) -> Values:
        return Values([_get_attr(self._env(i, GET_ATTR), request.name) for i in request.locals])

    def set_attr(self, request: SetAttr) -> Values:
        for i, value in zip(request.locals, request.values, strict=True):
            env = self._env(i, SET_ATTR)
            if hasattr(env, "set_wrapper_attr"):
                env.set_wrapper_attr(request.name, value)
            else:
                setattr(env, request.name, value)
        return Values([None] * len(request.locals))

    def attach(self, request: Attach) -> Values:
        if self.buffers is not None:
            self.buffers.close()
        self.buffers = shm.SharedBuffers.attach(request.layout, self.file)
        return Values([])

    def _env(self, i: int, code: int) -> Any:
        """Env ``i``, about to be in call ``code`` (marked so)."""
        self.current = self.env_ids[i]
        self._words[self._at] = mark(self.current, code)
        return self.envs[i]

    def close(self) -> None:
        # not strict: after a factory failed part-way, fewer envs than ids were built
        for slot, env in zip(self.env_ids, self.envs, strict=False):
            try:
                self._words[self._at] = mark(slot, CLOSE)
                env.close()
            except Exception:  # closing must go on for the others
                logger.exception("closing env %d failed", slot)
        self.unmark()
        if self.buffers is not None:
            self.buffers.close()
        if self.file is not None:
            self.file.close()


class _Answer:
    """Builds a :class:`Stepped`: results go into shared memory where they can (as gymnasium
    writes them: ``envmanager.wire.returns``); what does not fit travels."""

    def __init__(self, n: int, buffers: shm.SharedBuffers | None, call: str) -> None:
        self.b = buffers
        self.call = call
        self.times = [0.0] * n
        self.infos: dict[int, dict] = {}
        self.failures: dict[int, RemoteException] = {}
        self.observations = [None] * n if buffers is None or buffers.observation is None else None
        # Rewards and flags as the env returned them (``None``: a reset's zeros), where they travel.
        if buffers is not None:
            buffers.scalars.begin()
        travelling = buffers is None or buffers.scalars.travelling
        self.scalars: list[tuple[Any, Any, Any] | None] | None = [None] * n if travelling else None

    def add(self, n: int, slot: int, obs: Any, scalars: tuple[Any, Any, Any] | None, info: dict, t: float) -> None:
        """Env ``slot``'s results (``scalars``: its reward, terminated and truncated; ``None``
        after a reset); one that does not fit fails it, naming the value (nothing is written)."""
        self.times[n] = t
        b = self.b
        if self.observations is None:
            try:
                returns.write_shared(b.observation, slot, obs)  # type: ignore[union-attr]
            except Exception as exc:
                self.failed(n, remote_exception(slot, returns.refusal(exc, slot, self.call, "observation", obs)), t)
                return
        else:
            self.observations[n] = obs
        if self.scalars is not None:  # (always without shared memory)
            self.scalars[n] = scalars
        elif scalars is None:
            b.scalars.clear(slot)  # type: ignore[union-attr]
        else:
            try:
                b.scalars.put(slot, *scalars, call=self.call)  # type: ignore[union-attr]
            except Exception as exc:
                self.failed(n, remote_exception(slot, exc), t)
                return
        if info:
            self.infos[slot] = info

    def failed(self, n: int, failure: RemoteException, t: float) -> None:
        self.times[n] = t
        self.failures[n] = failure

    def answer(self, generations: tuple[int, ...]) -> Stepped:
        return Stepped(self.times, self.infos or None, self.failures or None, self.observations, self.scalars, None,
                       generations)


def order_enforced(env: Any) -> bool:
    """Whether stepping ``env`` now raises gymnasium's ``ResetNeeded``: an ``OrderEnforcing``
    wrapper (as ``gymnasium.make`` adds) that was not reset yet."""
    while env is not None:
        if isinstance(env, OrderEnforcing):
            return not env.has_reset
        env = getattr(env, "env", None) if isinstance(env, Wrapper) else None
    return False


def _get_attr(env: Any, name: str) -> Any:
    return env.get_wrapper_attr(name) if hasattr(env, "get_wrapper_attr") else getattr(env, name)


def remote_exception(slot: int, exc: BaseException) -> RemoteException:
    """Package ``exc`` so it always crosses the pipe, keeping the object when it pickles."""
    try:
        pickle.loads(pickle.dumps(exc))
        obj: BaseException | None = exc
    except Exception:
        obj = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return RemoteException(slot, name, str(exc), tb, obj)
