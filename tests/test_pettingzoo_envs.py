"""Real PettingZoo envs in worker processes against the same envs stepped here, with the same
seeds and actions: observations, rewards, terminations, truncations, active and action masks,
returns and lengths equal, step by step, across episode ends (only the env that ended resets)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pettingzoo", minversion="1.24")  # mlagents-envs 1.1.0 pins 1.15

import pettingzoo_envs as envs
from envmanager.pettingzoo import ParallelVectorEnv


def assert_same(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), f"{what}: agents {sorted(got)} != {sorted(expected)}"
    for agent, value in expected.items():
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if k != "action_mask"}
            value = value["observation"] if set(value) == {"observation"} else value
        np.testing.assert_array_equal(np.asarray(got[agent]), np.asarray(value), err_msg=f"{what}: {agent}")


def run_parallel(make, n_envs: int, steps: int, seed: int, envs_per_worker: int, dicts: bool) -> dict:
    """Steps the vector and the reference in lockstep; returns what happened (for the caller's checks)."""
    refs = [make() for _ in range(n_envs)]
    returns = [dict.fromkeys(r.possible_agents, 0.0) for r in refs]
    lengths = [dict.fromkeys(r.possible_agents, 0) for r in refs]
    seen = {"ends": 0, "deaths": 0, "resets": 0}
    rng = np.random.default_rng(seed)
    with ParallelVectorEnv([make] * n_envs, envs_per_worker=envs_per_worker, timeout=60) as vec:
        batch = vec.reset(seed=seed)
        assert batch.episode_start.all() and not batch.restarted.any()
        for i, r in enumerate(refs):
            obs, _ = r.reset(seed=seed + i)
            assert_same(batch.as_dicts()[i].observations, obs, f"reset env {i}")
        for t in range(steps):
            actions, arrays = envs.policy(vec, batch, rng)
            batch = vec.step_dicts(actions) if dicts else vec.step(arrays)
            n = vec.num_agents
            for i, r in enumerate(refs):
                view = batch.as_dicts()[i]
                where = f"step {t} env {i}"
                if not r.agents:  # its last result ended the episode: this step is its reset, and only its
                    obs, _ = r.reset()
                    assert batch.episode_start[i] and not batch.episode_end[i], where
                    returns[i] = dict.fromkeys(r.possible_agents, 0.0)
                    lengths[i] = dict.fromkeys(r.possible_agents, 0)
                    assert_same(view.observations, obs, where)
                    seen["resets"] += 1
                else:
                    assert not batch.episode_start[i], where
                    acting = list(r.agents)
                    obs, rew, term, trunc, _ = r.step(actions[i])
                    for a in acting:
                        lengths[i][a] += 1
                    for a, value in rew.items():
                        returns[i][a] += value
                    assert_same(view.observations, obs, where)
                    assert view.rewards == pytest.approx({a: float(v) for a, v in rew.items()}), where
                    assert view.terminations == {a: bool(v) for a, v in term.items()}, where
                    assert view.truncations == {a: bool(v) for a, v in trunc.items()}, where
                    assert batch.episode_end[i] == (not r.agents), where
                    seen["ends"] += int(not r.agents)
                    seen["deaths"] += sum(1 for a, v in term.items() if v and r.agents)
                names = [a for k, a in enumerate(vec.possible_agents) if batch.active[i * n + k]]
                assert names == [a for a in vec.possible_agents if a in r.agents], where
                rows = slice(i * n, (i + 1) * n)
                np.testing.assert_allclose(batch.episode_return[rows], [returns[i][a] for a in vec.possible_agents])
                np.testing.assert_array_equal(batch.episode_length[rows], [lengths[i][a] for a in vec.possible_agents])
    return seen


def test_pistonball_two_envs_in_one_process_across_episode_ends():
    seen = run_parallel(envs.pistonball, 2, 16, seed=3, envs_per_worker=2, dicts=False)
    assert seen["ends"] >= 2 and seen["resets"] >= 2


def test_a_parallelizable_aec_env_goes_through_aec_to_parallel():
    with ParallelVectorEnv([envs.pistonball_aec]) as vec:
        assert not vec.layout.turn_based
        batch = vec.reset(seed=1)
        ref = envs.pistonball()
        obs, _ = ref.reset(seed=1)
        assert_same(batch.as_dicts()[0].observations, obs, "reset")
        actions = np.linspace(-1, 1, 3, dtype=np.float32).reshape(3, 1)
        batch = vec.step(actions)
        obs, rew, *_ = ref.step({a: actions[k] for k, a in enumerate(ref.possible_agents)})
        assert_same(batch.as_dicts()[0].observations, obs, "step")
        assert batch.as_dicts()[0].rewards == pytest.approx(rew)


def test_knights_archers_zombies_agents_die_and_are_masked():
    seen = run_parallel(envs.kaz, 2, 150, seed=1, envs_per_worker=2, dicts=True)
    assert seen["deaths"] >= 1  # an agent died while others went on: masked from then, never asserted on


def test_multiwalker_box_actions():
    pytest.importorskip("Box2D")
    seen = run_parallel(envs.multiwalker, 2, 30, seed=5, envs_per_worker=1, dicts=False)
    assert seen["ends"] >= 1


def test_mpe_agents_with_different_spaces_form_groups():
    with ParallelVectorEnv([envs.adversary] * 2, timeout=60) as vec:
        groups = vec.groups
        assert list(groups) == ["adversary", "agent"]
        assert groups["adversary"].agents == ("adversary_0",) and groups["agent"].agents == ("agent_0", "agent_1")
        batch = vec.reset(seed=0)
        assert batch.groups["adversary"].observation.shape == (2, 8)
        assert batch.groups["agent"].observation.shape == (4, 10)
        assert batch.groups["agent"].action_mask.shape == (4, 5) and batch.groups["agent"].action_mask.all()
        with pytest.raises(AttributeError, match="2 groups"):
            _ = batch.observation
    seen = run_parallel(envs.adversary, 2, 12, seed=2, envs_per_worker=2, dicts=False)
    assert seen["ends"] == 2


def test_one_group_when_every_agent_shares_spaces_and_a_group_map_splits_them():
    with ParallelVectorEnv([envs.spread], agent_groups={"a": ["agent_0"], "bc": ["agent_2", "agent_1"]}) as vec:
        assert {name: g.agents for name, g in vec.groups.items()} == {"a": ("agent_0",), "bc": ("agent_1", "agent_2")}
        batch = vec.reset(seed=0)
        ref = envs.spread()
        obs, _ = ref.reset(seed=0)
        np.testing.assert_array_equal(batch.groups["bc"].observation, np.stack([obs["agent_1"], obs["agent_2"]]))
    with ParallelVectorEnv([envs.spread] * 2, envs_per_worker=2) as vec:
        assert list(vec.groups) == ["agent"]
        assert vec.reset(seed=0).observation.shape == (6, 18)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_first_ready_batches_hold_the_envs_that_finished(shared_memory):
    seen: set[int] = set()
    with ParallelVectorEnv([envs.spread] * 3, envs_per_worker=2, shared_memory=shared_memory) as vec:
        first = vec.reset(seed=0)
        ref = envs.spread()
        obs, _ = ref.reset(seed=2)
        np.testing.assert_array_equal(first.observation[6:9], np.stack([obs[a] for a in ref.possible_agents]))
        np.testing.assert_array_equal(vec.call("state", env_ids=[2])[0], ref.state())
        assert vec.call("possible_agents") == [ref.possible_agents] * 3
        vec.send(np.zeros(9, np.int64))
        while len(seen) < 3:
            batch = vec.recv(1)
            assert batch.reward.shape == (3 * batch.num_envs,) and batch.observation.shape == (3 * batch.num_envs, 18)
            seen |= set(batch.env_ids.tolist())
        # each env on its own: send env 2 alone, receive it
        vec.send(np.zeros(3, np.int64), env_ids=[2])
        assert vec.recv(1).env_ids.tolist() == [2]
        # one seed per env
        batch = vec.reset(seed=[5, None, 7])
        obs, _ = ref.reset(seed=7)
        np.testing.assert_array_equal(batch.observation[6:9], np.stack([obs[a] for a in ref.possible_agents]))


def check_turn(vec, batch, refs, where: str) -> None:
    """The agent whose turn it is is the one active agent; its observation and mask are the AEC env's."""
    n = vec.num_agents
    for i, r in enumerate(refs):
        if not r.agents:
            continue
        acting = [a for k, a in enumerate(vec.possible_agents) if batch.active[i * n + k]]
        assert acting == [r.agent_selection], f"{where} env {i}"
        obs = r.observe(r.agent_selection)
        view = batch.as_dicts()[i]
        np.testing.assert_array_equal(view.observations[r.agent_selection], obs["observation"], err_msg=f"{where} env {i}")
        np.testing.assert_array_equal(view.action_masks[r.agent_selection], obs["action_mask"].astype(bool))


def test_tictactoe_turn_by_turn_against_the_aec_loop():
    """A turn-based AEC game with action masks: one agent acts per step (the active mask), its
    observation and mask are the AEC env's, and the final rewards and terminations are."""
    n_envs, seed = 2, 7
    rng = np.random.default_rng(seed)
    refs = [envs.tictactoe() for _ in range(n_envs)]
    games = 0
    with ParallelVectorEnv([envs.tictactoe] * n_envs, envs_per_worker=2) as vec:
        assert vec.layout.turn_based and list(vec.groups) == ["player"]
        n = vec.num_agents
        batch = vec.reset(seed=seed)
        for i, r in enumerate(refs):
            r.reset(seed=seed + i)
        check_turn(vec, batch, refs, "reset")
        for t in range(25):
            actions, arrays = envs.policy(vec, batch, rng)
            assert [len(a) for a in actions] == [0 if end else 1 for end in batch.episode_end]  # one agent a step
            batch = vec.step(arrays)
            for i, r in enumerate(refs):
                where = f"step {t} env {i}"
                if not r.agents:  # the game ended last step: this step is its reset
                    assert batch.episode_start[i] and not batch.episode_end[i], where
                    r.reset()
                    continue
                r.step(actions[i][r.agent_selection])
                final = {}  # what the AEC loop hands each agent as the game ends
                while r.agents and (r.terminations[r.agent_selection] or r.truncations[r.agent_selection]):
                    final[r.agent_selection] = r.last()
                    r.step(None)
                assert batch.episode_end[i] == (not r.agents), where
                if not r.agents:
                    games += 1
                    view = batch.as_dicts()[i]
                    assert view.terminations == {a: bool(f[2]) for a, f in final.items()}, where
                    assert view.rewards == {a: float(f[1]) for a, f in final.items()}, where
                    rows = slice(i * n, (i + 1) * n)
                    np.testing.assert_allclose(batch.episode_return[rows], [final[a][1] for a in vec.possible_agents])
                    assert not batch.active[rows].any()
            check_turn(vec, batch, refs, f"step {t}")
    assert games >= 2


def test_an_env_that_keeps_done_agents_listed_still_ends_its_episode():
    with ParallelVectorEnv([envs.spread_keeping_agents]) as vec:
        batch = vec.reset(seed=0)
        for _ in range(3):
            assert not batch.episode_end[0] and batch.active.all()
            batch = vec.step(np.zeros(3, np.int64))
        assert batch.episode_end[0] and batch.truncated.all() and not batch.active.any()
        batch = vec.step(np.full(3, -1))  # read by nobody: the env's reset
        assert batch.episode_start[0] and batch.active.all() and not batch.episode_length.any()


def test_layout_groups_and_the_facade_action_space_samples_what_agents_take():
    from gymnasium import spaces

    from envmanager.pettingzoo import AgentLayout

    obs = {"red_0": spaces.Box(0, 1, (2,)), "red_1": spaces.Box(0, 1, (2,)), "blue_0": spaces.Discrete(4)}
    act = {"red_0": spaces.MultiDiscrete([3, 2], start=[1, 0]), "red_1": spaces.MultiDiscrete([3, 2], start=[1, 0]),
           "blue_0": spaces.Box(-2.0, 2.0, (3,), np.float32)}
    layout = AgentLayout.of(list(obs), obs.__getitem__, act.__getitem__)
    assert [(g.name, g.agents, g.slots) for g in layout.groups] == [("red", ("red_0", "red_1"), (0, 1)),
                                                                    ("blue", ("blue_0",), (2,))]
    space = layout.action_space()
    space.seed(0)
    for _ in range(20):
        sampled = space.sample()
        assert all(act["red_0"].contains(row) for row in sampled["red"])
        assert act["blue_0"].contains(sampled["blue"][0])
    assert layout.observation_space()["groups"]["blue"]["observation"] == spaces.Box(0, 3, (1,), np.int64)
    with pytest.raises(TypeError, match="not supported"):
        AgentLayout.of(["a"], lambda a: spaces.Box(0, 1, (1,)), lambda a: spaces.Text(4))


def test_action_masks_given_in_infos():
    with ParallelVectorEnv([envs.spread_mask_in_info]) as vec:
        for batch in (vec.reset(seed=0), vec.step(np.array([0, 2, 4]))):
            assert (batch.action_mask == envs.MaskInInfo.MASK.astype(bool)).all()
            assert batch.infos == [{a: {"note": a} for a in vec.possible_agents}]  # the mask is in the array only
            assert batch.as_dicts()[0].infos == {a: {"note": a} for a in vec.possible_agents}
