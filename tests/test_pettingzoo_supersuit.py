"""The SuperSuit drop-in (``envmanager.pettingzoo.concat_vec_envs`` / ``pettingzoo_env_to_vec_env``)
side by side with SuperSuit 3.11 itself, on real PettingZoo envs with the same seeds and actions:
observations, rewards, terminations, truncations, infos (``terminal_observation`` included),
row order, across episode ends, in one process and in several; agents that die (where SuperSuit
asserts); SB3's PPO through it; bad input."""

from __future__ import annotations

import os

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")

import numpy as np
import pytest

pytest.importorskip("pettingzoo", minversion="1.24")  # mlagents-envs 1.1.0 pins 1.15
ss = pytest.importorskip("supersuit")

from envmanager.errors import InvalidInputError, WorkerError  # noqa: E402
from envmanager.pettingzoo import (  # noqa: E402
    PettingZooVecEnv,
    concat_vec_envs,
    concat_vec_envs_v1,
    pettingzoo_env_to_vec_env,
    pettingzoo_env_to_vec_env_v1,
)


def pistonball(**kwargs):
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.parallel_env(n_pistons=3, max_cycles=kwargs.pop("max_cycles", 8), **kwargs)


def spread():
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env(N=3, max_cycles=6)


def kaz():
    from pettingzoo.butterfly import knights_archers_zombies_v11

    return knights_archers_zombies_v11.parallel_env(spawn_delay=2, max_zombies=20, max_cycles=130)


def theirs(env, n, base_class="gymnasium"):
    """SuperSuit's own, in this process (``num_cpus=0``: the reference for every ``num_cpus``)."""
    return ss.concat_vec_envs_v1(ss.pettingzoo_env_to_vec_env_v1(env), n, num_cpus=0, base_class=base_class)


def sample_actions(space, rows: int, rng: np.random.Generator) -> np.ndarray:
    if hasattr(space, "n"):
        return rng.integers(0, space.n, rows)
    return rng.uniform(space.low, space.high, (rows, *space.shape)).astype(space.dtype)


def assert_infos_equal(got: list[dict], expected: list[dict], what: str) -> int:
    """Equal infos, row by row; returns how many rows had a terminal observation."""
    assert len(got) == len(expected), what
    terminal = 0
    for row, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert set(g) == set(e), f"{what} row {row}: {sorted(g)} != {sorted(e)}"
        for key in e:
            np.testing.assert_array_equal(np.asarray(g[key]), np.asarray(e[key]), err_msg=f"{what} row {row} {key}")
        terminal += "terminal_observation" in e
    return terminal


def run_side_by_side(ours, reference, steps: int, seed: int) -> int:
    """Gymnasium side: reset and ``steps`` steps of both with the same actions, everything equal.
    Returns the number of terminal observations seen (episode ends crossed)."""
    got, expected = ours.reset(seed=seed), reference.reset(seed=seed)
    np.testing.assert_array_equal(got[0], expected[0])
    assert_infos_equal(got[1], expected[1], "reset")
    assert ours.num_envs == reference.num_envs
    assert ours.observation_space == reference.observation_space and ours.action_space == reference.action_space
    rng = np.random.default_rng(seed)
    ends = 0
    for t in range(steps):
        actions = sample_actions(ours.action_space, ours.num_envs, rng)
        got, expected = ours.step(actions), reference.step(actions)
        for name, g, e in zip(("observations", "rewards", "terminations", "truncations"), got[:4], expected[:4],
                              strict=True):
            np.testing.assert_array_equal(g, e, err_msg=f"step {t}: {name}")
        assert got[1].dtype == np.float32 and got[2].dtype == got[3].dtype == np.bool_
        ends += assert_infos_equal(got[4], expected[4], f"step {t}")
        assert ours.active.all()  # no agent dies here
    return ends


@pytest.mark.parametrize("num_cpus", [0, 2])
def test_pistonball_equals_supersuit(num_cpus):
    reference = theirs(pistonball(), 3)
    ours = concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(pistonball()), 3, num_cpus=num_cpus)
    try:
        assert isinstance(ours, PettingZooVecEnv)
        assert ours.envs_per_worker == (3 if num_cpus == 0 else 2)  # SuperSuit's split: ceil(3 / 2) per process
        assert ours.render_mode == reference.render_mode and ours.metadata == reference.metadata
        ends = run_side_by_side(ours, reference, 20, seed=5)
        assert ends >= 9  # every env crossed an episode end (3 agents each)
    finally:
        ours.close()
        reference.close()


def test_mpe_spread_equals_supersuit_on_the_sb3_side():
    """``base_class="stable_baselines3"``: reset returns observations (infos in ``reset_infos``),
    step ``dones = terminated | truncated``, terminal observations in the infos."""
    from stable_baselines3.common.vec_env import VecEnv

    reference = theirs(spread(), 2, "stable_baselines3")
    ours = concat_vec_envs(pettingzoo_env_to_vec_env(spread()), 2, num_cpus=2, base_class="stable_baselines3")
    try:
        assert isinstance(ours, VecEnv) and ours.num_envs == reference.num_envs == 6
        assert ours.seed(7) == [7, 7, 7, 8, 8, 8]  # per row: its env's seed
        got = ours.reset()
        expected, _ = reference.venv.reset(seed=7)  # SuperSuit's own reset(seed) / seed() raise AttributeError
        np.testing.assert_array_equal(got, expected)
        assert ours.reset_infos == [{}] * 6
        rng = np.random.default_rng(1)
        ends = 0
        for t in range(14):
            actions = sample_actions(ours.action_space, 6, rng)
            ours.step_async(actions)
            reference.step_async(actions)
            got, expected = ours.step_wait(), reference.step_wait()
            for g, e in zip(got[:3], expected[:3], strict=True):
                np.testing.assert_array_equal(g, e, err_msg=f"step {t}")
            assert got[2].dtype == np.bool_
            ends += assert_infos_equal(got[3], expected[3], f"step {t}")
        assert ends == 12  # two episodes of 6 steps, 2 envs x 3 agents
        assert ours.get_attr("render_mode") == [None] * 6
        assert ours.get_attr("possible_agents", indices=[0, 5]) == [["agent_0", "agent_1", "agent_2"]] * 2
        assert ours.env_is_wrapped(object) == [False] * 6
    finally:
        ours.close()
        reference.close()


def test_one_env_alone_and_supersuits_own_to_vec_env_accepted():
    """``pettingzoo_env_to_vec_env`` alone is a vector env of one env's agents (started at its
    first reset); ``concat_vec_envs`` takes SuperSuit's ``MarkovVectorEnv`` as well."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    alone = pettingzoo_env_to_vec_env(pistonball())
    assert not alone.closed and alone.num_envs == 3
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before  # started at its first reset
    reference = ss.pettingzoo_env_to_vec_env_v1(pistonball())
    try:
        run_side_by_side(alone, reference, 10, seed=3)
    finally:
        alone.close()
    from_theirs = concat_vec_envs(ss.pettingzoo_env_to_vec_env_v1(pistonball()), 2)
    with pytest.raises(InvalidInputError, match="step_wait"):
        from_theirs.step_wait()
    try:
        run_side_by_side(from_theirs, theirs(pistonball(), 2), 3, seed=0)
    finally:
        from_theirs.close()


def test_agents_that_die_are_padded_where_supersuit_asserts():
    """KAZ: an archer dies mid-episode. SuperSuit's vector env asserts there (it needs
    ``black_death``); ours goes on, the dead agent's row zeros, reward 0, not done, not active,
    its action not read; the others as the env stepped here with the same actions."""
    seed, n = 1, 2
    reference = theirs(kaz(), n)
    ours = concat_vec_envs(pettingzoo_env_to_vec_env(kaz()), n, num_cpus=1)
    envs = [kaz() for _ in range(n)]
    try:
        ours.reset(seed=seed)
        reference.reset(seed=seed)
        for i, env in enumerate(envs):
            env.reset(seed=seed + i)
        names = envs[0].possible_agents
        rng = np.random.default_rng(0)
        supersuit_failed, deaths, ends = False, 0, 0
        for t in range(140):
            actions = rng.integers(0, 6, ours.num_envs)
            alive = [[a in env.agents for a in names] for env in envs]
            unread = np.array([not a for row in alive for a in row])
            actions[unread] = 99  # out of the space: never read for agents not in the env
            obs, rewards, terms, truncs, infos = ours.step(actions)
            if not supersuit_failed:
                try:
                    reference.step(np.where(unread, 0, actions))
                except AssertionError as e:
                    assert "black_death" in str(e)
                    supersuit_failed = True
            for i, env in enumerate(envs):
                acts = {a: int(actions[i * 4 + k]) for k, a in enumerate(names) if a in env.agents}
                o, r, te, tr, _ = env.step(acts)
                done = all(te[a] or tr[a] for a in o)
                if done:
                    ends += 1
                    o_reset, _ = env.reset()
                for k, agent in enumerate(names):
                    row = i * 4 + k
                    if agent in r:
                        assert rewards[row] == np.float32(r[agent]) and terms[row] == te[agent], f"step {t} {agent}"
                    else:  # dead: padded
                        assert rewards[row] == 0 and not terms[row] and not truncs[row]
                    if done:  # reset within the step: the reset's observation, the last one in the infos
                        np.testing.assert_array_equal(obs[row], o_reset[agent], err_msg=f"step {t} {agent}")
                        assert ("terminal_observation" in infos[row]) == (agent in o)
                        if agent in o:
                            np.testing.assert_array_equal(infos[row]["terminal_observation"], o[agent])
                    elif agent in o:
                        np.testing.assert_array_equal(obs[row], o[agent], err_msg=f"step {t} {agent}")
                        assert ours.active[row] == (agent in env.agents)  # one that just died is not
                    else:  # dead: padded, not active
                        deaths += 1
                        assert not obs[row].any() and not ours.active[row] and infos[row] == {}
        assert supersuit_failed and deaths > 0 and ends == n
    finally:
        ours.close()
        reference.close()


def test_sb3_ppo_trains_through_the_drop_in_with_supersuits_wrappers():
    """PettingZoo's SB3 tutorial's shape: SuperSuit's observation wrappers on the PettingZoo env,
    then the drop-in, then PPO with ``VecMonitor``; the wrapped env's first steps equal
    SuperSuit's own vector env's."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecMonitor

    def make():
        env = pistonball(max_cycles=20, continuous=False)
        env = ss.color_reduction_v0(env, mode="B")
        env = ss.resize_v1(env, x_size=48, y_size=48)
        return ss.frame_stack_v1(env, 3)

    venv = concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(make()), 2, num_cpus=2, base_class="stable_baselines3")
    reference = theirs(make(), 2, "stable_baselines3")
    try:
        assert venv.observation_space.shape == (48, 48, 3)
        venv.seed(0)
        np.testing.assert_array_equal(venv.reset(), reference.venv.reset(seed=0)[0])
        for _ in range(3):
            actions = np.random.default_rng(0).integers(0, 3, 6)
            venv.step_async(actions)
            reference.step_async(actions)
            np.testing.assert_array_equal(venv.step_wait()[0], reference.step_wait()[0])
        monitored = VecMonitor(venv)
        model = PPO("CnnPolicy", monitored, n_steps=32, batch_size=64, n_epochs=1, seed=0,
                    policy_kwargs={"normalize_images": True, "features_extractor_kwargs": {"features_dim": 16}})
        model.learn(total_timesteps=384)
        assert model.num_timesteps >= 384
        episodes = list(model.ep_info_buffer)
        assert episodes and all(1 <= e["l"] <= 20 for e in episodes)  # VecMonitor saw episodes end (max_cycles 20)
        action, _ = model.predict(venv.reset(), deterministic=True)
        assert action.shape == (6,)
    finally:
        venv.close()
        reference.close()


def test_bad_input_is_refused_clearly_and_loses_nothing():
    from mpe2 import simple_adversary_v3
    from pettingzoo.butterfly import pistonball_v6

    for refused, words in [(pistonball_v6.env(n_pistons=3), "ParallelEnv"),  # AEC
                           (simple_adversary_v3.parallel_env(), "other spaces")]:
        for error in (InvalidInputError, AssertionError):  # (SuperSuit asserts: its own tests catch AssertionError)
            with pytest.raises(error, match=words):
                pettingzoo_env_to_vec_env(refused)
        with pytest.raises(AssertionError):
            ss.pettingzoo_env_to_vec_env_v1(refused)  # the reference refuses both too
    with pytest.raises(InvalidInputError, match="pettingzoo_env_to_vec_env first"):
        concat_vec_envs(pistonball(), 2)
    with pytest.raises(InvalidInputError, match="base_class"):
        concat_vec_envs(pettingzoo_env_to_vec_env(pistonball()), 2, base_class="stable_baselines")
    with pytest.raises(InvalidInputError, match="num_vec_envs"):
        concat_vec_envs(pettingzoo_env_to_vec_env(pistonball()), 0)
    for bad in (1.5, True):
        with pytest.raises(InvalidInputError, match="num_vec_envs"):
            concat_vec_envs(pettingzoo_env_to_vec_env(pistonball()), bad)
    for bad in (-1, 1.5, None):
        with pytest.raises(InvalidInputError, match="num_cpus"):
            concat_vec_envs(pettingzoo_env_to_vec_env(pistonball()), 1, num_cpus=bad)
    with pytest.raises(InvalidInputError, match="envs_per_worker is num_cpus's split"):  # (a bare TypeError)
        concat_vec_envs(pettingzoo_env_to_vec_env(pistonball()), 2, num_cpus=1, envs_per_worker=2)
    venv = concat_vec_envs(pettingzoo_env_to_vec_env(pistonball()), 2)
    reference = theirs(pistonball(), 2)
    try:
        with pytest.raises(InvalidInputError, match="seed"):
            venv.reset(seed="0")
        venv.reset(seed=0)
        reference.reset(seed=0)
        with pytest.raises(InvalidInputError, match="one row per agent row"):
            venv.step(np.zeros((5, 1), np.float32))
        with pytest.raises(InvalidInputError):
            venv.step(np.full((6, 1), np.nan, np.float32))  # NaN: not in Box(-1, 1)
        actions = np.zeros((6, 1), np.float32)  # nothing was sent: the envs step on as SuperSuit's
        got, expected = venv.step(actions), reference.step(actions)
        np.testing.assert_array_equal(got[0], expected[0])
    finally:
        venv.close()
        reference.close()
    discrete = concat_vec_envs(pettingzoo_env_to_vec_env(spread()), 1, base_class="stable_baselines3")
    try:
        discrete.reset()
        discrete.step_async(np.array([0, 7, 0]))
        with pytest.raises(InvalidInputError, match=r"agent 'agent_1' is invalid: value \[7\] is outside Discrete\(5\)"):
            discrete.step_wait()
        discrete.step_async(np.array([0, 4, 0]))
        assert discrete.step_wait()[0].shape == (3, 18)
    finally:
        discrete.close()


@pytest.mark.parametrize("restart", [False, True])
def test_an_env_that_raises_is_named_or_restarted(tmp_path, restart):
    """Without restarts, the error names the env; with them, its rows come back as a reset,
    truncated, the other env's untouched."""
    import pettingzoo_envs

    env = pettingzoo_envs.FailingOnce(pistonball(max_cycles=50), "raise", 1, str(tmp_path / "struck"))
    venv = concat_vec_envs(pettingzoo_env_to_vec_env(env), 2, num_cpus=2, timeout=20, restart_workers=restart)
    try:
        venv.reset(seed=0)
        actions = np.zeros((6, 1), np.float32)
        if not restart:
            with pytest.raises(WorkerError, match="the env blew up"):
                venv.step(actions)
            # Nothing of that step is left in flight (this vector env has no recv): the env that
            # raised must be reset, as the core says; it said a step was in flight recv() had not returned.
            with pytest.raises(InvalidInputError, match="must be reset before it is stepped"):
                venv.step(actions)
            venv.reset(seed=1)
            assert venv.step(actions)[0].shape[0] == 6
            return
        _, rewards, terms, truncs, infos = venv.step(actions)
        failed = [i for i in range(2) if truncs[i * 3]]
        assert len(failed) == 1 and truncs.sum() == 3 and not terms[failed[0] * 3 : failed[0] * 3 + 3].any()
        rows = slice(failed[0] * 3, failed[0] * 3 + 3)
        assert not rewards[rows].any() and all("terminal_observation" not in info for info in infos[rows])
        assert venv.active.all()
        venv.step(actions)  # and on it goes
    finally:
        venv.close()


def test_a_reset_that_raises_within_a_step_leaves_nothing_in_flight(tmp_path):
    """An env's reset within the step that ended its episode raises (restarts off): the step
    raises it, and nothing of that step is left in flight (it said the other env had a step
    recv() had not returned, which a user of this vector env cannot call); after reset() all steps."""
    import pettingzoo_envs

    env = pettingzoo_envs.FailingSecondReset(pistonball(max_cycles=2), str(tmp_path / "struck"))
    venv = concat_vec_envs(pettingzoo_env_to_vec_env(env), 2, num_cpus=2, timeout=20)
    try:
        venv.reset(seed=0)
        actions = np.zeros((6, 1), np.float32)
        with pytest.raises(WorkerError, match="the reset blew up"):
            for _ in range(3):
                venv.step(actions)
        with pytest.raises(InvalidInputError, match="must be reset before it is stepped"):
            venv.step(actions)
        venv.reset(seed=1)
        assert venv.step(actions)[0].shape[0] == 6
    finally:
        venv.close()


def assert_trees_equal(got, expected, what: str) -> None:
    """Equal observations, a dict of arrays (an env's ``Dict`` space) or an array."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), f"{what}: keys {got!r:.80} != {list(expected)}"
        for key in expected:
            assert_trees_equal(got[key], expected[key], f"{what}[{key!r}]")
        return
    np.testing.assert_array_equal(got, expected, err_msg=what)
    assert np.asarray(got).dtype == np.asarray(expected).dtype, what


@pytest.mark.parametrize("base_class", ["gymnasium", "stable_baselines3"])
def test_an_action_mask_in_the_observation_stays_in_it_as_supersuits(base_class):
    """An env whose observations are ``{"observation", "action_mask"}`` (PettingZoo's classic
    convention): the rows keep the mask, as the declared ``observation_space`` says, and so do
    the terminal observations."""
    import pettingzoo_envs

    env = pettingzoo_envs.spread_mask_in_observation
    reference = theirs(env(), 2, base_class)
    ours = concat_vec_envs(pettingzoo_env_to_vec_env(env()), 2, num_cpus=2, base_class=base_class)
    try:
        assert ours.observation_space == reference.observation_space
        if base_class == "gymnasium":
            got, expected = ours.reset(seed=3)[0], reference.reset(seed=3)[0]
        else:
            ours.seed(3)
            got, (expected, _) = ours.reset(), reference.venv.reset(seed=3)  # SuperSuit's SB3 seed() raises
        assert_trees_equal(got, expected, "reset")
        ends = 0
        for t in range(9):
            actions = np.full(ours.num_envs, (t + 2) % 5)
            if base_class == "gymnasium":
                got, expected = ours.step(actions), reference.step(actions)
                infos_got, infos_expected = got[4], expected[4]
            else:
                got, expected = ours.step(actions), reference.step(actions)
                infos_got, infos_expected = got[3], expected[3]
            assert_trees_equal(got[0], expected[0], f"step {t}")
            for row in range(ours.num_envs):
                assert ("terminal_observation" in infos_got[row]) == ("terminal_observation" in infos_expected[row])
                if "terminal_observation" in infos_expected[row]:
                    ends += 1
                    assert_trees_equal(infos_got[row]["terminal_observation"], infos_expected[row]["terminal_observation"],
                                       f"step {t} row {row} terminal_observation")
                    assert ours.observation_space.contains(infos_got[row]["terminal_observation"])
            assert ours.observation_space.contains({k: v[0] for k, v in got[0].items()})
        assert ends == 2 * 6  # both envs ended twice (max_cycles=4), 3 agents each
    finally:
        ours.close()
        reference.close()


def test_a_mask_key_with_other_than_discrete_actions_is_an_ordinary_observation_key():
    """Masks are carried for ``Discrete`` actions only; with ``MultiDiscrete`` ones an
    ``action_mask`` key is part of the observation like any other, as in SuperSuit (it failed
    in the worker at the first reset, looking for a mask array never made)."""
    import pettingzoo_envs

    env = pettingzoo_envs.MaskWithMultiDiscrete
    reference = theirs(env(), 2)
    ours = concat_vec_envs(pettingzoo_env_to_vec_env(env()), 2, num_cpus=2)
    try:
        assert ours.observation_space == reference.observation_space
        assert_trees_equal(ours.reset(seed=1)[0], reference.reset(seed=1)[0], "reset")
        rng = np.random.default_rng(0)
        for t in range(7):
            actions = np.stack([rng.integers(0, 3, 4), rng.integers(0, 2, 4)], axis=1)
            got, expected = ours.step(actions), reference.step(actions)
            assert_trees_equal(got[0], expected[0], f"step {t}")
            np.testing.assert_array_equal(got[1], expected[1])
            np.testing.assert_array_equal(got[3], expected[3])
    finally:
        ours.close()
        reference.close()


def test_after_close_every_call_raises_and_nothing_starts():
    """``close()`` is final, as SuperSuit's: a step or reset afterwards raises (ours:
    ``ManagerClosedError``) and starts no process."""
    import psutil

    from envmanager.errors import ManagerClosedError

    def children() -> set[int]:
        return {p.pid for p in psutil.Process().children(recursive=True)}

    before = children()  # (multiprocessing's helpers)
    venv = concat_vec_envs(pettingzoo_env_to_vec_env(spread()), 2, num_cpus=2)
    venv.reset(seed=0)
    venv.close()
    assert venv.closed
    for call in (lambda: venv.step(np.zeros(6, np.int64)), lambda: venv.reset(seed=0), venv.render):
        with pytest.raises(ManagerClosedError):
            call()
    assert venv.closed and children() == before
    venv.close()  # again: nothing to do
    alone = pettingzoo_env_to_vec_env(spread())  # never started: closing it is final too
    alone.close()
    with pytest.raises(ManagerClosedError):
        alone.reset(seed=0)
    assert children() == before


@pytest.mark.parametrize("base_class", ["gymnasium", "stable_baselines3"])
def test_get_attr_of_an_attribute_the_env_lacks_is_an_attribute_error(base_class):
    """``get_attr`` of an attribute the env does not have raises an ``AttributeError`` (as
    SuperSuit's, and SB3's own vector envs), which code probing attributes catches; it was a bare
    ``WorkerError``. The envs step on unharmed, as SuperSuit's."""
    from envmanager.errors import RemoteAttributeError

    reference = theirs(spread(), 2, base_class)
    ours = concat_vec_envs(pettingzoo_env_to_vec_env(spread()), 2, num_cpus=2, base_class=base_class)
    try:
        with pytest.raises(AttributeError):
            reference.get_attr("no_such_attribute")
        with pytest.raises(AttributeError, match="no_such_attribute") as caught:
            ours.get_attr("no_such_attribute")
        assert isinstance(caught.value, RemoteAttributeError) and isinstance(caught.value, WorkerError)
        assert ours.get_attr("possible_agents")[5] == ["agent_0", "agent_1", "agent_2"]
        vec, ref = (ours, reference) if base_class == "gymnasium" else (ours.venv, reference.venv)
        np.testing.assert_array_equal(vec.reset(seed=4)[0], ref.reset(seed=4)[0])
        actions = np.array([0, 1, 2, 3, 4, 0])
        np.testing.assert_array_equal(vec.step(actions)[0], ref.step(actions)[0])
    finally:
        ours.close()
        reference.close()


def test_reset_infos_kept_from_reset_are_left_as_they_were():
    """``reset_infos`` kept from ``reset()`` (SB3's place for reset infos) is left as it was by a
    step that reset an env within it, as SuperSuit's; ``reset_infos`` read after that step holds
    the new episode's (ours keeps them, SuperSuit's drops them), as SB3's ``SubprocVecEnv`` binds a
    new list. The step wrote them into the list the caller held."""
    import pettingzoo_envs

    env = pettingzoo_envs.DiesInTurn
    reference = theirs(ss.black_death_v3(env()), 2, "stable_baselines3")
    ours = concat_vec_envs(pettingzoo_env_to_vec_env(env()), 2, num_cpus=2, base_class="stable_baselines3")
    gym = concat_vec_envs(pettingzoo_env_to_vec_env(env()), 2, num_cpus=1)  # its reset_infos: ours alone
    try:
        ours.reset()
        reference.reset()
        gym.reset(seed=0)
        kept, kept_reference, kept_gym = ours.reset_infos, reference.reset_infos, gym.reset_infos
        first = [{"episode": 1}] * 8
        assert kept == kept_reference == kept_gym == first
        actions = np.zeros(8, np.int64)
        for _ in range(7):  # both ended and reset within a step (SuperSuit's black_death a step later)
            ours.step_async(actions)
            reference.step_async(actions)
            ours.step_wait()
            reference.step_wait()
            gym.step(actions)
        assert kept == kept_reference == kept_gym == first
        assert ours.reset_infos == gym.reset_infos == [{"episode": 2}] * 8
    finally:
        ours.close()
        reference.close()
        gym.close()
