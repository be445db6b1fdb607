"""Observations, rewards, termination flags and actions of every env slot, as arrays whose
first axis is the slot, written in place.

In shared memory (``SharedBuffers.create`` in the parent, ``attach`` in the workers) they are
the hot path's data: a step request and its answer then carry no arrays at all. The same
class over private memory (``SharedBuffers.private``) holds the parent's copy of the results
when they travel pickled (``shared_memory=False``), so the layers above read one layout either
way. Spaces it cannot lay out (anything but Box, Discrete, MultiDiscrete, MultiBinary and
Dict/Tuple of those) have ``observation`` / ``action`` ``None``: those values travel pickled.

The shared memory has no name where the platform allows (:class:`SharedFile`): nothing is
left behind however the processes end, even all killed at once. Elsewhere it is a named POSIX
segment (``envmgr_<pid>_<hex>``) that the creator unlinks at close and multiprocessing's
resource tracker unlinks should the creator die.
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import context, reduction, shared_memory
from typing import Any

import numpy as np
from gymnasium import spaces

from envmanager.errors import SpaceMismatchError
from envmanager.wire.returns import MAX_AXES, ScalarLayout

__all__ = ["SharedBuffers", "SharedFile", "BufferLayout", "array_layout", "tree_map", "write", "read"]


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


#: The shapes of rewards and flags, as the parent decided them at the first step (``returns.ScalarLayout``).
_LAYOUT_WORD = np.zeros((3, 1 + MAX_AXES), dtype=np.int64)


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


@dataclass(frozen=True)
class BufferLayout:
    """What lives in the shared memory; picklable, so workers can map it. ``name`` is the
    named segment's, or ``""``: the :class:`SharedFile` the worker was started with."""

    name: str
    n_envs: int
    observation: Any  # layout tree or None (observations are pickled)
    action: Any  # layout tree or None (actions are pickled)

    def nbytes(self) -> int:
        total = _aligned(8 * self.n_envs) + 2 * _aligned(self.n_envs)  # reward, terminated, truncated
        total += _aligned(_LAYOUT_WORD.itemsize * int(np.prod(_LAYOUT_WORD.shape)))  # their layout (returns.ScalarLayout)
        for tree in (self.observation, self.action):
            if tree is not None:
                for leaf in _leaves(tree):
                    size = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
                    total += _aligned(self.n_envs * size)
        return max(total, 1)


class SharedFile:
    """Shared memory with no name: a ``memfd`` (Linux), else a file in ``/dev/shm`` unlinked
    as soon as it is made (as multiprocessing's own heap). The kernel frees it when the last
    process holding it (a descriptor or a mapping) ends, however it ends: nothing can leak.

    Worker processes receive it as they start, as they receive their pipes: inherited under
    ``fork``, its descriptor passed by multiprocessing under ``spawn`` and ``forkserver``; a
    restarted worker the same way. So it is made empty before the workers start, and sized
    (``resize``) once their spaces give the layout.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def create(cls) -> SharedFile | None:
        """A new empty file; ``None`` where descriptors cannot reach workers (not POSIX) or
        there is neither ``memfd_create`` nor ``/dev/shm``: named segments are used there."""
        if os.name != "posix":
            return None
        name = f"envmgr_{os.getpid()}"
        if hasattr(os, "memfd_create"):
            try:
                return cls(os.memfd_create(name, os.MFD_CLOEXEC))
            except OSError:  # a kernel or sandbox without the call
                pass
        if not os.path.isdir("/dev/shm"):
            return None
        try:
            fd, path = tempfile.mkstemp(prefix=name + "_", dir="/dev/shm")
        except OSError:
            return None
        try:
            os.unlink(path)  # still empty: even a kill before this leaves no memory behind
        except OSError:
            os.close(fd)
            return None
        return cls(fd)

    def resize(self, nbytes: int) -> None:
        os.ftruncate(self.fd, nbytes)

    def map(self, nbytes: int) -> mmap.mmap:
        return mmap.mmap(self.fd, nbytes)

    def close(self) -> None:
        """Close this process's descriptor (mappings keep the memory alive). Safe twice."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __reduce__(self) -> tuple[Callable[[Any], SharedFile], tuple[Any]]:
        # Only to a process being started, whose descriptors multiprocessing passes with it.
        if context.get_spawning_popen() is None:
            raise TypeError("a SharedFile can only be passed to a process as it starts")
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup: Any) -> SharedFile:
    fd = dup.detach()
    os.set_inheritable(fd, False)  # for the worker, not for programs its envs may exec
    return SharedFile(fd)


class SharedBuffers:
    """Per-slot arrays over one block of memory: ``observation`` and ``action`` (trees of
    arrays, or ``None``), ``reward`` (float64), ``terminated`` and ``truncated`` (bool).

    Rewards and flags have one value per slot until the first step decides their shapes
    (``scalars``, a :class:`~envmanager.wire.returns.ScalarLayout`): then ``reward`` & co. are
    arrays of those shapes (views of the same memory where each value is one element).

    ``mapping`` is the shared memory (an ``mmap`` of a :class:`SharedFile`, or a named
    ``SharedMemory``), ``None`` for private memory. The creator (``owner``) of a named
    segment is the only one to unlink it.
    """

    def __init__(self, layout: BufferLayout, memory: Any, mapping: mmap.mmap | shared_memory.SharedMemory | None, owner: bool):
        self.layout = layout
        self._mapping = mapping
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
        #: The arrays of one value per slot, whatever shapes the first step decides.
        self.base_scalars = (self.reward, self.terminated, self.truncated)
        self.layout_word: np.ndarray | None = take(_LAYOUT_WORD.shape, _LAYOUT_WORD.dtype)
        self.scalars = ScalarLayout(self)
        self.observation = None if layout.observation is None else build(layout.observation)
        self.action = None if layout.action is None else build(layout.action)

    @classmethod
    def create(
        cls, n_envs: int, observation_space: spaces.Space | None, action_space: spaces.Space | None,
        file: SharedFile | None = None,
    ) -> SharedBuffers:
        """Shared arrays in ``file`` (sized here), or, without one, in a new named segment."""
        if file is not None:
            layout = _layout("", n_envs, observation_space, action_space)
            file.resize(layout.nbytes())
            return cls._over(layout, file.map(layout.nbytes()))
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
    def attach(cls, layout: BufferLayout, file: SharedFile | None = None) -> SharedBuffers:
        """Map the arrays ``layout`` describes: its named segment, or else ``file``."""
        if layout.name:
            shm = shared_memory.SharedMemory(name=layout.name)
            return cls(layout, shm.buf, shm, owner=False)
        if file is None:
            raise ValueError("the shared memory has no name and this process was not started with its file")
        return cls._over(layout, file.map(layout.nbytes()))

    @classmethod
    def _over(cls, layout: BufferLayout, mapping: mmap.mmap) -> SharedBuffers:
        try:
            return cls(layout, mapping, mapping, owner=False)
        except BaseException:
            mapping.close()
            raise

    @property
    def shared(self) -> bool:
        return self._mapping is not None

    def close(self) -> None:
        """Let go of the memory (an ``mmap`` is unmapped with the last array over it); the owner
        of a named segment also unlinks it. Safe to call twice."""
        self.observation = self.action = None
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
        self.reward = self.terminated = self.truncated = None  # type: ignore[assignment]
        self.base_scalars = ()  # type: ignore[assignment]
        self.layout_word = self.scalars.word = None
        if isinstance(mapping, mmap.mmap):
            # Not unmapped here: arrays handed out over it (``copy=False``) read their memory
            # after close, as gymnasium's do (unmapped, they crashed the process). The last
            # reference to it (this one when there is none of those) unmaps it.
            return
        try:
            mapping.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        if self._owner and isinstance(mapping, shared_memory.SharedMemory):
            try:
                mapping.unlink()
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


def check_one_layout(observation_spaces: list[Any], action_spaces: list[Any]) -> None:
    """Shared memory lays out every slot alike: all envs' spaces must have one layout."""
    for kind, spaces_ in (("observation", observation_spaces), ("action", action_spaces)):
        first = array_layout(spaces_[0])
        for slot, space in enumerate(spaces_):
            if array_layout(space) != first:
                raise SpaceMismatchError(
                    f"worker {slot} has {kind} space {space}, unlike worker 0's {spaces_[0]}; shared "
                    "memory needs one layout for all (pass shared_memory=False)"
                )
