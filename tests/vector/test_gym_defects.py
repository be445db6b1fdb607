"""Defects of gymnasium 1.4's ``AsyncVectorEnv`` that ours must not have.

Every test is marked ``gym_defect``: under ``ENVMANAGER_CONFORMANCE_REFERENCE=1`` it becomes
``xfail(strict=True)``, so the suite proves each test really detects the defect on gymnasium.
The expected behaviour is always that of ``gymnasium.vector.SyncVectorEnv``.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from envs import assert_tree_equal, env_fn, env_fns, run_lockstep
from gymnasium.error import NoAsyncCallError
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

N = 3
pytestmark = pytest.mark.gym_defect


def test_a_reset_clears_pending_autoreset_without_shared_memory(make_async, make_sync):
    """(a) NEXT_STEP, shared_memory=False: an explicit reset() after an episode ended must cancel the
    pending autoreset.  gymnasium's worker only clears its ``autoreset`` flag inside
    ``if shared_memory:``, so the step after the reset is swallowed by a spurious env.reset()."""
    fns = [env_fn(fixed_len=2), env_fn(fixed_len=2), env_fn(fixed_len=5)]
    vec = make_async(fns, shared_memory=False, autoreset_mode=AutoresetMode.NEXT_STEP)
    ref = make_sync(fns, autoreset_mode=AutoresetMode.NEXT_STEP)
    actions = np.ones((N, 3), dtype=np.float32)
    assert_tree_equal(vec.reset(seed=0), ref.reset(seed=0), "reset")
    for t in range(2):
        out = vec.step(actions)
        assert_tree_equal(out, ref.step(actions), f"step {t}")
    assert list(out[2]) == [True, True, False]  # envs 0 and 1 have just finished
    assert_tree_equal(vec.reset(seed=1), ref.reset(seed=1), "explicit reset")
    out = vec.step(actions)
    assert_tree_equal(out, ref.step(actions), "first step after the explicit reset")
    assert out[1][0] != 0.0  # a real step (an autoreset would report reward 0)
    run_lockstep(vec, ref, steps=10, seed=None, action_seed=2)


@pytest.mark.parametrize("n_actions", [N - 1, N + 1], ids=["too-few", "too-many"])
@pytest.mark.parametrize("act_kind", ["discrete", "box"])
def test_b_wrong_number_of_actions_is_rejected_before_sending(make_async, make_sync, act_kind, n_actions):
    """(b) step() with a wrong number of actions must raise before any worker is sent a step.
    gymnasium sends to the first workers, then ``zip(..., strict=True)`` raises; the queued replies
    are returned by the following steps, so every later result is off by one step."""
    fns = env_fns(N, act_kind=act_kind)
    vec, ref = make_async(fns), make_sync(fns)
    assert_tree_equal(vec.reset(seed=0), ref.reset(seed=0))
    run_lockstep(vec, ref, steps=2, seed=None, action_seed=0)
    bad = batch_space(ref.single_action_space, n_actions).sample()
    with pytest.raises(ValueError):  # gymnasium's own: zip(strict=True) after sending
        vec.step(bad)
    run_lockstep(vec, ref, steps=20, seed=None, action_seed=1)
    assert vec.get_attr("step_count") == ref.get_attr("step_count")


def test_c_no_stale_result_after_step_wait_timeout(make_async, make_sync, gates):
    """(c) After ``step_wait(timeout=...)`` raised ``multiprocessing.TimeoutError``, no later call may
    return the late replies of that step as if they were the results of another step.

    Correct behaviour (either design is accepted):
    * the timed-out step stays pending: ``step_wait()`` then returns *its* results; or
    * it is abandoned: ``step_wait()`` raises ``NoAsyncCallError`` (its actions were still applied).
    In both cases the following ``step(a2)`` returns the results of ``a2``, as SyncVectorEnv does
    after ``step(a1); step(a2)``.  gymnasium abandons the step but leaves the late replies in the
    pipes, so ``step(a2)`` returns the results of ``a1``."""
    gate = gates()
    vec = make_async([env_fn(), env_fn(step_gate=gate.path), env_fn()])
    ref = make_sync(env_fns(N))
    assert_tree_equal(vec.reset(seed=0), ref.reset(seed=0))
    space = batch_space(ref.single_action_space, N)
    space.seed(0)
    a1, a2 = space.sample(), space.sample()
    vec.step_async(a1)
    with pytest.raises(multiprocessing.TimeoutError):
        vec.step_wait(timeout=0.2)  # env 1 cannot finish: its gate is closed
    gate.open()
    expected1, expected2 = ref.step(a1), ref.step(a2)
    try:
        late = vec.step_wait()
    except NoAsyncCallError:
        late = None
    if late is not None:
        assert_tree_equal(late, expected1, "completing the timed-out step")
    assert_tree_equal(vec.step(a2), expected2, "the step after the timeout")
    run_lockstep(vec, ref, steps=10, seed=None, action_seed=1)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
def test_d_disabled_mode_rejects_stepping_a_finished_env(make_async, make_sync, shared_memory):
    """(d) DISABLED autoreset: stepping an env whose episode ended, without resetting it, must raise
    ``AssertionError`` like SyncVectorEnv (and, being rejected before sending, change nothing).
    gymnasium's worker asserts on an ``autoreset`` flag it never sets in this mode, so it steps on."""
    mode = AutoresetMode.DISABLED
    fns = [env_fn(fixed_len=2), env_fn(fixed_len=4), env_fn(fixed_len=4)]
    vec = make_async(fns, shared_memory=shared_memory, autoreset_mode=mode)
    ref = make_sync(fns, autoreset_mode=mode)
    actions = np.ones((N, 3), dtype=np.float32)
    assert_tree_equal(vec.reset(seed=0), ref.reset(seed=0))
    for t in range(2):
        out = vec.step(actions)
        assert_tree_equal(out, ref.step(actions), f"step {t}")
    assert list(out[2]) == [True, False, False]
    with pytest.raises(AssertionError):
        ref.step(actions)  # SyncVectorEnv's behaviour; env 0 is checked first, so nothing stepped
    with pytest.raises(AssertionError):
        vec.step(actions)
    mask = np.array([True, False, False])
    assert_tree_equal(
        vec.reset(options={"reset_mask": mask.copy()}), ref.reset(options={"reset_mask": mask.copy()})
    )
    for t in range(2):
        assert_tree_equal(vec.step(actions), ref.step(actions), f"step {t} after the masked reset")
