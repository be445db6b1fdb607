"""Actions as gymnasium's ``AsyncVectorEnv`` hands them to its envs, for ``envmanager.AsyncVectorEnv``.

gymnasium sends env ``i`` the ``i``-th item that ``iterate(action_space, actions)`` yields, as
it is: a ``float64`` scalar from a ``float64`` array, a Python int from a list, an integer out
of a ``Discrete``'s range, an array of another shape. The env judges it (and raises, if it
objects). We do the same, on two paths:

* a batch that already is arrays of the space's dtypes and shapes (what ``action_space.sample()``
  and most policies give) goes through shared memory, whose rows are exactly those items;
* anything else travels pickled, one item per env, exactly as ``iterate`` yields it.

What ``iterate`` raises (``TypeError`` for a scalar, ``KeyError`` for a Dict batch without a
key) is raised as gymnasium raises it, before anything is sent. A number of items other than
the number of envs is refused with ``InvalidInputError`` (a ``ValueError``), also before
anything is sent: gymnasium sends to some envs, then fails, and every later result is off.
"""

from __future__ import annotations

from typing import Any

import cloudpickle
import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_space, iterate

from envmanager.core.actions import ActionChecker
from envmanager.errors import InvalidInputError
from envmanager.wire.shm import tree_map

__all__ = ["Actions", "HandedActions"]


class HandedActions:
    """A batch ready to send: ``batch`` (exact arrays) or ``per_env`` (one item per env)."""

    __slots__ = ("batch", "per_env")

    def __init__(self, batch: Any = None, per_env: list[Any] | None = None) -> None:
        self.batch = batch
        self.per_env = per_env

    def kept(self) -> HandedActions:
        """A copy that outlives the caller's buffers, for steps sent later (``max_concurrency``):
        every item is pickled now, so one that cannot be is refused before anything is sent,
        and a caller reusing its action array after ``step_async`` changes nothing."""
        if self.per_env is None:
            return HandedActions(batch=tree_map(np.copy, self.batch))
        kept = []
        for i, item in enumerate(self.per_env):
            try:
                kept.append(cloudpickle.loads(cloudpickle.dumps(item)))
            except Exception as exc:
                raise InvalidInputError(f"the action for env {i} cannot be pickled: {exc!r}") from exc
        return HandedActions(per_env=kept)

    def rows(self, rows: np.ndarray) -> HandedActions:
        """The actions of these rows only (for envs sent later, with ``max_concurrency``)."""
        if self.per_env is not None:
            return HandedActions(per_env=[self.per_env[r] for r in rows.tolist()])
        return HandedActions(batch=tree_map(lambda a: a[rows], self.batch))


class Actions:
    """Splits a batch of actions into what each env gets, as gymnasium does (module doc)."""

    def __init__(self, single_space: spaces.Space, checker: ActionChecker) -> None:
        self.single_space = single_space
        self.checker = checker
        self._batch_spaces: dict[int, spaces.Space] = {}
        # A space of one array (Box, Discrete, ...): its dtype and shape, worked out once, so the
        # usual batch (one array of exactly those) is told apart without ``checker.exact``'s walk
        # over the space on every step. The test is ``exact``'s own for such a space.
        space = checker.space
        self._array: tuple[Any, tuple[int, ...]] | None = None
        if space is not None and not isinstance(space, (spaces.Dict, spaces.Tuple)) and space.shape is not None:
            self._array = (space.dtype, space.shape)

    def hand_over(self, actions: Any, n: int) -> HandedActions:
        """The actions of ``n`` envs, ready to send; raises what gymnasium raises, and
        ``InvalidInputError`` for a number of items other than ``n``."""
        array = self._array
        if array is not None and type(actions) is np.ndarray and actions.dtype == array[0] and actions.shape == (n, *array[1]):
            return HandedActions(batch=actions)
        exact = self.checker.exact(actions, n)
        if exact is not None:
            return HandedActions(batch=exact)
        space = self._batch_spaces.get(n)
        if space is None:
            space = self._batch_spaces[n] = batch_space(self.single_space, n)
        per_env = list(iterate(space, actions))
        if len(per_env) != n:
            raise InvalidInputError(f"expected actions for {n} environment(s), got {len(per_env)}")
        return HandedActions(per_env=per_env)
