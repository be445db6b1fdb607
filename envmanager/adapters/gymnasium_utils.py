"""Helpers of ``envmanager.vector``: space checks, reset masks and batch shapes, as gymnasium
defines them."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces import Space
from gymnasium.vector.utils.shared_memory import create_shared_memory


def gymnasium_can_share(space: Space) -> bool:
    """Whether gymnasium's shared memory supports ``space`` (custom spaces are refused)."""
    return create_shared_memory.dispatch(type(space)) is not create_shared_memory.dispatch(object) and all(
        gymnasium_can_share(sub) for sub in _subspaces(space)
    )


def _subspaces(space: Space) -> list[Space]:
    if isinstance(space, gym.spaces.Dict):
        return list(space.spaces.values())
    if isinstance(space, gym.spaces.Tuple):
        return list(space.spaces)
    return []


def check_reset_mask(reset_mask: Any, n: int) -> np.ndarray:
    if not isinstance(reset_mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(reset_mask)}")
    if reset_mask.shape != (n,):
        raise ValueError(f"`options['reset_mask']` must have shape `({n},)`, got {reset_mask.shape}")
    if reset_mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {reset_mask.dtype}")
    if not np.any(reset_mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one True value, "
            f"got reset_mask={reset_mask}"
        )
    return reset_mask
