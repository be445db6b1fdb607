"""``MultiAgentSampler``: per-agent trajectories from PettingZoo envs in worker processes.

A layer over the single-agent samplers, not a third one: each PettingZoo env runs behind its
fixed-shape facade (``envmanager.pettingzoo.facade``), so the ``Sampler`` (policy in the
parent) or the ``WorkerPolicySampler`` (policy in the workers) collects env steps as it does
for any env, with its records, episode ids, updates, stats and its one fault path (a cut
episode is flagged, ids are never reused, an error names the slot). What this layer adds is
the policy's side, one policy per group of agents called with the observations of the active
agents only (``GroupPolicies``, which runs wherever the policy runs), and the learner's side,
the env steps turned into per-agent rows per group (``envmanager.pettingzoo.agents``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np

from envmanager.core.actions import ActionChecker
from envmanager.errors import InvalidInputError
from envmanager.pettingzoo.agents import AgentRows, agent_episode_id
from envmanager.pettingzoo.facade import FacadeFactory, OnPettingZooEnv
from envmanager.pettingzoo.layout import MASK_KEY, AgentGroup, AgentLayout, check_group_options, one_layout, stacked_action_space
from envmanager.sampler.batches import EpisodeBatch, TransitionBatch
from envmanager.sampler.sampler import Sampler, apply_agent_update
from envmanager.sampler.slots import EpisodeSlots
from envmanager.sampler.worker_policy import WorkerPolicySampler
from envmanager.wire.interrupts import DEFERRED

__all__ = ["MultiAgentSampler", "AgentSample", "ActingAgents", "GroupPolicies"]

logger = logging.getLogger(__name__)

_Batch = TypeVar("_Batch", TransitionBatch, EpisodeBatch)


class ActingAgents(NamedTuple):
    """Who a group's policy acts for, one entry per row of the observations it is given: the env
    slot, the agent slot (index into ``possible_agents``), the agent's episode id (``None`` in
    the workers, which do not keep the records), and the action mask (bool ``(rows, n)``, for
    ``Discrete`` actions; else ``None``)."""

    worker_ids: np.ndarray
    agents: np.ndarray
    episode_ids: np.ndarray | None
    action_mask: np.ndarray | None


class GroupPolicies:
    """The ``Sampler``'s policy: the facades' observations of the ready slots in, their actions
    out. Each group's policy, ``get_actions(observations, acting)`` (or such a callable), gets the
    observations of that group's active agents only (``acting``: :class:`ActingAgents`) and
    returns one action per row; the rows of inactive agents are filled with a valid value the
    facade never reads (so the core's check passes and nothing is sent to an agent)."""

    def __init__(self, layout: AgentLayout, policies: Any, episodes: EpisodeSlots | None) -> None:
        names = [g.name for g in layout.groups]
        if isinstance(policies, Mapping):
            if set(policies) != set(names):
                raise InvalidInputError(f"policies must have one entry per group {names}, got {sorted(map(str, policies))}")
            self.policies = dict(policies)
        else:
            self.policies = dict.fromkeys(names, policies)
        for name, policy in self.policies.items():
            _check_policy(name, policy)
        self.layout = layout
        self.episodes = episodes  # the parent-side sampler's records (each slot's env episode id); None in a worker
        self._fill = {g.name: _valid_rows(g) for g in layout.groups}
        self._checkers = {g.name: ActionChecker(g.action_space) for g in layout.groups}

    def per_group(self, update: Any) -> dict[str, Any]:
        """An ``agent_update`` as ``{group: update}``: a dict naming groups is by group (every key
        must be a group: a misspelt one is refused, not taken as one update for every group)."""
        names = [g.name for g in self.layout.groups]
        if isinstance(update, Mapping) and update and set(update) & set(names):
            unknown = sorted(map(str, set(update) - set(names)))
            if unknown:
                raise InvalidInputError(f"agent_update names groups {unknown} that do not exist (groups: {names})")
            return dict(update)
        return dict.fromkeys(names, update)

    def set_param_values(self, update: Any) -> None:
        """An ``agent_update``: ``{group: update}`` for some groups, or one update for every
        group (each applied as the ``Sampler`` applies one: weights loaded, or a new policy)."""
        for name, value in self.per_group(update).items():
            policy = apply_agent_update(self.policies[name], value)
            _check_policy(name, policy)
            self.policies[name] = policy

    def get_actions(self, observations: dict[str, Any], worker_ids: np.ndarray) -> dict[str, np.ndarray]:
        active = np.asarray(observations["active"]) != 0  # (envs, agents)
        n = self.layout.num_agents
        episodes = self.episodes
        env_ids = None if episodes is None else np.array([episodes[s].episode_id for s in worker_ids.tolist()], np.int64)
        out = {}
        for g in self.layout.groups:
            k = len(worker_ids)
            actions = np.repeat(self._fill[g.name][None], k, axis=0)  # (envs, size, *shape)
            rows = active[:, list(g.slots)]  # (envs, size)
            if rows.any():
                block = observations["groups"][g.name]
                env_at, row_at = np.nonzero(rows)
                agents = np.asarray(g.slots, np.int64)[row_at]
                mask = block[MASK_KEY][env_at, row_at] != 0 if MASK_KEY in block else None
                ids = None if env_ids is None else agent_episode_id(env_ids[env_at], agents, n)
                acting = ActingAgents(np.asarray(worker_ids)[env_at], agents, ids, mask)
                policy = self.policies[g.name]
                get_actions: Callable[..., Any] = getattr(policy, "get_actions", policy)
                chosen = np.asarray(get_actions(_pick(block["observation"], env_at, row_at), acting))
                if chosen.shape[:1] != (len(env_at),):
                    raise InvalidInputError(f"the policy of group {g.name!r} returned {chosen.shape[:1] or 'no'} rows "
                                            f"for {len(env_at)} acting agents")
                checker = self._checkers[g.name]
                try:
                    actions[env_at, row_at] = checker.batch(chosen, agents)  # as the core checks
                except (ValueError, TypeError, InvalidInputError):
                    raise InvalidInputError(f"the actions of group {g.name!r} do not fit {g.action_space}: "
                                            f"{_first_refused(checker, chosen, acting, self.layout.possible_agents)}") from None
            out[g.name] = actions
        return out


def _first_refused(checker: ActionChecker, chosen: np.ndarray, acting: ActingAgents, names: Sequence[str]) -> str:
    """The first row of a policy's answer its group's checker refuses, named by env slot and agent."""
    for r, (slot, agent) in enumerate(zip(acting.worker_ids.tolist(), acting.agents.tolist(), strict=True)):
        try:
            checker.batch(chosen[r:r + 1], [slot])
        except (ValueError, TypeError, InvalidInputError) as exc:
            return f"agent {names[agent]!r} (row {r} of the policy's answer): {exc}"
    return "the rows together"  # each row fits alone


@dataclass(frozen=True)
class AgentSample:
    """What a collection hands back. ``groups``: per group, one row per agent transition (a
    ``TransitionBatch``, or an ``EpisodeBatch`` of per-agent episodes from the ``*episodes``
    calls): ``episode_ids`` are the agents' episode ids, ``worker_ids`` the env slots, and
    ``agent_infos`` holds ``agent`` (the agent slot), ``env_episode_id`` and, for ``Discrete``
    actions, ``action_mask`` (the mask the agent acted under). ``env_steps``: the env steps
    they came from, as the ``Sampler`` recorded them (the facades' observations: ``active``,
    ``present``, per-agent ``reward`` / ``terminated`` / ``truncated``, and per group its
    observations and action masks; the env infos, per agent)."""

    groups: dict[str, TransitionBatch]
    env_steps: TransitionBatch

    def __getitem__(self, group: str) -> TransitionBatch:
        return self.groups[group]


class MultiAgentSampler:
    """Per-agent transitions or episodes from PettingZoo envs (``ParallelEnv``, or AEC through
    the facade's conversion) in worker processes, with one policy per group of agents.

    Args:
        env_fns: one function per env slot, each returning a PettingZoo env (called in the worker).
        policy: ``{group: policy}`` or one for every group; see :class:`GroupPolicies`.
        policy_in_workers: run the policies in the workers (``WorkerPolicySampler``: whole
            rollout fragments per request; the policies must pickle with cloudpickle) instead
            of in the parent (``Sampler``: one batched call per group over the ready envs).
        agent_groups, turn_based: as ``ParallelVectorEnv``'s.
        sampler_options: the underlying sampler's (``seed``, ``envs_per_worker``, ``timeout``,
            ``restart_workers``, ``context``, ...).

    Counts are the underlying sampler's, of env steps and env episodes: ``obtain_steps(n)``
    collects ``n`` env steps (``n`` per slot with the policy in the workers), each one row per
    agent that acted, once its transition is closed (those still open go on into the next
    call); ``obtain_episodes(n)`` ``n`` env episodes, every agent's episode in them whole.
    ``sampler`` is the sampler underneath (stats, records).
    """

    def __init__(self, env_fns: Sequence[Callable[[], Any]], policy: Any = None, *, policy_in_workers: bool = False,
                 agent_groups: Mapping[str, Sequence[str]] | None = None, turn_based: bool | None = None,
                 **sampler_options: Any) -> None:
        env_fns = list(env_fns)
        if not env_fns or not all(callable(f) for f in env_fns):
            raise InvalidInputError("env_fns must be a non-empty sequence of functions that make PettingZoo envs")
        check_group_options(agent_groups, turn_based)
        factory, n = FacadeFactory(env_fns, agent_groups, turn_based), len(env_fns)
        self.sampler: Sampler | WorkerPolicySampler
        if policy_in_workers:  # its agent is set below, once the layout is known (version 0 still)
            self.sampler = WorkerPolicySampler(factory, n, _NotYet(), check_spaces=one_layout, **sampler_options)
        else:
            self.sampler = Sampler(factory, n, check_spaces=one_layout, **sampler_options)
        try:
            layouts: list[AgentLayout] = self.sampler.manager.get_attr("layout")
            if any(other != layouts[0] for other in layouts):
                raise InvalidInputError("every env must have the same agents, groups and spaces")
            #: The agent slots and groups of every env.
            self.layout = layouts[0]
            if isinstance(self.sampler, Sampler):
                self._policies = self.sampler.policy = GroupPolicies(self.layout, policy, self.sampler.episodes)
            else:
                self._policies = GroupPolicies(self.layout, policy, None)
                self.sampler.update(self._policies, version=0)
            self._rows = AgentRows(self.layout)
        except BaseException:
            self.sampler.close()
            raise

    @property
    def groups(self) -> dict[str, AgentGroup]:
        return {g.name: g for g in self.layout.groups}

    @property
    def possible_agents(self) -> tuple[str, ...]:
        return self.layout.possible_agents

    @property
    def stats(self) -> Any:
        return self.sampler.stats

    @property
    def manager(self) -> Any:
        return self.sampler.manager

    @property
    def cut_episodes(self) -> list[int]:
        """Ids of the env episodes a restart cut (every agent's episode in them is flagged)."""
        return self.sampler.cut_episodes

    def update(self, agent_update: Any = None, env_update: Any = None, version: int | None = None) -> tuple[int, int]:
        """The sampler's ``update``; ``agent_update``: ``{group: update}`` or one for every
        group (weights loaded, or a new policy; see ``GroupPolicies.set_param_values``);
        ``env_update``: ``fn(env)`` (or one per env slot) gets the PettingZoo env ``env_fns``
        made (as converted from AEC, where it was: as ``ParallelVectorEnv.call``)."""
        env_update = _on_pettingzoo_envs(env_update)
        if agent_update is not None:
            by_group = self._policies.per_group(agent_update)  # refused before anything is recorded
            for name, value in by_group.items():  # a new policy (not weights loaded into one) must be a policy
                current = self._policies.policies[name]
                if not (hasattr(current, "set_param_values") or hasattr(current, "load_state_dict")):
                    _check_policy(name, value)
        if agent_update is not None and isinstance(self.sampler, WorkerPolicySampler):  # the workers get them all, pickled
            # copies of those loaded in place: an update refused below leaves the policies as they were
            policies = GroupPolicies(self.layout, {k: copy.deepcopy(v) if k in by_group else v
                                                   for k, v in self._policies.policies.items()}, None)
            policies.set_param_values(by_group)
            versions = self.sampler.update(policies, env_update, version)
            self._policies = policies
            return versions
        return self.sampler.update(agent_update, env_update, version)

    # ------------------------------------------------------------------------------------------

    def obtain_steps(self, n: int, agent_update: Any = None, env_update: Any = None) -> AgentSample:
        """``n`` env steps (``n`` per slot with the policy in the workers), in env slot order,
        as per-agent transitions, per group."""
        self.update(agent_update, env_update)
        return self._hand_out(lambda: self.sampler.obtain_steps(n), self._transitions)

    def obtain_episodes(self, n: int, per_worker: bool = False, agent_update: Any = None,
                        env_update: Any = None) -> AgentSample:
        """``n`` env episodes (or ``n`` per env slot), as per-agent episodes, per group."""
        self.update(agent_update, env_update)
        return self._hand_out(lambda: self.sampler.obtain_episodes(n, per_worker), self._episodes)

    def obtain_exact_episodes(self, n_eps_per_worker: int, agent_update: Any = None,
                              env_update: Any = None) -> AgentSample:
        """Exactly ``n_eps_per_worker`` env episodes from each slot (unbiased: the sampler's)."""
        self.update(agent_update, env_update)
        return self._hand_out(lambda: self.sampler.obtain_exact_episodes(n_eps_per_worker), self._episodes)

    def _hand_out(self, collect: Callable[[], _Batch], rows: Callable[[_Batch], AgentSample]) -> AgentSample:
        """``rows(collect())``: the sampler's env steps turned into per-agent rows in a section of
        their own, so a Ctrl-C never leaves the transitions kept open (``AgentRows``) apart from
        the sampler's records (``interrupts``). One raised after the sampler handed its steps out,
        before they are rows (held while it handed them out, it is raised on entering the
        section), drops them as the sampler drops a call's steps when it raises: its episodes
        running are not recorded on (the worker-side sampler lets them go), so no agent's rows
        have a gap; the transitions they left open go at the next call (``_settle``)."""
        batch: _Batch | None = None
        try:
            batch = collect()
            with DEFERRED:
                return rows(batch)
        except KeyboardInterrupt:  # (raised in the collection, the sampler has done this already)
            if batch is not None and len(batch):
                self.stats.count("dropped_steps", len(batch))
            self.sampler.let_running_go()
            raise

    def _transitions(self, env: TransitionBatch) -> AgentSample:
        self._settle(env)
        rows = self._rows.rows(env)
        return AgentSample({name: TransitionBatch.from_steps(steps) for name, steps in rows.items()}, env)

    def _episodes(self, env: EpisodeBatch) -> AgentSample:
        for slot in list(self._rows.open):  # as the Sampler's own: what earlier calls left running is not handed out
            self._drop(slot)
        per_group: dict[str, tuple[list[TransitionBatch], list[bool]]] = {g.name: ([], []) for g in self.layout.groups}
        for i, episode in enumerate(env.split_episodes()):
            cut = bool(env.episode_interrupted[i])
            for name, steps in self._rows.rows(episode).items():
                by_agent: dict[int, list] = {}
                for step in steps:
                    by_agent.setdefault(step.episode_id, []).append(step)
                for agent_steps in by_agent.values():
                    per_group[name][0].append(TransitionBatch.from_steps(agent_steps))
                    per_group[name][1].append(cut)
        groups: dict[str, TransitionBatch] = {
            name: EpisodeBatch.from_transitions(batches, flags) if batches else TransitionBatch.from_steps([])
            for name, (batches, flags) in per_group.items()}
        return AgentSample(groups, env)

    def _settle(self, env: TransitionBatch) -> None:
        """Transitions left open by an earlier call whose env episode does not go on in ``env``:
        closed and flagged if a restart cut it, else (it went on unrecorded: a call admitting its
        own episodes, or one that raised) dropped and counted as ``dropped_agent_steps``."""
        going_on = set(env.episode_ids.tolist())
        cut = set(self.sampler.cut_episodes)
        for slot, episode in list(self._rows.open.items()):
            record = self.sampler.episodes[slot]
            if episode.env_episode_id in going_on:
                continue
            if episode.env_episode_id in cut:
                self._rows.close_episode(slot, interrupted=True)
            elif not (record.episode_id == episode.env_episode_id and record.recording):
                self._drop(slot)

    def _drop(self, slot: int) -> None:
        dropped = self._rows.drop_episode(slot)
        if dropped:
            self.stats.count("dropped_agent_steps", dropped)

    # ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sampler and its workers. Idempotent."""
        self.sampler.close()

    def __enter__(self) -> MultiAgentSampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _NotYet:
    """The worker-side sampler's agent until the layout is known (replaced before any request)."""

    def get_actions(self, observations: Any, worker_ids: Any) -> Any:
        raise RuntimeError("the multi-agent sampler's policies were never set")


def _on_pettingzoo_envs(env_update: Any) -> Any:
    """``env_update`` with each function run on the PettingZoo env, not the facade hosting it
    (anything else left as it is, for the sampler's own check to refuse)."""
    if isinstance(env_update, (list, tuple)):
        return [OnPettingZooEnv(u) if callable(u) else u for u in env_update]
    return OnPettingZooEnv(env_update) if callable(env_update) else env_update


def _check_policy(group: str, policy: Any) -> None:
    """Refuse what cannot act for ``group`` (``None``, a misspelt name...) before anything runs."""
    if not (hasattr(policy, "get_actions") or callable(policy)):
        raise InvalidInputError(f"the policy of group {group!r} needs get_actions(observations, acting) or must be "
                                f"callable, got {type(policy).__name__}")


def _valid_rows(g: AgentGroup) -> np.ndarray:
    """A valid action for each of the group's rows, as close to zero as the space allows."""
    space = stacked_action_space(g.action_space, g.size)
    return np.clip(np.zeros(space.shape), space.low, space.high).astype(space.dtype)


def _pick(tree: Any, env_at: np.ndarray, row_at: np.ndarray) -> Any:
    if isinstance(tree, dict):
        return {k: _pick(v, env_at, row_at) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_pick(v, env_at, row_at) for v in tree)
    return np.asarray(tree)[env_at, row_at]
