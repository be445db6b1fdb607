"""EnvPool-style partial batches of ``envmanager.AsyncVectorEnv``: ``send(actions, env_ids)``
steps the listed envs and ``recv()`` returns the first ``batch_size`` to finish, their ids in
``infos["env_id"]``. Their state lives here: the envs sent a step whose result ``recv`` has not
returned yet, and what arrived beyond the batches returned so far."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

from envmanager.adapters.gymnasium_errors import raise_as_gymnasium
from envmanager.adapters.gymnasium_utils import AsyncState, env_ids_checked, partial_infos
from envmanager.core.deadline import Deadline
from envmanager.core.results import InfoBlock, StepBatch
from envmanager.core.slots import IN_FLIGHT
from envmanager.errors import EnvManagerError, failed_slots
from envmanager.wire.interrupts import begin, end

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from envmanager.adapters.gymnasium import AsyncVectorEnv

__all__ = ["PartialBatches"]


class PartialBatches:
    """``send`` / ``recv`` and their state: the envs sent a step whose result ``recv`` has not
    returned yet (a set: ``send``'s check is one ``isdisjoint``, ``recv``'s count a ``len``), and
    what arrived beyond the batches returned so far: slots in arrival order, their infos (dicts,
    columns)."""

    def __init__(self) -> None:
        self.outstanding: set[int] = set()
        self.received: list[int] = []
        self.received_infos: dict[int, dict] = {}
        self.received_columns: list[InfoBlock] = []

    def pending(self) -> bool:
        """Whether envs were sent a step whose result no ``recv`` returned yet."""
        return bool(self.outstanding or self.received)

    def clear(self) -> None:
        """Forget every step in flight and every result not returned (after a drain)."""
        self.outstanding.clear()
        self.received, self.received_infos, self.received_columns = [], {}, []

    def reset_some(self, manager: Any, ids: list[int]) -> None:
        """Before a masked reset: the steps of ``ids`` still in flight are waited out and dropped (with what
        arrived for them); what arrived for the other envs stays for ``recv``, and their steps stay in flight."""
        masked = set(ids)
        busy = sorted(masked & self.outstanding)
        if busy:
            manager.wait_for(lambda: not (manager.status[busy] == IN_FLIGHT).any(), None, "the steps of the envs to reset",
                             lambda: [s for s in busy if manager.status[s] == IN_FLIGHT])
        while True:
            try:
                got = manager.receive_batch(0, info_columns=True)
            except EnvManagerError as error:
                if set(failed_slots(error)) <= masked:
                    logger.warning("reset() dropped a step no recv() returned, which failed: %s", error)
                    continue
                raise
            break
        self.received += got.slots.tolist()
        if got.infos:
            self.received_infos.update(got.infos)
        if got.info_columns:
            self.received_columns += got.info_columns
        self.outstanding -= masked
        self.received = [s for s in self.received if s not in masked]
        for s in masked:
            self.received_infos.pop(s, None)
        kept = []
        for block in self.received_columns:
            rows = [n for n, s in enumerate(block.slots.tolist()) if s not in masked]
            if len(rows) == len(block.slots):
                kept.append(block)
            elif rows:
                kept.append(block._replace(slots=block.slots[rows], columns=[c[rows] for c in block.columns]))
        self.received_columns = kept

    def refuse_step(self, what: str) -> None:
        """``step()`` steps every env: one sent a step whose result no ``recv()`` returned yet would be
        stepped again and that result lost (or the core refuse it, naming a worker). Refused before
        anything is sent, as gymnasium refuses a call while another is pending."""
        raise AlreadyPendingCallError(
            f"Calling `{what}` while env(s) {sorted(self.outstanding)} were sent a step by `send` whose result "
            "`recv` has not returned yet; `recv` them (or `reset`) first.", "recv")

    def send(self, env: AsyncVectorEnv, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Queue one step for each env in ``env_ids`` (default: all), ``actions`` row by row.

        An env whose previous result has not been received by ``recv()`` yet is rejected,
        before anything is sent.
        """
        manager = env._manager
        if manager is None or env.closed:
            manager = env._running()
        if env._state is not AsyncState.DEFAULT:
            env._assert_default("send")
        if env._stale:
            env._drain_stale(manager)
        if env_ids is None:
            ids, listed = env._all, env._all_list
        else:
            ids, listed = env_ids_checked(env_ids, env.num_envs)
        outstanding = self.outstanding
        if not outstanding.isdisjoint(listed):
            raise ValueError(f"env(s) {sorted(outstanding.intersection(listed))} were sent a step whose result was "
                             "not received yet")
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            env._send(manager, ids, env._hand_over(manager, actions, ids))
            outstanding.update(listed)
        finally:
            end()

    def recv(self, env: AsyncVectorEnv, timeout: float | None = None) -> tuple[Any, ...]:
        """The first ``batch_size`` envs to finish: ``(obs, rewards, terminations, truncations,
        infos)`` with ``infos["env_id"]`` giving each row's env."""
        manager = env._manager
        if manager is None or env.closed:
            manager = env._running()
        size = env.batch_size
        if len(self.outstanding) < size:
            raise NoAsyncCallError(f"`recv` needs {size} envs in flight, only {len(self.outstanding)} were sent", "recv")
        try:
            begin()  # a Ctrl-C waits until what this keeps agrees with the manager (``interrupts``)
            received = self.received
            got: StepBatch | None = None
            if len(received) < size:
                deadline = None if timeout is None else Deadline(timeout)
                try:
                    while len(received) < size:  # one wait for what is missing, not one per answer
                        got = manager._receive_batch(size - len(received), None if deadline is None else deadline.left(),
                                                    info_columns=True)
                        received += got.slots.tolist()
                        if got.infos:
                            self.received_infos.update(got.infos)
                        if got.info_columns:
                            self.received_columns += got.info_columns
                except EnvManagerError as exc:
                    raise_as_gymnasium("recv", timeout, exc, lambda: env._abandon(deadline))
            if len(received) == size:  # the usual case: what arrived is one batch
                listed, self.received = received, []
                # the slots of the one answer that made it (int64, the core's own copy), else a new array
                ids = got.slots if got is not None and len(got.slots) == size else np.array(listed, dtype=np.int64)
            else:
                listed, self.received = received[:size], received[size:]
                ids = np.array(listed, dtype=np.int64)
            self.outstanding.difference_update(listed)
            infos = self._infos(env, listed) if self.received_infos or self.received_columns else {}
            infos["env_id"] = ids
            r = manager.results
            if manager.observation_list is None and type(r.observation) is np.ndarray:  # one array (Box, Discrete, ...)
                obs = r.observation.take(ids, axis=0)  # obs[ids]'s rows, in a quarter of its time for 2+ axes
            else:
                obs = env._observations_of(ids)
            return obs, r.reward[ids], r.terminated[ids], r.truncated[ids], infos
        finally:
            end()

    def _infos(self, env: AsyncVectorEnv, listed: list[int]) -> dict[str, Any]:
        """gymnasium's batched infos of the envs ``listed`` (row ``k``: env ``listed[k]``) from
        what arrived for them; what arrived for envs of a later batch (``_received``) stays."""
        infos, self.received_infos, self.received_columns = partial_infos(
            listed, bool(self.received), self.received_infos, self.received_columns, env.num_envs, env._add_info)
        return infos

