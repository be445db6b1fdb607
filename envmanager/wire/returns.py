"""What an env's ``reset()`` and ``step()`` return, written into the results arrays as gymnasium's
``AsyncVectorEnv`` writes it, whatever Python or numpy types the env used (issue 38).

* **Observations.** In shared memory by gymnasium's rule for its shared memory
  (``write_to_shared_memory``): each value cast to the space's dtype as ``np.asarray`` casts it,
  flattened, and copied into its slot -- any shape with the slot's number of elements, or one
  element for all. Results that travel pickled go into the parent's copy by its rule for that
  copy (``concatenate``, ``np.stack`` into the batch): the slot's very shape, a cast of the same
  kind. Dict values may hold more keys than the space, Tuple values more items (pickled) or
  exactly as many (shared), as there.
* **Rewards and flags.** Converted as gymnasium converts a batch of them
  (``np.array(values, dtype=np.float64)`` and ``np.bool_``), in the shape the first step gave
  them (:class:`ScalarLayout`): a reward of shape ``(1,)`` makes rewards of shape ``(n, 1)``,
  as in gymnasium; decided once, by the parent, at the first step answer it files, then held
  by every worker (a word in shared memory), so a next-step autoreset's zeros take that shape
  and an env whose shapes wander later is refused. Values of one element live in the shared
  arrays (a reshaped view); other shapes travel pickled into the parent's own arrays.

A value the rules refuse raises an exception of the type gymnasium's would (``ValueError``,
``TypeError``, ``KeyError``...), whose message names the env, the call and the value
(:func:`refusal`).
"""

from __future__ import annotations

import reprlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from envmanager.wire.shm import SharedBuffers

__all__ = [
    "MAX_AXES", "PLAIN_SCALARS", "ScalarLayout", "write_shared", "write_stacked", "write_observation", "refusal",
    "refused_here",
]

#: The most axes a reward or flag may have (the layout's word in shared memory has room for these).
MAX_AXES = 6
_FIELDS = ("reward", "terminated", "truncated")
_DTYPES = (np.float64, np.bool_, np.bool_)
#: Python and numpy scalar types: one env's values of these fit the rows of one scalar each.
PLAIN_SCALARS = frozenset({float, int, bool, np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
                           np.uint64, np.uint32, np.uint16, np.uint8, np.bool_})
_show = reprlib.Repr()
_show.maxstring = _show.maxother = 120
_show.maxlist = _show.maxtuple = _show.maxdict = 8


def refusal(exc: BaseException, slot: int, call: str, what: str, value: Any) -> BaseException:
    """``exc`` (why ``value`` was refused) restated to name the env, the call and the value: an
    exception of the same type where its type takes a message (else ``ValueError``), raised from it."""
    text = f"env {slot}'s {call}() returned {what} {_shown(value)}, which the vector env cannot take: {exc}"
    try:
        made = type(exc)(text)
    except Exception:
        made = ValueError(text)
    made.__cause__ = exc
    return made


def refused_here(exc: BaseException, slot: int, call: str) -> BaseException:
    """An exception of the worker's own handling of what an env's ``call`` returned (unpacking
    it, the truth of its flags), restated to name the env and the call; an exception raised
    inside the env (a deeper frame) is its own and is returned as it is."""
    tb = exc.__traceback__
    if tb is None or tb.tb_next is not None:
        return exc
    # Only the worker's own handling (unpacking, a flag's truth): an exception of the call itself
    # (a native env's, or a signature the worker's call does not fit) is the env's own.
    if not isinstance(exc, (TypeError, ValueError)) or not any(
            text in str(exc) for text in ("unpack", "truth value", "not iterable")):
        return exc
    values = tb.tb_frame.f_locals
    shown = "what"
    if "truth value" in str(exc):  # ``terminated or truncated``: the flags were returned (the worker's names)
        terminated, truncated = values.get("term", values.get("terminated")), values.get("trunc", values.get("truncated"))
        shown = f"terminated={_shown(terminated)}, truncated={_shown(truncated)}, which"
    text = f"env {slot}'s {call}() returned {shown} the vector env cannot take: {exc}"
    try:
        made = type(exc)(text)
    except Exception:
        made = ValueError(text)
    made.__cause__ = exc
    return made


def _shown(value: Any) -> str:
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    shape = f" of shape {value.shape}" if isinstance(value, np.ndarray) else ""
    return f"{_show.repr(value)} ({name}{shape})"


# ------------------------------------------------------------------------------------------------
# Observations


def write_shared(tree: Any, slot: int, value: Any) -> None:
    """Write one env's observation into its slot of ``tree`` (an array, or a dict / tuple of
    arrays) by gymnasium's rule for shared memory: cast as ``np.asarray(value, dtype)``, then the
    slot's number of elements in any shape, or one element for the whole slot."""
    if type(tree) is np.ndarray:
        shape = tree.shape[1:]
        size = int(np.prod(shape))
        source = np.asarray(value, dtype=tree.dtype)
        if source.size == size:
            tree[slot] = source.reshape(shape)
        elif source.size == 1:
            tree[slot] = source.reshape(())
        else:
            raise ValueError(f"could not broadcast input array from shape ({source.size},) into shape ({size},)")
    elif isinstance(tree, dict):
        for key, array in tree.items():
            write_shared(array, slot, value[key])
    else:
        for item, array in zip(value, tree, strict=True):
            write_shared(array, slot, item)


def write_stacked(tree: Any, slot: int, value: Any) -> None:
    """Write one env's observation into the parent's copy by gymnasium's rule for it
    (``concatenate``: ``np.stack`` into the batch): the slot's very shape, cast with
    ``casting="same_kind"``; a dict's extra keys and a tuple's extra items are left out."""
    if type(tree) is np.ndarray:
        source = np.asarray(value)
        if source.shape != tree.shape[1:]:
            raise ValueError(f"an observation of shape {source.shape} does not stack into a batch of {tree.shape[1:]}")
        np.copyto(tree[slot : slot + 1], source[np.newaxis], casting="same_kind")
    elif isinstance(tree, dict):
        for key, array in tree.items():
            write_stacked(array, slot, value[key])
    else:
        for i, array in enumerate(tree):
            write_stacked(array, slot, value[i])


def write_observation(tree: Any, slot: int, value: Any, call: str = "step") -> None:
    """:func:`write_shared`, a value it refuses raised as :func:`refusal` names it (the env, the
    ``call``, the value)."""
    try:
        write_shared(tree, slot, value)
    except Exception as exc:
        raise refusal(exc, slot, call, "observation", value) from exc


# ------------------------------------------------------------------------------------------------
# Rewards and flags


class ScalarLayout:
    """The shapes of rewards, terminated and truncated (each env's; the batch adds the env axis),
    decided once at the first step, and where their values go (see the module doc).

    One per :class:`SharedBuffers`: the parent's decides (:meth:`put`, the first step answer
    filed) and writes the decision into the buffers' ``layout_word``; a worker's reads it
    (:meth:`known`, at the start of each request: :meth:`begin`) and from then on checks and
    writes its envs' values itself where they fit the shared arrays. ``buffers.reward``,
    ``terminated`` and ``truncated`` are replaced by arrays of the decided shapes (views of the
    shared arrays, or the parent's own).
    """

    def __init__(self, buffers: SharedBuffers) -> None:
        self.buffers = buffers
        self.word = buffers.layout_word  # per field: [axes + 1 (0: not decided), the axes...]
        #: The decided shapes (``None``: not yet), whether every value fits the shared arrays,
        #: and what a next-step autoreset's row holds (in the decided shapes).
        self.shapes: tuple[tuple[int, ...], ...] | None = None
        self.fits = True
        self.plain = False
        self.travelling = True  # (a worker's current request: ``begin``)
        self.zeros: tuple[Any, Any, Any] = (np.float64(0.0), False, False)

    # -- the worker's half -----------------------------------------------------------------------
    def known(self) -> bool:
        """Whether the parent decided (read from shared memory until it has)."""
        if self.shapes is None and self.word is not None and self.word[0, 0]:
            self._adopt(tuple(tuple(int(d) for d in row[1 : row[0]]) for row in self.word))
        return self.shapes is not None

    def begin(self) -> tuple[Any, Any, Any]:
        """A worker's request starts: whether its values travel (:attr:`travelling`: the parent
        had not decided when it started, or they do not fit the shared arrays) is settled for the
        whole request; returns what a next-step autoreset's row holds."""
        self.travelling = not self.known() or not self.fits
        return self.zeros

    # -- both halves -------------------------------------------------------------------------------
    def put(self, slot: int, reward: Any, terminated: Any, truncated: Any, call: str = "step") -> None:
        """One env's values into its row (deciding the layout if nobody has: the parent's first
        step answer); a value refused raises :func:`refusal`'s exception, and nothing is written."""
        values = (reward, terminated, truncated)
        converted: list[np.ndarray] = []
        for field, value, dtype in zip(_FIELDS, values, _DTYPES, strict=True):
            try:
                converted.append(np.asarray(value, dtype=dtype))
            except Exception as exc:
                raise refusal(exc, slot, call, field, value) from exc
        if self.shapes is None and not self.known():
            self.decide(tuple(a.shape for a in converted), slot, values)
        assert self.shapes is not None
        for field, value, array, shape in zip(_FIELDS, values, converted, self.shapes, strict=True):
            if array.shape != shape:
                why = ValueError(f"its shape {array.shape} is not {shape}, the shape the first step gave every env's {field}")
                raise refusal(why, slot, call, field, value)
        for target, array in zip(self._arrays, converted, strict=True):
            target[slot] = array

    def clear(self, slot: int) -> None:
        """A reset's row: zeros (the reset answers for no reward)."""
        for target in self._arrays if self.shapes is not None else self._base():
            target[slot] = 0

    # -- the parent's half --------------------------------------------------------------------------
    def decide(self, shapes: tuple[tuple[int, ...], ...], slot: int = 0, values: tuple = ()) -> None:
        """Hold ``shapes`` from now on, and tell the workers (the shared word)."""
        for field, shape, value in zip(_FIELDS, shapes, values or (None,) * 3, strict=True):
            if len(shape) > MAX_AXES:
                why = ValueError(f"{len(shape)} axes are more than the {MAX_AXES} a vector env's {field}s may have")
                raise refusal(why, slot, "step", field, value)
        self._adopt(shapes)
        if self.word is not None:
            for row, shape in zip(self.word, shapes, strict=True):
                row[1 : 1 + len(shape)] = shape
                row[0] = len(shape) + 1

    def _adopt(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        b, n = self.buffers, self.buffers.layout.n_envs
        self.shapes = shapes
        self.fits = all(int(np.prod(s)) == 1 for s in shapes)
        self.plain = all(s == () for s in shapes)  # one scalar per env, as most envs return
        base = self._base()
        arrays = []
        for array, shape, dtype in zip(base, shapes, _DTYPES, strict=True):
            if int(np.prod(shape)) == 1:
                arrays.append(array.reshape((n, *shape)))  # a view: the same memory
            else:  # the parent's own (a worker never writes these: its values travel)
                arrays.append(np.zeros((n, *shape), dtype=dtype))
        b.reward, b.terminated, b.truncated = arrays
        reward, terminated, truncated = shapes
        self.zeros = (np.zeros(reward) if reward else np.float64(0.0),
                      np.zeros(terminated, dtype=np.bool_) if terminated else False,
                      np.zeros(truncated, dtype=np.bool_) if truncated else False)

    @property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = self.buffers
        return b.reward, b.terminated, b.truncated

    def _base(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.buffers.base_scalars
