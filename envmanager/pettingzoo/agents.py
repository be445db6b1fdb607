"""Per-agent transitions out of a multi-agent env's steps, as the sampler recorded them.

The ``Sampler`` records one step per env step of a PettingZoo env behind its facade
(``envmanager.pettingzoo.facade``): the facade's observation (every agent's, with the active
mask and per-agent rewards and flags) and action (one row per agent; only active agents' rows
reach the env). A learner wants one row per agent instead. An agent's transition runs from an
observation it acted on to the next result in which it acts again or is done, its reward summed
over the env steps in between (PettingZoo AEC's cumulative reward: in a turn-based game an
agent is rewarded on its opponent's move). In a parallel env, where every live agent acts at
every step, that is one row per active agent per step.

Each agent's episode id is derived from the env episode's, which the parent issued before the
episode started: ``env_episode_id * num_agents + agent_slot``, so agent ids are unique and
never reused when env ids are not (also across restarts). Rows of an env episode cut by a
restart carry ``interrupted``, and the transitions still open when it was cut are closed there,
flagged too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envmanager.pettingzoo.layout import MASK_KEY, AgentGroup, AgentLayout
from envmanager.sampler.batches import Step, TransitionBatch

__all__ = ["agent_episode_id", "AgentRows"]


def agent_episode_id(env_episode_id: Any, agent: Any, num_agents: int) -> Any:
    """The episode id of agent slot ``agent`` in env episode ``env_episode_id`` (ints or arrays)."""
    return env_episode_id * num_agents + agent


def _at(tree: Any, t: int, j: int) -> Any:
    """Row ``j`` of step ``t`` of a stacked tree (``(steps, agents, ...)`` arrays)."""
    if isinstance(tree, dict):
        return {k: _at(v, t, j) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_at(v, t, j) for v in tree)
    return tree[t, j]


@dataclass
class _Open:
    """An agent's transition from the observation it acted on, until it acts again or is done."""

    group: AgentGroup
    row: int  # the agent's row in its group
    agent: int  # its agent slot
    step: Step  # filled in as results come; ``next_observation`` None while open


@dataclass
class _Episode:
    """The open transitions of one env episode (an env slot runs one at a time)."""

    env_episode_id: int
    open: dict[int, _Open] = field(default_factory=dict)
    #: Rewards paid to an agent while it had no open transition (before its first action: it
    #: appeared with a reward, or an opponent moved first): added to its next transition.
    pending: dict[int, float] = field(default_factory=dict)


class AgentRows:
    """Turns env steps into per-agent rows, per group. Transitions still open at the end of a
    call (the episode goes on into the next ``obtain_steps``) wait here, one entry per env slot."""

    def __init__(self, layout: AgentLayout) -> None:
        self.layout = layout
        self._group_of = {a: (g, j) for g in layout.groups for j, a in enumerate(g.slots)}
        self.open: dict[int, _Episode] = {}  # per env slot: its episode's open transitions
        self._waiting: list[_Open] = []  # opened and not handed out yet, in the order opened

    def rows(self, env: TransitionBatch) -> dict[str, list[Step]]:
        """The transitions ``env`` (env steps, each slot's in order) and anything closed since the
        last call close, per group, in the order they were opened. Those still open wait."""
        self._run(env)
        out: dict[str, list[Step]] = {g.name: [] for g in self.layout.groups}
        waiting = []
        for o in self._waiting:
            if o.step.next_observation is None:
                waiting.append(o)
            else:
                out[o.group.name].append(o.step)
        self._waiting = waiting
        return out

    def close_episode(self, slot: int, interrupted: bool) -> None:
        """The slot's episode is over (ended, or cut when ``interrupted``): what it has open
        closes, truncated where the agent had no end of its own."""
        episode = self.open.pop(slot, None)
        for o in [] if episode is None else episode.open.values():
            if o.step.next_observation is None:  # no result of its own after it acted: its last observation
                o.step.next_observation = o.step.observation
            o.step.truncated = o.step.truncated or not o.step.terminated
            o.step.interrupted = o.step.interrupted or interrupted

    def drop_episode(self, slot: int) -> int:
        """The slot's episode goes on unrecorded: its open transitions are dropped (returned: how many)."""
        episode = self.open.pop(slot, None)
        if episode is None:
            return 0
        dropped = set(map(id, episode.open.values()))
        self._waiting = [o for o in self._waiting if id(o) not in dropped]
        return len(dropped)

    def _run(self, env: TransitionBatch) -> None:
        n = self.layout.num_agents
        obs, nxt = env.observations, env.next_observations
        slots, ids = env.worker_ids.tolist(), env.episode_ids.tolist()
        for t, (slot, episode_id) in enumerate(zip(slots, ids, strict=True)):
            episode = self.open.get(slot)
            if episode is None or episode.env_episode_id != episode_id:
                self.close_episode(slot, interrupted=True)  # (the caller settles ended runs first: none here)
                episode = self.open[slot] = _Episode(episode_id)
            interrupted = bool(env.interrupted[t])
            for a in np.flatnonzero(obs["active"][t]).tolist():  # the agents that acted
                g, j = self._group_of[a]
                block = obs["groups"][g.name]
                info: dict[str, Any] = {"agent": a, "env_episode_id": episode_id}
                if MASK_KEY in block:
                    info[MASK_KEY] = block[MASK_KEY][t, j].astype(np.bool_)
                step = Step(_at(block["observation"], t, j), _at(env.actions[g.name], t, j),
                            episode.pending.pop(a, 0.0), False, False, None,
                            slot, agent_episode_id(episode_id, a, n), int(env.policy_versions[t]),
                            int(env.env_versions[t]), info, {}, interrupted)
                episode.open[a] = o = _Open(g, j, a, step)
                self._waiting.append(o)
            self._result(episode, nxt, t, interrupted)
            last_of_episode = t + 1 == len(ids) or slots[t + 1] != slot or ids[t + 1] != episode_id
            if env.terminated[t] or env.truncated[t] or (interrupted and last_of_episode):
                self.close_episode(slot, interrupted)

    @staticmethod
    def _result(episode: _Episode, nxt: Any, t: int, interrupted: bool) -> None:
        """Step ``t``'s result: rewards added to the open transitions; those whose agent acts
        again or is done close with its observation there."""
        for a in np.flatnonzero(nxt["present"][t]).tolist():
            if a not in episode.open and nxt["reward"][t, a]:
                episode.pending[a] = episode.pending.get(a, 0.0) + float(nxt["reward"][t, a])
        for a, o in list(episode.open.items()):
            step = o.step
            step.reward += float(nxt["reward"][t, a])
            step.interrupted = step.interrupted or interrupted
            terminated, truncated = bool(nxt["terminated"][t, a]), bool(nxt["truncated"][t, a])
            if nxt["present"][t, a] and (nxt["active"][t, a] or terminated or truncated):
                step.next_observation = _at(nxt["groups"][o.group.name]["observation"], t, o.row)
                step.terminated, step.truncated = terminated, truncated
                del episode.open[a]
