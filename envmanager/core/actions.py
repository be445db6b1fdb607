"""Checking a batch of actions against the action space, once, before anything is sent.

One vectorized check per array of the batch, not ``space.contains`` per env. Integer spaces
(Discrete, MultiDiscrete, MultiBinary) take only integers within range. Box actions keep their
values (policies send out-of-bound values that wrappers clip) but may not be NaN, nor change
when stored in the space's dtype beyond float rounding (an overflow, a fraction in an integer
Box, an integer out of the dtype's range).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from gymnasium import spaces

from envmanager.errors import InvalidInputError

__all__ = ["ActionChecker"]

#: Up to this many actions, a Discrete batch's range is checked on Python ints (measured: 4 values
#: 0.4 us against 2.1 us for numpy's min and max; even at ~64).
_FEW = 32


def _asarray_numpy1(values: Any) -> np.ndarray:
    """``np.asarray`` that refuses ragged nested sequences as numpy 2 does (numpy 1.x warns
    and makes an object array of them, which would pass the shape check)."""
    ragged = getattr(np, "VisibleDeprecationWarning", Warning)  # numpy 1.x's (gone from numpy's top level in 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ragged)
        try:
            return np.asarray(values)
        except ragged:
            raise ValueError("the requested array has an inhomogeneous shape (ragged nested sequences)") from None


_asarray = np.asarray if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else _asarray_numpy1


class ActionChecker:
    """Turns a batch of actions for ``n`` slots into arrays of the space's layout, or raises
    :class:`InvalidInputError` saying what is wrong (and, where it can, for which slot)."""

    def __init__(self, space: spaces.Space | None) -> None:
        self.space = space
        #: A Discrete space's (lowest, highest, dtype): the fast paths of the common case.
        self._ints: tuple[int, int, np.dtype] | None = None
        if isinstance(space, spaces.Discrete):
            self._ints = (int(space.start), int(space.start) + int(space.n) - 1, np.dtype(space.dtype))

    def batch(self, actions: Any, slots: list[int] | np.ndarray) -> Any:
        """``actions`` (a batch: arrays whose first axis runs over ``slots``, or dicts / tuples
        of them) checked and as arrays of the space's dtypes."""
        ints = self._ints
        if ints is not None:
            n = len(slots)
            # An array of the space's dtype for a few slots (a policy's argmax): checked inline.
            if type(actions) is np.ndarray and n <= _FEW and actions.dtype == ints[2] and actions.shape == (n,):
                values = actions.tolist()
                if not values or (min(values) >= ints[0] and max(values) <= ints[1]):
                    return actions
            arr = _discrete_batch(actions, n, *ints)
            if arr is not None:
                return arr
        return _check(self.space, actions, np.asarray(slots), "")

    def exact(self, actions: Any, n: int) -> Any:
        """``actions`` if they already are arrays of the space's dtypes and shapes with ``n`` rows
        (dicts rebuilt in the space's key order, Tuple items as a tuple), else ``None``. Values
        are not checked: such a batch reaches each env through shared memory exactly as
        gymnasium's ``iterate`` would hand its rows over (the gymnasium drop-in's fast path)."""
        return None if self.space is None else _exact(self.space, actions, n)

    def stack(self, per_slot: list[Any], slots: list[int]) -> Any:
        """The same for one action per slot, stacked into a batch first."""
        if self._ints is not None:  # Discrete and plain ints, the common case: checked in Python
            low, high, dtype = self._ints
            if all(type(a) is int and low <= a <= high for a in per_slot):
                return np.array(per_slot, dtype=dtype)
        try:
            batch = _stack(self.space, per_slot)
        except InvalidInputError:
            raise
        except Exception as exc:
            raise InvalidInputError(f"actions for workers {list(slots)} do not fit {self.space}: {exc}") from None
        return self.batch(batch, slots)


def _discrete_batch(actions: Any, n: int, low: int, high: int, dtype: np.dtype) -> np.ndarray | None:
    """For a Discrete space, the common case in a few numpy calls: an integer array in range
    (``None`` sends anything else through the full check, which explains what is wrong)."""
    try:
        arr = _asarray(actions)
    except ValueError:
        return None
    if arr.shape != (n,) or arr.dtype.kind not in "iu":
        return None
    if n <= _FEW:  # a numpy reduction costs ~1 us whatever the size: a few values compare faster as ints
        values = arr.tolist()
        if values and (min(values) < low or max(values) > high):
            return None
    elif arr.min() < low or arr.max() > high:
        return None
    return arr.astype(dtype, copy=False)


def _exact(space: Any, batch: Any, n: int) -> Any:
    if isinstance(space, spaces.Dict):
        if type(batch) is not dict or len(batch) != len(space.spaces):
            return None
        out = {}
        for key, sub in space.spaces.items():
            value = _exact(sub, batch[key], n) if key in batch else None
            if value is None:
                return None
            out[key] = value
        return out
    if isinstance(space, spaces.Tuple):
        if not isinstance(batch, (tuple, list)) or len(batch) != len(space.spaces):
            return None
        items = tuple(_exact(sub, b, n) for sub, b in zip(space.spaces, batch, strict=True))
        return None if any(item is None for item in items) else items
    if type(batch) is not np.ndarray or batch.dtype != space.dtype or batch.shape != (n, *space.shape):
        return None
    return batch


def _stack(space: Any, values: list[Any]) -> Any:
    if isinstance(space, spaces.Dict):
        for v in values:
            if not isinstance(v, dict) or set(v) != set(space.spaces):
                got = sorted(v) if isinstance(v, dict) else type(v).__name__
                raise InvalidInputError(f"action must be a dict with keys {sorted(space.spaces)}, got {got}")
        return {key: _stack(sub, [v[key] for v in values]) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        for v in values:  # a list or an array row is a tuple's items, as ``Tuple.contains`` reads them (SB3's users give rows)
            if not (isinstance(v, (tuple, list)) or (type(v) is np.ndarray and v.ndim == 1)) or len(v) != len(space.spaces):
                raise InvalidInputError(f"action must be a tuple of {len(space.spaces)} items, got {v!r:.60}")
        return tuple(_stack(sub, [v[k] for v in values]) for k, sub in enumerate(space.spaces))
    return _asarray(values)


def _check(space: Any, batch: Any, slots: np.ndarray, where: str) -> Any:
    n = len(slots)
    if isinstance(space, spaces.Dict):
        if not isinstance(batch, dict) or set(batch) != set(space.spaces):
            got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise InvalidInputError(f"actions{where} must be a dict with keys {sorted(space.spaces)}, got {got}")
        return {key: _check(sub, batch[key], slots, f"{where}[{key!r}]") for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        if not isinstance(batch, (tuple, list)) or len(batch) != len(space.spaces):
            raise InvalidInputError(f"actions{where} must be a tuple of {len(space.spaces)} items")
        return tuple(_check(sub, b, slots, f"{where}[{k}]") for k, (sub, b) in enumerate(zip(space.spaces, batch, strict=True)))
    try:
        arr = _asarray(batch)
    except Exception as exc:  # ragged nested sequences
        raise InvalidInputError(f"actions{where} cannot be read as an array: {exc}") from None
    shape = (n, *space.shape)
    if arr.shape != shape:
        raise InvalidInputError(f"actions{where} have shape {arr.shape}, expected {shape} ({n} worker(s) × {space.shape})")
    kind = arr.dtype.kind
    if isinstance(space, (spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)):
        if kind not in "iub":  # (integers and bools)
            bad = _first_bad(arr, ~np.isclose(arr, np.round(arr)) if kind in "fc" else None)
            what = f"{arr.dtype} values" if bad is None else f"{arr.reshape(n, -1)[bad][0]!r}"
            raise InvalidInputError(_at(slots, bad, where) + f"{what} for {space}: integer actions only")
        if isinstance(space, spaces.Discrete):
            low, high = int(space.start), int(space.start) + int(space.n) - 1
            out = (arr < low) | (arr > high)
        elif isinstance(space, spaces.MultiDiscrete):
            out = (arr < space.start) | (arr >= space.start + space.nvec)
        else:
            out = (arr != 0) & (arr != 1)
        bad = _first_bad(arr, out)
        if bad is not None:
            raise InvalidInputError(_at(slots, bad, where) + f"value {arr.reshape(n, -1)[bad].tolist()} is outside {space}")
        return arr.astype(space.dtype, copy=False)
    if isinstance(space, spaces.Box):
        if kind not in "iubf":
            raise InvalidInputError(f"actions{where} of dtype {arr.dtype} for {space}: numbers only")
        if kind == "f":
            bad = _first_bad(arr, np.isnan(arr))
            if bad is not None:
                raise InvalidInputError(_at(slots, bad, where) + f"NaN in the action for {space}")
        dtype = np.dtype(space.dtype)
        if arr.dtype != dtype:
            with np.errstate(all="ignore"):
                cast = arr.astype(dtype)
            bad = _first_bad(arr, np.isinf(cast) & ~np.isinf(arr) if dtype.kind == "f" else cast != arr)
            if bad is not None:
                value = arr.reshape(n, -1)[bad].tolist()
                raise InvalidInputError(_at(slots, bad, where) + f"value {value} cannot be stored as {dtype} without loss")
            return cast
        return arr
    return arr


def _first_bad(arr: np.ndarray, mask: np.ndarray | None) -> int | None:
    """The row of the first True in ``mask``, or None."""
    if mask is None:
        return None
    rows = mask.reshape(len(arr), -1).any(axis=1) if mask.ndim > 1 else mask
    hit = np.flatnonzero(rows)
    return int(hit[0]) if hit.size else None


def _at(slots: np.ndarray, row: int | None, where: str) -> str:
    return f"action{where} for worker {int(slots[row])}: " if row is not None else f"actions{where}: "
