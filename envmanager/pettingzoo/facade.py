"""The worker's half: a PettingZoo env behind a fixed-shape single-agent facade the core can
carry unchanged (shared memory, several envs per process, first-ready, deadlines, restarts).

The facade's observation is a dict of arrays (``AgentLayout.observation_space``): per agent slot
``active``, ``present``, ``terminated``, ``truncated``, ``reward``, ``episode_return``,
``episode_length``; per group its agents' observations stacked, and their action masks. Its
action is per group one row per agent; only the rows of active agents reach the env. Its
episode ends when the env has no agents left (``env.agents`` empty), and the core's next-step
autoreset then resets it, alone.

AEC envs go through PettingZoo's own conversions: ``aec_to_parallel`` where the env says it is
parallelizable (``metadata["is_parallelizable"]``: its agents act once per cycle, as in a
parallel env), else ``turn_based_aec_to_parallel`` (turn-based games: one agent acts per step,
the others observe; the active mask holds only the agent whose turn it is).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np

from envmanager.extras import requires_extra
from envmanager.pettingzoo.layout import AGENT_KEYS, MASK_KEY, AgentLayout, put_row, zeros_of

with requires_extra("pettingzoo", __name__):
    from pettingzoo import AECEnv
    from pettingzoo.utils.conversions import aec_to_parallel, turn_based_aec_to_parallel

__all__ = ["AgentFacade", "FacadeFactory", "OnPettingZooEnv", "as_parallel", "call_env"]

logger = logging.getLogger(__name__)

#: Info keys the facade moves into arrays (and so out of the infos that travel pickled).
_MOVED = (MASK_KEY, "active_agent")


def as_parallel(env: Any, turn_based: bool | None = None) -> tuple[Any, bool]:
    """``env`` as a PettingZoo ``ParallelEnv`` and whether it is stepped turn by turn."""
    if isinstance(env, AECEnv):
        if turn_based is None:
            turn_based = not env.metadata.get("is_parallelizable", False)
        return (turn_based_aec_to_parallel(env) if turn_based else aec_to_parallel(env)), turn_based
    if not (hasattr(env, "step") and hasattr(env, "reset") and hasattr(env, "possible_agents")):
        raise TypeError(f"expected a PettingZoo ParallelEnv or AECEnv, got {type(env).__name__} {env!r:.80}")
    if turn_based:
        raise ValueError("turn_based=True needs an AEC env (a ParallelEnv steps every agent at once)")
    return env, False


class AgentFacade(gymnasium.Env):
    """One PettingZoo env as a fixed-shape single-agent env (see the module doc).

    Its observation is one preallocated tree of arrays, rewritten in place by every ``reset`` /
    ``step``: the core's worker copies it into shared memory (or pickles it) before the next
    call, so holding on to it past that sees the next result."""

    def __init__(self, env: Any, group_map: Mapping[str, Sequence[str]] | None = None,
                 turn_based: bool | None = None) -> None:
        self.env, self.turn_based = as_parallel(env, turn_based)
        par = self.env
        #: The agent slots and groups (the parent checks every env has the same).
        self.layout = AgentLayout.of(par.possible_agents, par.observation_space, par.action_space, group_map,
                                     self.turn_based)
        self.observation_space = self.layout.observation_space()
        self._groups_space = self.observation_space.spaces["groups"]
        self.action_space = self.layout.action_space()
        self.metadata = dict(getattr(par, "metadata", None) or {})
        self.render_mode = getattr(par, "render_mode", None)
        self._slot = {a: i for i, a in enumerate(self.layout.possible_agents)}
        # Per agent: its group's index, its row there, the group's observation space and mask rule.
        self._where = {a: (k, row) for k, g in enumerate(self.layout.groups) for row, a in enumerate(g.agents)}
        self._returns = np.zeros(self.layout.num_agents, np.float64)
        self._lengths = np.zeros(self.layout.num_agents, np.int64)
        # Per agent slot: a result of this episode ended it (terminated or truncated).
        self._ended = np.zeros(self.layout.num_agents, np.bool_)
        self._active: list[str] = []
        # The one result this facade hands out, rewritten in place each step (the core copies it
        # into shared memory, or pickles it, before the env is stepped again).
        n = self.layout.num_agents
        self._out: dict[str, Any] = {key: np.zeros(n, dtype) for key, dtype in AGENT_KEYS.items()}
        self._out["groups"] = zeros_of(self._groups_space)
        self._agent_arrays = [self._out[key] for key in ("active", "present", "terminated", "truncated", "reward")]
        # Per agent whose observation is one array: where its row goes (array, row); others go by put_row.
        self._plain: dict[str, tuple[np.ndarray, int]] = {}
        for g in self.layout.groups:
            block = self._out["groups"][g.name]["observation"]
            if isinstance(block, np.ndarray) and not g.mask_in_observation:
                self._plain.update({a: (block, row) for row, a in enumerate(g.agents)})
        # The agents whose observations the last result holds (rows not written this time go back to zero).
        self._written: tuple[str, ...] = ()
        self._info_masks = [g for g in self.layout.groups if g.mask_size is not None and not g.mask_in_observation]
        self._index_cache: dict[tuple[str, ...], Any] = {}
        self._acts = [(a, self.layout.groups[self._where[a][0]], self._where[a][1]) for a in self.layout.possible_agents]

    # -- the env's calls ----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        observations, infos = self.env.reset(seed=seed, options=options)
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self._ended[:] = False
        out = self._fill(observations, infos or {}, None, None, None)
        return out, self._infos(infos)

    def step(self, action: Mapping[str, np.ndarray]) -> tuple[dict, float, bool, bool, dict]:
        actions: dict[str, Any] = {}
        where, groups = self._where, self.layout.groups
        rows: dict[str, list] = {}  # Discrete groups' rows as Python ints, read once
        for agent in self._active:
            k, row = where[agent]
            g = groups[k]
            if g.mask_size is not None:
                values = rows.get(g.name)
                if values is None:
                    values = rows[g.name] = np.asarray(action[g.name]).reshape(g.size).tolist()
                actions[agent] = int(values[row])
            else:
                actions[agent] = np.array(action[g.name][row], dtype=g.action_space.dtype)
        acted = self._indices(tuple(self._active))
        observations, rewards, terminations, truncations, infos = self.env.step(actions)
        self._lengths[acted] += 1
        out = self._fill(observations, infos or {}, rewards, terminations, truncations)
        ends = any(terminations.values()) or any(truncations.values())
        if ends or self._ended.any():
            self._track_ends(out)
        # Over when no agent is left, or (an env that keeps done agents listed) every agent of the
        # result is done and no other agent is listed.
        done = not self._active
        if not done and ends:
            present = out["present"] == 1
            ended = (out["terminated"] | out["truncated"]) == 1
            done = bool(present.any() and ended[present].all()
                        and all(present[self._slot[a]] for a in self._active))
        if done:
            self._active = []
            out["active"][:] = 0
        # The env's episode was cut short (truncated) when its last agents were only truncated.
        truncated = done and any(truncations.values()) and not any(terminations.values())
        return out, float(out["reward"].sum()), done and not truncated, truncated, self._infos(infos)

    def render(self) -> Any:
        return self.env.render()

    def close(self) -> None:
        self.env.close()

    def _track_ends(self, out: dict[str, Any]) -> None:
        """Note the agents this result ends; refuse one that ended earlier in the episode and is
        back, live: PettingZoo forbids it (its API tests: "agents cannot resurect! Generate a new
        agent with a new name"), and its new life would join the old one (its agent episode id,
        return and length are per episode)."""
        ended = (out["terminated"] | out["truncated"]) == 1
        back = self._ended & (out["present"] == 1) & ~ended
        if back.any():
            names = [self.layout.possible_agents[i] for i in np.flatnonzero(back)]
            raise ValueError(f"the env returned agents {names} alive after they were terminated or truncated in "
                             f"this episode; PettingZoo does not allow an agent back: give its new life a new name")
        self._ended |= ended

    # -- arrays ---------------------------------------------------------------------------------
    def _indices(self, agents: tuple[str, ...]) -> Any:
        """The agent slots of ``agents`` as an index (a slice for every agent in order), cached:
        the same agents come back step after step. Raises for an agent not in possible_agents."""
        index = self._index_cache.get(agents)
        if index is None:
            slot = self._slot
            for agent in agents:
                if agent not in slot:
                    raise ValueError(f"the env returned agent {agent!r}, which is not one of possible_agents "
                                     f"{list(self.layout.possible_agents)}")
            if agents == self.layout.possible_agents:
                index = slice(None)
            else:
                index = np.array([slot[a] for a in agents], np.intp)
            if len(self._index_cache) >= 256:
                self._index_cache.clear()
            self._index_cache[agents] = index
        return index

    def _fill(self, observations: Mapping[str, Any], infos: Mapping[str, Any], rewards: Mapping[str, Any] | None,
              terminations: Mapping[str, Any] | None, truncations: Mapping[str, Any] | None) -> dict[str, Any]:
        """The result in the facade's one preallocated result, rewritten in place."""
        out = self._out
        for arr in self._agent_arrays:
            arr.fill(0)
        keys = tuple(observations)
        present = out["present"]
        present[self._indices(keys)] = 1
        for given, key in ((rewards, "reward"), (terminations, "terminated"), (truncations, "truncated")):
            if given:
                agents = tuple(given)
                index = self._indices(agents)
                if agents != keys:
                    present[index] = 1
                values = list(given.values())
                target = out[key]
                try:
                    target[index] = values
                except (ValueError, TypeError):  # odd values (arrays of one reward): one by one
                    for a, v in zip(agents, values, strict=True):
                        target[self._slot[a]] = v if key == "reward" else bool(v)
        self._returns += out["reward"]
        out["episode_return"][:] = self._returns
        out["episode_length"][:] = self._lengths
        self._observations(observations)
        for g in self._info_masks:  # masks given in infos; everything allowed where the env gives none
            mask = out["groups"][g.name][MASK_KEY]
            if not infos or not any(infos.values()):
                mask.fill(1)
                continue
            for row, agent in enumerate(g.agents):
                info = infos.get(agent)
                given_mask = info.get(MASK_KEY) if isinstance(info, Mapping) else None
                mask[row] = 1 if given_mask is None else given_mask
        active = list(self.env.agents)
        if self.turn_based:
            selected = getattr(self.env.aec_env, "agent_selection", None)
            active = [selected] if active and selected in active else []
        self._active = active
        if active:
            out["active"][self._indices(tuple(active))] = 1
        return out

    def _observations(self, observations: Mapping[str, Any]) -> None:
        """The agents' observations into their groups' rows; rows the last result wrote and this
        one does not go back to zero (rows of agents not present are zeros)."""
        groups, where, plain, blocks = self.layout.groups, self._where, self._plain, self._out["groups"]
        for agent, obs in observations.items():
            target = plain.get(agent)
            if target is not None:
                target[0][target[1]] = obs
                continue
            k, row = where[agent]
            g = groups[k]
            block = blocks[g.name]
            if g.mask_in_observation:
                block[MASK_KEY][row] = obs[MASK_KEY]
                obs = obs["observation"] if not isinstance(g.observation_space, gymnasium.spaces.Dict) else {
                    key: v for key, v in obs.items() if key != MASK_KEY}
            put_row(block["observation"], row, obs)
        keys = tuple(observations)
        if keys != self._written:  # agents the last result had and this one has not: zero their rows
            for agent in set(self._written).difference(keys):
                k, row = where[agent]
                g = groups[k]
                _zero_row(blocks[g.name]["observation"], row)
                if g.mask_in_observation:
                    blocks[g.name][MASK_KEY][row] = 0
            self._written = keys

    def _infos(self, infos: Mapping[str, Any] | None) -> dict[str, Any]:
        """The agents' non-empty infos, less what went into arrays (the action mask, whose turn
        it is): an empty dict, the usual case, travels as nothing."""
        if not infos or not any(infos.values()):
            return {}
        out = {}
        for agent, info in (infos or {}).items():
            if isinstance(info, Mapping):
                info = {k: v for k, v in info.items() if k not in _MOVED}
            if info:
                out[agent] = info
        return out


class FacadeFactory:
    """The core's ``env_factory``: ``env_fns[slot]()`` behind an :class:`AgentFacade` (made in
    the worker; pickled by reference, so the worker imports this module, not the parent's)."""

    def __init__(self, env_fns: Sequence[Callable[[], Any]], group_map: Mapping[str, Sequence[str]] | None,
                 turn_based: bool | None) -> None:
        self.env_fns = list(env_fns)
        self.group_map = None if group_map is None else {k: list(v) for k, v in group_map.items()}
        self.turn_based = turn_based

    def __call__(self, slot: int) -> AgentFacade:
        return AgentFacade(self.env_fns[slot](), self.group_map, self.turn_based)


def _zero_row(block: Any, row: int) -> None:
    if isinstance(block, dict):
        for sub in block.values():
            _zero_row(sub, row)
    elif isinstance(block, tuple):
        for sub in block:
            _zero_row(sub, row)
    else:
        block[row] = 0


class OnPettingZooEnv:
    """An env update ``fn(env)`` for the PettingZoo env (as :func:`call_env` reaches it), run
    in a worker on the facade that hosts it: the core's updates get the slot's env, the facade."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, facade: AgentFacade) -> Any:
        return self.fn(facade.env)


def call_env(facade: AgentFacade, name: str, args: tuple, kwargs: dict) -> Any:
    """Run in a worker: ``env.<name>(*args, **kwargs)`` on the PettingZoo env (``unwrapped``
    reaches through PettingZoo's wrappers), or its value when not callable."""
    value = getattr(facade.env, name)
    return value(*args, **kwargs) if callable(value) else value
