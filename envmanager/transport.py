"""How results and actions move between processes.

Two pieces, used by both the parent and the workers:

* :class:`StepQueue`: the one step queue all workers post their answers to. It is a plain pipe
  whose write end every worker shares. Each notice is written with a single ``write`` of at
  most ``PIPE_BUF`` bytes, which POSIX makes atomic, so no lock is needed and a worker killed
  mid-write cannot corrupt or block the queue for the others. An answer too big for one
  notice goes over the worker's own pipe, announced by a stub notice.
* :class:`SharedBuffers`: observations, rewards, termination flags and actions of every
  environment slot, in one shared-memory segment, written in place. Spaces it cannot lay out
  (anything but Box, Discrete, MultiDiscrete, MultiBinary and Dict/Tuple of those) fall back to
  pickling inside the messages.
"""

from __future__ import annotations

import fcntl
import math
import os
import select
import secrets
import struct
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from gymnasium import spaces

from envmanager.protocol import NOTICE_HEADER, EnvironmentResponse, decode_notice

__all__ = ["StepQueue", "SharedBuffers", "BufferLayout", "array_layout", "check_value", "read_message"]

# Largest pickled notice that still goes out in one atomic write (4-byte length header included).
MAX_NOTICE_BYTES = select.PIPE_BUF - 4
_F_SETPIPE_SZ = 1031  # Linux fcntl: grow the pipe so many workers can post without waiting


class StepQueue:
    """The shared step queue: many writers (workers), one reader (the parent)."""

    def __init__(self, ctx: Any) -> None:
        self.reader, self.writer = ctx.Pipe(duplex=False)
        try:
            fcntl.fcntl(self.writer.fileno(), _F_SETPIPE_SZ, 1 << 20)
        except OSError:  # not Linux, or above pipe-max-size: the default size still works
            pass
        self._ready = select.poll()  # Connection.poll() builds a selector per call: too slow here
        self._ready.register(self.reader.fileno(), select.POLLIN)

    # -- worker side ------------------------------------------------------------------------
    @staticmethod
    def post(writer: Connection, own_pipe: Connection, notice: bytes, payload: bytes) -> None:
        """Post ``notice`` (an ``encode_notice`` header) with its pickled ``payload``; a
        payload too big for one atomic notice goes over the worker's own pipe."""
        if len(notice) + len(payload) <= MAX_NOTICE_BYTES:
            writer.send_bytes(notice + payload)
            return
        # The notice first: the parent reads the payload only once it knows it is coming, and a
        # payload larger than the pipe's buffer can only be written while the parent reads it.
        cmd, index, seq, sent_at, _ = NOTICE_HEADER.unpack(notice)
        writer.send_bytes(NOTICE_HEADER.pack(cmd, index, seq, sent_at, True))
        own_pipe.send_bytes(payload)

    # -- parent side ------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether a notice is waiting (without blocking)."""
        return bool(self._ready.poll(0))

    def get_nowait(self) -> tuple[EnvironmentResponse, bool] | None:
        """The next notice (payload still pickled) and whether its payload is on the worker's
        own pipe; ``None`` if the queue is empty right now."""
        if not self._ready.poll(0):
            return None
        return decode_notice(self.reader.recv_bytes())

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


# ---------------------------------------------------------------------------------------------
# Shared memory


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


@dataclass(frozen=True)
class BufferLayout:
    """What lives in the shared segment; picklable, so workers can attach by name."""

    name: str
    n_envs: int
    observation: Any  # layout tree or None (observations are pickled)
    action: Any  # layout tree or None (actions are pickled)

    def nbytes(self) -> int:
        n = self.n_envs
        total = _aligned(8 * n) + 2 * _aligned(n)  # reward, terminated, truncated
        for tree in (self.observation, self.action):
            if tree is not None:
                for leaf in _leaves(tree):
                    total += _aligned(self.n_envs * _leaf_bytes(leaf))
        return total


def _leaf_bytes(leaf: _Leaf) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class SharedBuffers:
    """Views on one shared-memory segment: per-slot observations, rewards, flags, actions.

    Arrays have the environment slot as their first axis. The parent creates the segment
    (``create``) and is the only one to unlink it; workers ``attach`` by name.
    """

    def __init__(self, layout: BufferLayout, shm: shared_memory.SharedMemory, owner: bool):
        self.layout = layout
        self._shm = shm
        self._owner = owner
        buf = shm.buf
        offset = 0

        def take(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            nonlocal offset
            arr = np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset)
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
    def create(
        cls, n_envs: int, observation_space: spaces.Space | None, action_space: spaces.Space | None
    ) -> SharedBuffers:
        layout = BufferLayout(
            name=f"envmgr_{os.getpid()}_{secrets.token_hex(4)}",
            n_envs=n_envs,
            observation=array_layout(observation_space),
            action=array_layout(action_space),
        )
        shm = shared_memory.SharedMemory(name=layout.name, create=True, size=layout.nbytes())
        try:
            return cls(layout, shm, owner=True)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, layout: BufferLayout) -> SharedBuffers:
        return cls(layout, shared_memory.SharedMemory(name=layout.name), owner=False)

    # -- per-slot access --------------------------------------------------------------------
    @staticmethod
    def write(tree: Any, index: int, value: Any) -> None:
        """Write one slot's value into a tree of arrays (observation or action)."""
        if isinstance(tree, np.ndarray):
            tree[index] = value
        elif isinstance(tree, dict):
            for key, arr in tree.items():
                SharedBuffers.write(arr, index, value[key])
        else:
            for arr, item in zip(tree, value, strict=True):
                SharedBuffers.write(arr, index, item)

    @staticmethod
    def read(tree: Any, index: int) -> Any:
        """A copy of one slot's value from a tree of arrays."""
        if isinstance(tree, np.ndarray):
            value = tree[index]
            return value.copy() if isinstance(value, np.ndarray) else value
        if isinstance(tree, dict):
            return {key: SharedBuffers.read(arr, index) for key, arr in tree.items()}
        return tuple(SharedBuffers.read(arr, index) for arr in tree)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment. Safe to call twice."""
        if self._shm is None:
            return
        self.observation = self.action = None
        self.reward = self.terminated = self.truncated = None  # type: ignore[assignment]
        shm, self._shm = self._shm, None
        try:
            shm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if self._owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def check_value(tree: Any, value: Any) -> str | None:
    """Why ``value`` does not fit the layout ``tree`` (wrong shape or keys), or ``None``."""
    if isinstance(tree, _Leaf):
        if isinstance(value, (np.ndarray, np.generic)):
            shape = value.shape
        elif isinstance(value, (int, float, bool)):
            shape = ()
        else:
            try:
                shape = np.shape(value)
            except Exception as exc:  # ragged nested sequences
                return f"cannot be read as an array ({exc})"
        if shape != tree.shape:
            return f"has shape {shape}, expected {tree.shape}"
        return None
    if isinstance(tree, dict):
        if not isinstance(value, dict) or set(value) != set(tree):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            return f"must be a dict with keys {sorted(tree)}, got {got}"
        for key, child in tree.items():
            why = check_value(child, value[key])
            if why:
                return f"[{key!r}] {why}"
        return None
    if not isinstance(value, (tuple, list)) or len(value) != len(tree):
        return f"must be a tuple of {len(tree)} items"
    for n, (child, item) in enumerate(zip(tree, value)):
        why = check_value(child, item)
        if why:
            return f"[{n}] {why}"
    return None


def read_message(conn: Connection, deadline: float, sentinel: int) -> bytes:
    """One ``send_bytes`` message from ``conn``, read before ``deadline`` (``time.monotonic``).

    ``Connection.recv_bytes`` would block with no bound once a message has begun; this raises
    ``TimeoutError`` past the deadline and ``EOFError`` once the writer is gone (``sentinel``,
    its process, has ended and nothing more is buffered).
    """
    fd = conn.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(sentinel, select.POLLIN)

    def read_exact(n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("a message from the worker did not arrive in time")
            events = dict(poller.poll(max(1, math.ceil(left * 1000))))
            if fd in events:
                chunk = os.read(fd, min(n - got, 1 << 20))
                if not chunk:
                    raise EOFError("the worker's pipe closed mid-message")
                chunks.append(chunk)
                got += len(chunk)
            elif sentinel in events:
                raise EOFError("the worker ended mid-message")
        return b"".join(chunks)

    (size,) = struct.unpack("!i", read_exact(4))
    if size == -1:  # multiprocessing's header for messages over 2 GiB
        (size,) = struct.unpack("!Q", read_exact(8))
    return read_exact(size)
