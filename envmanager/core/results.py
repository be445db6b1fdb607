"""What the manager hands back: ``StepResult``, ``StepTimings``, ``StepInfo`` (the StepInfo
level) and ``StepBatch`` (the batch level)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["StepResult", "StepTimings", "StepInfo", "StepBatch", "InfoBlock"]


class StepResult(NamedTuple):
    """One environment's result, gymnasium style."""

    observation: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class StepTimings(NamedTuple):
    """Where the time went, in seconds: ``env`` inside the environment's ``step``/``reset`` in the
    worker; ``queued`` from the worker posting the result until the parent took it;
    ``round_trip`` from sending the command until the result was taken."""

    env: float = 0.0
    queued: float = 0.0
    round_trip: float = 0.0


class StepInfo(NamedTuple):
    """One finished environment step, as returned by ``SubprocessEnvManager.step``.

    ``previous_result`` is the result the action was chosen from (``None`` right after a reset),
    ``current_result`` the result it led to. ``interrupted`` marks a result from a restarted
    worker: the episode was cut short and ``current_result`` is a fresh reset. ``generation``:
    how often the slot's env had been replaced when it answered (a newer one: a fresh env).
    """

    worker_id: int
    previous_result: StepResult | None
    current_result: StepResult
    action: Any
    timings: StepTimings = StepTimings()
    interrupted: bool = False
    generation: int = 0


class InfoBlock(NamedTuple):
    """The infos of some slots as columns (one answer's, ``envmanager.wire.info_columns``):
    ``columns[j][i]`` is slot ``slots[i]``'s value of ``keys[j]``; ``python[j]``: the envs
    returned Python scalars for that key (else numpy scalars of the column's dtype)."""

    slots: np.ndarray
    keys: tuple[str, ...]
    columns: list[np.ndarray]
    python: tuple[bool, ...]


class StepBatch(NamedTuple):
    """The slots that finished, in the order they finished, and what only they carry.

    Their observations, rewards and flags are rows ``slots`` of the manager's ``results``
    arrays (shared memory when it is on): read them before sending those slots again.
    ``infos``: the non-empty info dicts by slot; ``interrupted``: slots whose result is the fresh
    reset of a restarted worker; ``resets``: slots whose result is a reset; ``info_columns``: the
    infos that came as columns, with ``receive_batch(info_columns=True)`` (else in ``infos``).
    ``generations``: the manager's array of every slot's generation as of its latest answer; rows
    ``slots`` are this batch's, valid as the ``results`` rows are (no copy per batch).
    """

    slots: np.ndarray
    infos: dict[int, dict]
    interrupted: frozenset[int] = frozenset()
    resets: frozenset[int] = frozenset()
    info_columns: tuple[InfoBlock, ...] = ()
    generations: np.ndarray | None = None
