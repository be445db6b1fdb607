"""Observations, rewards, termination flags and actions of every env slot, as arrays whose
first axis is the slot, written in place.

In shared memory (``SharedBuffers.create`` in the parent, ``attach`` in the workers) they are
the hot path's data: a step request and its answer then carry no arrays at all. The same
class over private memory (``SharedBuffers.private``) holds the parent's copy of the results
when they travel pickled (``shared_memory=False``), so the layers above read one layout either
way. Spaces it cannot lay out (anything but Box, Discrete, MultiDiscrete, MultiBinary and
Dict/Tuple of those) have ``observation`` / ``action`` ``None``: those values travel pickled.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from gymnasium import spaces

__all__ = ["SharedBuffers", "BufferLayout", "array_layout", "tree_map", "write", "read"]


@dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]
    dtype: str


def array_layout(space: spaces.Space | None) -> Any:
    """A tree of ``_Leaf`` (shape, dtype) mirroring ``space``, or ``None`` if not array-like."""
    if isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
        return _Leaf(tuple(space.shape), np.dtype(space.dtype).str)
    if isinstance(space, spaces.Discrete):
        return _Leaf((), np.dtype(space.dtype).str)
    if isinstance(space, spaces.Dict):
        children = {key: array_layout(sub) for key, sub in space.spaces.items()}
        return None if any(c is None for c in children.values()) else children
    if isinstance(space, spaces.Tuple):
        items = tuple(array_layout(sub) for sub in space.spaces)
        return None if any(c is None for c in items) else items
    return None


def _leaves(tree: Any) -> list[_Leaf]:
    if isinstance(tree, _Leaf):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree
    return [leaf for child in values for leaf in _leaves(child)]


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


@dataclass(frozen=True)
class BufferLayout:
    """What lives in the segment; picklable, so workers can attach by name."""

    name: str
    n_envs: int
    observation: Any  # layout tree or None (observations are pickled)
    action: Any  # layout tree or None (actions are pickled)

    def nbytes(self) -> int:
        total = _aligned(8 * self.n_envs) + 2 * _aligned(self.n_envs)  # reward, terminated, truncated
        for tree in (self.observation, self.action):
            if tree is not None:
                for leaf in _leaves(tree):
                    size = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
                    total += _aligned(self.n_envs * size)
        return max(total, 1)


class SharedBuffers:
    """Per-slot arrays over one block of memory: ``observation`` and ``action`` (trees of
    arrays, or ``None``), ``reward`` (float64), ``terminated`` and ``truncated`` (bool).

    The creator (``owner``) is the only one to unlink a shared segment.
    """

    def __init__(self, layout: BufferLayout, memory: Any, shm: shared_memory.SharedMemory | None, owner: bool):
        self.layout = layout
        self._shm = shm
        self._owner = owner
        offset = 0

        def take(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            nonlocal offset
            arr = np.ndarray(shape, dtype=dtype, buffer=memory, offset=offset)
            offset += _aligned(arr.nbytes)
            return arr

        def build(tree: Any) -> Any:
            if isinstance(tree, _Leaf):
                return take((layout.n_envs, *tree.shape), np.dtype(tree.dtype))
            if isinstance(tree, dict):
                return {key: build(child) for key, child in tree.items()}
            return tuple(build(child) for child in tree)

        n = layout.n_envs
        self.reward = take((n,), np.float64)
        self.terminated = take((n,), np.bool_)
        self.truncated = take((n,), np.bool_)
        self.observation = None if layout.observation is None else build(layout.observation)
        self.action = None if layout.action is None else build(layout.action)

    @classmethod
    def create(cls, n_envs: int, observation_space: spaces.Space | None, action_space: spaces.Space | None) -> SharedBuffers:
        layout = _layout(f"envmgr_{os.getpid()}_{secrets.token_hex(4)}", n_envs, observation_space, action_space)
        shm = shared_memory.SharedMemory(name=layout.name, create=True, size=layout.nbytes())
        try:
            return cls(layout, shm.buf, shm, owner=True)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def private(cls, n_envs: int, observation_space: spaces.Space | None, action_space: spaces.Space | None) -> SharedBuffers:
        """The same arrays in this process's own memory (results that travel pickled)."""
        layout = _layout("", n_envs, observation_space, action_space)
        return cls(layout, bytearray(layout.nbytes()), None, owner=False)

    @classmethod
    def attach(cls, layout: BufferLayout) -> SharedBuffers:
        shm = shared_memory.SharedMemory(name=layout.name)
        return cls(layout, shm.buf, shm, owner=False)

    @property
    def shared(self) -> bool:
        return self._shm is not None

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment. Safe to call twice."""
        self.observation = self.action = None
        shm, self._shm = self._shm, None
        if shm is None:
            return
        self.reward = self.terminated = self.truncated = None  # type: ignore[assignment]
        try:
            shm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if self._owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def _layout(name: str, n: int, observation_space: Any, action_space: Any) -> BufferLayout:
    return BufferLayout(name, n, array_layout(observation_space), array_layout(action_space))


# ---------------------------------------------------------------------------------------------
# Trees of arrays (Dict and Tuple spaces)


def tree_map(fn: Callable[[np.ndarray], Any], tree: Any) -> Any:
    """``fn`` applied to every array of a tree (dict / tuple of arrays, or one array)."""
    if isinstance(tree, dict):
        return {key: tree_map(fn, value) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, value) for value in tree)
    return fn(tree)


def write(tree: Any, index: Any, value: Any) -> None:
    """Write ``value`` at ``index`` (a slot, or an index array with a batch as value)."""
    if isinstance(tree, np.ndarray):
        tree[index] = value
    elif isinstance(tree, dict):
        for key, arr in tree.items():
            write(arr, index, value[key])
    else:
        for arr, item in zip(tree, value, strict=True):
            write(arr, index, item)


def read(tree: Any, index: int) -> Any:
    """One slot's value from a tree of arrays: a copy for arrays, a numpy scalar for scalars."""
    if isinstance(tree, np.ndarray):
        value = tree[index]
        return value.copy() if isinstance(value, np.ndarray) else value
    if isinstance(tree, dict):
        return {key: read(arr, index) for key, arr in tree.items()}
    return tuple(read(arr, index) for arr in tree)
