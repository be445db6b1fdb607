"""How a PettingZoo env's agents are laid out as fixed-shape arrays: agent slots (one per
``possible_agents`` entry), groups of agents that share spaces (TorchRL's ``group_map``), and the
single-agent spaces of the facade the core carries (``envmanager.pettingzoo.facade``).

Plain gymnasium: nothing here imports PettingZoo, so the parent and the worker agree on the
layout from the spaces alone. Every env of a vector must have the same layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from envmanager.errors import InvalidInputError, SpaceMismatchError

__all__ = ["AgentGroup", "AgentLayout", "stacked_space", "stacked_action_space", "zeros_of", "put_row", "AGENT_KEYS",
           "one_layout", "check_group_options"]

#: The per-agent arrays every facade observation carries, one entry per agent slot, and their dtypes.
AGENT_KEYS: dict[str, Any] = {
    "active": np.int8,  # the agent acts next (it is in ``env.agents``; in a turn-based game: its turn)
    "present": np.int8,  # the agent is in this result (its observation, reward and flags are its own)
    "terminated": np.int8,
    "truncated": np.int8,
    "reward": np.float64,
    "episode_return": np.float64,
    "episode_length": np.int64,
}
MASK_KEY = "action_mask"


@dataclass(frozen=True)
class AgentGroup:
    """Agents that share an observation and an action space: one block of arrays.

    ``agents``: their names, in ``possible_agents`` order; ``slots``: their agent slots (indices
    into ``possible_agents``); ``observation_space`` / ``action_space``: one agent's (the
    observation without its action mask, when the env puts one in the observation);
    ``mask_size``: the length of the action mask (``Discrete`` actions), else ``None``;
    ``mask_in_observation``: the env puts the mask in ``observation["action_mask"]`` (else it may
    put it in ``info["action_mask"]``; where it gives none, every action is allowed)."""

    name: str
    agents: tuple[str, ...]
    slots: tuple[int, ...]
    observation_space: spaces.Space
    action_space: spaces.Space
    mask_size: int | None
    mask_in_observation: bool

    @property
    def size(self) -> int:
        return len(self.agents)


@dataclass(frozen=True)
class AgentLayout:
    """The agent slots and groups of an env (and of every env of a vector)."""

    possible_agents: tuple[str, ...]
    groups: tuple[AgentGroup, ...]
    turn_based: bool

    @property
    def num_agents(self) -> int:
        return len(self.possible_agents)

    @classmethod
    def of(cls, possible_agents: Sequence[str], observation_space: Any, action_space: Any,
           group_map: Mapping[str, Sequence[str]] | None = None, turn_based: bool = False) -> AgentLayout:
        """The layout of an env with these agents; ``observation_space(agent)`` and
        ``action_space(agent)`` as PettingZoo has them. Raises ``ValueError`` / ``TypeError``
        saying what does not fit (names, spaces a fixed-shape array cannot hold)."""
        agents = tuple(possible_agents)
        if not agents:
            raise ValueError("the env has no possible_agents: nothing to lay out")
        if len(set(agents)) != len(agents):
            raise ValueError(f"possible_agents has duplicates: {list(agents)}")
        obs = {a: observation_space(a) for a in agents}
        act = {a: action_space(a) for a in agents}
        if group_map is None:
            members: list[list[str]] = []
            for a in agents:
                for m in members:
                    if obs[m[0]] == obs[a] and act[m[0]] == act[a]:
                        m.append(a)
                        break
                else:
                    members.append([a])
            named = _names(members)
        else:
            named = _checked_map(group_map, agents, obs, act)
        index = {a: i for i, a in enumerate(agents)}
        groups = tuple(_group(name, tuple(m), tuple(index[a] for a in m), obs[m[0]], act[m[0]]) for name, m in named)
        return cls(agents, groups, bool(turn_based))

    def observation_space(self) -> spaces.Dict:
        """The facade's observation space: the per-agent arrays (``AGENT_KEYS``) and, per group,
        its agents' observations stacked (and their action masks)."""
        n = self.num_agents
        out: dict[str, spaces.Space] = {}
        for key, dtype in AGENT_KEYS.items():
            if np.dtype(dtype).kind == "f":
                out[key] = spaces.Box(-np.inf, np.inf, (n,), dtype)
            else:
                out[key] = spaces.Box(0, np.iinfo(dtype).max, (n,), dtype)
        groups: dict[str, spaces.Space] = {}
        for g in self.groups:
            block: dict[str, spaces.Space] = {"observation": stacked_space(g.observation_space, g.size)}
            if g.mask_size is not None:
                block[MASK_KEY] = spaces.Box(0, 1, (g.size, g.mask_size), np.int8)
            groups[g.name] = spaces.Dict(block)
        out["groups"] = spaces.Dict(groups)
        return spaces.Dict(out)

    def action_space(self) -> spaces.Dict:
        """The facade's action space: per group, one row per agent (rows of agents that do not
        act are not read; the parent checks the others against the agent's space)."""
        return spaces.Dict({g.name: stacked_action_space(g.action_space, g.size) for g in self.groups})


# ----------------------------------------------------------------------------------------------
# Groups


def _prefix(agent: str) -> str:
    """``adversary_0`` -> ``adversary`` (PettingZoo's ``<kind>_<n>`` names), else the name."""
    match = re.fullmatch(r"(.+?)_?\d+", agent)
    return match.group(1) if match else agent


def _names(members: list[list[str]]) -> list[tuple[str, list[str]]]:
    """Group names: the agents' common name prefix (``piston``, ``adversary``), ``agents`` for a
    single group of mixed names, ``group_<i>`` where prefixes do not tell groups apart."""
    prefixes = [{_prefix(a) for a in m} for m in members]
    names = [next(iter(p)) if len(p) == 1 else ("agents" if len(members) == 1 else "") for p in prefixes]
    if "" in names or len(set(names)) != len(names):
        names = [f"group_{i}" for i in range(len(members))]
    return list(zip(names, members, strict=True))


def _checked_map(group_map: Mapping[str, Sequence[str]], agents: tuple[str, ...], obs: dict[str, Any],
                 act: dict[str, Any]) -> list[tuple[str, list[str]]]:
    seen: dict[str, str] = {}
    out = []
    for name, listed in group_map.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"group names must be non-empty strings, got {name!r}")
        members = [str(a) for a in listed]
        if not members:
            raise ValueError(f"group {name!r} has no agents")
        for a in members:
            if a not in obs:
                raise ValueError(f"group {name!r} names {a!r}, which is not one of possible_agents {list(agents)}")
            if a in seen:
                raise ValueError(f"agent {a!r} is in two groups: {seen[a]!r} and {name!r}")
            seen[a] = name
            if obs[a] != obs[members[0]] or act[a] != act[members[0]]:
                raise ValueError(f"group {name!r}: agents {members[0]!r} and {a!r} have different spaces "
                                 f"({obs[members[0]]} / {act[members[0]]} against {obs[a]} / {act[a]})")
        out.append((name, sorted(members, key=agents.index)))
    missing = [a for a in agents if a not in seen]
    if missing:
        raise ValueError(f"agents {missing} are in no group of the group map")
    return out


def _group(name: str, agents: tuple[str, ...], slots: tuple[int, ...], obs: Any, act: Any) -> AgentGroup:
    if not isinstance(act, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)):
        raise TypeError(f"agent {agents[0]!r}: action space {act} is not supported (Box, Discrete, MultiDiscrete, MultiBinary)")
    # An action mask in the observation is taken out only for Discrete actions (the ones masks are
    # carried for); with other actions it stays an ordinary part of the observation.
    in_obs = isinstance(obs, spaces.Dict) and MASK_KEY in obs.spaces and isinstance(act, spaces.Discrete)
    if in_obs:
        rest = {k: v for k, v in obs.spaces.items() if k != MASK_KEY}
        obs = rest["observation"] if set(rest) == {"observation"} else spaces.Dict(rest)
    stacked_space(obs, 1)  # raises for spaces with no fixed-shape layout
    mask_size = int(act.n) if isinstance(act, spaces.Discrete) else None
    return AgentGroup(name, agents, slots, obs, act, mask_size, in_obs)


# ----------------------------------------------------------------------------------------------
# Spaces stacked over a group's agents, and rows of them


def _compact(bound: np.ndarray) -> Any:
    """A bound that is one value everywhere as that value (a small space to send around)."""
    flat = bound.reshape(-1)
    return flat[0] if flat.size and (flat == flat[0]).all() else bound


def stacked_space(space: spaces.Space, n: int) -> spaces.Space:
    """``n`` agents' observations of ``space`` as one array (or a dict / tuple of arrays)."""
    if isinstance(space, spaces.Box):
        shape = (n, *space.shape)
        return spaces.Box(_compact(np.broadcast_to(space.low, shape)), _compact(np.broadcast_to(space.high, shape)),
                          shape, space.dtype)
    if isinstance(space, spaces.Discrete):
        return spaces.Box(int(space.start), int(space.start + space.n - 1), (n,), np.int64)
    if isinstance(space, spaces.MultiDiscrete):
        low = np.broadcast_to(np.asarray(space.start, np.int64), (n, *space.shape))
        return spaces.Box(_compact(low), _compact(low + np.broadcast_to(space.nvec - 1, low.shape)), (n, *space.shape),
                          np.int64)
    if isinstance(space, spaces.MultiBinary):
        return spaces.Box(0, 1, (n, *space.shape), np.int8)
    if isinstance(space, spaces.Dict):
        return spaces.Dict({k: stacked_space(v, n) for k, v in space.spaces.items()})
    if isinstance(space, spaces.Tuple):
        return spaces.Tuple(tuple(stacked_space(v, n) for v in space.spaces))
    raise TypeError(f"observation space {space} has no fixed-shape array layout "
                    "(Box, Discrete, MultiDiscrete, MultiBinary, and Dict / Tuple of them)")


def stacked_action_space(space: spaces.Space, n: int) -> spaces.Box:
    """``n`` agents' actions as one array: the agent's bounds (so that ``sample()`` gives actions
    the env takes: ``envs_per_worker="auto"`` steps the facade with samples), integer actions as
    int64."""
    if isinstance(space, spaces.MultiBinary):
        return spaces.Box(0, 1, (n, *space.shape), np.int64)
    stacked = stacked_space(space, n)
    assert isinstance(stacked, spaces.Box)
    return stacked


def zeros_of(space: spaces.Space) -> Any:
    """An all-zero value of a stacked space (arrays, or dicts / tuples of them)."""
    if isinstance(space, spaces.Dict):
        return {k: zeros_of(v) for k, v in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(zeros_of(v) for v in space.spaces)
    return np.zeros(space.shape, space.dtype)


def put_row(block: Any, row: int, value: Any) -> None:
    """Write one agent's ``value`` into row ``row`` of a stacked ``block``."""
    if isinstance(block, dict):
        for k, sub in block.items():
            put_row(sub, row, value[k])
    elif isinstance(block, tuple):
        for sub, item in zip(block, value, strict=True):
            put_row(sub, row, item)
    else:
        block[row] = value


def one_layout(observation_spaces: list[Any], action_spaces: list[Any]) -> None:
    """The core's ``check_spaces``: every env's facade has the same spaces (else a clear error)."""
    for slot, (o, a) in enumerate(zip(observation_spaces, action_spaces, strict=True)):
        if o != observation_spaces[0] or a != action_spaces[0]:
            raise SpaceMismatchError(f"env {slot}'s agents have other spaces than env 0's: every env of a "
                                     "ParallelVectorEnv must have the same agents and spaces")


def check_group_options(agent_groups: Mapping[str, Sequence[str]] | None, turn_based: bool | None) -> None:
    """What can be checked before any process starts (agent names are checked against each env's
    ``possible_agents`` once it is made)."""
    if turn_based is not None and not isinstance(turn_based, bool):
        raise InvalidInputError(f"turn_based must be True, False or None, got {turn_based!r}")
    if agent_groups is None:
        return
    if not isinstance(agent_groups, Mapping) or not agent_groups:
        raise InvalidInputError(f"agent_groups must be a non-empty dict {{group name: [agents]}}, got {agent_groups!r:.80}")
    seen: dict[str, str] = {}
    for name, agents in agent_groups.items():
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"group names must be non-empty strings, got {name!r}")
        if isinstance(agents, str) or not isinstance(agents, Sequence) or not agents:
            raise InvalidInputError(f"group {name!r} must list its agents (a non-empty list of names), got {agents!r:.80}")
        for agent in agents:
            if agent in seen:
                raise InvalidInputError(f"agent {agent!r} is in two groups: {seen[agent]!r} and {name!r}")
            seen[agent] = name
