"""``MultiAgentSampler`` on real PettingZoo envs: the per-agent rows it collects equal the same
envs stepped here with the same seeds and actions (parallel envs, agents that die, a turn-based
AEC game with action masks), and faults mid-episode with several agents (an env that raises, a
process killed or hung) cut every agent's episode of that env, flagged, with ids never reused,
nothing lost or duplicated; with restarts off the error names the slot."""

from __future__ import annotations

import functools
import itertools
import re
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pettingzoo", minversion="1.24")  # mlagents-envs 1.1.0 pins 1.15

from pettingzoo.utils.conversions import turn_based_aec_to_parallel

import pettingzoo_envs as envs
from envmanager.errors import InvalidInputError, WorkerDiedError, WorkerError, WorkerTimeoutError
from envmanager.pettingzoo import ActingAgents, MultiAgentSampler
from envmanager.pettingzoo.agents import AgentRows
from envmanager.sampler import TransitionBatch

SEED = 3


class RandomPolicy:
    """Seeded random actions, legal where a mask is given (``spaces``: each agent slot's action
    space); checks what it is given. Pickles: it runs in the workers too."""

    def __init__(self, seed: int, spaces: list) -> None:
        self.rng, self.spaces, self.rows = np.random.default_rng(seed), spaces, 0

    def get_actions(self, observations: Any, acting: ActingAgents) -> np.ndarray:
        n = len(acting.agents)
        self.rows += n
        assert n and len(acting.worker_ids) == n and (acting.episode_ids is None or len(acting.episode_ids) == n)
        assert len({(int(w), int(a)) for w, a in zip(acting.worker_ids, acting.agents, strict=True)}) == n
        return np.stack([envs.sample(self.spaces[int(a)], self.rng, None if acting.action_mask is None else acting.action_mask[i])
                         for i, a in enumerate(acting.agents)])


def action_spaces(make) -> list:
    env = make()
    return [env.action_space(a) for a in env.possible_agents]


def reference(make, turn_based: bool, seed: int, episodes: list[dict[int, list[dict]]], names) -> list[dict]:
    """Each episode of one slot replayed here in order (the first reset seeded, then the env's
    RNG goes on), each agent given the actions its rows recorded; the per-agent transitions, in
    the order closed: what the sampler should have handed out. A reward an agent gets while it
    has no transition open (before its first action; in turn-based games while it waits) goes to
    its next transition, as PettingZoo's AEC API gives an agent its reward since it last acted."""
    env = make()
    par = turn_based_aec_to_parallel(env) if turn_based else env
    out = []
    for k, rows in enumerate(episodes):
        queues = {a: list(r) for a, r in rows.items()}
        obs, _ = par.reset(seed=seed if k == 0 else None)
        open_: dict[str, dict] = {}
        pending: dict[str, float] = defaultdict(float)
        t = 0
        while par.agents:
            acting = [par.aec_env.agent_selection] if turn_based else list(par.agents)
            actions = {}
            for a in acting:
                row = queues[names.index(a)].pop(0)
                action = np.asarray(row["action"])
                actions[a] = action.item() if action.ndim == 0 else action
                open_[a] = {"episode": k, "t": t, "agent": names.index(a), "observation": _obs(obs[a]), "mask": _mask(obs[a]),
                            "action": row["action"], "reward": pending.pop(a, 0.0)}
            obs, rew, term, trunc, _ = par.step(actions)
            nxt = [par.aec_env.agent_selection] if turn_based and par.agents else list(par.agents)
            for a, r in rew.items():
                if a not in open_:
                    pending[a] += float(r)
            for a in list(open_):
                open_[a]["reward"] += float(rew.get(a, 0.0))
                if a in obs and (a in nxt or term.get(a) or trunc.get(a)):
                    out.append({**open_.pop(a), "next_observation": _obs(obs[a]), "terminated": bool(term[a]),
                                "truncated": bool(trunc[a])})
            t += 1
        assert not open_, f"transitions left open at the end: {sorted(open_)}"
        assert not any(queues.values()), "the sampler recorded actions the env never took"
    return out


def _obs(value: Any) -> Any:
    return value["observation"] if isinstance(value, dict) else value


def _mask(value: Any) -> Any:
    return value.get("action_mask") if isinstance(value, dict) else None


def rows_of(sample, sampler) -> dict[tuple[int, int], list[dict]]:
    """Per (slot, env episode id), the per-agent rows, in order, as dicts."""
    out: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for name, b in sample.groups.items():
        for i in range(len(b)):
            info = {k: v[i] for k, v in b.agent_infos.items()}
            out[(int(b.worker_ids[i]), int(info["env_episode_id"]))].append({
                "group": name, "agent": int(info["agent"]), "episode_id": int(b.episode_ids[i]),
                "observation": b.observations[i], "action": b.actions[i], "reward": float(b.rewards[i]),
                "terminated": bool(b.terminated[i]), "truncated": bool(b.truncated[i]),
                "next_observation": b.next_observations[i], "mask": info.get("action_mask"),
                "interrupted": bool(b.interrupted[i])})
    return out


def check_ids(sample, sampler) -> None:
    """Agent episode ids: the env episode's, per agent; unique per (env episode, agent)."""
    n = len(sampler.possible_agents)
    for b in sample.groups.values():
        agents, env_ids = b.agent_infos["agent"], b.agent_infos["env_episode_id"]
        np.testing.assert_array_equal(b.episode_ids, env_ids * n + agents)


CASES = {
    "pistonball": (envs.pistonball, False, 2, 1),
    "kaz": (envs.kaz, False, 2, 1),  # archers and knights die: agents leave mid-episode
    "tictactoe": (envs.tictactoe, True, 2, 3),  # turn-based AEC, action masks, rewarded on the opponent's move
    "tictactoe_shaped": (envs.tictactoe_shaped, True, 1, 2),  # rewarded at every step: summed while waiting
}


WHERE = {"parent": {}, "workers": {"policy_in_workers": True}, "workers-k2": {"policy_in_workers": True, "envs_per_worker": 2}}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("case", CASES)
def test_per_agent_rows_equal_the_env_stepped_here(case, where):
    make, turn_based, n_slots, n_eps = CASES[case]
    policy = RandomPolicy(7, action_spaces(make))
    with MultiAgentSampler([make] * n_slots, policy, seed=SEED, timeout=60, **WHERE[where]) as sampler:
        sample = sampler.obtain_exact_episodes(n_eps)
        names = list(sampler.possible_agents)
        check_ids(sample, sampler)
        got = rows_of(sample, sampler)
        env_ids = sample.env_steps.episode_ids
        assert len(set(env_ids.tolist())) == n_slots * n_eps
        deaths = 0
        for slot in range(n_slots):
            ids = sorted({e for s, e in got if s == slot})
            assert len(ids) == n_eps
            per_episode = []
            for e in ids:
                by_agent: dict[int, list] = defaultdict(list)
                for r in got[(slot, e)]:
                    by_agent[r["agent"]].append(r)
                per_episode.append(by_agent)
            expected = reference(make, turn_based, SEED + slot, per_episode, names)
            rows = [r for e in ids for r in got[(slot, e)]]
            assert len(rows) == len(expected)
            # per agent episode, its rows in order (an EpisodeBatch holds each agent's episode contiguous)
            rows = sorted(rows, key=lambda r: r["episode_id"])  # stable: each agent's rows stay in order
            expected = sorted(expected, key=lambda x: (x["episode"], x["agent"]))
            for r, x in zip(rows, expected, strict=True):
                what = f"slot {slot} agent {names[r['agent']]} step {x['t']}"
                assert r["agent"] == x["agent"], what
                np.testing.assert_array_equal(r["observation"], x["observation"], err_msg=what)
                np.testing.assert_array_equal(r["next_observation"], x["next_observation"], err_msg=what)
                np.testing.assert_array_equal(r["action"], x["action"], err_msg=what)
                assert r["reward"] == pytest.approx(x["reward"]), what
                assert (r["terminated"], r["truncated"]) == (x["terminated"], x["truncated"]), what
                assert not r["interrupted"], what
                if x["mask"] is not None:
                    np.testing.assert_array_equal(r["mask"], x["mask"] != 0, err_msg=what)
                    assert r["mask"][int(r["action"])], what  # the policy was given the mask
            last = {}
            for r in rows:
                last[(r["episode_id"])] = r
            # every agent's episode ends with its own end; an agent that ended early died
            assert all(r["terminated"] or r["truncated"] for r in last.values())
            lengths = defaultdict(int)
            for r in rows:
                lengths[r["episode_id"]] += 1
            deaths += len(set(lengths.values())) > 1
        # the policy was asked for the active agents only: one row each, as recorded
        if where == "parent":
            assert policy.rows == sum(len(b) for b in sample.groups.values())
        if case == "kaz":
            assert deaths, "no agent died before its episode's end: the case checks nothing"
        # whole per-agent episodes: contiguous, one per agent that acted in each env episode
        for b in sample.groups.values():
            starts = b.starts
            assert all(len(set(b.episode_ids[s:s + n].tolist())) == 1 for s, n in zip(starts, b.lengths, strict=True))
            assert len(set(b.episode_ids.tolist())) == b.n_episodes
            assert b.dones[starts + b.lengths - 1].all()


@pytest.mark.parametrize("where", ["parent", "workers"])
def test_steps_carry_open_transitions_into_the_next_call(where):
    """A turn-based game over several ``obtain_steps`` calls: each transition handed out once,
    whole (a transition open at a call's end is handed out by the call that closes it)."""
    policy = RandomPolicy(1, action_spaces(envs.tictactoe))
    with MultiAgentSampler([envs.tictactoe] * 2, {"player": policy}, seed=SEED, timeout=60, **WHERE[where]) as sampler:
        batches = [sampler.obtain_steps(3) for _ in range(8)]
        seen = []
        for b in batches:
            g = b["player"]
            seen += list(zip(g.episode_ids.tolist(), g.observations.reshape(len(g), -1).sum(1).tolist(), strict=True))
        assert len(seen) == len(set(seen)), "a transition handed out twice"
        env_steps = sum(len(b.env_steps) for b in batches)
        assert env_steps == (24 if where == "parent" else 2 * 24)  # the worker-side sampler counts per slot
        rows = sum(len(b["player"]) for b in batches)
        open_now = sum(len(e.open) for e in sampler._rows.open.values())
        assert rows + open_now == env_steps  # one agent acts per step: one row per step, none lost
        assert sampler.stats.counters.get("dropped_agent_steps", 0) == 0
        # an episodes call admits its own episodes (the Sampler's rule): what was open is dropped, counted
        episodes = sampler.obtain_episodes(2)
        assert sampler.stats.counters["dropped_agent_steps"] == open_now > 0
        assert not set(episodes["player"].episode_ids.tolist()) & {e for e, _ in seen}


@functools.cache
def recorded_games():
    """Env steps of whole tic-tac-toe games (rewarded at every step), recorded once by a real sampler."""
    policy = RandomPolicy(5, action_spaces(envs.tictactoe_shaped))
    with MultiAgentSampler([envs.tictactoe_shaped] * 2, policy, seed=SEED, timeout=60) as sampler:
        return sampler.layout, sampler.obtain_exact_episodes(3).env_steps


def agent_rows(steps: list) -> list[tuple]:
    """Rows comparable across orders: each agent episode's rows in order."""
    out = [(s.episode_id, s.reward, s.terminated, s.truncated, s.interrupted, s.observation.tobytes(),
            s.next_observation.tobytes(), int(s.action)) for s in steps]
    return sorted(out, key=lambda r: r[0])  # stable: an agent's rows keep their order


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rows_do_not_depend_on_where_the_calls_split_the_steps(data):
    """However ``obtain_steps`` calls split the env steps, the rows handed out are those of the
    whole run: each once, whole, in order per agent; nothing left open at the episodes' ends."""
    layout, env = recorded_games()
    whole = AgentRows(layout).rows(env)["player"]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(env) - 1), max_size=12)))
    rows = AgentRows(layout)
    pieces: list = []
    for a, b in itertools.pairwise([0, *cuts, len(env)]):
        pieces += rows.rows(TransitionBatch.select(env, slice(a, b)))["player"]
    assert agent_rows(pieces) == agent_rows(whole)
    assert len(whole) == len(env) and not rows.open  # one mover per step; every game ended


def test_the_policy_must_give_one_action_per_acting_agent():
    with (MultiAgentSampler([envs.pistonball], lambda obs, acting: np.zeros((1, 1), np.float32), seed=0) as sampler,
          pytest.raises(InvalidInputError, match="group 'piston'")):
        sampler.obtain_steps(1)
    with pytest.raises(InvalidInputError, match="one entry per group"):
        MultiAgentSampler([envs.pistonball], {"nope": None}, seed=0)


# ---------------------------------------------------------------------------------------------
# Faults mid-episode with several agents

AT = 3  # the failing env's step


def spread_policy(observations: Any, acting: ActingAgents) -> np.ndarray:
    return (acting.worker_ids + acting.agents) % 5


@pytest.mark.parametrize("where", ["parent", "workers"])
@pytest.mark.parametrize("how", ["raise", "kill", "hang"])
def test_a_fault_cuts_every_agent_of_the_env_and_collection_goes_on(tmp_path, how, where):
    fns = [envs.spread, envs.Failing(envs.spread, how, AT, str(tmp_path / "struck")), envs.spread]
    with MultiAgentSampler(fns, spread_policy, seed=0, timeout=2.0, restart_workers=True, **WHERE[where]) as sampler:
        first = sampler.obtain_steps(3 * 10 if where == "parent" else 10)  # env 1 fails at its 3rd step, mid-episode
        second = sampler.obtain_exact_episodes(1)
        (cut,) = sampler.cut_episodes
        assert cut % 3 == 1  # an episode of slot 1
        for sample in (first, second):
            check_ids(sample, sampler)
        g, g2 = first["agent"], second["agent"]
        # every agent's rows of the cut env episode are flagged, and only those
        in_cut = g.agent_infos["env_episode_id"] == cut
        assert in_cut.any()
        assert set(g.agent_infos["agent"][in_cut].tolist()) == {0, 1, 2}
        assert g.interrupted[in_cut].all() and not g.interrupted[~in_cut].any()
        assert (first.env_steps.episode_ids == cut).sum() == AT - 1  # the steps answered before the fault ...
        assert in_cut.sum() == 3 * (AT - 1)  # ... one row per agent each
        # ids never reused: no agent episode id in both calls, none twice per (id, observation)
        ids_before, ids_after = set(g.episode_ids.tolist()), set(g2.episode_ids.tolist())
        assert not ids_before & ids_after
        assert not g2.interrupted.any() and g2.n_episodes == 3 * 3
        assert sampler.stats.counters["interrupted_episodes"] == 1
        # each env step recorded is one row per agent, in order: none lost, none twice
        for sample in (first, second):
            steps, rows = sample.env_steps, sample["agent"]
            for e in set(steps.episode_ids.tolist()):
                at_env = steps.observations["groups"]["agent"]["observation"][steps.episode_ids == e]
                for a in range(3):
                    mine = (rows.agent_infos["env_episode_id"] == e) & (rows.agent_infos["agent"] == a)
                    np.testing.assert_array_equal(rows.observations[mine], at_env[:, a])
        # nothing lost: every env step recorded gave one row per agent (all act at every step)
        assert len(g) == 3 * len(first.env_steps) and len(g2) == 3 * len(second.env_steps)


@pytest.mark.parametrize("where", ["parent", "workers"])
@pytest.mark.parametrize("how,error", [("raise", WorkerError), ("kill", WorkerDiedError), ("hang", WorkerTimeoutError)])
def test_with_restarts_off_the_error_names_the_slot(tmp_path, how, error, where):
    fns = [envs.spread, envs.Failing(envs.spread, how, AT, str(tmp_path / "struck"))]
    with MultiAgentSampler(fns, spread_policy, seed=0, timeout=2.0, **WHERE[where]) as sampler:
        with pytest.raises(error) as caught:
            sampler.obtain_steps(2 * 10)
        assert 1 in (getattr(caught.value, "worker_ids", None) or [getattr(caught.value, "worker_id", None)])
        assert "worker 1" in str(caught.value)
        if how == "raise":  # the env's own error, with its traceback; its process serves on
            assert "the env blew up mid-episode" in caught.value.remote_traceback
            assert sampler.stats.counters["failed_episodes"] == 1  # its agents' rows dropped, counted
            after = sampler.obtain_episodes(2)
            assert not after["agent"].interrupted.any() and after["agent"].n_episodes == 2 * 3
            check_ids(after, sampler)
            assert not {int(e) for e in after.env_steps.episode_ids} & {0, 1}  # ids never reused
        else:  # a process that died or hung is given up: named at once on every later call
            with pytest.raises(error) as later:
                sampler.obtain_steps(2)
            assert later.value is caught.value


class Constant:
    """Always the same action; ``set_param_values`` changes it (weights loaded in place)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def set_param_values(self, value: int) -> None:
        self.value = value

    def get_actions(self, observations: Any, acting: ActingAgents) -> np.ndarray:
        return np.full(len(acting.agents), self.value, np.int64)


@pytest.mark.parametrize("where", ["parent", "workers"])
def test_a_policy_update_reaches_its_group(where):
    """``update(agent_update={group: weights})``: the next episodes act with them, recorded
    with the new policy version, wherever the policy runs."""
    groups = {"first": ["agent_0"], "rest": ["agent_1", "agent_2"]}
    with MultiAgentSampler([envs.spread] * 2, {"first": Constant(1), "rest": Constant(2)}, agent_groups=groups, seed=0,
                           **WHERE[where]) as sampler:
        before = sampler.obtain_exact_episodes(1)
        assert (before["first"].actions == 1).all() and (before["rest"].actions == 2).all()
        assert sampler.update(agent_update={"rest": 4}) == (1, 0)
        after = sampler.obtain_exact_episodes(1)
        assert (after["first"].actions == 1).all() and (after["rest"].actions == 4).all()
        assert (after["rest"].policy_versions == 1).all() and (before["rest"].policy_versions == 0).all()
        sampler.update(agent_update=3)  # one value: every group
        last = sampler.obtain_exact_episodes(1)
        assert all((last[g].actions == 3).all() for g in groups)


@pytest.mark.parametrize("where", ["parent", "workers"])
def test_an_env_update_reaches_the_pettingzoo_env(where):
    """``update(env_update=fn)``: ``fn`` gets the PettingZoo env ``env_fns`` made (it got the
    facade hosting it, where setting an attribute changed nothing, the rows stamped all the same)."""
    with MultiAgentSampler([envs.spread] * 2, spread_policy, seed=0, **WHERE[where]) as sampler:
        assert sampler.update(env_update=envs.short_episodes) == (0, 1)
        batch = sampler.obtain_exact_episodes(1)
        for g in batch.groups.values():
            assert (g.env_versions == 1).all()
            _, lengths = np.unique(g.episode_ids, return_counts=True)
            assert set(lengths.tolist()) == {3}, "episodes of 3 cycles after the update"
            assert g.truncated[g.dones].all()
        ends = batch.env_steps.dones  # the env's own episode: cut short by max_cycles, not terminated
        assert ends.sum() == 2 and batch.env_steps.truncated[ends].all() and not batch.env_steps.terminated.any()


@pytest.mark.parametrize("where", ["parent", "workers"])
def test_bad_policies_and_policy_updates_are_refused_before_anything_acts(where):
    """A group without a policy, a policy that is neither callable nor has ``get_actions``, an
    update naming a group that does not exist (it was taken as one update for every group) —
    refused with ``InvalidInputError`` before any env is stepped with them. An update refused for
    its env update loads no weights either (they went out with the next accepted update)."""
    groups = {"first": ["agent_0"], "rest": ["agent_1", "agent_2"]}
    for bad in (None, {"first": Constant(1), "rest": None}, {"first": Constant(1), "rest": "Constant(2)"}):
        with pytest.raises(InvalidInputError, match="policy of group"):
            MultiAgentSampler([envs.spread], bad, agent_groups=groups, seed=0, **WHERE[where])
    with MultiAgentSampler([envs.spread], {"first": Constant(1), "rest": Constant(2)}, agent_groups=groups, seed=0,
                           **WHERE[where]) as sampler:
        with pytest.raises(InvalidInputError, match="typo"):
            sampler.update(agent_update={"rest": 4, "typo": 5})
        with pytest.raises(InvalidInputError):
            sampler.update(agent_update={"rest": 3}, env_update="not a function")
        batch = sampler.obtain_exact_episodes(1)
        assert (batch["first"].actions == 1).all() and (batch["rest"].actions == 2).all()
        assert sampler.update(agent_update={"first": 4}) == (1, 0)
        batch = sampler.obtain_exact_episodes(1)
        assert (batch["first"].actions == 4).all() and (batch["rest"].actions == 2).all()
        assert sampler.stats.counters.get("worker_restarts", 0) == 0


@pytest.mark.parametrize("where", ["parent", "workers"])
def test_a_fractional_action_for_a_discrete_space_is_refused_not_truncated(where):
    with (MultiAgentSampler([envs.spread], lambda obs, acting: np.full(len(acting.agents), 2.7), seed=0,
                            **WHERE[where]) as sampler,
          pytest.raises((InvalidInputError, WorkerError), match="integer")):
        sampler.obtain_steps(1)


@pytest.mark.parametrize("where", ["parent", "workers"])
def test_a_bad_action_is_named_by_its_env_slot_and_agent(where):
    """One action out of its space, env slot 1's ``agent_2``: the error names that slot and agent
    (it named "worker 5", the agent's row among the acting agents, a worker that does not exist)."""

    def bad(observations: Any, acting: ActingAgents) -> np.ndarray:
        actions = np.zeros(len(acting.agents), np.int64)
        actions[(acting.worker_ids == 1) & (acting.agents == 2)] = 9
        return actions

    with (MultiAgentSampler([envs.spread] * 2, bad, seed=0, **WHERE[where]) as sampler,
          pytest.raises((InvalidInputError, WorkerError)) as caught):
        sampler.obtain_steps(2)
    message = str(caught.value)
    assert re.search(r"agent 'agent_2' \(row [25] of the policy's answer\): action for worker 1: value \[?9\]? is outside "
                     r"Discrete\(5\)", message), message


@pytest.mark.parametrize("where", ["parent", "workers"])
def test_a_reward_before_an_agent_s_first_action_is_in_its_first_row(where):
    """An agent that appears rewarded has that reward in its first transition: its rows add up to
    what the env paid it, as PettingZoo's AEC API hands an agent its reward since it last acted
    (it was in no row)."""

    def ones(observations: Any, acting: ActingAgents) -> np.ndarray:
        return np.ones(len(acting.agents), np.int64)

    with MultiAgentSampler([envs.Joiner] * 2, ones, seed=0, **WHERE[where]) as sampler:
        sample = sampler.obtain_exact_episodes(2)
    rows = rows_of(sample, sampler)
    assert len(rows) == 4  # 2 slots x 2 episodes
    for (slot, episode), got in rows.items():
        paid = defaultdict(float)
        for r in got:
            paid[sampler.possible_agents[r["agent"]]] += r["reward"]
        assert paid == {"early": 6.0, "late": 14.0}, (slot, episode, got)
        late = [r for r in got if sampler.possible_agents[r["agent"]] == "late"]
        assert [r["reward"] for r in late] == [12.0, 2.0]  # the bonus with its first action's own reward


@pytest.mark.parametrize("where", ["parent", "workers"])
@pytest.mark.parametrize("make,turn_based", [(envs.Respawner, None), (envs.respawner_aec, True)])
def test_an_agent_back_after_its_end_is_refused_not_joined_to_its_ended_episode(make, turn_based, where):
    """PettingZoo forbids an agent back in an episode after it ended ("Generate a new agent with
    a new name", its API tests): its new life's rows would carry the ended episode's agent id (the
    id is per env episode and agent slot), one agent episode with a terminal row inside. The env
    is refused, naming the agent, before any such row is handed out."""
    def zeros(observations: Any, acting: ActingAgents) -> np.ndarray:
        return np.zeros(len(acting.agents), np.int64)

    with (MultiAgentSampler([make] * 2, zeros, seed=0, turn_based=turn_based, **WHERE[where]) as sampler,
          pytest.raises(WorkerError, match=r"agents \['a'\] alive after they were terminated")):
        sampler.obtain_exact_episodes(1)
