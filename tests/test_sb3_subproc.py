"""envmanager.sb3.SubprocVecEnv against Stable-Baselines3's own VecEnvs, with real worker processes.

(tests/vector/test_sb3_conformance.py is the shared conformance suite; these cover the rest:
envmanager's extras, faults, restarts, wrappers, and a PPO smoke run.)
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

pytest.importorskip("stable_baselines3")
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecNormalize

from envmanager import InvalidInputError, ManagerClosedError, WorkerError
from envmanager.sb3 import RemoteAttributeError, SubprocVecEnv

N = 4


class ToyEnv(gym.Env):
    """Random-length episodes (ending terminated, truncated or both), infos that vary per step."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, obs_kind="box", act_kind="discrete", max_len=4, render_mode=None, fail_at=None):
        self.obs_kind, self.render_mode, self.max_len, self.fail_at = obs_kind, render_mode, max_len, fail_at
        self.observation_space = {
            "box": spaces.Box(-5, 5, (3,), np.float32),
            "discrete": spaces.Discrete(6),
            "dict": spaces.Dict({"pos": spaces.Box(-5, 5, (2,), np.float32), "k": spaces.Discrete(4)}),
        }[obs_kind]
        self.action_space = spaces.Discrete(3) if act_kind == "discrete" else spaces.Box(-1, 1, (2,), np.float32)
        self.tag, self.steps, self.t, self.length, self.end = "none", 0, 0, 1, 0
        self.failed_reset = False

    def _obs(self):
        r = self.np_random
        if self.obs_kind == "box":
            return np.array([self.t, r.uniform(-1, 1), r.uniform(-5, 5)], dtype=np.float32)
        if self.obs_kind == "discrete":
            return int((self.t + r.integers(6)) % 6)
        return {"pos": np.array([self.t % 5, r.uniform(-1, 1)], dtype=np.float32), "k": int(r.integers(4))}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if (options or {}).get("fail") and not self.failed_reset:  # once: the same reset again works
            self.failed_reset = True
            raise RuntimeError("toy reset failure")
        self.t = int((options or {}).get("start", 0))
        self.length, self.end = int(self.np_random.integers(1, self.max_len + 1)), int(self.np_random.integers(3))
        info = {"length": self.length}
        if options:
            info["options"] = dict(options)
        return self._obs(), info

    def step(self, action):
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError(f"toy failure at step {self.steps}")
        self.t += 1
        reward = float(np.sum(action)) + self.t / 4  # exact in float32
        done = self.t >= self.length
        info = {"t": self.t}
        if self.t % 2:
            info["odd"] = np.array([self.t])
        return self._obs(), reward, done and self.end != 1, done and self.end != 0, info

    def render(self):
        return np.full((3, 2, 3), self.t % 256, dtype=np.uint8)

    def add(self, x, y=0):
        return x + y + self.steps


def fns(n=N, wrap=None, **kwargs):
    make = functools.partial(ToyEnv, **kwargs)
    if wrap is not None:
        make = functools.partial(wrap, make)
    return [make for _ in range(n)]


def time_limited(make, steps=2):
    return gym.wrappers.TimeLimit(make(), steps)


def monitored(make):
    return Monitor(make())


@pytest.fixture
def opened():
    envs = []

    def register(env):
        envs.append(env)
        return env

    yield register
    for env in envs:
        env.close()


@pytest.fixture
def subproc(opened):
    return lambda env_fns, start_method="fork", **kw: opened(SubprocVecEnv(env_fns, start_method, **kw))


@pytest.fixture
def dummy(opened):
    return lambda env_fns: opened(DummyVecEnv(env_fns))


def assert_same(a, b, where=""):
    if isinstance(b, dict):
        assert isinstance(a, dict) and set(a) == set(b), f"{where}: {a!r} != {b!r}"
        for k in b:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for n, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{n}]")
    elif isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype, f"{where}: {a!r} != {b!r}"
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def run_against_dummy(vec, ref, steps=40, seed=3):
    """Same seeds, same actions: identical obs, rewards, dones, infos and reset_infos."""
    assert vec.seed(seed) == ref.seed(seed)
    assert_same(vec.reset(), ref.reset(), "reset")
    assert_same(vec.reset_infos, ref.reset_infos, "reset_infos")
    ref.action_space.seed(seed)
    dones = 0
    for t in range(steps):
        actions = np.stack([ref.action_space.sample() for _ in range(ref.num_envs)])
        obs, rew, done, infos = vec.step(actions)
        e_obs, e_rew, e_done, e_infos = ref.step(actions)
        assert_same(obs, e_obs, f"step {t} obs")
        assert_same(rew, e_rew, f"step {t} rewards")  # float32, as DummyVecEnv
        assert_same(done, e_done, f"step {t} dones")
        assert_same(list(infos), list(e_infos), f"step {t} infos")
        assert_same(vec.reset_infos, ref.reset_infos, f"step {t} reset_infos")
        dones += int(e_done.sum())
    assert dones > 5  # the trajectories went through many autoresets


@pytest.mark.parametrize(
    "kwargs,options",
    [
        ({"obs_kind": "box", "act_kind": "discrete"}, {}),
        ({"obs_kind": "discrete", "act_kind": "box"}, {"envs_per_worker": 2}),
        ({"obs_kind": "dict", "act_kind": "discrete"}, {"shared_memory": False}),
        ({"obs_kind": "dict", "act_kind": "box"}, {"envs_per_worker": 3}),
    ],
)
def test_trajectories_equal_dummy_vec_env(subproc, dummy, kwargs, options):
    run_against_dummy(subproc(fns(**kwargs), **options), dummy(fns(**kwargs)))


def test_terminal_observation_and_time_limit_truncated(subproc, dummy):
    env_fns = fns(2, wrap=time_limited, max_len=5) + fns(1, max_len=1)
    vec, ref = subproc(env_fns), dummy(env_fns)
    run_against_dummy(vec, ref, steps=12)
    for _ in range(3):
        _, _, done, infos = vec.step(np.zeros(3, dtype=np.int64))
        for d, info in zip(done, infos, strict=True):
            assert ("terminal_observation" in info) == bool(d)
            assert isinstance(info["TimeLimit.truncated"], bool)


def test_seed_and_options_are_used_once(subproc, dummy):
    vec, ref = subproc(fns()), dummy(fns())
    for env in (vec, ref):
        env.seed(7)
        env.set_options([{"start": 2}, {}, None, {"start": 1}])
    assert_same(vec.reset(), ref.reset())
    assert [i.get("options") for i in vec.reset_infos] == [{"start": 2}, None, None, {"start": 1}]
    assert_same(vec.reset_infos, ref.reset_infos)
    for env in (vec, ref):
        env.set_options({"start": 3})
        env.seed(7)
    assert_same(vec.reset(), ref.reset())
    assert [i["options"] for i in vec.reset_infos] == [{"start": 3}] * N
    first = vec.reset_infos
    vec.seed(7), ref.seed(7)
    assert_same(vec.reset(), ref.reset())  # no options any more, same seeds again
    assert all("options" not in i for i in vec.reset_infos)
    assert [i["length"] for i in vec.reset_infos] == [i["length"] for i in first]
    assert vec.seed(None) != vec.seed(None)  # random base seeds, as VecEnv.seed


def test_env_method_get_attr_set_attr_with_indices(subproc, dummy):
    env_fns = fns(wrap=time_limited, max_len=10)
    vec, ref = subproc(env_fns, envs_per_worker=2), dummy(env_fns)
    vec.reset(), ref.reset()
    vec.step(np.ones(N, dtype=np.int64)), ref.step(np.ones(N, dtype=np.int64))
    for indices in (None, 2, [3, 0], range(1, 3), np.array([1])):
        assert vec.env_method("add", 1, y=2, indices=indices) == ref.env_method("add", 1, y=2, indices=indices)
        assert vec.get_attr("steps", indices) == ref.get_attr("steps", indices)
        vec.set_attr("tag", f"i{indices}", indices)
        ref.set_attr("tag", f"i{indices}", indices)
        assert vec.get_attr("tag") == ref.get_attr("tag")
    # As SB3, set_attr sets on the outermost env (here the TimeLimit), not through wrappers.
    assert vec.env_method("__getattribute__", "tag") == ref.env_method("__getattribute__", "tag")
    assert vec.get_attr("tag") == ["i[3, 0]", "i[1]", "irange(1, 3)", "i[3, 0]"]
    assert vec.has_attr("tag") and vec.has_attr("steps") and not vec.has_attr("nothing")


def test_missing_attribute_is_an_attribute_error_and_needs_no_reset(subproc):
    vec = subproc(fns())
    vec.reset()
    with pytest.raises(AttributeError) as caught:
        vec.get_attr("nothing", indices=[1])
    assert isinstance(caught.value, RemoteAttributeError) and isinstance(caught.value, WorkerError)
    assert caught.value.worker_id == 1 and "nothing" in caught.value.remote_traceback
    with pytest.raises(AttributeError):
        vec.env_method("no_method")
    vec.step(np.zeros(N, dtype=np.int64))  # the envs are untouched: stepping goes on
    (env,) = vec.get_attr("unwrapped", indices=2)  # an env object still comes back whole
    assert isinstance(env, ToyEnv) and env.steps == 1


def test_env_is_wrapped(subproc, dummy):
    env_fns = [*fns(1, wrap=monitored), *fns(1, wrap=time_limited), *fns(2)]
    vec, ref = subproc(env_fns, envs_per_worker=3), dummy(env_fns)
    for wrapper in (Monitor, gym.wrappers.TimeLimit, gym.Wrapper, gym.wrappers.ClipAction):
        assert vec.env_is_wrapped(wrapper) == ref.env_is_wrapped(wrapper)
    assert vec.env_is_wrapped(Monitor) == [True, False, False, False]
    assert vec.env_is_wrapped(gym.wrappers.TimeLimit, indices=[1, 0]) == [True, False]
    assert vec.env_is_wrapped(Monitor, indices=0) == [True]


def test_render_and_get_images(subproc, dummy):
    vec, ref = subproc(fns(render_mode="rgb_array")), dummy(fns(render_mode="rgb_array"))
    assert isinstance(vec, VecEnv) and vec.num_envs == N
    assert vec.render_mode == "rgb_array" and vec.metadata == {"render_modes": ["human", "rgb_array"]}
    vec.seed(0), ref.seed(0)
    vec.reset(), ref.reset()
    vec.step(np.zeros(N, dtype=np.int64)), ref.step(np.zeros(N, dtype=np.int64))
    assert_same(list(vec.get_images()), list(ref.get_images()))
    assert_same(vec.render(), ref.render())
    assert vec.render().shape == (6, 4, 3)  # 2x2 tiles of 3x2 frames
    no_render = subproc(fns(2))
    with pytest.warns(UserWarning):
        assert no_render.get_images() == [None, None]


def test_sb3s_own_isinstance_checks_see_a_subprocvecenv(subproc, monkeypatch, tmp_path):
    """SB3 branches on ``isinstance(venv, SubprocVecEnv)``: ``VecVideoRecorder`` takes the env's
    own metadata (its ``render_fps``) only for its vec envs. Ours is one to such checks, so a
    recording runs at the env's frame rate as with SB3's class (it fell back to 30 fps)."""
    import sys
    import types

    from stable_baselines3.common.vec_env import SubprocVecEnv as SB3SubprocVecEnv
    from stable_baselines3.common.vec_env import VecVideoRecorder

    monkeypatch.setitem(sys.modules, "moviepy", types.ModuleType("moviepy"))  # (only imported, nothing recorded)
    env_fns = [lambda: gym.make("CartPole-v1", render_mode="rgb_array")] * 2
    ours = subproc(env_fns)
    assert isinstance(ours, SB3SubprocVecEnv)
    reference = SB3SubprocVecEnv(env_fns, "fork")
    try:
        fps = [VecVideoRecorder(vec, str(tmp_path), lambda step: False).frames_per_sec for vec in (ours, reference)]
    finally:
        reference.close()
        for remote in reference.remotes:  # (SB3 leaves its pipes to the collector)
            remote.close()
    assert fps == [50, 50]  # CartPole's render_fps, as with SB3's class (ours was 30: the fallback)


def test_bad_use_is_rejected_before_anything_is_sent(subproc):
    vec = subproc(fns())
    vec.reset()
    with pytest.raises(ValueError):
        vec.step_async(np.zeros(N - 1, dtype=np.int64))
    with pytest.raises(InvalidInputError):
        vec.step_async(np.zeros((N, 2), dtype=np.int64))  # wrong action shape
    assert not vec.waiting
    with pytest.raises(InvalidInputError):
        vec.step_wait()  # no step_async before
    vec.step(np.zeros(N, dtype=np.int64))  # nothing got out of step


class ActionRecorder(gym.Env):
    """Reports, in its info, the type, dtype and value of the action it received."""

    observation_space = spaces.Box(-np.inf, np.inf, (1,), np.float64)

    def __init__(self, act_kind="box"):
        self.action_space = spaces.Discrete(3) if act_kind == "discrete" else spaces.Box(-2, 2, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1), {}

    def step(self, action):
        got = {"type": type(action).__name__, "dtype": str(getattr(action, "dtype", None)),
               "value": np.asarray(action).tolist()}
        return np.zeros(1), 0.0, False, False, got


@pytest.mark.parametrize("act_kind,actions", [
    ("box", np.array([[0.1], [-1.3], [1.7], [0.0]])),  # float64 rows for a float32 Box
    ("box", np.array([[0.1], [-1.3], [1.7], [0.0]], np.float32)),  # the space's own dtype (shared memory)
    ("discrete", np.array([0, 2, 1, 2], np.int32)),
    ("discrete", np.array([0, 2, 1, 2])),
    ("discrete", [0, 2, 1, 2]),
])
def test_each_env_gets_its_action_as_given_as_sb3s(subproc, dummy, act_kind, actions):
    """SB3 hands env ``i`` ``actions[i]`` unconverted (``DummyVecEnv`` and ``SubprocVecEnv``
    alike): so does ours, checked first, whatever the layout."""
    for options in ({}, {"envs_per_worker": 2}, {"shared_memory": False}):
        make = [functools.partial(ActionRecorder, act_kind)] * N
        vec, ref = subproc(make, **options), dummy(make)
        vec.reset()
        ref.reset()
        got, expected = vec.step(actions)[3], ref.step(actions)[3]
        assert got == expected, options


def test_float64_actions_give_sb3s_trajectories():
    """Pendulum with float64 actions: the env computes with them as given (SB3's trajectory to
    the last bit, not one of actions rounded to float32 first)."""
    make = [lambda: gym.make("Pendulum-v1")] * 2
    actions = np.random.default_rng(0).uniform(-2, 2, (60, 2, 1))
    out = []
    for vec in (SubprocVecEnv(make, "fork"), DummyVecEnv(make)):
        try:
            vec.seed(0)
            vec.reset()
            for a in actions:
                obs = vec.step(a)[0]
            out.append(obs)
        finally:
            vec.close()
    np.testing.assert_array_equal(out[0], out[1])


class CompositeActionRecorder(ActionRecorder):
    """A Dict or Tuple action space of two subspaces; the info holds the action received."""

    def __init__(self, act_kind="dict"):
        parts = (spaces.Discrete(3), spaces.Box(-2, 2, (2,), np.float32))
        if act_kind == "tuple_of_discrete":
            parts = (spaces.Discrete(3), spaces.Discrete(3))
        elif act_kind.endswith("_text"):  # no array layout: the batch is taken apart in the parent
            parts = (spaces.Discrete(3), spaces.Text(5))
        dict_space = act_kind.startswith("dict")
        self.action_space = spaces.Dict(dict(zip("ab", parts, strict=True))) if dict_space else spaces.Tuple(parts)

    def step(self, action):
        items = action.items() if isinstance(action, dict) else enumerate(action)
        return np.zeros(1), 0.0, False, False, {"got": {k: np.asarray(v).tolist() for k, v in items}}


@pytest.mark.parametrize("act_kind,n", [("dict", 2), ("dict", 3), ("tuple", 3), ("dict_text", 2), ("tuple_text", 3)])
def test_a_batch_of_composite_actions_gives_each_env_its_row(subproc, act_kind, n):
    """For a Dict / Tuple action space, a batch (a dict / tuple of arrays, one row per env) gives
    each env its row, as one action per env does. The batch was counted and sent as a list of its
    keys / items: refused unless there were as many as envs, and then env ``i`` got key ``i``;
    with a Text inside (no array layout) it still was. (A tuple of as many items as envs is one
    action per env: the next test.)"""
    discrete, box = np.array([2, 0, 1][:n]), np.arange(2 * n, dtype=np.float32).reshape(n, 2) / 4
    if act_kind.endswith("_text"):
        box = ("ab", "cd", "ef")[:n]
    if act_kind.startswith("dict"):
        batch = {"a": discrete, "b": box}
        per_env = [{"a": int(d), "b": b} for d, b in zip(discrete, box, strict=True)]
    else:
        batch, per_env = (discrete, box), [(int(d), b) for d, b in zip(discrete, box, strict=True)]
    vec = subproc([functools.partial(CompositeActionRecorder, act_kind)] * n)
    vec.reset()
    expected = [info["got"] for info in vec.step(per_env)[3]]
    assert [info["got"] for info in vec.step(batch)[3]] == expected
    key = "a" if act_kind.startswith("dict") else 0
    assert [got[key] for got in expected] == [2, 0, 1][:n]
    short = {"a": discrete[:1], "b": box[:1]} if act_kind.startswith("dict") else (discrete[:1], box[:1])
    with pytest.raises(InvalidInputError):
        vec.step(short)  # rows for one env only
    assert not vec.waiting
    vec.step(batch)


def test_a_tuple_of_one_tuple_action_per_env_is_read_as_sb3_reads_it(subproc, dummy):
    """As many items as envs: env ``i`` gets item ``i``, as SB3 reads any sequence of actions, not
    the batch reading (a tuple of arrays) that would hand env 0 the first items of each."""
    make = [functools.partial(CompositeActionRecorder, "tuple_of_discrete")] * 2
    vec, ref = subproc(make), dummy(make)
    vec.reset(), ref.reset()
    actions = ((0, 1), (2, 0))
    expected = [info["got"] for info in ref.step(actions)[3]]
    assert expected == [{0: 0, 1: 1}, {0: 2, 1: 0}]
    assert [info["got"] for info in vec.step(actions)[3]] == expected
    assert [info["got"] for info in vec.step(list(actions))[3]] == expected


def test_array_rows_of_tuple_actions_are_read_as_sb3_reads_them(subproc, dummy):
    """An ``(n_envs, k)`` array for a Tuple action space of ``k`` items: env ``i`` gets row ``i``'s
    items, as SB3's vec envs hand it ``actions[i]`` (a Tuple space takes an array row as its items,
    ``Tuple.contains``). It was refused ("action must be a tuple"). Out of the space, refused before
    any env steps, as any action."""
    make = [functools.partial(CompositeActionRecorder, "tuple_of_discrete")] * 3
    vec, ref = subproc(make), dummy(make)
    vec.reset(), ref.reset()
    actions = np.array([[0, 1], [2, 0], [1, 2]])
    expected = [info["got"] for info in ref.step(actions)[3]]
    assert expected == [{0: 0, 1: 1}, {0: 2, 1: 0}, {0: 1, 1: 2}]
    assert [info["got"] for info in vec.step(actions)[3]] == expected
    with pytest.raises(InvalidInputError):
        vec.step(np.array([[0, 1], [2, 0], [3, 0]]))  # 3 is not in Discrete(3)
    assert not vec.waiting
    assert [info["got"] for info in vec.step(actions[::-1])[3]] == expected[::-1]


def test_env_exception_carries_traceback_and_reset_recovers(subproc):
    vec = subproc(fns(3, max_len=100, fail_at=2) + fns(1, max_len=100))
    vec.reset()
    vec.step(np.zeros(N, dtype=np.int64))
    with pytest.raises(WorkerError) as caught:
        vec.step(np.zeros(N, dtype=np.int64))
    assert "toy failure at step 2" in caught.value.remote_traceback
    assert not vec.waiting
    vec.reset()  # drops whatever the other workers delivered
    assert vec.get_attr("steps", indices=3) == [2]


class SeedOnlyReset(gym.Env):
    """An env as older code writes it: ``reset(seed=None)`` with no ``options``."""

    observation_space, action_space = spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2)

    def reset(self, seed=None):
        super().reset(seed=seed)
        self.t = 0
        return np.full(2, self.np_random.uniform(-1, 1), np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(2, np.float32), 1.0, self.t >= 3, False, {}


class StepWithoutAction(SeedOnlyReset):
    def step(self):  # forgot the action: the call itself raises, before anything is returned
        return np.zeros(2, np.float32), 0.0, False, False, {}


def test_an_env_whose_reset_takes_no_options_runs_as_in_sb3s(subproc, dummy):
    """SB3's workers pass ``options`` only when there are some; ours always passed them."""
    vec, ref = subproc([SeedOnlyReset] * 2, envs_per_worker=2), dummy([SeedOnlyReset] * 2)
    for v in (vec, ref):
        v.seed(3)
    np.testing.assert_array_equal(vec.reset(), ref.reset())
    for _ in range(4):
        got, want = vec.step(np.array([0, 1])), ref.step(np.array([0, 1]))
        for a, b in zip(got[:3], want[:3], strict=True):
            np.testing.assert_array_equal(a, b)
    vec.set_options({"x": 1})  # options given: they are passed, and this env refuses them as in SB3
    with pytest.raises(WorkerError, match="unexpected keyword argument 'options'"):
        vec.reset()


SHARED_INFO = {"tag": "x"}  # one dict object for every env and step, as some envs return a constant


class SharedInfo(SeedOnlyReset):
    def reset(self, seed=None, options=None):
        return super().reset(seed=seed)[0], SHARED_INFO

    def step(self, action):
        return (*super().step(action)[:4], SHARED_INFO)


def test_envs_returning_one_info_object_get_infos_of_their_own(subproc):
    """Two envs of one worker returning the same dict object (it travels as one): each env's info
    is its own dict, as from SB3's workers (one process each), and a reset info never gets a step's
    ``TimeLimit.truncated``."""
    vec = subproc([SharedInfo] * 2, envs_per_worker=2)
    vec.reset()
    for _ in range(3):  # the third step ends both episodes (terminated): their reset infos are kept
        _, _, dones, infos = vec.step(np.array([0, 1]))
        assert infos[0] is not infos[1]
        infos[0]["mine"] = 1
        assert "mine" not in infos[1]
    assert dones.all() and vec.reset_infos == [{"tag": "x"}, {"tag": "x"}]


def test_an_exception_of_the_env_call_itself_is_not_called_a_bad_return(subproc):
    vec = subproc([StepWithoutAction] * 2)
    vec.reset()
    with pytest.raises(WorkerError) as caught:
        vec.step(np.array([0, 1]))
    assert "takes 1 positional argument but 2 were given" in str(caught.value)
    assert "cannot take" not in str(caught.value)  # it was "step() returned what the vector env cannot take"


def test_a_failed_reset_is_named_when_stepping_before_the_next_reset(subproc):
    """After reset() raised (env 3's reset), step() says in SB3's terms what to do, sends nothing,
    and the next reset() recovers (the options stay until a reset succeeds)."""
    vec = subproc(fns(N, max_len=100))
    vec.reset()
    vec.set_options([{}, {}, {}, {"fail": True}])
    with pytest.raises(WorkerError, match="toy reset failure"):
        vec.reset()
    steps = vec.get_attr("steps")
    with pytest.raises(InvalidInputError, match=r"the last reset\(\) failed .*call reset\(\) again"):
        vec.step(np.zeros(N, dtype=np.int64))
    assert vec.get_attr("steps") == steps and not vec.waiting  # nothing was sent
    vec.reset()
    vec.step(np.zeros(N, dtype=np.int64))
    assert vec.get_attr("steps") == [k + 1 for k in steps]


def test_restarted_worker_ends_the_episode_as_truncated(subproc):
    vec = subproc(fns(2, max_len=100), restart_workers=True, envs_per_worker=1)  # env 1 alone in its process
    vec.reset()
    before, _, _, _ = vec.step(np.zeros(2, dtype=np.int64))
    os.kill(vec.manager.processes[1].pid, signal.SIGKILL)
    obs, rewards, dones, infos = vec.step(np.zeros(2, dtype=np.int64))
    assert dones[1] and rewards[1] == 0.0  # (env 0's random episode may end here too)
    assert infos[1]["interrupted"] and infos[1]["TimeLimit.truncated"]
    np.testing.assert_array_equal(infos[1]["terminal_observation"], before[1])
    assert "length" in vec.reset_infos[1] and "TimeLimit.truncated" not in vec.reset_infos[1]  # the reset's own info
    assert obs[1][0] == 0  # a fresh episode
    vec.step(np.zeros(2, dtype=np.int64))


def test_close_twice_and_with_a_step_in_flight(subproc):
    vec = subproc(fns())
    vec.reset()
    vec.step_async(np.zeros(N, dtype=np.int64))
    vec.close()
    assert vec.closed and not vec.waiting
    vec.close()
    with pytest.raises(ManagerClosedError):
        vec.reset()


def test_bogus_start_method_raises_as_multiprocessing():
    with pytest.raises(ValueError) as expected:
        multiprocessing.get_context("bogus")
    with pytest.raises(ValueError) as got:
        SubprocVecEnv(fns(2), start_method="bogus")
    assert str(got.value) == str(expected.value)


def test_default_start_method_and_ppo_smoke(opened):
    vec = opened(make_vec_env("CartPole-v1", n_envs=2, seed=0, vec_env_cls=SubprocVecEnv))
    expected = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    assert type(vec.manager.processes[0].process).__name__.lower().startswith(expected)
    env = VecNormalize(vec)
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=1, seed=0, device="cpu")
    model.learn(total_timesteps=256)
    mean, _ = evaluate_policy(model, env, n_eval_episodes=2)  # checks env_is_wrapped(Monitor)
    assert mean > 0


def test_negative_and_numpy_indices_as_sb3(subproc, dummy):
    env_fns = fns(wrap=time_limited, max_len=10)
    vec, ref = subproc(env_fns, envs_per_worker=2), dummy(env_fns)
    vec.reset(), ref.reset()
    vec.step(np.ones(N, dtype=np.int64)), ref.step(np.ones(N, dtype=np.int64))
    for indices in ([0, -1], [-1], -1, -N, [-2, 1], np.array([0, -1]), np.array([2], dtype=np.int32)):
        assert vec.env_method("add", 1, y=2, indices=indices) == ref.env_method("add", 1, y=2, indices=indices)
        assert vec.get_attr("steps", indices) == ref.get_attr("steps", indices)
        assert vec.env_is_wrapped(gym.wrappers.TimeLimit, indices) == ref.env_is_wrapped(gym.wrappers.TimeLimit, indices)
        vec.set_attr("tag", f"i{indices}", indices)
        ref.set_attr("tag", f"i{indices}", indices)
        assert vec.get_attr("tag") == ref.get_attr("tag")
    assert vec.get_attr("tag", indices=[-1, 0, 1, -2]) == ["i[ 0 -1]", "i[ 0 -1]", "i[-2, 1]", "i[2]"]
    # A NumPy integer is one env (SB3 itself would try to iterate it).
    assert vec.get_attr("tag", indices=np.int64(-1)) == vec.get_attr("tag", indices=[N - 1])
    for bad in (N, -N - 1, [0, N]):  # out of range: IndexError, as list indexing in SB3
        with pytest.raises(IndexError):
            ref.get_attr("steps", indices=bad)
        with pytest.raises(IndexError):
            vec.get_attr("steps", indices=bad)
    assert vec.get_attr("steps") == ref.get_attr("steps")  # nothing was disturbed
