"""Helpers of ``envmanager.AsyncVectorEnv``: observation modes, space checks, reset masks, as
gymnasium 1.4 defines them (same rules, same messages); infos that came as columns, batched
as gymnasium batches infos."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from operator import itemgetter
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces import Space
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector.utils import batch_differing_spaces, batch_space
from gymnasium.vector.utils.shared_memory import create_shared_memory

from envmanager.core.results import InfoBlock
from envmanager.wire.returns import refusal


class AsyncState(Enum):
    """The drop-in's state machine, as gymnasium's AsyncVectorEnv has it: which ``*_wait`` is due."""

    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    WAITING_CALL = "call"


def check_observation_mode(observation_mode: Any) -> None:
    """gymnasium's refusals of an ``observation_mode`` (its words), before anything starts."""
    if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
        if not all(isinstance(s, Space) for s in observation_mode):
            raise TypeError(
                "Expected both elements of observation_mode to be Spaces, got "
                f"{type(observation_mode[0])} and {type(observation_mode[1])}"
            )
    elif not (isinstance(observation_mode, str) and observation_mode in ("same", "different")):
        raise ValueError(
            "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and "
            f"batch observation space, actual got {observation_mode}"
        )


def observation_spaces_of(observation_mode: Any, first: Space, every: Callable[[], list[Space]], n: int) -> tuple[Space, Space]:
    """``(single, batched)`` observation spaces for gymnasium's ``observation_mode``: ``"same"``
    (the first env's, batched), ``"different"`` (``every()`` env's, batched with
    ``batch_differing_spaces``, which raises for spaces of different shapes or types), or a
    tuple ``(batched, single)`` given by the user (``check_observation_mode`` checked it)."""
    if isinstance(observation_mode, tuple):
        return observation_mode[1], observation_mode[0]
    if observation_mode == "same":
        return first, batch_space(first, n)
    env_spaces = every()
    return env_spaces[0], batch_differing_spaces(env_spaces)


def space_check(
    observation_mode: Any, single_observation_space: Space, single_action_space: Space
) -> Callable[[list[Space], list[Space]], None]:
    """gymnasium's check of the spaces every env reports (its ``_check_spaces``): equal
    observation spaces in ``"same"`` mode, of one shape and dtype otherwise; equal action spaces."""

    def check(observation_spaces: list[Space], action_spaces: list[Space]) -> None:
        if observation_mode == "same":
            if any(s != single_observation_space for s in observation_spaces):
                raise RuntimeError(
                    "AsyncVectorEnv(..., observation_mode='same') however some of the sub-environments observation "
                    "spaces are not equivalent. If this is intentional, use `observation_mode='different'` instead."
                )
        elif not all(is_space_dtype_shape_equiv(single_observation_space, s) for s in observation_spaces):
            raise RuntimeError(
                "AsyncVectorEnv(..., observation_mode='different' or custom space) however the sub-environment's "
                "observation spaces do not share a common shape and dtype."
            )
        if any(s != single_action_space for s in action_spaces):
            raise RuntimeError(
                f"Some environments have an action space different from `{single_action_space}`. "
                "In order to batch actions, the action spaces from all environments must be equal."
            )

    return check


def check_shareable(shared_memory: bool, space: Space) -> None:
    """gymnasium's refusal of a space its shared memory cannot hold (custom spaces), its words."""
    if shared_memory and not gymnasium_can_share(space):
        raise ValueError(
            "Using `AsyncVector(..., shared_memory=True)` caused an error, you can disable this "
            "feature with `shared_memory=False` however this is slower."
        )


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


def infos_from_columns(blocks: Sequence[InfoBlock], num_envs: int) -> dict[str, Any]:
    """gymnasium's batched infos (``{key: array, "_key": mask}``, as ``VectorEnv._add_info``
    builds them env by env) from infos that came as columns: a few numpy operations per key
    and answer, no per-env Python. Each array takes the dtype of the lowest env's value, as
    gymnasium's does."""
    infos: dict[str, Any] = {}
    if len(blocks) == 1 and len(blocks[0].slots) == num_envs:  # every env, in order (distinct slots of [0, n)): one block
        block = blocks[0]
        if block.slots[0] == 0 and block.slots[-1] == num_envs - 1:
            every = _MASKS.get((num_envs, 0, num_envs))
            if every is None:
                every = _run_mask(num_envs, 0, num_envs)
            for key, column in zip(block.keys, block.columns, strict=True):
                infos[key] = column if column.flags.writeable and column.base is None else column.copy()
                infos[f"_{key}"] = every.copy()
            return infos
    for block in sorted(blocks, key=lambda b: int(b.slots.min())) if len(blocks) > 1 else blocks:
        for key, column in zip(block.keys, block.columns, strict=True):
            if key not in infos:
                infos[key] = np.zeros(num_envs, dtype=column.dtype)
                infos[f"_{key}"] = np.zeros(num_envs, dtype=np.bool_)
            infos[key][block.slots] = column
            infos[f"_{key}"][block.slots] = True
    return infos


def batched_infos(dicts: dict[int, dict], columns: Sequence[InfoBlock], num_envs: int,
                  add_info: Callable[[dict, dict, int], dict], call: str = "step") -> dict[str, Any]:
    """gymnasium's batched infos of a ``call``: from columns alone with a few numpy operations,
    else (some envs' infos came as dicts) env by env with gymnasium's ``add_info``. What
    ``add_info`` refuses raises its exception, restated to name the env whose info it was."""
    try:
        if columns and not dicts:
            return infos_from_columns(columns, num_envs)
        for block in columns:
            dicts.update(block_dicts(block))
        infos: dict[str, Any] = {}
        for i in sorted(dicts):
            infos = add_info(infos, dicts[i], i)
        return infos
    except Exception as exc:
        named = refused_info(exc, dicts, columns, add_info, call)
        if named is exc:  # no env's info alone is refused: gymnasium's own error
            raise
        raise named from exc


def refused_info(exc: Exception, dicts: Mapping[int, dict], columns: Sequence[InfoBlock],
                 add_info: Callable[[dict, dict, int], dict], call: str) -> BaseException:
    """``exc``, raised batching infos, restated to name the first env whose info gymnasium's
    ``add_info`` refuses (batched again, env by env), the call and the info."""
    every = dict(dicts)
    for block in columns:
        every.update(block_dicts(block))
    infos: dict[str, Any] = {}
    for k in sorted(every):
        try:
            infos = add_info(infos, every[k], k)
        except Exception as why:
            return refusal(why, k, call, "info", every[k])
    return exc


#: The types gymnasium's ``_add_info`` batches into an array of their own (with ``numpy.number``).
_SCALARS = (int, float, bool)
#: A column of Python scalars (``InfoBlock.python``): the envs' type, by the column's dtype kind.
_PYTHON_KIND = {"i": int, "f": float, "b": bool}


def partial_batch_infos(listed: Sequence[int], dicts: Mapping[int, dict], blocks: Sequence[tuple[list[int], InfoBlock]],
                        num_envs: int) -> dict[str, Any] | None:
    """gymnasium's batched infos of a partial batch (``{key: array, "_key": mask}``, exactly as
    ``VectorEnv._add_info`` builds them env by env, the batch's ``k``-th env as env ``k``): the
    envs ``listed`` (slots), whose info dicts are in ``dicts`` by slot (an env without one returned
    none, or its infos came as columns), and infos that came as columns (``blocks``: each with the
    batch positions of its slots).

    Per env only a walk over its dict; per key a few numpy operations for each run of values
    of one type. Keys come in gymnasium's order (the first env that has a key, then that env's
    order); each array takes the type of the first env's value, and a value of another type is
    assigned on its own, as ``_add_info`` assigns it. ``None`` where gymnasium's rules go beyond
    flat values: a nested dict, ``"final_obs"``, a key that is not a string or starts with
    ``_`` (its mask could collide with another key's): the caller goes env by env then. What
    ``_add_info`` would raise on (an int beyond int64, say) raises here too, maybe otherwise
    worded: the caller goes env by env for gymnasium's own error.
    """
    infos: dict[str, Any] = {}
    for key, key_runs in _runs(listed, dicts, blocks).items():
        if type(key) is not str or key[:1] == "_" or key == "final_obs":
            return None
        if len(key_runs) == 1:  # the usual key: one run, of one scalar type, of neighbouring rows
            rows, values, kind, ascending = key_runs[0]
            if kind is None:
                types = set(map(type, values))
                kind = types.pop() if len(types) == 1 else None
            n = len(rows)
            start = rows[0]
            if (kind in _SCALARS or (kind is not None and issubclass(kind, np.number))) and ascending \
                    and rows[-1] - start == n - 1:
                array = np.zeros(num_envs, dtype=kind)
                array[start : start + n] = values
                made = _MASKS.get((num_envs, start, n))
                infos[key] = array
                infos[f"_{key}"] = (made if made is not None else _run_mask(num_envs, start, n)).copy()
                continue
        first = key_runs[0]
        value = first[1][0]
        kind = first[2] or type(value)
        whole: type | None = kind  # values of this type go in with one assignment per run
        if kind in _SCALARS or issubclass(kind, np.number):
            array = np.zeros(num_envs, dtype=kind)
        elif issubclass(kind, dict):
            return None
        elif issubclass(kind, np.ndarray):
            array, whole = np.zeros((num_envs, *value.shape), dtype=value.dtype), None
        else:
            array, whole = np.full(num_envs, fill_value=None, dtype=object), None
        mask = None
        for rows, values, t, ascending in key_runs:
            if t is None:  # the envs' own values: of one type?
                types = set(map(type, values))
                t = types.pop() if len(types) == 1 else object
            if t is whole:
                n = len(rows)
                start = rows[0]
                if ascending and rows[-1] - start == n - 1:  # neighbours: slices
                    array[start : start + n] = values
                    if mask is None:
                        mask = np.zeros(num_envs, dtype=np.bool_)
                    mask[start : start + n] = True
                    continue
                array[rows] = values
            else:  # one by one, as _add_info assigns them
                if type(values) is np.ndarray:  # a column: the values as the envs returned them
                    values = values.tolist() if t in _SCALARS else list(values)
                for r, v in zip(rows, values, strict=True):
                    if isinstance(v, dict):
                        return None
                    array[r] = v
            if mask is None:
                mask = np.zeros(num_envs, dtype=np.bool_)
            mask[rows] = True
        infos[key] = array
        infos[f"_{key}"] = mask
    return infos


#: Per key, its runs of values, first position first: [the batch positions, the values (a list,
#: or a column), their type (None: the envs' own values, of one type or not, found out later),
#: whether the positions ascend].
_Runs = dict[Any, list[list[Any]]]


def _runs(listed: Sequence[int], dicts: Mapping[int, dict], blocks: Sequence[tuple[list[int], InfoBlock]]) -> _Runs:
    """Every key's runs, in gymnasium's key order (see ``_Runs``)."""
    runs: _Runs = {}
    entries: Iterable[tuple[int, Any]] = enumerate(listed)  # (position, slot), or (position, (positions, block))
    if blocks:  # every block at its first position: keys in gymnasium's order of first use
        with_dicts = [(k, i) for k, i in enumerate(listed) if i in dicts] if dicts else []
        entries = with_dicts + [(min(rows), (rows, block)) for rows, block in blocks]
        if len(entries) > 1:
            entries.sort(key=itemgetter(0))
    for k, item in entries:
        if type(item) is tuple:
            rows, block = item
            ascending = rows == sorted(rows)
            for key, column, py in zip(block.keys, block.columns, block.python, strict=True):
                kind = _PYTHON_KIND[column.dtype.kind] if py else column.dtype.type
                runs.setdefault(key, []).append([rows, column, kind, ascending])
            continue
        info = dicts.get(item)
        if not info:
            continue
        for key, value in info.items():  # the envs' dicts, walked in row order
            key_runs = runs.get(key)
            if key_runs is None:
                runs[key] = [[[k], [value], None, True]]
            elif key_runs[-1][2] is None:
                last = key_runs[-1]
                last[0].append(k)
                last[1].append(value)
            else:
                key_runs.append([[k], [value], None, True])
    return runs


#: Masks of a run of neighbours, by (num_envs, start, n): copied, not made, for each batch.
_MASKS: dict[tuple[int, int, int], np.ndarray] = {}


def _run_mask(num_envs: int, start: int, n: int) -> np.ndarray:
    """The mask of ``num_envs`` with rows ``start`` to ``start + n`` set (made once: copy it)."""
    made = np.zeros(num_envs, dtype=np.bool_)
    made[start : start + n] = True
    if len(_MASKS) < 1024:
        _MASKS[num_envs, start, n] = made
    return made


def env_ids_checked(env_ids: Any, n: int) -> tuple[np.ndarray, list[int]]:
    """``send``'s ``env_ids``: distinct integer ids in ``[0, n)``, as an int64 array and a list.

    An int64 array of one axis (what ``recv`` hands out in ``infos["env_id"]``) is used as it
    is; the checks run on its Python list (a set and ``min``/``max``: no ``np.unique`` sort)."""
    if type(env_ids) is np.ndarray and env_ids.dtype == np.int64 and env_ids.ndim == 1:
        ids = env_ids
    else:
        ids = np.asarray(env_ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"env_ids must be integers, got {np.asarray(env_ids).tolist()}")
        ids = ids.astype(np.int64)
    listed = ids.tolist()
    if listed and (len(set(listed)) != len(listed) or min(listed) < 0 or max(listed) >= n):
        raise ValueError(f"env_ids must be distinct ids in [0, {n}), got {listed}")
    return ids, listed


def block_dicts(block: InfoBlock) -> dict[int, dict]:
    """Each slot's info dict, from a block of columns (values as the envs returned them)."""
    columns = [c.tolist() if py else list(c) for c, py in zip(block.columns, block.python, strict=True)]
    return {slot: {k: c[i] for k, c in zip(block.keys, columns, strict=True)} for i, slot in enumerate(block.slots.tolist())}


def partial_infos(listed: list[int], later: bool, dicts: dict[int, dict], columns: list[InfoBlock], num_envs: int,
                  add_info: Callable[[dict, dict, int], dict]) -> tuple[dict[str, Any], dict[int, dict], list[InfoBlock]]:
    """A partial batch's infos as gymnasium batches them (row ``k``: env ``listed[k]``), from the
    info dicts and column blocks that arrived; with the dicts and columns left for a later batch
    (``later``: some arrived envs are not in this one). Per key where it can
    (``partial_batch_infos``), else ``add_info`` (gymnasium's ``_add_info``) env by env."""
    left: dict[int, dict] = {}
    if later and dicts:  # this batch's are taken out first: none is left behind if batching raises
        left = dicts
        dicts = {i: left.pop(i) for i in listed if i in left}
    blocks: list[tuple[list[int], InfoBlock]] = []
    rest_columns: list[InfoBlock] = []
    row = {slot: k for k, slot in enumerate(listed)}
    for block in columns:
        slots = block.slots.tolist()
        mine = [n for n, s in enumerate(slots) if s in row] if later else list(range(len(slots)))
        if len(mine) == len(slots):
            blocks.append(([row[s] for s in slots], block))
            continue
        if mine:  # an answer across batches: this batch's rows here, the others stay
            blocks.append(([row[slots[n]] for n in mine],
                           block._replace(slots=block.slots[mine], columns=[c[mine] for c in block.columns])))
            rest = [n for n, s in enumerate(slots) if s not in row]
            block = block._replace(slots=block.slots[rest], columns=[c[rest] for c in block.columns])
        rest_columns.append(block)
    if not dicts and not blocks:
        return {}, left, rest_columns
    try:
        infos = partial_batch_infos(listed, dicts, blocks, num_envs)
    except Exception:  # a value _add_info refuses (an int beyond int64, say): its own error, below
        infos = None
    if infos is None:  # gymnasium's own, env by env
        by_row = {k: dicts[i] for k, i in enumerate(listed) if i in dicts}
        for rows, block in blocks:
            by_row.update(zip(rows, block_dicts(block).values(), strict=True))
        infos = {}
        for k in sorted(by_row):
            try:
                infos = add_info(infos, by_row[k], k)
            except Exception as exc:  # gymnasium's refusal, naming the env (row k is env listed[k])
                raise refusal(exc, listed[k], "step", "info", by_row[k]) from exc
    return infos, left, rest_columns
