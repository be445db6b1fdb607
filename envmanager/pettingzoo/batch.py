"""What ``ParallelVectorEnv`` hands back: a batch of envs, flat by agent (row ``i * n + a`` is
agent slot ``a`` of the batch's ``i``-th env, ``n`` agent slots per env), one block per group,
and a view as PettingZoo's dicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from envmanager.pettingzoo.layout import AgentGroup, AgentLayout
from envmanager.wire.shm import tree_map

__all__ = ["GroupBatch", "MultiAgentBatch", "AgentStep"]


@dataclass(frozen=True)
class GroupBatch:
    """One group's rows: ``len(env_ids) * group.size``, row ``i * group.size + j`` is the group's
    ``j``-th agent in the batch's ``i``-th env. ``observation`` is an array (or a dict / tuple of
    arrays, as the agent's space); ``action_mask`` a bool array ``(rows, n)`` for ``Discrete``
    actions (all True where the env gives no mask), else ``None``; the flags as in
    :class:`MultiAgentBatch`, for these agents."""

    group: AgentGroup
    observation: Any
    action_mask: np.ndarray | None
    active: np.ndarray
    present: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    reward: np.ndarray
    episode_return: np.ndarray
    episode_length: np.ndarray


class AgentStep(NamedTuple):
    """One env's result as PettingZoo's parallel API has it: dicts keyed by agent name, for the
    agents in the result (``present``); ``action_masks`` for those of them with a mask."""

    observations: dict[str, Any]
    rewards: dict[str, float]
    terminations: dict[str, bool]
    truncations: dict[str, bool]
    infos: dict[str, dict]
    action_masks: dict[str, np.ndarray]


@dataclass(frozen=True)
class MultiAgentBatch:
    """The envs ``env_ids`` (in the order they finished), flat by agent: every per-agent array
    has ``len(env_ids) * layout.num_agents`` rows, row ``i * n + a`` being agent slot ``a``
    (``layout.possible_agents[a]``) of env ``env_ids[i]``.

    * ``active``: the agent acts next (send it an action; its row of the next action batch is
      read). Agents that died, have not appeared, or whose turn it is not are inactive: their
      action rows are never sent to the env.
    * ``present``: the agent is in this result (PettingZoo returned it: its observation, reward
      and flags are its own; an agent that just terminated is present, not active). Rows of
      agents not present are zeros.
    * ``terminated`` / ``truncated`` / ``reward``: this step's, per agent.
    * ``episode_return`` / ``episode_length``: the agent's sum of rewards and number of actions
      in the env's current episode, up to and including this result.

    Per env (``len(env_ids)`` rows): ``episode_start`` (this result is a reset: from ``reset()``,
    the autoreset of an env whose agents were all done, or a restart), ``episode_end`` (no
    agent is left: the env's next step is its reset, with no action read), ``restarted`` (its
    process was restarted: the episode was cut short, this is a fresh reset), ``infos`` (the
    agents' non-empty infos, less the action mask). ``groups`` holds the observations and action
    masks, one block per group; with one group, ``observation`` and ``action_mask`` are its.
    """

    env_ids: np.ndarray
    layout: AgentLayout
    groups: dict[str, GroupBatch]
    active: np.ndarray
    present: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    reward: np.ndarray
    episode_return: np.ndarray
    episode_length: np.ndarray
    episode_start: np.ndarray
    episode_end: np.ndarray
    restarted: np.ndarray
    infos: list[dict[str, dict]] = field(default_factory=list)

    @property
    def num_envs(self) -> int:
        return len(self.env_ids)

    @property
    def observation(self) -> Any:
        """The observations of the one group (for several groups: ``groups[name].observation``)."""
        return self._only().observation

    @property
    def action_mask(self) -> np.ndarray | None:
        """The action masks of the one group (for several groups: ``groups[name].action_mask``)."""
        return self._only().action_mask

    def _only(self) -> GroupBatch:
        if len(self.groups) != 1:
            raise AttributeError(f"the agents form {len(self.groups)} groups {list(self.groups)}: use groups[name]")
        return next(iter(self.groups.values()))

    def as_dicts(self) -> list[AgentStep]:
        """Per env of the batch, its result as PettingZoo's dicts (agents that are present)."""
        n, names = self.layout.num_agents, self.layout.possible_agents
        out = []
        for i in range(len(self.env_ids)):
            step = AgentStep({}, {}, {}, {}, dict(self.infos[i]) if self.infos else {}, {})
            for g in self.groups.values():
                size = g.group.size
                for j, agent in enumerate(g.group.agents):
                    row = i * size + j
                    if not g.present[row]:
                        continue
                    step.observations[agent] = _row(g.observation, row)
                    if g.action_mask is not None:
                        step.action_masks[agent] = g.action_mask[row]
            for a in range(n):
                row = i * n + a
                if self.present[row]:
                    step.rewards[names[a]] = float(self.reward[row])
                    step.terminations[names[a]] = bool(self.terminated[row])
                    step.truncations[names[a]] = bool(self.truncated[row])
            out.append(step)
        return out


def _row(tree: Any, row: int) -> Any:
    if isinstance(tree, dict):
        return {k: _row(v, row) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_row(v, row) for v in tree)
    return tree[row]


_FLAGS = ("active", "present", "terminated", "truncated")
_NUMBERS = ("reward", "episode_return", "episode_length")


def gather(layout: AgentLayout, observation: dict[str, Any], ids: np.ndarray, starts: np.ndarray, ends: np.ndarray,
           restarted: np.ndarray, infos: Sequence[dict[str, dict]]) -> MultiAgentBatch:
    """The batch of envs ``ids`` out of the core's result arrays (a copy: valid after the envs
    are stepped again). ``observation`` is the facade's observation tree, env-first."""
    k, n = len(ids), layout.num_agents
    # Every env in order (a lockstep step): whole arrays copied, no fancy indexing.
    whole = k == len(observation["active"]) and ids.tolist() == list(range(k))

    def take(a: np.ndarray) -> np.ndarray:
        return a.copy() if whole else a[ids]

    flags = np.empty((len(_FLAGS), k, n), np.bool_)  # the four flags, one array, read once each
    for i, key in enumerate(_FLAGS):
        np.not_equal(observation[key] if whole else observation[key][ids], 0, out=flags[i])
    per_env = dict(zip(_FLAGS, flags, strict=True))
    per_env.update({key: take(observation[key]) for key in _NUMBERS})  # (k, n) each, copies
    groups = {}
    for g in layout.groups:
        block = observation["groups"][g.name]
        every = g.slots == tuple(range(n))  # the group is every agent, in slot order

        def rows_of(a: np.ndarray, size: int = g.size) -> np.ndarray:
            return take(a).reshape(k * size, *a.shape[2:])

        mask = None
        if "action_mask" in block:
            src = block["action_mask"]
            mask = np.not_equal(src if whole else src[ids], 0).reshape(k * g.size, -1)
        cols = list(g.slots)
        mine = {key: (per_env[key].reshape(-1).copy() if every else per_env[key][:, cols].reshape(-1))
                for key in _FLAGS + _NUMBERS}
        groups[g.name] = GroupBatch(g, tree_map(rows_of, block["observation"]), mask, **mine)
    flat = {key: per_env[key].reshape(k * n) for key in _FLAGS + _NUMBERS}
    return MultiAgentBatch(env_ids=ids, layout=layout, groups=groups, episode_start=starts, episode_end=ends,
                           restarted=restarted, infos=list(infos), **flat)
