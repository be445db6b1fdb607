"""Conformance of the SB3 ``SubprocVecEnv`` under test with stable-baselines3's own.

Results are compared step by step with ``DummyVecEnv`` (same seeds, same actions); the class under
test is chosen by the ``sb3_impl`` fixture (see conftest.py).  Most tests use ``start_method="fork"``
to stay fast (forkserver / spawn workers must import SB3, which imports torch); the default and
``spawn`` start methods are checked once each.
"""

from __future__ import annotations

import functools
import multiprocessing

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
import envs
from envs import assert_tree_equal, env_fn, env_fns, worker_children
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv

N = 3


@pytest.fixture
def make_subproc(sb3_impl, closing):
    return lambda fns, start_method="fork": closing(sb3_impl(fns, start_method=start_method))


@pytest.fixture
def make_dummy(closing):
    return lambda fns: closing(DummyVecEnv(fns))


def assert_sb3_equal(actual, expected, where):
    """VecEnv step results: obs exactly; rewards by value (DummyVecEnv stores float32, SubprocVecEnv
    the env's float64); dones exactly; infos / reset_infos as lists of dicts."""
    obs, rewards, dones, infos = actual
    e_obs, e_rewards, e_dones, e_infos = expected
    assert_tree_equal(obs, e_obs, f"{where} obs")
    assert np.asarray(rewards).shape == e_rewards.shape
    assert np.array_equal(np.asarray(rewards, dtype=np.float64), e_rewards.astype(np.float64)), where
    assert_tree_equal(np.asarray(dones), e_dones, f"{where} dones")
    assert_tree_equal(list(infos), list(e_infos), f"{where} infos")


def actions_for(space, n, rng_seed):
    space.seed(rng_seed)
    while True:
        yield np.stack([space.sample() for _ in range(n)])


@pytest.mark.parametrize(
    "obs_kind,act_kind",
    [("box", "discrete"), ("discrete", "box"), ("dict", "multidiscrete"), ("tuple", "multibinary")],
)
def test_trajectory_equals_dummy(make_subproc, make_dummy, obs_kind, act_kind):
    fns = env_fns(N, obs_kind=obs_kind, act_kind=act_kind)
    vec, ref = make_subproc(fns), make_dummy(fns)
    assert vec.seed(5) == ref.seed(5) == [5, 6, 7]
    assert_tree_equal(vec.reset(), ref.reset(), "reset obs")
    assert_tree_equal(list(vec.reset_infos), list(ref.reset_infos), "reset infos")
    actions = actions_for(ref.action_space, N, 0)
    seen = {"done": 0, "terminal_observation": 0, "TimeLimit.truncated": 0}
    for t in range(60):
        a = next(actions)
        vec.step_async(a)
        assert vec.waiting
        out = vec.step_wait()
        assert not vec.waiting
        expected = ref.step(a)
        assert_sb3_equal(out, expected, f"step {t}")
        assert_tree_equal(list(vec.reset_infos), list(ref.reset_infos), f"step {t} reset_infos")
        seen["done"] += int(expected[2].sum())
        seen["terminal_observation"] += sum("terminal_observation" in i for i in expected[3])
        seen["TimeLimit.truncated"] += sum(bool(i["TimeLimit.truncated"]) for i in expected[3])
    assert seen["done"] >= 5 and seen["terminal_observation"] == seen["done"]
    assert seen["TimeLimit.truncated"] >= 1
    a = next(actions)
    assert_sb3_equal(vec.step(a), ref.step(a), "step()")


def test_time_limit_truncation_and_terminal_observation(make_subproc, make_dummy):
    fns = [functools.partial(envs.time_limited, 3, max_len=None) for _ in range(2)]
    fns.append(env_fn(fixed_len=2))  # ends by termination
    vec, ref = make_subproc(fns), make_dummy(fns)
    vec.seed(1), ref.seed(1)
    assert_tree_equal(vec.reset(), ref.reset())
    a = np.ones((N, 3), dtype=np.float32)
    for t in range(6):
        out, expected = vec.step(a), ref.step(a)
        assert_sb3_equal(out, expected, f"step {t}")
    infos = out[3]
    assert list(out[2]) == [True, True, True]  # step 6: TimeLimit(3) twice, fixed_len=2 thrice
    assert [i["TimeLimit.truncated"] for i in infos] == [True, True, False]
    assert all(isinstance(i["terminal_observation"], np.ndarray) for i in infos)


def test_set_options_and_seed(make_subproc, make_dummy):
    fns = env_fns(N)
    vec, ref = make_subproc(fns), make_dummy(fns)
    vec.set_options({"offset": 2}), ref.set_options({"offset": 2})
    vec.seed(4), ref.seed(4)
    assert_tree_equal(vec.reset(), ref.reset())
    assert [i["offset"] for i in vec.reset_infos] == [2, 2, 2]
    options = [{"offset": 1}, {}, {"offset": 3}]
    vec.set_options(options), ref.set_options(options)
    vec.seed(11), ref.seed(11)
    assert_tree_equal(vec.reset(), ref.reset())
    assert_tree_equal(list(vec.reset_infos), list(ref.reset_infos))
    assert [i.get("offset") for i in vec.reset_infos] == [1, None, 3]
    vec.seed(11), ref.seed(11)
    vec.reset(), ref.reset()  # options are used once only
    assert all("offset" not in i for i in vec.reset_infos)
    assert_tree_equal(list(vec.reset_infos), list(ref.reset_infos))


def test_env_method_get_attr_set_attr_with_indices(make_subproc, make_dummy):
    fns = env_fns(N, max_len=None)
    vec, ref = make_subproc(fns), make_dummy(fns)
    vec.reset(), ref.reset()
    a = np.zeros((N, 3), dtype=np.float32)
    vec.step(a), ref.step(a)
    for indices in (None, 1, [0, 2]):
        assert vec.env_method("add", 1, y=2, indices=indices) == ref.env_method("add", 1, y=2, indices=indices)
        assert vec.get_attr("step_count", indices=indices) == ref.get_attr("step_count", indices=indices)
    assert vec.env_method("add", 4) == [(4, 1)] * N
    vec.set_attr("tag", "z", indices=[0, 2])
    vec.set_attr("tag", 5, indices=1)
    assert vec.get_attr("tag") == ["z", 5, "z"]
    assert vec.get_attr("tag", indices=[2, 1]) == ["z", 5]
    vec.set_attr("tag", "all")
    assert vec.get_attr("tag") == ["all"] * N
    assert vec.has_attr("tag") and not vec.has_attr("no_such_attribute")


def test_env_is_wrapped(make_subproc, make_dummy):
    fns = [functools.partial(envs.time_limited, 5), env_fn(), functools.partial(envs.time_limited, 7)]
    vec, ref = make_subproc(fns), make_dummy(fns)
    TimeLimit = gym.wrappers.TimeLimit
    assert vec.env_is_wrapped(TimeLimit) == ref.env_is_wrapped(TimeLimit) == [True, False, True]
    assert vec.env_is_wrapped(TimeLimit, indices=[1, 2]) == [False, True]
    assert vec.env_is_wrapped(TimeLimit, indices=0) == [True]
    assert vec.env_is_wrapped(gym.wrappers.ClipAction) == [False] * N


def test_attributes_render_and_get_images(make_subproc, make_dummy):
    fns = env_fns(N, render_mode="rgb_array")
    vec, ref = make_subproc(fns), make_dummy(fns)
    assert isinstance(vec, VecEnv)
    assert vec.num_envs == N
    assert vec.observation_space == ref.observation_space
    assert vec.action_space == ref.action_space
    assert vec.render_mode == ref.render_mode == "rgb_array"
    assert vec.metadata == {"render_modes": ["human", "rgb_array"]}
    vec.seed(0), ref.seed(0)
    vec.reset(), ref.reset()
    for t in range(3):
        a = np.full((N, 3), t, dtype=np.float32)
        vec.step(a), ref.step(a)
    assert_tree_equal(list(vec.get_images()), list(ref.get_images()))
    big = vec.render()
    assert_tree_equal(big, ref.render())
    assert big.ndim == 3 and big.shape[-1] == 3
    assert_tree_equal(vec.render(mode="rgb_array"), big)


def test_close_is_idempotent_and_reaps_workers(make_subproc):
    vec = make_subproc(env_fns(N))
    vec.reset()
    vec.step_async(np.zeros((N, 3), dtype=np.float32))  # close() with a step in flight
    vec.close()
    assert vec.closed
    vec.close()
    assert vec.closed
    assert worker_children() == []


def test_bogus_start_method_raises_like_multiprocessing(sb3_impl):
    with pytest.raises(ValueError) as expected:
        multiprocessing.get_context("bogus")
    with pytest.raises(ValueError) as actual:
        sb3_impl(env_fns(2), start_method="bogus")
    assert str(actual.value) == str(expected.value)
    assert worker_children() == []


@pytest.mark.parametrize("start_method", [None, "spawn"], ids=["default", "spawn"])
def test_other_start_methods(make_subproc, make_dummy, start_method):
    fns = env_fns(2, obs_kind="dict", act_kind="discrete")
    vec, ref = make_subproc(fns, start_method=start_method), make_dummy(fns)
    vec.seed(3), ref.seed(3)
    assert_tree_equal(vec.reset(), ref.reset())
    actions = actions_for(ref.action_space, 2, 1)
    for t in range(20):
        a = next(actions)
        assert_sb3_equal(vec.step(a), ref.step(a), f"step {t}")


class _InnerVectorInfos(gym.Env):
    """An env whose own infos hold gymnasium's vector keys, as an env built on a same-step vector
    env of its own returns them: ``final_obs`` / ``final_info`` on steps that end no episode, and
    in its reset info."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int = 2) -> None:
        self.length, self.t, self.episode = length, 0, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.episode = 0, self.episode + 1
        return np.full(2, 0.5, np.float32), {"final_info": {"inner": self.episode}, "final_obs": np.zeros(2), "ep": self.episode}

    def step(self, action):
        self.t += 1
        info = {"final_info": {"inner": -self.t}, "final_obs": np.ones(2) * self.t, "t": self.t}
        return np.full(2, self.t / 10, np.float32), 1.0, self.t >= self.length, False, info


def test_env_infos_holding_final_obs_and_final_info(make_subproc, make_dummy):
    """An env's own ``final_obs`` / ``final_info`` keys are its info, as in SB3's worker: a step
    that ends no episode is not taken for an autoreset, and a reset info holding them does not
    replace the step's info nor its last observation (SB3's keeps the two apart)."""
    fns = [functools.partial(_InnerVectorInfos, length) for length in (2, 3)]
    vec, ref = make_subproc(fns), make_dummy(fns)
    assert_tree_equal(vec.reset(), ref.reset())
    assert_tree_equal(list(vec.reset_infos), list(ref.reset_infos), "reset infos")
    actions = np.zeros(2, dtype=np.int64)
    for t in range(7):
        assert_sb3_equal(vec.step(actions), ref.step(actions), f"step {t}")
        assert_tree_equal(list(vec.reset_infos), list(ref.reset_infos), f"step {t} reset infos")


def test_reset_infos_kept_from_an_earlier_step_do_not_change(make_subproc):
    """SB3's ``step_wait`` and ``reset`` bind ``reset_infos`` to a new sequence: one read before
    a step keeps the reset infos it had (ours wrote the new episodes' into the same list)."""
    vec = make_subproc([env_fn(fixed_len=2) for _ in range(N)])
    vec.reset()
    first = vec.reset_infos
    kept = [dict(i) for i in first]
    a = np.zeros((N, 3), dtype=np.float32)
    vec.step(a)
    after_one = vec.reset_infos
    _, _, dones, _ = vec.step(a)  # every episode ends and is reset: new reset infos
    assert dones.all()
    assert_tree_equal([dict(i) for i in first], kept, "reset_infos read after reset()")
    assert_tree_equal([dict(i) for i in after_one], kept, "reset_infos read after a step")
    assert vec.reset_infos is not first and vec.reset_infos is not after_one
