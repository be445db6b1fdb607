"""EnvPool-style partial batches of ``envmanager.AsyncVectorEnv``: ``send(actions, env_ids)``
steps the listed envs and ``recv()`` returns the first ``batch_size`` to finish, their ids in
``infos["env_id"]``. Their state lives here: the envs sent a step whose result ``recv`` has not
returned yet, and what arrived beyond the batches returned so far."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium.error import NoAsyncCallError

from envmanager.adapters.gymnasium_errors import raise_as_gymnasium
from envmanager.adapters.gymnasium_utils import AsyncState, env_ids_checked, partial_infos
from envmanager.core.deadline import Deadline
from envmanager.core.results import InfoBlock, StepBatch
from envmanager.errors import EnvManagerError

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
        if env_ids is None:
            ids, listed = env._all, env._all_list
        else:
            ids, listed = env_ids_checked(env_ids, env.num_envs)
        outstanding = self.outstanding
        if not outstanding.isdisjoint(listed):
            raise ValueError(f"env(s) {sorted(outstanding.intersection(listed))} were sent a step whose result was "
                             "not received yet")
        env._send(manager, ids, env._hand_over(manager, actions, ids))
        outstanding.update(listed)

    def recv(self, env: AsyncVectorEnv, timeout: float | None = None) -> tuple[Any, ...]:
        """The first ``batch_size`` envs to finish: ``(obs, rewards, terminations, truncations,
        infos)`` with ``infos["env_id"]`` giving each row's env."""
        manager = env._manager
        if manager is None or env.closed:
            manager = env._running()
        size = env.batch_size
        if len(self.outstanding) < size:
            raise NoAsyncCallError(f"`recv` needs {size} envs in flight, only {len(self.outstanding)} were sent", "recv")
        received = self.received
        got: StepBatch | None = None
        if len(received) < size:
            deadline = None if timeout is None else Deadline(timeout)
            try:
                while len(received) < size:  # one wait for what is missing, not one per answer
                    got = manager.receive_batch(size - len(received), None if deadline is None else deadline.left(),
                                                info_columns=True)
                    received += got.slots.tolist()
                    if got.infos:
                        self.received_infos.update(got.infos)
                    if got.info_columns:
                        self.received_columns += got.info_columns
            except EnvManagerError as exc:
                raise_as_gymnasium("recv", timeout, exc, env._abandon)
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

    def _infos(self, env: AsyncVectorEnv, listed: list[int]) -> dict[str, Any]:
        """gymnasium's batched infos of the envs ``listed`` (row ``k``: env ``listed[k]``) from
        what arrived for them; what arrived for envs of a later batch (``_received``) stays."""
        infos, self.received_infos, self.received_columns = partial_infos(
            listed, bool(self.received), self.received_infos, self.received_columns, env.num_envs, env._add_info)
        return infos

