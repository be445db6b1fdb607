"""Do an env's outputs match what it declares, and what would envmanager's shared memory do
with them? And do two trajectories agree?

Shared memory holds one array per observation leaf with the dtype and shape of the space
(``envmanager.wire.shm``): a value is written into it as gymnasium's shared memory writes it
(``envmanager.wire.returns``): with numpy's casting, so a float64 observation of a float32 Box
is rounded and an int too large for a uint8 wraps around; another shape with the space's number
of elements is reshaped, one element fills the slot, any other shape fails the step; a value
outside the bounds is stored unchanged (nothing clips). Rewards are batched as float64 and flags
as booleans, in the shape the first step gave them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from envmanager.check.probes import Trajectory, Unpicklable
from envmanager.wire.returns import write_shared

__all__ = ["Finding", "space_findings", "first_difference", "show"]

TOLERANCE = {"rtol": 1e-6, "atol": 1e-9}  # float outputs of the same computation may differ in the last bits


@dataclass
class Finding:
    """One kind of mismatch at one place of the observation (``where``), first seen at entry
    ``index`` of a trajectory, seen ``count`` times."""

    problem: str
    where: str
    index: int
    text: str
    count: int = 1


def show(value: Any, limit: int = 6) -> str:
    """A short, readable rendering of an output."""
    if isinstance(value, np.ndarray):
        body = np.array2string(value.reshape(-1)[:limit] if value.size > limit else value, precision=6, separator=", ",
                               threshold=limit)
        more = f" ... ({value.size} values)" if value.size > limit else ""
        return f"{body}{more} ({value.dtype}, shape {value.shape})"
    if isinstance(value, np.generic):
        return f"{value!r}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {show(v, limit)}" for k, v in list(value.items())[:limit]) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(show(v, limit) for v in value[:limit]) + ")"
    return f"{value!r:.100}"


def _entry(index: int) -> str:
    return "the reset" if index == 0 else f"step {index}"


def _leaf_findings(space: Any, value: Any, where: str, index: int) -> list[Finding]:
    if isinstance(value, Unpicklable):
        return [Finding("observation-not-in-space", where, index, f"an observation that cannot be pickled: {value.text}")]
    if isinstance(space, spaces.Dict):
        if not isinstance(value, dict) or set(value) != set(space.spaces):
            return [Finding("observation-not-in-space", where, index,
                            f"{_entry(index)}: expected a dict with keys {sorted(space.spaces)}, got {show(value)}")]
        return [f for key, sub in space.spaces.items() for f in _leaf_findings(sub, value[key], f"{where}[{key!r}]", index)]
    if isinstance(space, spaces.Tuple):
        if not isinstance(value, tuple) or len(value) != len(space.spaces):
            return [Finding("observation-not-in-space", where, index,
                            f"{_entry(index)}: expected a tuple of {len(space.spaces)}, got {show(value)}")]
        return [f for i, sub in enumerate(space.spaces) for f in _leaf_findings(sub, value[i], f"{where}[{i}]", index)]
    if isinstance(space, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)):
        return _array_findings(space, value, where, index)
    try:
        inside = space.contains(value)
    except Exception:
        inside = False
    if inside:
        return []
    return [Finding("observation-not-in-space", where, index, f"{_entry(index)}: {show(value)} is not in {space}")]


def _array_findings(space: Any, value: Any, where: str, index: int) -> list[Finding]:
    """dtype, shape and bounds of one array leaf, with what shared memory does with it."""
    shape = tuple(space.shape) if not isinstance(space, spaces.Discrete) else ()
    dtype = np.dtype(space.dtype)
    try:
        array = np.asarray(value)
    except Exception:
        return [Finding("observation-not-in-space", where, index, f"{_entry(index)}: {show(value)} is not an array")]
    if array.dtype == object or array.dtype.kind not in "biuf":
        return [Finding("observation-not-in-space", where, index,
                        f"{_entry(index)}: {show(value)} is not numeric (the space holds {dtype})")]
    if array.shape != shape:
        stored = np.zeros((1, *shape), dtype)
        try:
            write_shared(stored, 0, array)
            fate = f"shared memory {'reshapes' if array.size == stored[0].size else 'broadcasts'} it into shape {shape}"
        except Exception as exc:
            fate = f"shared memory cannot hold it: the step fails ({type(exc).__name__}: {exc})"
        return [Finding("observation-shape", where, index,
                        f"{_entry(index)}: shape {array.shape}, the space declares {shape}; {fate}")]
    out = []
    if array.dtype != dtype:
        out.append(Finding("observation-dtype", where, index,
                           f"{_entry(index)}: {array.dtype}, the space declares {dtype}; {_cast_fate(array, dtype)}"))
    low, high = _bounds(space, shape, dtype)
    if low is not None:
        with np.errstate(invalid="ignore"):
            outside = ~((array >= low) & (array <= high))
        if outside.any():
            first = np.argwhere(outside)[0]
            at = f" at {tuple(int(i) for i in first)}" if array.ndim else ""
            got = array[tuple(first)] if array.ndim else array
            bound = f"[{_scalar(low, first)}, {_scalar(high, first)}]"
            out.append(Finding("observation-out-of-bounds", where, index,
                               f"{_entry(index)}: {got!r}{at} is outside {bound} ({int(outside.sum())} of "
                               f"{array.size} values); shared memory stores it unchanged (nothing clips it)"))
    return out


def _cast_fate(array: np.ndarray, dtype: np.dtype) -> str:
    stored = np.zeros(array.shape, dtype)
    try:
        with np.errstate(all="ignore"):
            stored[...] = array
    except Exception as exc:
        return f"shared memory cannot hold it: the step fails ({type(exc).__name__}: {exc})"
    with np.errstate(all="ignore"):
        back = stored.astype(array.dtype)
        same = back == array
        if array.dtype.kind == "f":
            same |= np.isnan(back) & np.isnan(array)
        changed = ~same
    if not changed.any():
        return f"shared memory stores it as {dtype} (these values unchanged)"
    i = tuple(np.argwhere(changed)[0]) if array.ndim else ()
    before, after = array[i] if array.ndim else array, stored[i] if array.ndim else stored
    if dtype.kind == "f" and array.dtype.kind == "f":
        err = float(np.nanmax(np.abs(back.astype(np.float64) - array.astype(np.float64))))
        return f"shared memory stores it as {dtype}, rounded (largest change {err:.3g}: {before!r} -> {after!r})"
    return f"shared memory stores it as {dtype}, changing values ({before!r} becomes {after!r})"


def _bounds(space: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, Any]:
    if isinstance(space, spaces.Box):
        return space.low, space.high
    if isinstance(space, spaces.Discrete):
        return space.start, space.start + space.n - 1
    if isinstance(space, spaces.MultiDiscrete):
        return space.start, space.start + space.nvec - 1
    if isinstance(space, spaces.MultiBinary):
        return 0, 1
    return None, None


def _scalar(bound: Any, index: Any) -> Any:
    b = np.asarray(bound)
    return b[tuple(index)].item() if b.ndim else b.item()


def space_findings(trajectory: Trajectory, observation_space: Any) -> list[Finding]:
    """Every kind of mismatch of the observations, rewards, flags and infos of ``trajectory``
    (each kind once per place, with the first entry where it was seen and a count)."""
    found: dict[tuple[str, str], Finding] = {}

    def note(finding: Finding) -> None:
        key = (finding.problem, finding.where)
        if key in found:
            found[key].count += 1
        else:
            found[key] = finding

    for index, obs in enumerate(trajectory.observations):
        if observation_space is not None:
            for finding in _leaf_findings(observation_space, obs, "observation", index):
                note(finding)
        if index > 0:
            for finding in _step_findings(index, trajectory.rewards[index], trajectory.terminated[index],
                                          trajectory.truncated[index]):
                note(finding)
        info = trajectory.infos[index]
        if info is not None:
            note(Finding(info[0], "info", index, f"{_entry(index)}: {info[1]}"))
    return list(found.values())


def _step_findings(index: int, reward: Any, terminated: Any, truncated: Any) -> list[Finding]:
    out = []
    r = np.asarray(reward) if not isinstance(reward, Unpicklable) else None
    if r is None or r.ndim != 0 or r.dtype.kind not in "biuf":
        fate = "vector envs batch rewards as float64 arrays: "
        try:
            shape = np.asarray(reward, dtype=np.float64).shape
            fate += (f"rewards of this shape come back as (n, {', '.join(map(str, shape))}), as in gymnasium's "
                     "AsyncVectorEnv (the first step decides the shape)") if shape else "numpy converts it"
        except Exception as exc:
            fate += f"it cannot, the step fails ({type(exc).__name__})"
        out.append(Finding("reward-not-scalar", "reward", index, f"{_entry(index)}: {show(reward)}; {fate}"))
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool, np.bool_)):
            out.append(Finding("flags-not-bool", name, index,
                               f"{_entry(index)}: {name} is {show(flag)}; shared memory stores bool({name})"))
    return out


def first_difference(a: Trajectory, b: Trajectory) -> tuple[int, str, Any, Any] | None:
    """``(entry, field, value in a, value in b)`` of the first difference of two trajectories
    over the entries both have (observations, rewards, flags; infos are not compared), or ``None``."""
    fields = (("observation", a.observations, b.observations), ("reward", a.rewards, b.rewards),
              ("terminated", a.terminated, b.terminated), ("truncated", a.truncated, b.truncated))
    for index in range(min(len(a), len(b))):
        for name, xs, ys in fields:
            if not _same(xs[index], ys[index]):
                return index, name, xs[index], ys[index]
    return None


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same(i, j) for i, j in zip(x, y, strict=True))
    try:
        ax, ay = np.asarray(x), np.asarray(y)
        if ax.dtype.kind in "biuf" and ay.dtype.kind in "biuf":
            return ax.shape == ay.shape and bool(np.allclose(ax, ay, equal_nan=True, **TOLERANCE))
    except Exception:
        pass
    try:
        return bool(x == y)
    except Exception:
        return repr(x) == repr(y)
