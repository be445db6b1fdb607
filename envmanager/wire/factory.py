"""How the user's env factory reaches the workers: pickled (cloudpickle), or, under ``fork`` where
the caller asks for it, inherited.

gymnasium's ``AsyncVectorEnv`` never pickles its env fns under ``fork``: an env fn closing over a
lock, an open file or a trainer's ``self`` works there, and a dataset it holds is shared
copy-on-write by every worker. The gymnasium drop-in keeps that: the factory stays in this
process under a key (:func:`pack` with ``inherit=True``), every process forked from it (a
worker, a restarted worker, ``auto``'s measuring process) finds it under that key, and the key
is all that travels. The manager forgets it when it closes.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import cloudpickle

__all__ = ["forget", "load", "pack"]

_INHERITED: dict[bytes, Callable[[int], Any]] = {}
_KEY = b"envmanager-inherited-factory:"  # (a pickle starts with its protocol byte, never with this)
_numbers = itertools.count()


def pack(factory: Callable[[int], Any], inherit: bool = False) -> bytes:
    """What travels for ``factory``: its pickle, or (``inherit``: the workers are forked from
    this process) the key it is kept under here. Pickling errors pass."""
    if not inherit:
        return cloudpickle.dumps(factory)
    key = _KEY + f"{os.getpid()}:{next(_numbers)}".encode()
    _INHERITED[key] = factory
    return key


def load(packed: bytes) -> Callable[[int], Any]:
    """The factory ``packed`` stands for, in a worker (or any process forked after ``pack``)."""
    if packed.startswith(_KEY):
        return _INHERITED[packed]
    return cloudpickle.loads(packed)


def forget(packed: bytes) -> None:
    """Drop a factory kept for forked processes (its manager closed); a pickle is nothing to drop."""
    _INHERITED.pop(packed, None)
