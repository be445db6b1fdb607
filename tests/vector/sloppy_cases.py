"""Hypothesis strategies for what hand-written envs return, and the comparison of a vector env's
results with its reference's (``test_sloppy_returns.py``).

A *case* is one script per env slot (``sloppy_envs.ReplayEnv``): a reset's ``(obs, info)`` and a
few steps' ``(obs, reward, terminated, truncated, info)``, every value of some Python or numpy
type and shape the spaces allow or nearly allow. Rewards and flags keep one *shape family* per
case (scalars, shape ``(1,)``, ...): the batch layout is decided at the first step, so a case
whose shapes wander is a different test (``wandering``).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import numpy as np
from hypothesis import strategies as st
from sloppy_envs import obs_space

#: Reward shape families: the trailing shape of the rewards batch each gives.
REWARD_FAMILIES = {"scalar": (), "one": (1,), "pair": (2,), "column": (1, 1)}
#: Flag shape families (a flag of two or more elements has no truth value: refused by all).
FLAG_FAMILIES = {"scalar": (), "one": (1,)}

_small_floats = st.floats(-5.0, 5.0, allow_nan=False, allow_infinity=False)
_small_ints = st.integers(-5, 5)


# ------------------------------------------------------------------------------------------------
# Rewards and flags


@st.composite
def scalar_reward(draw) -> Any:
    """A reward of shape ``()``: every Python and numpy scalar type, 0-d arrays, nan and inf."""
    x = draw(st.one_of(_small_floats, st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e300])))
    i = draw(_small_ints)
    form = draw(st.sampled_from([
        "float", "int", "bool", "f16", "f32", "f64", "i8", "i32", "i64", "u8", "np_bool", "0d_f64", "0d_i64", "0d_f32",
    ]))
    return {
        "float": lambda: float(x),
        "int": lambda: int(i),
        "bool": lambda: bool(i % 2),
        "f16": lambda: np.float16(x) if math.isfinite(x) and abs(x) < 6e4 else np.float16(1.5),
        "f32": lambda: np.float32(x) if abs(x) < 3e38 else np.float32(2.5),
        "f64": lambda: np.float64(x),
        "i8": lambda: np.int8(i),
        "i32": lambda: np.int32(i),
        "i64": lambda: np.int64(i),
        "u8": lambda: np.uint8(abs(i)),
        "np_bool": lambda: np.bool_(i % 2),
        "0d_f64": lambda: np.array(x),
        "0d_i64": lambda: np.array(i),
        "0d_f32": lambda: np.array(x, dtype=np.float32) if abs(x) < 3e38 else np.array(0.5, dtype=np.float32),
    }[form]()


@st.composite
def shaped_reward(draw, shape: tuple[int, ...]) -> Any:
    """A reward of ``shape`` (not ``()``): arrays of several dtypes, nested lists and tuples."""
    size = int(np.prod(shape))
    values = draw(st.lists(_small_floats, min_size=size, max_size=size))
    base = np.array(values, dtype=np.float64).reshape(shape)
    form = draw(st.sampled_from(["f64", "f32", "i64", "bool", "list", "tuple", "list_of_np"]))
    if form == "f64":
        return base
    if form == "f32":
        return base.astype(np.float32)
    if form == "i64":
        return base.astype(np.int64)
    if form == "bool":
        return base > 0
    if form == "list":
        return base.tolist()
    if form == "tuple":
        return _tuples(base.tolist())
    return [np.float64(v) for v in base.reshape(-1)] if len(shape) == 1 else base.tolist()


def reward_in(family: str) -> st.SearchStrategy:
    shape = REWARD_FAMILIES[family]
    return scalar_reward() if shape == () else shaped_reward(shape)


@st.composite
def flag_in(draw, family: str, p_true: float = 0.2) -> Any:
    """A terminated / truncated flag of the family's shape; true about ``p_true`` of the time."""
    truth = draw(st.integers(0, 99)) < p_true * 100
    if family == "scalar":
        form = draw(st.sampled_from(["bool", "int", "np_bool", "np_int", "0d_bool", "0d_int", "float", "none"]))
        if form == "none":
            return None if not truth else True
        return {
            "bool": bool(truth),
            "int": int(truth) * draw(st.sampled_from([1, 2])),
            "np_bool": np.bool_(truth),
            "np_int": np.int64(truth),
            "0d_bool": np.array(truth),
            "0d_int": np.array(int(truth)),
            "float": float(truth),
        }[form]
    form = draw(st.sampled_from(["bool", "int", "list"]))
    if form == "bool":
        return np.array([truth])
    if form == "int":
        return np.array([int(truth)])
    return [truth]


# ------------------------------------------------------------------------------------------------
# Observations


#: How far a case's observations stray: other types of the space's shape; other shapes with
#: its number of elements (gymnasium's shared memory takes them, its ``concatenate`` does not);
#: values the space nearly allows (out of its range, an element too many, a key missing).
OBS_MODES = ("typed", "shaped", "nearly")


@st.composite
def box_value(draw, shape: tuple[int, ...], dtype: Any, low: float, high: float, mode: str) -> Any:
    """A value for a Box: its dtype or not, lists, tuples, transposed; ``shaped``: scalars,
    leading / trailing axes of one, flat; ``nearly``: also one element too many."""
    size = int(np.prod(shape))
    if np.dtype(dtype).kind in "iu":
        elems = st.integers(int(low), int(high))
    else:
        elems = st.floats(low, high, allow_nan=False)
    values = draw(st.lists(elems, min_size=size, max_size=size))
    base = np.array(values).reshape(shape)
    forms = ["own", "f64", "f32", "i64", "list", "tuple", "transposed"]
    if mode != "typed":
        forms += ["lead1", "trail1", "flat", "scalar", "np_scalar"]
    if mode == "nearly":
        forms += ["one_more"]
    form = draw(st.sampled_from(forms))
    if form == "own":
        return base.astype(dtype)
    if form == "f64":
        return base.astype(np.float64)
    if form == "f32":
        return base.astype(np.float32)
    if form == "i64":
        return np.trunc(base).astype(np.int64)
    if form == "list":
        return base.tolist()
    if form == "tuple":
        return _tuples(base.tolist())
    if form == "lead1":
        return base.reshape((1, *shape))
    if form == "trail1":
        return base.reshape((*shape, 1))
    if form == "flat":
        return base.reshape(-1)
    if form == "scalar":
        return base.reshape(-1)[0].item()
    if form == "np_scalar":
        return base.reshape(-1)[0]
    if form == "transposed":
        return base.astype(dtype).T
    return np.append(base.reshape(-1), base.reshape(-1)[:1])  # one_more


@st.composite
def discrete_value(draw, n: int, mode: str) -> Any:
    x = draw(st.integers(0, n - 1) if mode != "nearly" else st.integers(-1, n))
    forms = ["int", "i64", "i32", "0d"]
    if x >= 0:
        forms.append("u8")
    if mode != "typed":
        forms += ["one", "float", "np_f32"] + (["bool"] if x in (0, 1) else [])
    if mode == "nearly":
        forms.append("half")
    form = draw(st.sampled_from(forms))
    return {
        "int": lambda: int(x),
        "i64": lambda: np.int64(x),
        "i32": lambda: np.int32(x),
        "u8": lambda: np.uint8(x),
        "0d": lambda: np.array(x),
        "one": lambda: np.array([x]),
        "float": lambda: float(x),
        "np_f32": lambda: np.float32(x),
        "bool": lambda: bool(x),
        "half": lambda: x + 0.5,
    }[form]()


@st.composite
def multibinary_value(draw, n: int, mode: str) -> Any:
    bits = draw(st.lists(st.integers(0, 2 if mode == "nearly" else 1), min_size=n, max_size=n))
    form = draw(st.sampled_from(["i8", "bool", "i64", "list_bool", "list_int", "tuple"]))
    return {
        "i8": lambda: np.array(bits, dtype=np.int8),
        "bool": lambda: np.array(bits, dtype=bool),
        "i64": lambda: np.array(bits, dtype=np.int64),
        "list_bool": lambda: [bool(b) for b in bits],
        "list_int": lambda: list(bits),
        "tuple": lambda: tuple(bits),
    }[form]()


@st.composite
def observation(draw, kind: str, mode: str = "nearly") -> Any:
    """An observation an env of ``kind`` (``sloppy_envs.OBS_KINDS``) might return (``OBS_MODES``)."""
    space = obs_space(kind)
    return draw(_value_of(space, mode))


def _value_of(space: Any, mode: str) -> st.SearchStrategy:
    from gymnasium import spaces

    if isinstance(space, spaces.Box):
        low, high = float(space.low.reshape(-1)[0]), float(space.high.reshape(-1)[0])
        if mode == "nearly" and np.dtype(space.dtype).kind == "u":
            low, high = low - 1, high + 1
        return box_value(tuple(space.shape), space.dtype, low, high, mode)
    if isinstance(space, spaces.Discrete):
        return discrete_value(int(space.n), mode)
    if isinstance(space, spaces.MultiBinary):
        return multibinary_value(int(space.n), mode)
    if isinstance(space, spaces.Dict):
        return _dict_value(space, mode)
    if isinstance(space, spaces.Tuple):
        return _tuple_value(space, mode)
    raise TypeError(space)


@st.composite
def _dict_value(draw, space: Any, mode: str) -> Any:
    value = {key: draw(_value_of(sub, mode)) for key, sub in space.spaces.items()}
    forms = ["plain", "reversed", "extra_key"] + (["missing_key"] if mode == "nearly" else [])
    form = draw(st.sampled_from(forms))
    if form == "reversed":
        return dict(reversed(list(value.items())))
    if form == "extra_key":
        return {**value, "zz": 1}
    if form == "missing_key":
        return dict(list(value.items())[1:])
    return value


@st.composite
def _tuple_value(draw, space: Any, mode: str) -> Any:
    items = [draw(_value_of(sub, mode)) for sub in space.spaces]
    forms = ["tuple", "list"] + (["extra_item"] if mode == "nearly" else [])
    form = draw(st.sampled_from(forms))
    if form == "list":
        return items
    if form == "extra_item":
        return (*items, 0)
    return tuple(items)


# ------------------------------------------------------------------------------------------------
# Infos


#: The kinds of info values: each a strategy.
INFO_VALUES = {
    "int": _small_ints, "float": _small_floats, "bool": st.booleans(), "str": st.sampled_from(["", "x", "ok"]),
    "none": st.none(), "np_f32": _small_floats.map(np.float32), "np_i64": _small_ints.map(np.int64),
    "np_i8": _small_ints.map(np.int8), "array2": st.lists(_small_floats, min_size=2, max_size=2).map(np.array),
    "list": st.lists(_small_ints, max_size=2), "dict": st.dictionaries(st.sampled_from(["x", "y"]), _small_ints, max_size=2),
}
#: Values only the wild infos hold: arrays whose shapes differ from env to env.
_RAGGED = st.lists(_small_ints, min_size=1, max_size=3).map(np.array)


@st.composite
def info(draw, kinds: dict[str, str] | None = None) -> dict[str, Any]:
    """An info dict with some of the keys ``a``, ``b``, ``c`` (envs and steps differ): each
    key's values of the kind ``kinds`` gives it (envs that agree, as most do), or of any kind."""
    keys = draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3))
    return {key: draw(INFO_VALUES[kinds[key]] if kinds else st.one_of(*INFO_VALUES.values(), _RAGGED)) for key in keys}


# ------------------------------------------------------------------------------------------------
# Cases


@st.composite
def case(draw, n: int, obs_kind: str, steps: int, reward_family: str, flag_family: str) -> list[dict[str, Any]]:
    """One script per env slot: a reset and ``steps`` steps. Observations stray as the case's
    mode (``OBS_MODES``) lets them; one case in four has infos whose values disagree in kind."""
    mode = draw(st.sampled_from((*OBS_MODES, "typed")))  # typed twice as often: more steps the references take
    kinds = None if draw(st.integers(0, 3)) == 0 else {key: draw(st.sampled_from(sorted(INFO_VALUES))) for key in "abc"}
    table = []
    for _ in range(n):
        reset = (draw(observation(obs_kind, mode)), draw(info(kinds)))
        rows = []
        for _ in range(steps):
            rows.append((
                draw(observation(obs_kind, mode)),
                draw(reward_in(reward_family)),
                draw(flag_in(flag_family)),
                draw(flag_in(flag_family, p_true=0.1)),
                draw(info(kinds)),
            ))
        table.append({"reset": reset, "steps": rows})
    return table


def _tuples(nested: Any) -> Any:
    return tuple(_tuples(x) for x in nested) if isinstance(nested, list) else nested


# ------------------------------------------------------------------------------------------------
# Comparing


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Exact equality of two results: the same types, numpy dtypes, shapes and values (nan
    equal to nan), dict keys in the same order, object arrays element by element."""
    at = where or "<root>"
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{at}: expected a dict, got {type(actual).__name__} {actual!r}"
        assert list(actual) == list(expected), f"{at}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected), f"{at}: {type(actual).__name__} != {type(expected).__name__}"
        assert len(actual) == len(expected), f"{at}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{at}: expected ndarray, got {type(actual).__name__} {actual!r}"
        assert actual.dtype == expected.dtype, f"{at}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{at}: shape {actual.shape} != {expected.shape}"
        if expected.dtype == object:
            for idx in np.ndindex(expected.shape):
                assert_same(actual[idx], expected[idx], f"{where}[{idx}]")
        else:
            assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind in "fc"), \
                f"{at}: {actual!r} != {expected!r}"
    else:
        assert type(actual) is type(expected), f"{at}: type {type(actual).__name__} != {type(expected).__name__}"
        if isinstance(expected, float) and math.isnan(expected):
            assert math.isnan(actual), f"{at}: {actual!r} != nan"
        else:
            assert actual == expected, f"{at}: {actual!r} != {expected!r}"


def named_in(error: BaseException) -> str:
    """Everything an error says: its message and those of the errors it was raised from."""
    parts = []
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def assert_names(error: BaseException, call: str, n: int) -> tuple[int, str | None]:
    """The error names an env slot and the call (``env i's step() returned reward ...``, or a
    worker's account: ``worker i ...``); returns the slot and what it returned that was refused
    (``observation``, ``reward``, ``terminated``, ``truncated``, ``info``; ``None`` if unnamed)."""
    text = named_in(error)
    found = re.search(r"\benv (\d+)'s (\w+)\(\) returned (observation|reward|terminated|truncated|info)?", text)
    if found:
        slot, named_call, what = int(found.group(1)), found.group(2), found.group(3)
        assert named_call == call, f"the error names {named_call}(), not {call}(): {text!r}"
    else:
        found = re.search(r"\bworker (\d+)\b", text)
        assert found, f"the error names no env: {text!r}"
        slot, what = int(found.group(1)), None
        assert f"{call}()" in text, f"the error does not name {call}(): {text!r}"
    assert 0 <= slot < n, f"the error names env {slot} of {n}: {text!r}"
    return slot, what


def refused_alone(what: str, value: Any, space: Any, shared_memory: bool) -> type[BaseException] | None:
    """The exception gymnasium's own rule raises for an env's ``what`` (``value``) on its own,
    in a batch of one, or ``None`` if it takes it: its shared memory's writing or its
    ``concatenate`` for observations, ``np.array(values, dtype)`` for rewards and flags."""
    import multiprocessing

    from gymnasium.vector.utils import concatenate, create_empty_array, create_shared_memory, write_to_shared_memory

    try:
        if what == "observation" and shared_memory:
            memory = create_shared_memory(space, n=1, ctx=multiprocessing.get_context("fork"))
            write_to_shared_memory(space, 0, value, memory)
        elif what == "observation":
            concatenate(space, [value], create_empty_array(space, n=1))
        elif what == "reward":
            np.array([value], dtype=np.float64)
        elif what in ("terminated", "truncated"):
            np.array([value], dtype=np.bool_)
    except Exception as exc:
        return type(exc)
    return None


def close_reference(ref: Any) -> None:
    """Close gymnasium's vector env, broken or not, and free what it leaves to the collector."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref.close(terminate=True)
        except Exception:
            pass
    ref.error_queue.close()
    ref.error_queue.join_thread()
    for proc in ref.processes:
        proc.join(5)
        try:
            proc.close()
        except ValueError:
            pass
    for end in (getattr(ref.error_queue, "_reader", None), getattr(ref.error_queue, "_writer", None)):
        if end is not None:
            end.close()
