"""Infos in columns: the infos of one step answer as one array per key, not one dict per env.

Envs such as MuJoCo's return the same flat info every step (``{"x_position": 0.1, ...}``);
one pickled dict per env per step costs the worker a pickle and the parent an unpickle, a
Python loop and gymnasium's ``_add_info`` per env. When every env of an answer returned an
info with the same keys in the same order, each key's values all of one type, and that type
a scalar gymnasium batches into an array of its own (``int``, ``float``, ``bool``, a numpy
number), the answer carries :class:`InfoColumns` instead: one buffer of every column, no
dict. Anything else (differing keys, nested dicts, arrays, objects) travels as dicts.

Values come back as they went: Python scalars as Python scalars, numpy scalars as numpy
scalars (``InfoColumns.dicts``), so whoever asks for per-env dicts gets the envs' own.
"""

from __future__ import annotations

import functools
from array import array
from typing import Any, NamedTuple

import numpy as np

__all__ = ["InfoColumns", "as_dicts", "to_columns", "column_dtype"]

_PYTHON = (int, float, bool)
#: Scalar types packed with the ``array`` module (a worker's step is no place for numpy's
#: per-call overhead): type -> (array typecode, the column's dtype string).
_PACK: dict[type, tuple[str, str]] = {
    int: ("q", "py:<i8"), float: ("d", "py:<f8"), bool: ("B", "py:|b1"),
    np.float64: ("d", "<f8"), np.float32: ("f", "<f4"), np.int64: ("q", "<i8"), np.int32: ("i", "<i4"),
}


class InfoColumns(NamedTuple):
    """Infos of ``n`` envs (an answer's positions, in order) as columns.

    ``keys``: the info keys, in the envs' order; ``dtypes``: each column's numpy dtype string,
    prefixed ``py:`` when the envs' values were Python scalars; ``data``: the columns' bytes,
    one after the other.
    """

    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    data: bytes

    def arrays(self) -> list[np.ndarray]:
        """The columns (read-only views of ``data``)."""
        out, offset = [], 0
        n = self.n_envs()
        for dtype in self.dtypes:
            dt = _dtype(dtype)
            out.append(np.frombuffer(self.data, dt, n, offset))
            offset += n * dt.itemsize
        return out

    def n_envs(self) -> int:
        """How many envs' infos the columns hold."""
        width = sum(_dtype(d).itemsize for d in self.dtypes)
        return len(self.data) // width if width else 0

    def dicts(self, positions: list[int] | None = None) -> list[dict[str, Any]]:
        """The envs' own info dicts (at ``positions``, default all), values as they were."""
        arrays = self.arrays() if positions is None else [a[positions] for a in self.arrays()]
        columns = [a.tolist() if d.startswith("py:") else list(a) for a, d in zip(arrays, self.dtypes, strict=True)]
        return as_dicts(self.keys, columns, self.n_envs() if positions is None else len(positions))


def as_dicts(keys: tuple[str, ...], columns: list[list[Any]], n: int) -> list[dict[str, Any]]:
    """``n`` rows of ``columns`` (one list per key) as one dict per row, keys in order: filled one
    key at a time (a ``dict(zip(keys, row))`` per row costs twice to three times as much)."""
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, column in zip(keys, columns, strict=True):
        for row, value in zip(rows, column, strict=True):
            row[key] = value
    return rows


@functools.cache
def column_dtype(dtype: str) -> np.dtype:
    """A column's numpy dtype (its dtype string, ``py:`` or not)."""
    return np.dtype(dtype.removeprefix("py:"))


_dtype = column_dtype


#: Columns cost a few numpy operations per key where dicts cost some per env and key: below
#: this many values (envs x keys) an answer's infos travel as dicts (measured: 4 envs' single
#: ``{"t": n}`` batched 0.8-0.9x as fast through columns on 2 shared cores).
MIN_VALUES = 8


def to_columns(infos: list[dict]) -> InfoColumns | None:
    """``infos`` (one non-empty dict per env) as columns, or ``None`` where they do not fit
    (see the module doc) or are too few to pay (:data:`MIN_VALUES`)."""
    first = infos[0]
    keys = tuple(first)
    if not keys or len(keys) * len(infos) < MIN_VALUES:
        return None
    for info in infos:
        if len(info) != len(keys) or tuple(info) != keys:
            return None
    dtypes, chunks = [], []
    for key in keys:
        if type(key) is not str:
            return None
        values = [info[key] for info in infos]
        kind = type(values[0])
        for v in values:
            if type(v) is not kind:
                return None
        packed = _PACK.get(kind)
        try:
            if packed is not None:
                chunks.append(array(packed[0], values).tobytes())
                dtypes.append(packed[1])
                continue
            if kind in _PYTHON or not issubclass(kind, np.number):
                return None
            column = np.array(values, dtype=kind)
        except (OverflowError, TypeError, ValueError):  # an int beyond 64 bits, say
            return None
        if column.dtype.hasobject:
            return None
        dtypes.append(column.dtype.str)
        chunks.append(column.tobytes())
    return InfoColumns(keys, tuple(dtypes), b"".join(chunks))
