"""Misuse of ``AsyncVectorEnv`` fails with gymnasium 1.4's exception classes and messages.

Run with ``ENVMANAGER_CONFORMANCE_REFERENCE=1`` the same scenarios run on gymnasium's own
``AsyncVectorEnv``, which checks the expected messages below are really gymnasium's.
"""

from __future__ import annotations

import functools
import re
import warnings

import envs
import gymnasium
import numpy as np
import pytest
from envs import assert_tree_equal, env_fn, env_fns
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError, ResetNeeded

N = 2


@pytest.mark.parametrize("scalar", [1, np.int64(1), np.array(1)])
def test_scalar_action_is_a_type_error(make_async, make_sync, scalar):
    fns = env_fns(N)
    vec, ref = make_async(fns), make_sync(fns)
    assert_tree_equal(vec.reset(seed=0), ref.reset(seed=0))
    with pytest.raises(TypeError, match=r"^Unable to iterate over the following elements: 1$"):
        vec.step(scalar)
    actions = vec.action_space.sample()  # nothing was sent: stepping goes on
    assert_tree_equal(vec.step(actions), ref.step(actions))


def test_step_before_reset_is_reset_needed(make_async, make_sync):
    # gymnasium raises it from the OrderEnforcing wrapper that gymnasium.make adds (in the
    # worker); ours raises it for any env, before anything is sent.
    fns = [functools.partial(gymnasium.make, "CartPole-v1") for _ in range(N)]
    vec, ref = make_async(fns), make_sync(fns)
    actions = vec.action_space.sample()
    with pytest.raises(ResetNeeded, match=r"^Cannot call env\.step\(\) before calling env\.reset\(\)$"):
        vec.step(actions)
    if envs.REFERENCE:
        return  # gymnasium found out in the worker, and has closed its pipe
    # Ours refuses before anything is sent: the envs are untouched and work on.
    assert_tree_equal(vec.reset(seed=1), ref.reset(seed=1))
    assert_tree_equal(vec.step(actions), ref.step(actions))


def test_envs_without_order_enforcing_are_stepped_before_reset(make_async):
    # gymnasium's test_async_vector_subenv_error steps envs never reset: only OrderEnforcing
    # (which gymnasium.make adds) refuses that, in the env. Envs already reset by their
    # factory are stepped too.
    fns = [*env_fns(N, max_len=None), functools.partial(envs.order_enforced_env, reset=True, max_len=None)]
    vec = make_async(fns)
    vec.step(vec.action_space.sample())
    assert vec.get_attr("step_count") == (1, 1, 1)


def test_order_enforcing_env_among_others_refuses_the_step(make_async):
    fns = [functools.partial(envs.order_enforced_env, max_len=None), *env_fns(N, max_len=None)]
    vec = make_async(fns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium reports the env that raised
        with pytest.raises(ResetNeeded, match=r"^Cannot call env\.step\(\) before calling env\.reset\(\)$"):
            vec.step(vec.action_space.sample())
    if envs.REFERENCE:
        return  # gymnasium stepped the others, and shut the refusing worker down
    assert vec.get_attr("step_count") == (0, 0, 0)  # ours refused before sending anything
    vec.reset(seed=0)
    vec.step(vec.action_space.sample())
    assert vec.get_attr("step_count") == (1, 1, 1)


@pytest.mark.parametrize("pending, attempt, message", [
    ("reset", "reset_async", "Calling `reset_async` while waiting for a pending call to `reset` to complete"),
    ("step", "reset_async", "Calling `reset_async` while waiting for a pending call to `step` to complete"),
    ("step", "step_async", "Calling `step_async` while waiting for a pending call to `step` to complete."),
    ("reset", "step_async", "Calling `step_async` while waiting for a pending call to `reset` to complete."),
    ("step", "call_async", "Calling `call_async` while waiting for a pending call to `step` to complete."),
    ("call", "call_async", "Calling `call_async` while waiting for a pending call to `call` to complete."),
    ("step", "get_attr", "Calling `call_async` while waiting for a pending call to `step` to complete."),
    ("reset", "set_attr", "Calling `set_attr` while waiting for a pending call to `reset` to complete."),
])
def test_already_pending_messages(make_async, pending, attempt, message):
    vec = make_async(env_fns(N))
    vec.reset(seed=0)
    actions = vec.action_space.sample()
    start = {"step": lambda: vec.step_async(actions), "reset": lambda: vec.reset_async(seed=2),
             "call": lambda: vec.call_async("counts")}
    calls = {"reset_async": lambda: vec.reset_async(), "step_async": lambda: vec.step_async(actions),
             "call_async": lambda: vec.call_async("counts"), "get_attr": lambda: vec.get_attr("tag"),
             "set_attr": lambda: vec.set_attr("tag", 1)}
    start[pending]()
    with pytest.raises(AlreadyPendingCallError) as excinfo:
        calls[attempt]()
    assert str(excinfo.value) == message and excinfo.value.name == pending
    {"step": vec.step_wait, "reset": vec.reset_wait, "call": vec.call_wait}[pending]()  # still pending


@pytest.mark.parametrize("wait, before, message", [
    ("step_wait", None, "Calling `step_wait` without any prior call to `step_async`."),
    ("reset_wait", None, "Calling `reset_wait` without any prior call to `reset_async`."),
    ("call_wait", None, "Calling `call_wait` without any prior call to `call_async`."),
    ("step_wait", "reset", "Calling `step_wait` without any prior call to `step_async`."),
    ("call_wait", "step", "Calling `call_wait` without any prior call to `call_async`."),
])
def test_no_async_call_messages(make_async, wait, before, message):
    vec = make_async(env_fns(N))
    vec.reset(seed=0)
    actions = vec.action_space.sample()
    if before == "reset":
        vec.reset_async(seed=1)
    elif before == "step":
        vec.step_async(actions)
    with pytest.raises(NoAsyncCallError) as excinfo:
        getattr(vec, wait)()
    assert str(excinfo.value) == message
    if before is not None:
        {"reset": vec.reset_wait, "step": vec.step_wait}[before]()  # the pending call is unaffected


@pytest.mark.parametrize("pending", ["step", "reset"])
def test_close_while_pending_warns(make_async, pending):
    vec = make_async(env_fns(N))
    vec.reset(seed=0)
    if pending == "step":
        vec.step_async(vec.action_space.sample())
    else:
        vec.reset_async(seed=1)
    with pytest.warns(UserWarning, match=f"Calling `close` while waiting for a pending call to `{pending}` to complete."):
        vec.close(terminate=True)


def test_envs_that_raise_are_reported_as_gymnasium_does(make_async):
    # Envs 1 and 2 raise on their first step: each is reported (two warnings), then the last
    # exception is raised, the env's own class (gymnasium's test_async_vector_subenv_error).
    fns = [env_fn()] + [env_fn(fail_at_step=1)] * 2
    vec = make_async(fns)
    vec.reset(seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="boom at step 1"):
            vec.step(vec.action_space.sample())
    messages = [str(w.message.args[0]) for w in caught if w.category is UserWarning]
    assert len(messages) == 5, messages
    for received, trace in (messages[0:2], messages[2:4]):
        assert re.match(r"\x1b\[31mERROR: Received the following error from Worker-[12] - Shutting it down\x1b\[0m", received)
        assert re.match(r"\x1b\[31mERROR: Traceback \(most recent call last\):(?s:.)*ValueError: boom at step 1\n\x1b\[0m", trace)
    assert sorted(m.split("Worker-")[1][0] for m in messages[0:4:2]) == ["1", "2"]
    assert messages[4] == "\x1b[31mERROR: Raising the last exception back to the main process.\x1b[0m"
