"""``BatchResets``: the batch level's reset path, the parent's half of the RESET command.

``send_reset`` checks the slots and encodes every request before the first send (nothing
half-sent), then marks the slots IN_FLIGHT and owed a reset; ``receive_reset_batch`` waits for
them (answers filed by ``envmanager.core.slots``) and hands them out; ``allow_step_before_reset``
lets chosen slots skip their first reset. The worker's half is ``WorkerEnvs.reset``
(``envmanager.worker.envs``); how a reset splits per process is ``envmanager.core.plans``. Kept
apart from the step path (``envmanager.core.batch``, the hot loop): a mixin of
``BatchEnvManager``, the same object and methods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envmanager.core.plans import reset_plan
from envmanager.core.pool import WorkerPool
from envmanager.core.process import WorkerProcess
from envmanager.core.results import StepBatch
from envmanager.core.slots import SlotState
from envmanager.errors import InvalidInputError
from envmanager.wire.messages import EnvironmentCommand as Cmd

__all__ = ["BatchResets"]


class BatchResets:
    """Resets of chosen slots, sent and received as batches (see the module doc)."""

    # The batch manager's state this half works on (set by ``BatchEnvManager.__init__``).
    n_env: int
    status: np.ndarray
    slot_local: np.ndarray
    slot_lanes: list[int]
    _state: SlotState

    if TYPE_CHECKING:  # the batch manager's own methods
        @property
        def pool(self) -> WorkerPool: ...

        def worker_of(self, worker_id: int) -> WorkerProcess: ...

        def slots(self, worker_ids: Sequence[int] | int | None) -> list[int]: ...

        def wait_for(self, done: Callable[[], bool], timeout: float | None, what: str, late: Callable[[], list[int]],
                     enough: Callable[[], bool] = ...) -> None: ...

    def allow_step_before_reset(self, worker_ids: Sequence[int]) -> None:
        """Let these slots be stepped before their first reset (call it before any reset): their
        envs decide what that means (gymnasium's AsyncVectorEnv steps an env without
        ``OrderEnforcing``). A slot whose env fails needs a reset as always."""
        self._state.allow_steps(self.slots(worker_ids))

    def send_reset(self, seeds_and_options: Mapping[int, tuple[Any, Any]]) -> None:
        """Send a reset for the given slots: ``worker_id -> (seed, options)``."""
        pool = self.pool
        slots = np.array(sorted(seeds_and_options), dtype=np.int64)
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.n_env:
            raise InvalidInputError(f"unknown worker id in {slots.tolist()} (n_env={self.n_env})")
        plan = reset_plan(seeds_and_options, slots.tolist(), self.worker_of, self.slot_local, self.status)
        try:  # encode everything before the first send
            outgoing = [(index, message, pool.prepare(Cmd.RESET, message, own)) for index, message, own in plan]
        except Exception as exc:
            raise InvalidInputError(f"reset seeds or options cannot be sent: {exc!r}") from exc
        self._state.sent(slots, reset=True)
        for index, message, request in outgoing:
            if pool.workers[index].boot is not None:  # on its way back from a restart: its boot resets them
                pool.join_boot(index, Cmd.RESET, request.slots, message)
            else:
                pool.workers[index].send(request)

    def receive_reset_batch(self, worker_ids: Sequence[int] | None = None, timeout: float | None = None) -> StepBatch:
        """Wait for the resets sent to ``worker_ids`` (default: every reset in flight) and hand
        them out, sorted by slot. Raises the first failed reset (that slot needs a new reset);
        the others, and answers that arrive before a timeout, are kept, so a later call picks up
        where this one stopped."""
        wanted = set(self._state.owed_resets) if worker_ids is None else set(self.slots(worker_ids))
        if not wanted <= self._state.owed_resets:
            raise InvalidInputError(f"no reset was sent to worker(s) {sorted(wanted - self._state.owed_resets)}")
        state = self._state
        self.wait_for(lambda: wanted.isdisjoint(state.owed_resets - state.arrived_resets) or bool(state.reset_errors),
                      timeout, "a reset result", lambda: sorted(wanted & (state.owed_resets - state.arrived_resets)))
        if state.reset_errors:
            raise state.first_error(reset=True)
        return state.hand_out(resets=wanted)
