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

__all__ = ["check_arguments", "seeds_for", "is_count", "positive_count"]


def is_count(value: Any, least: int = 0) -> bool:
    """Whether ``value`` is an int (numpy's too, never a bool) of at least ``least``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= least)


def positive_count(name: str, value: Any) -> None:
    """Refuse ``value`` (``InvalidInputError``) unless it is an int of at least 1 (``is_count``)."""
    if not is_count(value, 1):
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")


def check_arguments(env_factory: Callable[[int], Any], n_env: Any, envs_per_worker: Any, timeout: Any,
                    autoreset_mode: Any, inherit_factory: bool = False) -> tuple[bytes, str]:
    """Raise ``InvalidInputError`` for a bad argument; return the factory as it travels to the
    workers (pickled, or with ``inherit_factory`` a key forked workers inherit: ``wire.factory``)
    and the autoreset mode's canonical name (``"next_step"`` and gymnasium's
    ``AutoresetMode.NEXT_STEP`` alike)."""
    positive_count("n_env", n_env)
    if envs_per_worker != AUTO and not is_count(envs_per_worker, 1):
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
