"""The batch manager's arguments, checked before any process starts (bad input reaches no
worker), and the seeds a ``reset(seed=...)`` gives each slot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envmanager.core.auto import AUTO
from envmanager.core.deadline import positive_seconds
from envmanager.errors import InvalidInputError
from envmanager.wire import factory as packed_factory
from envmanager.worker.envs import DISABLED, NEXT_STEP, SAME_STEP

__all__ = ["check_arguments", "seeds_for"]


def _positive_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 1)


def check_arguments(env_factory: Callable[[int], Any], n_env: Any, envs_per_worker: Any, timeout: Any,
                    autoreset_mode: Any, inherit_factory: bool = False) -> tuple[bytes, str]:
    """Raise ``InvalidInputError`` for a bad argument; return the factory as it travels to the
    workers (pickled, or with ``inherit_factory`` a key forked workers inherit: ``wire.factory``)
    and the autoreset mode's canonical name (``"next_step"`` and gymnasium's
    ``AutoresetMode.NEXT_STEP`` alike)."""
    if not _positive_int(n_env):
        raise InvalidInputError(f"n_env must be a positive int, got {n_env!r}")
    if envs_per_worker != AUTO and not _positive_int(envs_per_worker):
        raise InvalidInputError(f"envs_per_worker must be a positive int or 'auto', got {envs_per_worker!r}")
    positive_seconds("timeout", timeout)
    modes = {m.replace("_", ""): m for m in (NEXT_STEP, SAME_STEP, DISABLED)}
    mode = modes.get(str(getattr(autoreset_mode, "value", autoreset_mode)).lower().replace("_", ""), "")
    if not mode:
        raise InvalidInputError(f"unknown autoreset_mode {autoreset_mode!r}")
    if inherit_factory and not callable(env_factory):
        raise InvalidInputError(f"env_factory must be callable, got {env_factory!r}")
    try:
        factory = packed_factory.pack(env_factory, inherit_factory)
    except Exception as exc:
        raise InvalidInputError(f"env_factory cannot be pickled: {exc!r}") from exc
    return factory, mode


def seeds_for(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    """One seed per slot: ``None``; an int (slot ``i`` gets ``seed + i``); or a list of ``n``."""
    if seed is None:
        return [None] * n
    if isinstance(seed, (int, np.integer)):
        return [int(seed) + i for i in range(n)]
    seeds = list(seed)
    if len(seeds) != n:
        raise InvalidInputError(f"expected {n} seeds (one per worker), got {len(seeds)}")
    return seeds
