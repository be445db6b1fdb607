"""Conformance of the ``AsyncVectorEnv`` under test with gymnasium 1.4's vector API.

Behaviour is compared step by step with ``gymnasium.vector.SyncVectorEnv`` (same seeds, same
actions); the implementation is chosen by the ``impl`` fixture (see conftest.py).
"""

from __future__ import annotations

import copy
import gc
import inspect
import multiprocessing
import os
import subprocess
import sys

import envs
import gymnasium
import numpy as np
import pytest
from envs import assert_tree_equal, env_fn, env_fns, run_lockstep, worker_children
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

N = 3
MODES = list(AutoresetMode)
# every observation kind and every action kind appears once
PAIRS = [
    ("box", "discrete"),
    ("discrete", "box"),
    ("multidiscrete", "multibinary"),
    ("multibinary", "multidiscrete"),
    ("dict", "tuple"),
    ("tuple", "dict"),
]


# --------------------------------------------------------------------------- step-by-step equality


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
@pytest.mark.parametrize("obs_kind,act_kind", PAIRS, ids=[f"{o}-{a}" for o, a in PAIRS])
def test_lockstep_equals_sync(make_async, make_sync, obs_kind, act_kind, mode, shared_memory):
    fns = env_fns(N, obs_kind=obs_kind, act_kind=act_kind)
    vec = make_async(fns, shared_memory=shared_memory, autoreset_mode=mode)
    run_lockstep(vec, make_sync(fns, autoreset_mode=mode), mode, min_done=5)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_lockstep_copy_false(make_async, make_sync, mode, shared_memory):
    fns = env_fns(N, obs_kind="dict", act_kind="box")
    vec = make_async(fns, shared_memory=shared_memory, copy=False, autoreset_mode=mode)
    run_lockstep(vec, make_sync(fns, copy=False, autoreset_mode=mode), mode)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
@pytest.mark.parametrize("obs_kind", ["box", "dict", "tuple"])
def test_copy_true_returns_independent_observations(make_async, obs_kind, shared_memory):
    vec = make_async(env_fns(N, obs_kind=obs_kind, max_len=None), shared_memory=shared_memory, copy=True)
    obs0, _ = vec.reset(seed=1)
    saved0 = copy.deepcopy(obs0)
    actions = vec.action_space.sample()
    obs1 = vec.step(actions)[0]
    saved1 = copy.deepcopy(obs1)
    vec.step(actions)
    vec.reset(seed=2)
    assert_tree_equal(obs0, saved0, "reset obs mutated by later calls")
    assert_tree_equal(obs1, saved1, "step obs mutated by later calls")
    with pytest.raises(AssertionError):  # the observations really changed between calls
        assert_tree_equal(obs1, saved0)


def _leaves(tree):
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, tuple):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
@pytest.mark.parametrize("obs_kind", ["box", "dict", "tuple"])
def test_copy_false_returns_the_same_arrays_each_call(make_async, make_sync, obs_kind, shared_memory):
    """``copy=False``: every reset and step returns the vector env's own arrays, overwritten by
    the next call (gymnasium's ``observations``, as ``SyncVectorEnv``'s), not new ones."""
    fns = env_fns(N, obs_kind=obs_kind)
    vec, ref = make_async(fns, shared_memory=shared_memory, copy=False), make_sync(fns, copy=False)
    first = _leaves(vec.reset(seed=1)[0])
    ref.reset(seed=1)
    vec.action_space.seed(2)
    for t in range(3):
        actions = vec.action_space.sample()
        obs = vec.step(actions)[0]
        assert all(a is b for a, b in zip(_leaves(obs), first, strict=True)), f"step {t}: new arrays"
        assert_tree_equal(obs, ref.step(actions)[0], f"step {t}")
    assert all(a is b for a, b in zip(_leaves(vec.reset(seed=3)[0]), first, strict=True)), "reset: new arrays"


_READ_AFTER_CLOSE = """
import sys
import numpy as np
import envs
from envs import env_fns
from test_gym_conformance import _leaves as leaves

if envs.REFERENCE:
    from gymnasium.vector import AsyncVectorEnv
else:
    from envmanager import AsyncVectorEnv

vec = AsyncVectorEnv(env_fns(3, obs_kind=sys.argv[1]), copy=False)
vec.reset(seed=1)
vec.action_space.seed(2)
obs = vec.step(vec.action_space.sample())[0]
before = [np.array(leaf, copy=True) for leaf in leaves(obs)]
vec.close()
after = [np.array(leaf, copy=True) for leaf in leaves(obs)]  # (unmapped memory: SIGSEGV here)
assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)), "values changed at close"
print("read after close")
"""


@pytest.mark.parametrize("obs_kind", ["box", "dict"])
def test_copy_false_observations_stay_readable_after_close(obs_kind):
    """``copy=False`` with shared memory: the observations the last step returned (views of the
    vector env's memory) still read their values once it is closed, as gymnasium's do (its
    ``ctx.Array`` lives while a view does). Ours unmapped the memory at close: reading them
    then killed the process with SIGSEGV, so this runs in a process of its own."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", _READ_AFTER_CLOSE, obs_kind], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    assert "read after close" in done.stdout


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_lockstep_other_start_methods(make_async, make_sync, context):
    if context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{context} unavailable")
    fns = env_fns(2, obs_kind="dict", act_kind="multidiscrete")
    run_lockstep(make_async(fns, context=context), make_sync(fns), steps=30)


def test_lockstep_daemon_false_and_max_concurrency(make_async, make_sync):
    fns = env_fns(N, obs_kind="tuple", act_kind="discrete")
    vec = make_async(fns, daemon=False, max_concurrency=1, autoreset_mode="SameStep")
    assert vec.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    run_lockstep(vec, make_sync(fns, autoreset_mode="SameStep"), AutoresetMode.SAME_STEP)


@pytest.mark.parametrize(
    "mode,shared_memory",
    [(m, s) for m in MODES for s in (True, False) if (m, s) != (AutoresetMode.NEXT_STEP, False)],
    ids=lambda v: v.name if isinstance(v, AutoresetMode) else ("shm" if v else "pipe"),
)
def test_explicit_reset_after_episode_end(make_async, make_sync, mode, shared_memory):
    """An explicit reset() after an env finished starts fresh episodes (NEXT_STEP+pipe: see defects)."""
    fns = [env_fn(fixed_len=2), env_fn(fixed_len=2), env_fn(fixed_len=5)]
    vec = make_async(fns, shared_memory=shared_memory, autoreset_mode=mode)
    ref = make_sync(fns, autoreset_mode=mode)
    actions = np.zeros((N, 3), dtype=np.float32)
    for round_ in range(3):
        assert_tree_equal(vec.reset(seed=round_), ref.reset(seed=round_), f"round {round_} reset")
        for t in range(2):  # envs 0 and 1 end their episode on the 2nd step
            out = vec.step(actions + t)
            assert_tree_equal(out, ref.step(actions + t), f"round {round_} step {t}")
        assert list(out[2]) == [True, True, False]


# --------------------------------------------------------------------------- constructor, attributes


def test_same_step_infos_in_async_vector_envs_key_order(make_async):
    """An env that ended in a same-step autoreset: its ``final_info`` comes before its
    ``final_obs`` in the infos, as ``AsyncVectorEnv``'s worker builds them (``SyncVectorEnv``
    the other way round)."""
    vec = make_async([lambda: gymnasium.make("CartPole-v1")] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
    vec.reset(seed=0)
    for _ in range(200):  # one action always: CartPole falls within a few dozen steps
        infos = vec.step(np.zeros(2, np.int64))[4]
        if "final_obs" in infos:
            break
    assert list(infos) == ["final_info", "_final_info", "final_obs", "_final_obs"]


def test_constructor_signature_matches_gymnasium(impl):
    ours = inspect.signature(impl).parameters
    theirs = inspect.signature(gymnasium.vector.AsyncVectorEnv).parameters
    for name in ("env_fns", "shared_memory", "copy", "context", "daemon", "worker",
                 "observation_mode", "autoreset_mode", "max_concurrency"):
        assert name in ours, f"missing constructor argument {name!r}"
        assert ours[name].default == theirs[name].default, f"default of {name!r} differs"


def test_attributes_match_sync(make_async, make_sync):
    fns = env_fns(N, obs_kind="dict", act_kind="tuple", render_mode="rgb_array")
    vec = make_async(fns, shared_memory=True, copy=True, context=None, daemon=True, worker=None,
                     observation_mode="same", autoreset_mode=AutoresetMode.SAME_STEP, max_concurrency=2)
    ref = make_sync(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    assert vec.num_envs == N
    assert vec.single_observation_space == ref.single_observation_space
    assert vec.single_action_space == ref.single_action_space
    assert vec.observation_space == ref.observation_space
    assert vec.action_space == ref.action_space
    assert vec.metadata == ref.metadata
    assert vec.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
    assert vec.render_mode == ref.render_mode == "rgb_array"
    assert vec.spec == ref.spec
    assert vec.closed is False
    vec.close()
    assert vec.closed is True


@pytest.mark.parametrize(
    "kwargs", [{"max_concurrency": 0}, {"max_concurrency": "2"}, {"observation_mode": "bogus"}],
    ids=["concurrency0", "concurrency-str", "obs-mode"],
)
def test_invalid_constructor_arguments_raise_value_error(impl, kwargs):
    with pytest.raises(ValueError):
        impl(env_fns(2), **kwargs)
    gc.collect()
    assert worker_children() == []


@pytest.mark.parametrize("which", ["observation", "action"])
def test_mismatched_spaces_raise_runtime_error(impl, which):
    other = {"obs_kind": "discrete"} if which == "observation" else {"act_kind": "discrete"}
    with pytest.raises(RuntimeError) as excinfo:
        impl([env_fn(), env_fn(**other)])
    del excinfo
    gc.collect()  # gymnasium reaps its already-started workers in __del__
    assert worker_children() == []


def test_observation_mode_different(make_async, make_sync):
    fns = [env_fn(obs_high=h) for h in (1.0, 2.0, 3.0)]
    with pytest.raises(RuntimeError):
        make_sync(fns)  # really different spaces
    vec = make_async(fns, observation_mode="different")
    ref = make_sync(fns, observation_mode="different")
    assert vec.observation_space == ref.observation_space
    assert vec.single_observation_space == ref.single_observation_space
    run_lockstep(vec, ref, steps=30)


def test_custom_space_without_shared_memory(make_async, make_sync):
    fns = [envs.TokenEnv for _ in range(N)]
    vec = make_async(fns, shared_memory=False)
    ref = make_sync(fns)
    assert vec.observation_space == ref.observation_space
    run_lockstep(vec, ref, steps=20)


def test_custom_space_with_shared_memory_raises_value_error(impl):
    with pytest.raises(ValueError):
        impl([envs.TokenEnv for _ in range(2)], shared_memory=True)
    gc.collect()
    assert worker_children() == []


# --------------------------------------------------------------------------- reset / step / call


def test_reset_seeds_and_options(make_async, make_sync):
    fns = env_fns(N, obs_kind="tuple")
    vec, ref = make_async(fns), make_sync(fns)
    assert_tree_equal(vec.reset(seed=7), ref.reset(seed=7), "seed=int")
    assert vec.np_random_seed == ref.np_random_seed == (7, 8, 9)
    assert_tree_equal(vec.reset(seed=[5, 9, 2]), ref.reset(seed=[5, 9, 2]), "seed=list")
    assert vec.np_random_seed == (5, 9, 2)
    obs, info = vec.reset(seed=3, options={"offset": 4})
    assert_tree_equal((obs, info), ref.reset(seed=3, options={"offset": 4}), "options")
    assert list(info["offset"]) == [4, 4, 4] and info["_offset"].all()
    vec.reset_async(seed=11, options={"offset": 1})
    assert_tree_equal(vec.reset_wait(), ref.reset(seed=11, options={"offset": 1}), "reset_async/wait")
    with pytest.raises(ValueError):
        vec.reset(seed=[1, 2])
    for seed in (np.int64(3), 3.0, (s for s in [1, 2, 3])):  # an int or a list, nothing else
        with pytest.raises(TypeError):
            vec.reset(seed=seed)
        with pytest.raises(TypeError):
            ref.reset(seed=seed)
    assert_tree_equal(vec.reset(seed=4), ref.reset(seed=4), "after bad seed list")


def test_step_async_wait_equals_step(make_async, make_sync):
    fns = env_fns(N, obs_kind="multidiscrete", act_kind="dict")
    vec, ref = make_async(fns), make_sync(fns)
    assert_tree_equal(vec.reset(seed=0), ref.reset(seed=0))
    space = batch_space(ref.single_action_space, N)
    space.seed(0)
    for t in range(30):
        actions = space.sample()
        vec.step_async(actions)
        assert_tree_equal(vec.step_wait(), ref.step(actions), f"step {t}")


def test_call_get_attr_set_attr(make_async, make_sync):
    fns = env_fns(N, max_len=None)
    vec, ref = make_async(fns), make_sync(fns)
    vec.reset(seed=0), ref.reset(seed=0)
    for _ in range(4):
        actions = vec.action_space.sample()
        vec.step(actions), ref.step(actions)
    assert vec.call("counts") == ref.call("counts") == ((1, 4),) * N
    assert vec.call("add", 1, y=2) == ref.call("add", 1, y=2) == ((3, 4),) * N
    assert vec.call("reset_count") == (1,) * N  # a non-callable attribute is returned as is
    vec.call_async("add", 5)
    assert vec.call_wait() == ((5, 4),) * N
    assert vec.get_attr("step_count") == ref.get_attr("step_count") == (4,) * N
    vec.set_attr("tag", "x")
    assert vec.get_attr("tag") == ("x",) * N
    vec.set_attr("tag", [1, 2, 3])
    assert vec.get_attr("tag") == (1, 2, 3)
    vec.set_attr("tag", (4, 5, 6))
    assert vec.get_attr("tag") == (4, 5, 6)
    with pytest.raises(ValueError):
        vec.set_attr("tag", [1, 2])
    assert vec.get_attr("tag") == (4, 5, 6)


def test_render_rgb_array(make_async, make_sync):
    fns = env_fns(N, render_mode="rgb_array")
    vec, ref = make_async(fns), make_sync(fns)
    vec.reset(seed=0), ref.reset(seed=0)
    for _ in range(3):
        actions = vec.action_space.sample()
        vec.step(actions), ref.step(actions)
    frames = vec.render()
    assert_tree_equal(tuple(frames), ref.render())
    assert frames[0].shape == (4, 5, 3) and frames[0].dtype == np.uint8


def test_env_exception_reaches_caller(make_async):
    vec = make_async([env_fn(), env_fn(fail_at_step=3), env_fn()])
    vec.reset(seed=0)
    actions = vec.action_space.sample()
    vec.step(actions), vec.step(actions)
    with pytest.raises(ValueError, match="boom at step 3"):
        vec.step(actions)
    vec.close()
    assert vec.closed


# --------------------------------------------------------------------------- state machine errors


@pytest.mark.parametrize("pending", ["step", "reset", "call"])
def test_already_pending_call_error(make_async, make_sync, pending):
    fns = env_fns(N)
    vec, ref = make_async(fns), make_sync(fns)
    assert_tree_equal(vec.reset(seed=0), ref.reset(seed=0))
    actions = vec.action_space.sample()
    start = {"step": lambda: vec.step_async(actions),
             "reset": lambda: vec.reset_async(seed=5),
             "call": lambda: vec.call_async("counts")}
    start[pending]()
    attempts = [lambda: vec.step_async(actions), lambda: vec.reset_async(seed=1),
                lambda: vec.call_async("counts"), lambda: vec.set_attr("tag", 1)]
    for attempt in attempts:
        with pytest.raises(AlreadyPendingCallError) as excinfo:
            attempt()
        assert excinfo.value.name == pending
    # the pending call is unaffected
    if pending == "step":
        assert_tree_equal(vec.step_wait(), ref.step(actions))
    elif pending == "reset":
        assert_tree_equal(vec.reset_wait(), ref.reset(seed=5))
    else:
        assert vec.call_wait() == ((1, 0),) * N
    assert vec.get_attr("tag") == ("untagged",) * N


def test_no_async_call_error(make_async, make_sync):
    fns = env_fns(N)
    vec, ref = make_async(fns), make_sync(fns)
    for wait in (vec.step_wait, vec.reset_wait, vec.call_wait):
        with pytest.raises(NoAsyncCallError):
            wait()
    vec.reset_async(seed=3)
    for wait in (vec.step_wait, vec.call_wait):
        with pytest.raises(NoAsyncCallError):
            wait()
    assert_tree_equal(vec.reset_wait(), ref.reset(seed=3))
    actions = vec.action_space.sample()
    vec.step_async(actions)
    with pytest.raises(NoAsyncCallError):
        vec.reset_wait()
    assert_tree_equal(vec.step_wait(), ref.step(actions))


def test_closed_environment_error_and_double_close(make_async):
    vec = make_async(env_fns(N))
    vec.reset(seed=0)
    actions = vec.action_space.sample()
    vec.close()
    assert vec.closed
    vec.close()  # a second close is a no-op
    assert vec.closed
    calls = [lambda: vec.reset(), lambda: vec.reset_async(), lambda: vec.step(actions),
             lambda: vec.step_async(actions), vec.step_wait, vec.reset_wait,
             lambda: vec.call("counts"), vec.call_wait, lambda: vec.get_attr("tag"),
             lambda: vec.set_attr("tag", 1), vec.render]
    for call in calls:
        with pytest.raises(ClosedEnvironmentError):
            call()
    assert worker_children() == []


# --------------------------------------------------------------------------- timeouts and close


@pytest.mark.parametrize("what", ["step", "reset", "call"])
def test_wait_timeout_raises_multiprocessing_timeout_error(make_async, gates, what):
    gate = gates()
    slow = {"step": {"step_gate": gate.path}, "reset": {"reset_gate": gate.path}, "call": {}}[what]
    vec = make_async([env_fn(), env_fn(**slow), env_fn()])
    if what != "reset":
        vec.reset(seed=0)
    if what == "step":
        vec.step_async(vec.action_space.sample())
        wait = vec.step_wait
    elif what == "reset":
        vec.reset_async(seed=0)
        wait = vec.reset_wait
    else:
        vec.call_async("wait_then", gate.path, 1)
        wait = vec.call_wait
    with pytest.raises(multiprocessing.TimeoutError):
        wait(timeout=0.2)  # the gate is closed: no result can arrive in time
    gate.open()


@pytest.mark.ours_only
@pytest.mark.parametrize("max_concurrency", [None, 1])
def test_reset_wait_after_a_timeout_returns_the_whole_reset(make_async, make_sync, gates, max_concurrency):
    gate = gates()
    vec = make_async([env_fn(), env_fn(reset_gate=gate.path), env_fn()], max_concurrency=max_concurrency)
    vec.reset_async(seed=0)
    with pytest.raises(multiprocessing.TimeoutError):
        vec.reset_wait(timeout=0.2)
    gate.open()
    assert_tree_equal(vec.reset_wait(), make_sync(env_fns(N)).reset(seed=0), "the resumed reset_wait")


@pytest.mark.parametrize("pending_step", [False, True])
def test_close_terminate(make_async, gates, pending_step):
    gate = gates()
    vec = make_async([env_fn(), env_fn(step_gate=gate.path)])
    vec.reset(seed=0)
    if pending_step:
        vec.step_async(vec.action_space.sample())
    vec.close(terminate=True)
    assert vec.closed
    assert worker_children() == []


def test_close_with_timeout_terminates_stuck_worker(make_async, gates):
    gate = gates()  # never opened while the env is alive
    vec = make_async([env_fn(), env_fn(step_gate=gate.path)])
    vec.reset(seed=0)
    vec.step_async(vec.action_space.sample())
    vec.close(timeout=0.2)
    assert vec.closed
    assert worker_children() == []


def test_close_waits_for_pending_step(make_async, make_sync):
    vec = make_async(env_fns(N))
    vec.reset(seed=0)
    vec.step_async(vec.action_space.sample())
    vec.close()
    assert vec.closed
    assert worker_children() == []


# --------------------------------------------------------------------------- envmanager extensions
# Not part of gymnasium's API; skipped under the reference flag.  Assumed API (EnvPool style):
#   AsyncVectorEnv(env_fns, envs_per_worker=k): k envs share one worker process, results unchanged.
#   AsyncVectorEnv(env_fns, batch_size=B): after reset(), send(actions, env_ids=None) queues one step
#   per listed env (None = all envs, len(actions) == len(env_ids)); recv() blocks until B of the
#   stepping envs have finished and returns (obs, rewards, terminations, truncations, infos) for
#   exactly those B, row k belonging to env infos["env_id"][k]; sending to an env whose result has
#   not been received yet is rejected before anything is sent.


@pytest.mark.ours_only
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipe"])
@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_envs_per_worker_equals_sync(make_async, make_sync, mode, shared_memory):
    fns = env_fns(4, obs_kind="dict", act_kind="multidiscrete")
    vec = make_async(fns, envs_per_worker=2, shared_memory=shared_memory, autoreset_mode=mode)
    run_lockstep(vec, make_sync(fns, autoreset_mode=mode), mode, min_done=5)
    assert len(worker_children(grace=0)) == 2  # 4 envs, 2 per worker process


@pytest.mark.ours_only
@pytest.mark.parametrize("limit", [1, 3])
def test_max_concurrency_with_envs_per_worker_equals_sync(make_async, make_sync, limit):
    fns = env_fns(4)
    vec = make_async(fns, envs_per_worker=2, max_concurrency=limit)
    run_lockstep(vec, make_sync(fns), steps=30)


class Pool:
    """Bookkeeping around send/recv: which envs are in flight, which action each was sent."""

    def __init__(self, vec, n):
        self.vec, self.in_flight, self.sent, self.last = vec, set(), [0] * n, {}
        self.space = vec.single_action_space
        self.space.seed(0)

    def send(self, ids=None):
        targets = list(range(len(self.sent))) if ids is None else [int(i) for i in ids]
        actions = np.stack([self.space.sample() for _ in targets])
        if ids is None:
            self.vec.send(actions)
        else:
            self.vec.send(actions, np.asarray(targets))
        for i, a in zip(targets, actions, strict=True):
            self.in_flight.add(i)
            self.sent[i] += 1
            self.last[i] = a

    def recv(self, batch):
        obs, rewards, terms, truncs, infos = self.vec.recv()
        ids = [int(i) for i in infos["env_id"]]
        assert len(ids) == batch == len(set(ids)) == len(rewards) == len(terms) == len(truncs) == len(obs)
        for i in ids:
            assert i in self.in_flight, f"env {i} returned a result without having been sent an action"
            self.in_flight.remove(i)
        return ids, obs, rewards, terms, truncs


@pytest.mark.ours_only
def test_partial_batches_match_per_env_trajectories(make_async, make_sync):
    n, batch = 4, 2
    fns = env_fns(n)
    vec = make_async(fns, batch_size=batch)
    refs = [make_sync([fn]) for fn in fns]
    obs, _ = vec.reset(seed=10)
    for i, ref in enumerate(refs):
        assert_tree_equal(obs[i], ref.reset(seed=10 + i)[0][0], f"reset env {i}")
    pool = Pool(vec, n)

    def recv_and_check(where):
        ids, obs, rewards, terms, truncs = pool.recv(batch)
        assert obs.shape == (batch, 3)
        for k, i in enumerate(ids):
            e_obs, e_rew, e_term, e_trunc, _ = refs[i].step(pool.last[i][None])
            assert_tree_equal((obs[k], rewards[k], terms[k], truncs[k]),
                              (e_obs[0], e_rew[0], e_term[0], e_trunc[0]), f"{where} env {i}")
        return ids

    pool.send()
    for round_ in range(40):
        pool.send(recv_and_check(f"round {round_}"))
    while pool.in_flight:
        recv_and_check("drain")
    expected_counts = tuple(ref.get_attr("step_count")[0] for ref in refs)
    assert vec.get_attr("step_count") == expected_counts
    assert vec.get_attr("reset_count") == tuple(ref.get_attr("reset_count")[0] for ref in refs)
    assert sum(pool.sent) == n + 40 * batch


@pytest.mark.ours_only
def test_partial_batches_return_ready_envs_first(make_async, gates):
    n, batch = 4, 2
    gate = gates()
    fns = [env_fn(max_len=None, step_gate=gate.path if i >= 2 else None) for i in range(n)]
    # A process steps its envs one after another: a gated env holds the envs packed with it, so
    # each gets a process (auto measures env 0, which is quick and even, and would pack them).
    vec = make_async(fns, batch_size=batch, envs_per_worker=1)
    vec.reset(seed=0)
    pool = Pool(vec, n)
    pool.send()
    with pytest.raises(ValueError, match="not received yet"):  # env 2 is still stepping: rejected, nothing sent
        vec.send(np.zeros((1, 3), dtype=np.float32), np.array([2]))
    for _ in range(3):  # envs 2 and 3 wait at their gate, so only 0 and 1 can come back
        ids, obs, *_ = pool.recv(batch)
        assert sorted(ids) == [0, 1]
        for k, i in enumerate(ids):
            assert obs[k][0] == pool.sent[i] % 10  # the observation of this env's latest step
        pool.send(ids)
    gate.open()
    returned = []
    while pool.in_flight:  # every env in flight comes back exactly once
        ids, obs, *_ = pool.recv(batch)
        returned += ids
        for k, i in enumerate(ids):
            assert obs[k][0] == pool.sent[i] % 10
    assert sorted(returned) == [0, 1, 2, 3]
    assert pool.sent == [4, 4, 1, 1]
    assert vec.get_attr("step_count") == tuple(pool.sent)


def _made_holding(lock, data, make):
    """An env fn closing over what does not pickle (a lock: a trainer's ``self``, a logger) and
    over data (a dataset): the env reads the data when it is made."""
    with lock:
        env = make()
    env.data_sum = float(data.sum())
    return env


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_env_fns_are_inherited_not_pickled_under_fork(make_async, make_sync):
    """gymnasium never pickles its env fns under fork: one closing over a lock works, and a
    dataset it holds is the parent's, shared copy-on-write rather than copied into each worker."""
    import functools
    import threading

    from envmanager.wire import factory

    kept = len(factory._INHERITED)
    lock, data = threading.Lock(), np.arange(10.0)
    fns = [functools.partial(_made_holding, lock, data, f) for f in env_fns(N, fixed_len=3)]
    vec = make_async(fns, context="fork")
    run_lockstep(vec, make_sync(fns), steps=8)
    assert list(vec.get_attr("data_sum")) == [45.0] * N
    vec.close()
    assert len(factory._INHERITED) == kept  # the drop-in forgot it when it closed


class _OptionsRequired(gymnasium.Env):
    """``reset(self, *, seed=None, options)``: gymnasium's vector envs always pass ``options=``."""

    observation_space = gymnasium.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options):
        super().reset(seed=seed)
        return np.full(2, self.np_random.uniform(-1, 1), np.float32), {"options": options}

    def step(self, action):
        return np.zeros(2, np.float32), 1.0, False, False, {}


def test_reset_always_passes_options_even_when_none(make_async, make_sync):
    vec, ref = make_async([_OptionsRequired] * N), make_sync([_OptionsRequired] * N)
    assert_tree_equal(vec.reset(seed=3), ref.reset(seed=3), "reset without options")
    assert_tree_equal(vec.reset(seed=4, options={"a": 1}), ref.reset(seed=4, options={"a": 1}), "reset with options")


@pytest.mark.ours_only
@pytest.mark.parametrize("batch_size,envs_per_worker", [(2, 1), (1, 4)], ids=["apart", "one-process"])
def test_step_while_sent_steps_are_unreceived_is_refused(make_async, make_sync, batch_size, envs_per_worker):
    """``step()`` steps every env. Envs sent a step by ``send()`` whose result no ``recv()``
    returned yet (still in their process, or arrived with another env's result) are not stepped
    again, their first results lost and ``send()`` refusing them for good: ``step()`` refuses
    gymnasium's way, before anything is sent, and ``recv()`` still returns them."""
    n = 4
    fns = env_fns(n)
    vec = make_async(fns, batch_size=batch_size, envs_per_worker=envs_per_worker)
    ref = make_sync(fns)
    vec.reset(seed=0)
    ref.reset(seed=0)
    vec.action_space.seed(1)
    first, second = vec.action_space.sample(), vec.action_space.sample()
    vec.send(first)
    returned = [vec.recv()]
    assert vec.get_attr("step_count") == (1,) * n  # every step is done; the others' results wait for recv()
    with pytest.raises(AlreadyPendingCallError, match="recv"):
        vec.step(second)
    assert vec.get_attr("step_count") == (1,) * n  # nothing was sent
    while sum(len(r[4]["env_id"]) for r in returned) < n:
        returned.append(vec.recv())
    expected = ref.step(first)
    for obs, rewards, *_, infos in returned:
        ids = infos["env_id"]
        assert_tree_equal((obs, rewards), (expected[0][ids], expected[1][ids]), f"the results of envs {ids}")
    assert sorted(int(i) for r in returned for i in r[4]["env_id"]) == list(range(n))
    assert_tree_equal(vec.step(second), ref.step(second), "the step after")
