"""Each env gets its action exactly as gymnasium's ``AsyncVectorEnv`` hands it over: the item
``iterate(action_space, actions)`` yields, same type, dtype and value (a ``float64`` scalar
from a ``float64`` array, a Python int from a list, an integer out of a ``Discrete``'s
range); the env judges it.

The expected accounts are computed with gymnasium's ``iterate``; run with
``ENVMANAGER_CONFORMANCE_REFERENCE=1``, the same tests pass on gymnasium's own class.
"""

from __future__ import annotations

import functools
import threading
import warnings

import envs
import numpy as np
import pytest
from envs import RecordingEnv, describe
from gymnasium.vector.utils import batch_space, iterate

N = 2

#: Per action kind, batches of actions: exact arrays of the space's dtypes (they go through
#: shared memory in ours) and everything else (they travel pickled, item by item).
CASES = {
    "box0": [
        np.array([0.1, 0.3]),  # float64 for a float32 space: each env gets an np.float64
        np.array([0.1, 0.3], dtype=np.float32),
        [0.25, 0.5],  # Python floats
        np.array([2.0, -1.0]),  # out of the Box: the env decides
    ],
    "box": [
        np.zeros((N, 3), dtype=np.float32),
        np.arange(6, dtype=np.float64).reshape(N, 3),
        [[1, 2, 3], [4, 5, 6]],  # lists of Python ints
        np.zeros((N, 2), dtype=np.float32),  # another shape: the env decides
        [np.zeros(3), [0.0, 1.0]],  # one of them
    ],
    "discrete": [
        np.array([1, 2]),
        [2, 0],  # Python ints
        np.array([1, 2], dtype=np.int32),
        np.array([5, -1]),  # out of range: reaches the env
        np.array([0.5, 2.0]),  # floats: reach the env
    ],
    "dict": [
        {"a": np.array([1, 2]), "b": np.zeros((N, 2), dtype=np.float32)},
        {"b": np.ones((N, 2)), "a": [0, 7]},  # another key order, float64, Python ints
    ],
    "tuple": [
        (np.array([1, 2]), np.zeros((N, 2))),
        [[2, 1], np.ones((N, 2), dtype=np.float32)],
    ],
}


def expected_accounts(env, actions):
    space = batch_space(env.single_action_space, env.num_envs)
    return [describe(a) for a in iterate(space, actions)]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
@pytest.mark.parametrize("act_kind", sorted(CASES))
def test_each_env_gets_what_iterate_yields(make_async, act_kind, shared_memory):
    vec = make_async([functools.partial(RecordingEnv, act_kind)] * N, shared_memory=shared_memory)
    vec.reset(seed=0)
    expected = [[] for _ in range(N)]
    for actions in CASES[act_kind]:
        vec.step(actions)
        for i, account in enumerate(expected_accounts(vec, actions)):
            expected[i].append(account)
    assert [list(r) for r in vec.get_attr("received")] == expected


def test_with_max_concurrency_too(make_async):
    vec = make_async([functools.partial(RecordingEnv, "box0")] * 3, max_concurrency=1)
    vec.reset(seed=0)
    actions = np.array([0.1, 0.2, 0.3])
    vec.step(actions)
    assert [list(r) for r in vec.get_attr("received")] == [[a] for a in expected_accounts(vec, actions)]


@pytest.mark.ours_only
def test_queued_actions_are_kept_and_checked_before_anything_is_sent(make_async):
    # max_concurrency sends some envs' actions later: they are copied at step_async (the caller
    # may reuse its array), and one that cannot travel is refused before any env is stepped
    vec = make_async([functools.partial(RecordingEnv, "box0")] * 3, max_concurrency=1)
    vec.reset(seed=0)
    actions = np.array([0.1, 0.2, 0.3])
    expected = [[a] for a in expected_accounts(vec, actions)]
    vec.step_async(actions)
    actions[:] = 9.0
    vec.step_wait()
    assert [list(r) for r in vec.get_attr("received")] == expected
    with pytest.raises(ValueError, match="cannot be pickled"):
        vec.step_async([0.5, 0.5, threading.Lock()])
    assert [list(r) for r in vec.get_attr("received")] == expected  # no env was stepped


@pytest.mark.ours_only
def test_with_partial_batches_and_envs_per_worker(make_async):
    vec = make_async([functools.partial(RecordingEnv, "discrete")] * 4, envs_per_worker=2, batch_size=2)
    vec.reset(seed=0)
    vec.send([2, 0], env_ids=[3, 0])  # Python ints, for envs 3 and 0
    vec.recv()
    vec.send(np.array([7, 1]), env_ids=[1, 2])  # one out of range
    vec.recv()
    received = [list(r) for r in vec.get_attr("received")]
    assert received == [[describe(0)], [describe(np.int64(7))], [describe(np.int64(1))], [describe(2)]]


def test_an_env_that_refuses_its_action_is_reported_as_gymnasium_does(make_async):
    # Env 1 raises for an action outside its space; the env's own exception comes back.
    vec = make_async([functools.partial(RecordingEnv, "discrete", strict=True)] * N)
    vec.reset(seed=0)
    vec.step(np.array([1, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium's report of the failed env
        with pytest.raises(ValueError, match=r"is outside Discrete\(3\)"):
            vec.step(np.array([0, 5]))
    if envs.REFERENCE:
        return  # gymnasium has shut that worker down
    # Ours: the env that raised needs a reset; then all goes on.
    vec.reset(seed=1)
    vec.step(np.array([2, 2]))
    assert [len(r) for r in vec.get_attr("received")] == [3, 3]


def test_what_iterate_refuses_is_raised_as_gymnasium_raises_it(make_async):
    # A Dict batch without one of the keys: iterate() raises KeyError before anything is sent.
    vec = make_async([functools.partial(RecordingEnv, "dict")] * N)
    vec.reset(seed=0)
    with pytest.raises(KeyError, match="'b'"):
        vec.step({"a": np.array([1, 2])})
    assert [list(r) for r in vec.get_attr("received")] == [[], []]
    good = vec.action_space.sample()
    vec.step(good)
    assert [list(r) for r in vec.get_attr("received")] == [[a] for a in expected_accounts(vec, good)]

