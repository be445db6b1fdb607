"""How a batch of slots splits into one request per process, or per lane of a double-buffered
process (``send_batch``'s plan), cached for the full batches and the partial batches a user
repeats; and what ``send_batch`` says when it refuses a batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from envmanager.errors import InvalidInputError
from envmanager.wire import shm
from envmanager.wire.messages import raw_locals

__all__ = ["BatchPlans", "Plan", "lanes_of", "refuse_process", "refuse_slots", "row_of"]

# Slot statuses (``envmanager.core.slots``; plain ints here to keep this module below it).
_NEEDS_RESET, _IN_FLIGHT, _ARRIVED = 0, 2, 3

#: Per request (one per process, or per lane of a double-buffered process): the process index,
#: the lanes mask, its slots among the batch's, (their local indices, their rows in the batch),
#: and the local indices as a raw STEP request carries them.
Plan = list[tuple[int, int, tuple[int, ...], tuple[tuple[int, ...], list[int]], bytes]]


class BatchPlans:
    """The plan of every batch of slots asked for so far (up to ``limit`` of them)."""

    def __init__(self, slot_process: list[int], slot_local: list[int], slot_lanes: list[int] | None = None,
                 limit: int = 1024) -> None:
        self.slot_process, self.slot_local, self.limit = slot_process, slot_local, limit
        self.slot_lanes = slot_lanes or [1] * len(slot_process)  # each slot's lane, as a mask
        self._plans: dict[bytes, Plan] = {}

    def get(self, slots: np.ndarray) -> Plan:
        """The plan for ``slots`` (int64, one axis); ``InvalidInputError`` for unknown or
        repeated slots."""
        return self._plans.get(slots.tobytes()) or self._make(slots)

    def _make(self, slots: np.ndarray) -> Plan:
        listed = slots.tolist()
        n = len(self.slot_process)
        bad = [s for s in listed if not 0 <= s < n]
        if bad:
            raise InvalidInputError(f"unknown worker id {bad[0]} (n_env={n})")
        if len(set(listed)) != len(listed):
            raise InvalidInputError(f"worker ids must be distinct, got {listed}")
        by_lane: dict[tuple[int, int], list[int]] = {}
        for row, slot in enumerate(listed):
            by_lane.setdefault((self.slot_process[slot], self.slot_lanes[slot]), []).append(row)
        plan: Plan = []
        for (index, lanes), rows in sorted(by_lane.items()):
            rows.sort(key=listed.__getitem__)
            process_slots = tuple(listed[r] for r in rows)
            locals_ = tuple(self.slot_local[s] for s in process_slots)
            plan.append((index, lanes, process_slots, (locals_, rows), raw_locals(locals_)))
        if len(self._plans) < self.limit:
            self._plans[slots.tobytes()] = plan
        return plan


def lanes_of(envs_per_process: list[int], double_buffer: bool) -> list[int]:
    """Each slot's lane as a bit mask: 1; double buffered, 1 for the first half of its
    process's envs and 2 for the second."""
    return [1 << (local * 2 // k) if double_buffer else 1 for k in envs_per_process for local in range(k)]


def refuse_slots(slots: np.ndarray, status: np.ndarray, worker_of: Callable[[int], Any]) -> None:
    """Raise why ``slots`` (with ``status``) cannot be stepped: the first one that cannot."""
    for slot, s in zip(slots.tolist(), status.tolist(), strict=True):
        failure = worker_of(slot).failure
        if failure is not None:
            raise failure
        if s == _NEEDS_RESET:
            raise InvalidInputError(f"worker {slot} must be reset before it is stepped")
        if s == _IN_FLIGHT:
            raise InvalidInputError(f"worker {slot} is still stepping; it cannot take an action")
        if s == _ARRIVED:
            raise InvalidInputError(f"worker {slot} has a result that was not received yet; receive it before stepping")


def refuse_process(w: Any, slots: np.ndarray) -> None:
    """Raise why process ``w`` cannot take ``slots``' steps: it failed, or their lane is busy."""
    if w.failure is not None:
        raise w.failure
    slot = int(slots[np.isin(slots, w.env_ids)][0])
    raise InvalidInputError(f"worker {slot} is still stepping ({w.name} is busy); it cannot take an action")


def row_of(batch: Any, k: int, space: Any) -> Any:
    """Row ``k`` of a batch (one env's action, for actions that travel pickled)."""
    if space is None:
        return batch[k]
    return shm.tree_map(lambda a: a[k], batch)
