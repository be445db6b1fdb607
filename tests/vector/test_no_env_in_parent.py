"""No env in the parent (issue 38 item 2): the drop-ins take the spaces, ``metadata`` and
``render_mode`` from the first worker, as SB3's ``SubprocVecEnv`` does, instead of building
``env_fns[0]()`` in the parent as gymnasium's ``AsyncVectorEnv`` does. An env that can only be
built in a worker (``RefusesParent``: it refuses the test process's pid) runs under both
drop-ins; every other env gives what gymnasium's class gives; ``dummy_env=True`` asks for the
parent's copy, as gymnasium builds it.
"""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
import pytest
from envs import assert_tree_equal, env_fn, worker_children
from gymnasium.vector import AsyncVectorEnv as GymAsyncVectorEnv
from gymnasium.vector import AutoresetMode
from sloppy_cases import close_reference
from sloppy_envs import RefusesParent, unbuildable

import envmanager
from envmanager.errors import WorkerError

pytestmark = pytest.mark.skipif(
    __import__("envs").REFERENCE, reason="compares envmanager with its references itself"
)

N = 3


def refusing(n: int = N, log: str | None = None) -> list:
    """Env factories whose envs refuse to be built in this process."""
    return [functools.partial(RefusesParent, parent_pid=os.getpid(), render_mode="rgb_array", log=log) for _ in range(n)]


def built_in(log: str) -> list[int]:
    with open(log) as lines:
        return [int(line) for line in lines]


def test_gymnasium_builds_an_env_in_the_parent() -> None:
    """The reference, for contrast: gymnasium's constructor calls ``env_fns[0]()`` here."""
    with pytest.raises(RuntimeError, match="cannot be built in the parent process"):
        GymAsyncVectorEnv(refusing(), context="fork")


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_an_env_that_refuses_the_parent_runs_under_the_gymnasium_drop_in(closing, tmp_path, context: str) -> None:
    log = str(tmp_path / "built")
    envs = closing(envmanager.AsyncVectorEnv(refusing(log=log), context=context, envs_per_worker=1))
    assert envs.single_observation_space == gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    assert envs.single_action_space == gym.spaces.Discrete(3)
    assert envs.metadata == {"render_modes": ["rgb_array"], "render_fps": 7, "autoreset_mode": AutoresetMode.NEXT_STEP}
    assert envs.render_mode == "rgb_array"
    obs, infos = envs.reset(seed=1)
    assert obs.shape == (N, 2) and os.getpid() not in infos["built_in"].tolist()
    _, rewards, terminated, _, _ = envs.step(np.array([0, 1, 2]))
    assert rewards.tolist() == [0.0, 1.0, 2.0] and not terminated.any()
    assert [frame.shape for frame in envs.render()] == [(2, 2, 3)] * N
    envs.close()
    assert len(built_in(log)) == N and os.getpid() not in built_in(log)  # each env built once, in its worker


@pytest.mark.parametrize("start_method", ["fork", None])
def test_an_env_that_refuses_the_parent_runs_under_the_sb3_drop_in(closing, tmp_path, start_method: str | None) -> None:
    pytest.importorskip("stable_baselines3")
    from envmanager.sb3 import SubprocVecEnv

    log = str(tmp_path / "built")
    vec = closing(SubprocVecEnv(refusing(log=log), start_method=start_method, envs_per_worker=1))
    assert vec.observation_space == gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    assert vec.render_mode == "rgb_array" and vec.metadata == {"render_modes": ["human", "rgb_array"]}
    assert vec.reset().shape == (N, 2)
    _, rewards, dones, _ = vec.step(np.array([2, 1, 0]))
    assert rewards.tolist() == [2.0, 1.0, 0.0] and not dones.any()
    assert [frame.shape for frame in vec.get_images()] == [(2, 2, 3)] * N
    vec.close()
    assert len(built_in(log)) == N and os.getpid() not in built_in(log)


def test_envs_per_worker_auto_measures_in_a_throwaway_process(closing, tmp_path) -> None:
    """``"auto"`` builds ``env_fns[0]`` once more to measure it, in a process of its own."""
    log = str(tmp_path / "built")
    envs = closing(envmanager.AsyncVectorEnv(refusing(log=log), context="fork"))
    envs.reset(seed=0)
    envs.close()
    assert len(built_in(log)) == N + 1 and os.getpid() not in built_in(log)


def test_dummy_env_builds_the_first_env_in_the_parent_as_gymnasium(tmp_path) -> None:
    """``dummy_env=True``: the parent's copy, as gymnasium builds it (and its error, raised here)."""
    with pytest.raises(RuntimeError, match="cannot be built in the parent process"):
        envmanager.AsyncVectorEnv(refusing(), context="fork", dummy_env=True)
    log = str(tmp_path / "built")
    fns = [functools.partial(RefusesParent, parent_pid=-1, log=log)] * N
    envs = envmanager.AsyncVectorEnv(fns, context="fork", envs_per_worker=1, dummy_env=True)
    try:
        assert built_in(log).count(os.getpid()) == 1 and len(built_in(log)) == N + 1
        assert envs.single_observation_space == gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    finally:
        envs.close()


def _as_gymnasium_cases():
    cart_pole = functools.partial(gym.make, "CartPole-v1", render_mode="rgb_array")
    for kind in ("box", "discrete", "multidiscrete", "multibinary", "dict", "tuple"):
        yield pytest.param([env_fn(obs_kind=kind, act_kind=kind)] * N, {}, id=kind)
    yield pytest.param([cart_pole] * N, {}, id="cartpole-rgb_array")
    yield pytest.param([env_fn(obs_high=h) for h in (1.0, 2.0, 3.0)], {"observation_mode": "different"}, id="different")
    given = (gym.spaces.Box(-5.0, 5.0, (N, 3), np.float32), gym.spaces.Box(-5.0, 5.0, (3,), np.float32))
    yield pytest.param([env_fn()] * N, {"observation_mode": given}, id="given-spaces")
    yield pytest.param([env_fn(render_mode="rgb_array")] * N, {"autoreset_mode": AutoresetMode.SAME_STEP}, id="same-step")


@pytest.mark.parametrize("fns, kwargs", list(_as_gymnasium_cases()))
def test_spaces_metadata_and_render_mode_as_gymnasium(closing, fns: list, kwargs: dict) -> None:
    """What the first worker reports gives the attributes gymnasium reads off its parent's env."""
    ours = closing(envmanager.AsyncVectorEnv(fns, context="fork", envs_per_worker=1, **kwargs))
    ref = GymAsyncVectorEnv(fns, context="fork", **kwargs)
    try:
        for name in ("num_envs", "single_observation_space", "observation_space", "single_action_space", "action_space",
                     "metadata", "render_mode", "spec"):
            assert getattr(ours, name) == getattr(ref, name), (name, getattr(ours, name), getattr(ref, name))
        assert_tree_equal(ours.reset(seed=4)[0], ref.reset(seed=4)[0], "reset")
    finally:
        close_reference(ref)


def test_observation_spaces_that_do_not_batch_raise_as_gymnasium() -> None:
    """``observation_mode="different"`` with spaces of different shapes: gymnasium's error,
    its words, from the workers' spaces; no worker left."""
    fns = [env_fn(obs_kind="box"), env_fn(obs_kind="discrete")]
    with pytest.raises(Exception) as expected:
        GymAsyncVectorEnv(fns, context="fork", observation_mode="different")
    with pytest.raises(type(expected.value)) as got:
        envmanager.AsyncVectorEnv(fns, context="fork", envs_per_worker=1, observation_mode="different")
    assert str(got.value) == str(expected.value)


def test_an_env_that_cannot_be_built_raises_its_own_error() -> None:
    """Built in its worker, an env's constructor error reaches the caller as itself (gymnasium
    raises it from its parent's ``env_fns[0]()``), chained to the worker's account naming it;
    no worker is left."""
    fns = [functools.partial(unbuildable, "no licence server")] * N
    with pytest.raises(ValueError, match="no licence server"):
        GymAsyncVectorEnv(fns, context="fork")
    with pytest.raises(ValueError, match="no licence server") as refused:
        envmanager.AsyncVectorEnv(fns, context="fork", envs_per_worker=1)
    assert isinstance(refused.value.__cause__, WorkerError) and "worker" in str(refused.value.__cause__)
    assert worker_children() == []
