"""``ParallelVectorEnv``: PettingZoo envs in worker processes, on the core's batch level.

Each env runs in a worker behind a fixed-shape single-agent facade
(``envmanager.pettingzoo.facade``), so the core carries it as it carries any env: several envs
per process, observations and actions in shared memory, first-ready results, deadlines,
restarts. The parent sees batches flat by agent (``envmanager.pettingzoo.batch``); actions are
checked here before anything is sent (``envmanager.pettingzoo.actions``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from envmanager.core.batch import BatchEnvManager
from envmanager.core.deadline import Deadline
from envmanager.core.results import StepBatch
from envmanager.errors import (
    EnvManagerError,
    InvalidInputError,
    ManagerClosedError,
    SpaceMismatchError,
    WorkerError,
    failed_slots,
)
from envmanager.pettingzoo.actions import ActionRows
from envmanager.pettingzoo.batch import MultiAgentBatch, gather
from envmanager.pettingzoo.facade import FacadeFactory, call_env
from envmanager.pettingzoo.layout import AgentGroup, AgentLayout, check_group_options, one_layout
from envmanager.wire.interrupts import DEFERRED, begin, end

__all__ = ["ParallelVectorEnv"]

logger = logging.getLogger(__name__)


class ParallelVectorEnv:
    """PettingZoo ``ParallelEnv``s (or AEC envs) in worker processes, stepped as batches flat by
    agent: row ``i * num_agents + a`` of a batch is agent slot ``a`` (``possible_agents[a]``) of
    the batch's ``i``-th env (see :class:`MultiAgentBatch`).

    :param env_fns: one function per env, each returning a PettingZoo ``ParallelEnv`` or
        ``AECEnv`` (called in the worker).
    :param agent_groups: ``{group name: [agents]}`` (TorchRL's ``group_map``); by default agents
        are grouped by their (observation, action) spaces, one group when all share them.
    :param turn_based: for AEC envs: step them turn by turn (PettingZoo's
        ``turn_based_aec_to_parallel``: one agent acts per step) or as a parallel env
        (``aec_to_parallel``); by default turn by turn unless the env says it is parallelizable.
    :param envs_per_worker: envs per process, stepped as one message (default 1); ``"auto"``
        measures one env in a throwaway process, stepped with sampled actions (a turn-based
        game may print its illegal-move warnings there), and chooses.
    :param context, shared_memory, timeout, restart_workers, manager_kwargs: the
        core's (``SubprocessEnvManager``). With restarts on, an env whose process was restarted
        comes back as a fresh reset flagged ``restarted``.

    An env resets when all its agents are done, and only that env: its last result has
    ``episode_end``; its next step reads no action and returns the reset (``episode_start``).
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        *,
        agent_groups: Mapping[str, Sequence[str]] | None = None,
        turn_based: bool | None = None,
        envs_per_worker: int | str = 1,
        context: str | None = None,
        shared_memory: bool = True,
        timeout: float = 60.0,
        restart_workers: bool = False,
        **manager_kwargs: Any,
    ) -> None:
        self._manager: BatchEnvManager | None = None
        env_fns = list(env_fns)
        if not env_fns or not all(callable(f) for f in env_fns):
            raise InvalidInputError("env_fns must be a non-empty sequence of functions that make PettingZoo envs")
        check_group_options(agent_groups, turn_based)
        for fixed in ("autoreset_mode", "env_factory", "n_env", "check_spaces"):
            if fixed in manager_kwargs:
                raise TypeError(f"ParallelVectorEnv() does not take {fixed!r}")
        self.num_envs = n = len(env_fns)
        self._manager = BatchEnvManager(
            FacadeFactory(env_fns, agent_groups, turn_based), n, envs_per_worker=envs_per_worker, context=context,
            shared_memory=shared_memory, autoreset_mode="next_step", timeout=timeout, restart_workers=restart_workers,
            check_spaces=one_layout, **manager_kwargs)
        try:
            layouts: list[AgentLayout] = self._manager.get_attr("layout")
            for slot, other in enumerate(layouts):
                if other != layouts[0]:
                    raise SpaceMismatchError(f"env {slot} has agents {list(other.possible_agents)} in groups "
                                             f"{[g.name for g in other.groups]}, env 0 {list(layouts[0].possible_agents)} in "
                                             f"{[g.name for g in layouts[0].groups]}: every env must have the same")
            #: The agent slots and groups of every env.
            self.layout = layouts[0]
            self._actions = ActionRows(self.layout)
            self._all = np.arange(n, dtype=np.int64)
            self._active = np.zeros((n, self.layout.num_agents), np.bool_)  # as of each env's latest result
            self._ended = np.zeros(n, np.bool_)  # its latest result ended the episode: its next result is a reset
            self._known = np.zeros(n, np.bool_)  # its latest result was handed out (a reset came first)
            self._outstanding: set[int] = set()
            # Results taken aside by a send (restarts of idle envs, and what a wait took meanwhile), for the next recv.
            self._restarted: list[StepBatch] = []
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------
    # Properties

    @property
    def manager(self) -> BatchEnvManager:
        """The core's batch level underneath."""
        if self._manager is None:
            raise ManagerClosedError("the ParallelVectorEnv is closed")
        return self._manager

    @property
    def possible_agents(self) -> tuple[str, ...]:
        return self.layout.possible_agents

    @property
    def num_agents(self) -> int:
        """Agent slots per env (``len(possible_agents)``): a batch of ``k`` envs has ``k * num_agents`` rows."""
        return self.layout.num_agents

    @property
    def groups(self) -> dict[str, AgentGroup]:
        return {g.name: g for g in self.layout.groups}

    @property
    def closed(self) -> bool:
        return self._manager is None

    # ------------------------------------------------------------------------------------------
    # Resetting and stepping

    def reset(self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None) -> MultiAgentBatch:
        """Reset every env (``seed``: env ``i`` gets ``seed + i``, or one seed per env); steps in
        flight are dropped. Returns every env, in order."""
        manager = self.manager
        seeds = _seeds(seed, self.num_envs)
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            self.drop_in_flight()
            manager.send_reset({i: (seeds[i], options) for i in range(self.num_envs)})
            got = manager.receive_reset_batch()
            self._known[:] = True
            return self._hand_out(got.slots, got, starts=np.ones(len(got.slots), np.bool_))

    def drop_in_flight(self) -> list[EnvManagerError]:
        """Wait out every step in flight and drop every result not received, and the errors of
        those that failed (returned): what ``reset`` does first, and a caller with no ``recv``
        of its own does after a failed step (the SuperSuit drop-in)."""
        dropped = self.manager.drain()
        self._outstanding.clear()
        self._restarted.clear()
        return dropped

    def step(self, actions: Any, timeout: float | None = None) -> MultiAgentBatch:
        """Step every env with ``actions`` (see :meth:`send`) and wait for all; returns every env, in order."""
        self.send(actions)
        return self.recv(self.num_envs, timeout=timeout, sort=True)

    def step_dicts(self, actions: Sequence[Mapping[str, Any]], timeout: float | None = None) -> MultiAgentBatch:
        """:meth:`step` with one dict ``{agent: action}`` per env, for its active agents exactly."""
        self.send_dicts(actions)
        return self.recv(self.num_envs, timeout=timeout, sort=True)

    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Queue a step of the envs ``env_ids`` (default: all). ``actions``: with one group an
        array of ``len(env_ids) * group.size`` rows in the batch's order, else a dict
        ``{group name: array}``; rows of inactive agents are not read. Everything is checked
        before anything is sent."""
        ids = self._ids(env_ids)
        batch = self._actions.from_arrays(actions, ids, self._active[ids])
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            self._send(ids, batch)
        finally:
            end()

    def send_dicts(self, actions: Sequence[Mapping[str, Any]], env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """:meth:`send` with one dict ``{agent: action}`` per env: exactly its active agents.
        An unknown name, an agent that is not active, a missing agent: ``InvalidInputError``."""
        ids = self._ids(env_ids)
        batch = self._actions.from_dicts(actions, ids, self._active[ids])
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            self._send(ids, batch)
        finally:
            end()

    def recv(self, min_envs: int = 1, timeout: float | None = None, sort: bool = False) -> MultiAgentBatch:
        """Wait until at least ``min_envs`` envs sent a step finished, take whatever else finished,
        and return them (``env_ids``; in finishing order, or sorted with ``sort=True``).
        ``timeout``: seconds for this wait (``None``: the manager's deadline per answer)."""
        manager = self.manager
        if not 1 <= min_envs <= len(self._outstanding) + sum(len(b.slots) for b in self._restarted):
            raise InvalidInputError(f"recv({min_envs}) with {len(self._outstanding)} env(s) stepping")
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            taken = list(self._restarted)
            self._restarted.clear()
            count = sum(len(b.slots) for b in taken)
            deadline = None if timeout is None else Deadline(timeout)
            try:
                while count < min_envs:
                    got = manager._receive_batch(min_envs - count, None if deadline is None else deadline.left())
                    taken.append(got)
                    count += len(got.slots)
            except BaseException as exc:  # a timeout, an error, a Ctrl-C: what was taken waits for the next recv
                self._restarted[:0] = taken
                for b in taken:
                    self._outstanding.difference_update(b.slots.tolist())
                if isinstance(exc, WorkerError):  # its env raised: that step never comes (the env must be reset)
                    self._outstanding.difference_update(failed_slots(exc))
                raise
            ids = np.concatenate([b.slots for b in taken]) if len(taken) > 1 else taken[0].slots
            self._outstanding.difference_update(ids.tolist())
            merged = StepBatch(ids, {k: v for b in taken for k, v in b.infos.items()},
                               frozenset().union(*(b.interrupted for b in taken)), frozenset().union(*(b.resets for b in taken)),
                               generations=taken[-1].generations)  # (one array, the manager's: valid for every batch taken)
            if sort:
                ids = np.sort(ids)
            return self._hand_out(ids, merged)
        finally:
            end()

    # ------------------------------------------------------------------------------------------

    def _ids(self, env_ids: Sequence[int] | np.ndarray | None) -> np.ndarray:
        self.manager  # noqa: B018 (raises once closed)
        if env_ids is None:
            ids = self._all
        else:
            listed = self.manager.slots(list(np.asarray(env_ids).reshape(-1).tolist()))
            if len(set(listed)) != len(listed):
                raise InvalidInputError(f"env_ids has duplicates: {listed}")
            ids = np.array(listed, dtype=np.int64)
        known = self._known[ids]
        if not known.all():
            raise InvalidInputError(f"env(s) {ids[~known].tolist()} were never reset: call reset() first")
        if not self._outstanding and not self._restarted:  # nothing in flight (lockstep): nothing busy
            return ids
        busy = self._outstanding.union(*(b.slots.tolist() for b in self._restarted)).intersection(ids.tolist())
        if busy:
            for slot in sorted(busy):  # one whose process was given up: its error (no recv() can help)
                failure = self.manager.failure_of(slot)
                if failure is not None:
                    raise failure
            raise InvalidInputError(f"env(s) {sorted(busy)} were sent a step whose result recv() has not returned yet")
        return ids

    def _send(self, ids: np.ndarray, batch: dict[str, np.ndarray]) -> None:
        manager = self.manager
        early = manager.receive_unreceived()  # a process restarted while its envs were idle: their old episodes are gone
        if early is not None and len(early.slots):  # with any step results a wait took meanwhile: all for the next recv
            self._restarted.append(early)
            self._outstanding.difference_update(early.slots.tolist())
            cut = set(early.slots.tolist()).intersection(ids.tolist())  # not stepping, so restarted
            if cut:
                logger.warning("env(s) %s came back reset after a restart: the actions given for them are dropped",
                               sorted(cut))
            keep = np.array([s not in cut for s in ids.tolist()], np.bool_)
            ids = ids[keep]
            batch = {name: rows[keep] for name, rows in batch.items()}
            if not len(ids):
                return
        exact = manager.actions.exact(batch, len(ids))
        if exact is None:  # not the facade's layout: let the core check and convert it
            manager.send_batch(ids, batch)
        else:
            manager.send_batch(ids, exact, as_given=True)
        self._outstanding.update(ids.tolist())

    def _hand_out(self, ids: np.ndarray, got: StepBatch, starts: np.ndarray | None = None) -> MultiAgentBatch:
        manager = self.manager
        obs = manager.results.observation
        assert obs is not None  # the facade's spaces always have an array layout
        restarted = np.array([s in got.interrupted for s in ids.tolist()], np.bool_)
        if starts is None:
            starts = self._ended[ids] | restarted
        results = manager.results
        ends = (results.terminated[ids] | results.truncated[ids]).astype(np.bool_)  # (its last agents truncated: truncated)
        batch = gather(self.layout, obs, ids, starts, ends, restarted, [got.infos.get(s, {}) for s in ids.tolist()])
        self._active[ids] = batch.active.reshape(len(ids), -1)
        self._ended[ids] = ends
        return batch

    # ------------------------------------------------------------------------------------------
    # Reaching the envs

    def call(self, name: str, *args: Any, env_ids: Sequence[int] | None = None, **kwargs: Any) -> list[Any]:
        """``env.<name>(*args, **kwargs)`` on each PettingZoo env (``None``: all; as converted
        from AEC, where it was), or the attribute's value; results in ``env_ids`` order. Not
        while those envs have a step in flight."""
        ids = None if env_ids is None else self.manager.slots(list(env_ids))
        return self.manager.call_on(ids, call_env, (name, args, kwargs))

    def render(self) -> list[Any]:
        """Every env's ``render()``."""
        return self.call("render")

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close(self) -> None:
        """End every worker and free shared memory. Idempotent."""
        manager = self._manager
        if manager is not None:
            manager.close()
            self._manager = None  # only once closed: a close cut short (Ctrl-C) is finished by the next close()

    def __enter__(self) -> ParallelVectorEnv:
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
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return [int(seed) + i for i in range(n)]
    seeds = list(seed)  # type: ignore[arg-type]
    if len(seeds) != n or not all(s is None or (isinstance(s, (int, np.integer)) and not isinstance(s, bool)) for s in seeds):
        raise InvalidInputError(f"seed must be an int, None, or {n} ints (one per env), got {seed!r:.80}")
    return [None if s is None else int(s) for s in seeds]
