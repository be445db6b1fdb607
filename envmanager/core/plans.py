"""How a batch of slots splits into one request per process, or per lane of a double-buffered
process (``send_batch``'s plan), cached for the full batches and the partial batches a user
repeats; and what ``send_batch`` says when it refuses a batch. ``send_reset``'s split too."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from envmanager.core.slots import ARRIVED, IN_FLIGHT, NEEDS_RESET
from envmanager.errors import InvalidInputError
from envmanager.wire import shm
from envmanager.wire.messages import Reset, raw_locals

__all__ = ["BatchPlans", "BatchPlan", "Requests", "refuse_slots", "reset_plan", "row_of"]

_LIMIT = 1024  # the most plans cached

#: Per request (one per process, or per lane of a double-buffered process: the worker answers
#: the first lane before it steps the second): the process index, the lane (a bit mask), its
#: slots among the batch's, (their local indices, their rows in the batch), and the local
#: indices as a raw STEP request carries them.
Requests = list[tuple[int, int, tuple[int, ...], tuple[tuple[int, ...], list[int]], bytes]]


class BatchPlan(NamedTuple):
    """How one batch of slots is sent: its ``requests`` (one per process or lane, through the
    processes' pipes or rings), and its distinct ``processes`` as an array (on the step board the
    batch is one numpy operation for all of them)."""

    requests: Requests
    processes: np.ndarray


class BatchPlans:
    """The plan of every batch of slots asked for so far (up to ``_LIMIT`` of them); each slot's
    process, local index and lane (a mask)."""

    def __init__(self, slot_process: list[int], slot_local: list[int], slot_lanes: list[int]) -> None:
        self.slot_process, self.slot_local, self.slot_lanes = slot_process, slot_local, slot_lanes
        self._plans: dict[bytes, BatchPlan] = {}

    def get(self, slots: np.ndarray) -> BatchPlan:
        """The plan for ``slots`` (int64, one axis); ``InvalidInputError`` for unknown or
        repeated slots."""
        return self._plans.get(slots.tobytes()) or self._make(slots)

    def _make(self, slots: np.ndarray) -> BatchPlan:
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
        requests: Requests = []
        for (index, lanes), rows in sorted(by_lane.items()):
            rows.sort(key=listed.__getitem__)
            process_slots = tuple(listed[r] for r in rows)
            locals_ = tuple(self.slot_local[s] for s in process_slots)
            requests.append((index, lanes, process_slots, (locals_, rows), raw_locals(locals_)))
        plan = BatchPlan(requests, np.array(sorted({index for index, *_ in requests}), dtype=np.int64))
        if len(self._plans) < _LIMIT:
            self._plans[slots.tobytes()] = plan
        return plan


def slot_array(slots: Any) -> np.ndarray:
    """``slots`` as int64 on one axis; ``InvalidInputError`` for anything but integers (a float
    or bool id would silently name another slot)."""
    array = np.asarray(slots)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidInputError(f"worker ids must be integers on one axis, got {slots!r}")
    return array.astype(np.int64, copy=False)


def refuse_slots(slots: np.ndarray, status: np.ndarray, process_of: Callable[[int], Any]) -> None:
    """Raise why ``slots`` (with ``status``) cannot be stepped: the first one that cannot."""
    for slot, s in zip(slots.tolist(), status.tolist(), strict=True):
        failure = process_of(slot).failure
        if failure is not None:
            raise failure
        if s == NEEDS_RESET:
            raise InvalidInputError(f"worker {slot} must be reset before it is stepped")
        if s == IN_FLIGHT:
            raise InvalidInputError(f"worker {slot} is still stepping; it cannot take an action")
        if s == ARRIVED:
            raise InvalidInputError(f"worker {slot} has a result that was not received yet; receive it before stepping")


def reset_plan(seeds_and_options: Mapping[int, tuple[Any, Any]], slots: list[int], process_of: Callable[[int], Any],
               slot_local: np.ndarray, status: np.ndarray) -> list[tuple[int, Reset, tuple[int, ...]]]:
    """``send_reset``'s split: per process, its ``Reset`` and its slots. Raises a failed
    process's error, or ``InvalidInputError`` for a slot in flight or whose result was not
    received (its process's other slots may be busy: requests queue)."""
    by_process: dict[int, list[int]] = {}
    for slot in slots:
        w = process_of(slot)
        if w.failure is not None:
            raise w.failure
        if status[slot] in (IN_FLIGHT, ARRIVED):
            raise InvalidInputError(f"worker {slot} is busy; it cannot be reset now")
        by_process.setdefault(w.index, []).append(slot)
    try:
        return [(index, Reset(tuple(slot_local[own].tolist()), tuple(seeds_and_options[s][0] for s in own),
                              tuple(seeds_and_options[s][1] for s in own)), tuple(own))
                for index, own in by_process.items()]
    except Exception as exc:
        raise InvalidInputError(f"reset seeds or options cannot be sent: {exc!r}") from exc


def row_of(batch: Any, k: int, space: Any) -> Any:
    """Row ``k`` of a batch (one env's action, for actions that travel pickled)."""
    return batch[k] if space is None else shm.tree_map(lambda a: a[k], batch)
