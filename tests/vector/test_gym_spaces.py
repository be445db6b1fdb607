"""Every space and observation mode gymnasium's ``AsyncVectorEnv`` takes, with its results, errors
and messages: Graph, Sequence and OneOf spaces (alone and inside Dict / Tuple) step for step
as ``SyncVectorEnv``; ``observation_mode`` "same", "different" and a custom pair of spaces.

Run with ``ENVMANAGER_CONFORMANCE_REFERENCE=1``, the same tests pass on gymnasium's own class.
"""

from __future__ import annotations

import functools
import gc
import re

import envs
import gymnasium as gym
import numpy as np
import pytest
from envs import DYNAMIC_KINDS, SampledEnv, has_dynamic_shape, run_lockstep, worker_children
from gymnasium.spaces import Box, Dict, Discrete, Text
from gymnasium.vector.utils import batch_differing_spaces

N = 2


def assert_refused(impl, fns, error, message, anywhere=False, **kwargs):
    """``impl(fns, **kwargs)`` raises ``error`` with a message starting with (or, if ``anywhere``,
    holding) ``message``, and leaves no worker behind."""
    with pytest.raises(error, match=("" if anywhere else "^") + re.escape(message)) as excinfo:
        impl(fns, **kwargs).close()
    del excinfo
    gc.collect()  # gymnasium reaps its already-started workers in __del__
    assert worker_children() == []


def _dynamic_cases():
    for kind in DYNAMIC_KINDS:
        for shared_memory in (False, True):
            # gymnasium's shared memory freezes OneOf observations: its read_from_shared_memory
            # picks each env's subspace and value once, when the vector env is built.
            defect = shared_memory and "oneof" in kind
            yield pytest.param(kind, shared_memory, id=f"{kind}-{'shm' if shared_memory else 'pipe'}",
                               marks=[pytest.mark.gym_defect] if defect else [])


@pytest.mark.parametrize("kind, shared_memory", list(_dynamic_cases()))
def test_dynamic_spaces_step_as_sync_vector_env(impl, make_async, make_sync, kind, shared_memory):
    fns = [functools.partial(SampledEnv, kind, kind)] * N
    if shared_memory and has_dynamic_shape(kind) and envs.REFERENCE:
        # gymnasium refuses; ours sends such observations pickled (a documented difference)
        assert_refused(impl, fns, TypeError,
                       "has a dynamic shape so its not possible to make a static shared memory. "
                       "For `AsyncVectorEnv`, disable `shared_memory`.",
                       anywhere=True, shared_memory=True)
        return
    vec, ref = make_async(fns, shared_memory=shared_memory), make_sync(fns)
    assert vec.single_observation_space == ref.single_observation_space
    assert vec.observation_space == ref.observation_space
    assert vec.action_space == ref.action_space
    run_lockstep(vec, ref, steps=7, min_done=N)


@pytest.mark.parametrize("shared_memory", [False, pytest.param(True, marks=pytest.mark.gym_defect)])
def test_text_observations_step_as_sync_vector_env(make_async, make_sync, shared_memory):
    """Text observations are the envs' strings (gymnasium's shared memory reads back
    ``"0" * max_length`` for every one of them)."""
    fns = [WordEnv] * N
    run_lockstep(make_async(fns, shared_memory=shared_memory), make_sync(fns), steps=7, min_done=N)


class WordEnv(gym.Env):
    """Text observations made from the step and the action (``Text.sample`` picks characters in a
    set's order, which differs between processes)."""

    observation_space, action_space = Text(5), Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return "r", {}

    def step(self, action):
        self._t += 1
        return f"t{self._t}a{int(action)}", 0.0, self._t >= 3, False, {}


def test_same_mode_with_unequal_spaces_says_so_as_gymnasium(impl):
    fns = [functools.partial(SampledEnv, Box(0, high, (2,))) for high in (1.0, 2.0)]
    message = (
        "AsyncVectorEnv(..., observation_mode='same') however some of the sub-environments observation "
        "spaces are not equivalent. If this is intentional, use `observation_mode='different'` instead."
    )
    for shared_memory in (True, False):
        assert_refused(impl, fns, RuntimeError, message, observation_mode="same", shared_memory=shared_memory)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
def test_custom_spaces_must_share_shape_and_dtype(impl, shared_memory):
    # A custom (batched, single) pair: every env's space must have the single space's shape and dtype.
    fns = [functools.partial(SampledEnv, Box(0, 1, (i + 1,))) for i in range(3)]
    mode = (Box(0, 4, (3, 5)), Box(0, 4, (5,)))
    message = (
        "AsyncVectorEnv(..., observation_mode='different' or custom space) however the sub-environment's "
        "observation spaces do not share a common shape and dtype."
    )
    assert_refused(impl, fns, RuntimeError, message, observation_mode=mode, shared_memory=shared_memory)


def test_custom_space_pair_steps_as_sync_vector_env(make_async, make_sync):
    env_spaces = [Box(0, high, (5,), np.float32) for high in (1.0, 2.0, 3.0)]
    fns = [functools.partial(SampledEnv, s) for s in env_spaces]
    mode = (batch_differing_spaces(env_spaces), Box(0, 1, (5,), np.float32))
    vec, ref = make_async(fns, observation_mode=mode), make_sync(fns, observation_mode=mode)
    assert vec.observation_space == ref.observation_space == mode[0]
    assert vec.single_observation_space == mode[1]
    run_lockstep(vec, ref, steps=5)


@pytest.mark.parametrize("spaces, error, message", [
    pytest.param([Box(0, 1, (1,)), Box(0, 1, (2,))], ValueError,
                 "Expected all Box.low shape to be equal, actually [(1,), (2,)]", id="shapes"),
    pytest.param([Box(0, 1, (3,)), Discrete(5), Dict({"a": Discrete(2)})], TypeError,
                 "Expects all spaces to be of the same type, actual types: ", id="types"),
])
def test_different_mode_refuses_what_cannot_be_batched(impl, spaces, error, message):
    fns = [functools.partial(SampledEnv, s) for s in spaces]
    assert_refused(impl, fns, error, message, observation_mode="different")


def test_custom_mode_must_be_two_spaces(impl):
    fns = [functools.partial(SampledEnv, Box(0, 1, (2,)))]
    assert_refused(impl, fns, TypeError, "Expected both elements of observation_mode to be Spaces, got ",
                   observation_mode=(Box(0, 1, (1, 2)), "box"))
