"""Actions of a ``ParallelVectorEnv``, checked in the parent before anything is sent: per group
one array of rows (env × agent), or per env a dict ``{agent: action}`` as PettingZoo takes them.
Only the rows of active agents are checked and reach the env; the others are never read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from envmanager.core.actions import ActionChecker
from envmanager.errors import InvalidInputError
from envmanager.pettingzoo.layout import AgentGroup, AgentLayout

__all__ = ["ActionRows"]


class ActionRows:
    """Turns the user's actions for some envs into the facades' action batch (per group an array
    ``(envs, group.size, *action_shape)``), or raises :class:`InvalidInputError` naming the env
    and agent."""

    def __init__(self, layout: AgentLayout) -> None:
        self.layout = layout
        self._checkers = {g.name: ActionChecker(g.action_space) for g in layout.groups}
        self._shapes = {g.name: _action_shape(g) for g in layout.groups}
        self._index = {a: i for i, a in enumerate(layout.possible_agents)}
        self._group_of = {a: (g, j) for g in layout.groups for j, a in enumerate(g.agents)}

    def from_arrays(self, actions: Any, ids: np.ndarray, active: np.ndarray) -> dict[str, np.ndarray]:
        """``actions``: with one group an array of ``len(ids) * group.size`` rows (or a dict with
        the group's name), else a dict ``{group name: array}``; ``active``: ``(len(ids), n)``."""
        groups = self.layout.groups
        if not isinstance(actions, Mapping):
            if len(groups) != 1:
                raise InvalidInputError(f"the agents form {len(groups)} groups: actions must be a dict "
                                        f"{{group: array}} with keys {[g.name for g in groups]}")
            actions = {groups[0].name: actions}
        if set(actions) != {g.name for g in groups}:
            raise InvalidInputError(f"actions must have one array per group {[g.name for g in groups]}, "
                                    f"got keys {sorted(map(str, actions))}")
        return {g.name: self._group(g, actions[g.name], ids, active) for g in groups}

    def from_dicts(self, actions: Sequence[Mapping[str, Any]], ids: np.ndarray, active: np.ndarray) -> dict[str, np.ndarray]:
        """``actions``: per env of ``ids``, ``{agent: action}`` for exactly its active agents."""
        if isinstance(actions, Mapping) or len(actions) != len(ids):
            raise InvalidInputError(f"expected a sequence of {len(ids)} dicts (one per env), got {actions!r:.80}")
        names = self.layout.possible_agents
        arrays = {g.name: np.zeros((len(ids) * g.size, *self._shapes[g.name]), _dtype(g)) for g in self.layout.groups}
        for i, (env, given) in enumerate(zip(ids.tolist(), actions, strict=True)):
            if not isinstance(given, Mapping):
                raise InvalidInputError(f"env {env}: actions must be a dict {{agent: action}}, got {type(given).__name__}")
            for agent, value in given.items():
                if agent not in self._index:
                    raise InvalidInputError(f"env {env}: unknown agent {agent!r} (possible agents: {list(names)})")
                if not active[i, self._index[agent]]:
                    raise InvalidInputError(f"env {env}: agent {agent!r} is not active (done, not there yet, or not its "
                                            "turn): it takes no action")
                g, j = self._group_of[agent]
                try:
                    arrays[g.name][i * g.size + j] = value
                except (ValueError, TypeError) as exc:
                    raise InvalidInputError(f"env {env}: the action for agent {agent!r} does not fit "
                                            f"{g.action_space}: {exc}") from None
            missing = [names[a] for a in np.flatnonzero(active[i]).tolist() if names[a] not in given]
            if missing:
                raise InvalidInputError(f"env {env}: no action for active agent(s) {missing}")
        return {g.name: self._group(g, arrays[g.name], ids, active) for g in self.layout.groups}

    def _group(self, g: AgentGroup, values: Any, ids: np.ndarray, active: np.ndarray) -> np.ndarray:
        k, shape = len(ids), self._shapes[g.name]
        try:
            arr = np.asarray(values)
        except Exception as exc:
            raise InvalidInputError(f"actions of group {g.name!r} cannot be read as an array: {exc}") from None
        expected = (k * g.size, *shape)
        if arr.shape != expected:
            raise InvalidInputError(f"actions of group {g.name!r} have shape {arr.shape}, expected {expected} "
                                    f"({k} env(s) × {g.size} agent(s) {list(g.agents)} × {shape})")
        dtype = _dtype(g)
        every = g.slots == tuple(range(self.layout.num_agents))
        rows = active.reshape(-1) if every else active[:, list(g.slots)].reshape(-1)
        if type(arr) is np.ndarray and arr.dtype == dtype and rows.all():
            # Every row is read and the array is already the space's layout: checked as a whole,
            # no rows picked and copied (a bad row falls through to the search below, which names it).
            try:
                checked = self._checkers[g.name].batch(arr, np.arange(len(rows)))
            except InvalidInputError:
                pass
            else:
                return np.asarray(checked, dtype).reshape(k, g.size, *shape)
        out = np.zeros(expected, dtype)
        if rows.any():
            picked = np.flatnonzero(rows)
            checker = self._checkers[g.name]
            try:
                out[picked] = checker.batch(arr[picked], picked)
            except InvalidInputError:
                for r in picked.tolist():  # the first bad row, named by env and agent
                    try:
                        checker.batch(arr[r : r + 1], [r])
                    except InvalidInputError as exc:
                        reason = str(exc).split(": ", 1)[-1]
                        raise InvalidInputError(f"env {int(ids[r // g.size])}: the action for agent "
                                                f"{g.agents[r % g.size]!r} is invalid: {reason}") from None
                raise
        return out.reshape(k, g.size, *shape)


def _action_shape(g: AgentGroup) -> tuple[int, ...]:
    return tuple(g.action_space.shape or ())


def _dtype(g: AgentGroup) -> np.dtype:
    return np.dtype(g.action_space.dtype if isinstance(g.action_space, spaces.Box) else np.int64)
