"""Faults and bad input with PettingZoo envs in worker processes: an env that raises, hangs or
dies mid-episode with several agents; actions for absent agents, unknown names, wrong shapes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

pytest.importorskip("pettingzoo", minversion="1.24")  # mlagents-envs 1.1.0 pins 1.15

import pettingzoo_envs as envs
from envmanager.errors import InvalidInputError, SpaceMismatchError, WorkerDiedError, WorkerError, WorkerTimeoutError
from envmanager.pettingzoo import ParallelVectorEnv

AT = 3  # the failing env's step


def fns(tmp_path, how: str) -> list:
    """Two envs in one process; env 1 fails at its ``AT``-th step, once."""
    return [envs.spread, envs.Failing(envs.spread, how, AT, str(tmp_path / "struck"))]


def zeros(vec, batch) -> np.ndarray:
    return np.zeros(batch.num_envs * vec.num_agents, np.int64)


def step_until(vec, batch, error):
    with pytest.raises(error) as caught:
        for _ in range(AT + 1):
            batch = vec.step(zeros(vec, batch))
    return caught.value


@pytest.mark.parametrize("how,error", [("raise", WorkerError), ("kill", WorkerDiedError), ("hang", WorkerTimeoutError)])
def test_a_fault_mid_episode_names_the_slot(tmp_path, how, error):
    with ParallelVectorEnv(fns(tmp_path, how), envs_per_worker=2, timeout=2.0) as vec:
        batch = vec.reset(seed=0)
        caught = step_until(vec, batch, error)
        assert 1 in getattr(caught, "worker_ids", [getattr(caught, "worker_id", None)])
        assert "worker 1" in str(caught)
        if how == "raise":
            assert "the env blew up mid-episode" in str(caught) and "Traceback" in str(caught)


@pytest.mark.parametrize("dicts", [False, True])
def test_an_env_that_raised_is_not_left_in_flight(tmp_path, dicts):
    """Restarts off, env 1 raised in ``step()``: its step never comes, so it is no longer counted
    as in flight (every later step said so, and no ``recv()`` could return it). Env 0's result
    is still there for ``recv()``; then a step of env 1 is refused as the core refuses a failed
    env's (it must be reset), and after ``reset()`` both envs step."""
    with ParallelVectorEnv(fns(tmp_path, "raise"), envs_per_worker=2, timeout=5.0) as vec:
        batch = vec.reset(seed=0)

        def step(ids=None):
            n = batch.num_envs if ids is None else len(ids)
            if dicts:
                vec.send_dicts([dict.fromkeys(vec.possible_agents, 0)] * n, ids)
            else:
                vec.send(np.zeros(n * vec.num_agents, np.int64), ids)
            return vec.recv(n, sort=True)

        with pytest.raises(WorkerError, match="the env blew up mid-episode"):
            for _ in range(AT + 1):
                batch = step()
        assert vec.recv(1, timeout=10).env_ids.tolist() == [0]  # env 0's step, kept
        with pytest.raises(InvalidInputError, match="worker 1 must be reset before it is stepped"):
            step([1])
        batch = vec.reset(seed=1)
        batch = step()
        assert batch.active.all() and batch.episode_length.tolist() == [1] * (2 * vec.num_agents)


@pytest.mark.parametrize("how", ["raise", "kill", "hang"])
def test_with_restarts_the_env_comes_back_reset_and_flagged(tmp_path, how):
    with ParallelVectorEnv(fns(tmp_path, how), envs_per_worker=2, timeout=2.0, restart_workers=True) as vec:
        batch = vec.reset(seed=0)
        restarted = None
        for _ in range(AT + 2):
            batch = vec.step(zeros(vec, batch))
            if batch.restarted.any():
                restarted = batch
                break
        assert restarted is not None
        n = vec.num_agents
        assert restarted.restarted.tolist()[1] and restarted.episode_start[1]
        assert restarted.active[n:].all() and not restarted.episode_length[n:].any() and not restarted.episode_return[n:].any()
        # it goes on: both envs step, a fresh episode on env 1
        batch = vec.step(zeros(vec, batch))
        assert batch.active.all() and batch.episode_length[n:].tolist() == [1] * n


def test_a_worker_killed_from_outside_mid_episode(tmp_path):
    with ParallelVectorEnv([envs.kaz] * 2, envs_per_worker=1, timeout=10.0, restart_workers=True) as vec:
        vec.reset(seed=0)
        actions = np.zeros(2 * vec.num_agents, np.int64)
        vec.step(actions)
        pid = vec.manager.process_of(1).pid
        os.kill(pid, signal.SIGSTOP)  # it cannot answer the step sent next: killed with the step in flight
        vec.send(actions)
        os.kill(pid, signal.SIGKILL)
        got = vec.recv(2, sort=True)
        assert got.env_ids.tolist() == [0, 1]
        assert got.restarted.tolist() == [False, True] and got.episode_start.tolist() == [False, True]
        # killed while idle: its env comes back reset from the next step, flagged
        os.kill(vec.manager.process_of(0).pid, signal.SIGKILL)
        batch = vec.step(actions)
        assert batch.restarted.tolist() == [True, False] and batch.episode_start.tolist() == [True, False]
        assert batch.active.all() and not batch.episode_length[: vec.num_agents].any()
    with ParallelVectorEnv([envs.kaz] * 2, timeout=10.0) as vec:
        vec.reset(seed=0)
        pid = vec.manager.process_of(0).pid
        os.kill(pid, signal.SIGSTOP)
        vec.send(actions)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="worker 0 died"):
            vec.recv(2)


# ---------------------------------------------------------------------------------------------
# Bad input: rejected before anything is sent; nothing is lost


def nothing_sent(vec) -> None:
    assert not vec.manager.in_flight()
    assert (vec.manager.status == 1).all()  # every slot idle, as before the call


def test_bad_actions_are_rejected_and_nothing_is_lost():
    ref = envs.tictactoe()
    ref.reset(seed=4)
    with ParallelVectorEnv([envs.tictactoe], timeout=30) as vec:
        batch = vec.reset(seed=4)
        mover = ref.agent_selection
        other = next(a for a in ref.possible_agents if a != mover)
        bad = [
            ([{mover: 0, other: 1}], "not active"),  # an action for an agent whose turn it is not
            ([{"player_9": 0}], "unknown agent 'player_9'"),
            ([{}], "no action for active agent"),
            ([{mover: 9}], "is invalid"),  # out of Discrete(9)
            ([{mover: "x"}], "does not fit"),
            ([{mover: 0}, {mover: 0}], "expected a sequence of 1 dicts"),
        ]
        for actions, message in bad:
            with pytest.raises(InvalidInputError, match=message):
                vec.step_dicts(actions)
            nothing_sent(vec)
        for arrays, message in [(np.zeros((3,), np.int64), "shape"), (np.zeros((2, 1)), "shape"),
                                (np.where(np.arange(2) == vec.possible_agents.index(mover), -1, 0), "is invalid"),
                                ({"nobody": np.zeros(2)}, "one array per group")]:
            with pytest.raises(InvalidInputError, match=message):
                vec.step(arrays)
            nothing_sent(vec)
        # nothing lost: the env is where it was, and the next good step is the reference's
        np.testing.assert_array_equal(batch.as_dicts()[0].observations[mover], ref.observe(mover)["observation"])
        move = int(np.flatnonzero(ref.observe(mover)["action_mask"])[0])
        batch = vec.step_dicts([{mover: move}])
        ref.step(move)
        np.testing.assert_array_equal(batch.as_dicts()[0].observations[other], ref.observe(other)["observation"])


def test_box_actions_nan_only_where_it_is_read():
    with ParallelVectorEnv([envs.pistonball] * 2, envs_per_worker=2, timeout=30) as vec:
        vec.reset(seed=0)
        actions = np.zeros((6, 1), np.float32)
        actions[4] = np.nan
        with pytest.raises(InvalidInputError, match=r"env 1: the action for agent 'piston_1' is invalid: NaN"):
            vec.step(actions)
        nothing_sent(vec)
        with pytest.raises(InvalidInputError, match="env_ids has duplicates"):
            vec.send(np.zeros((6, 1), np.float32), env_ids=[0, 0])
        with pytest.raises(InvalidInputError, match="unknown worker id 5"):
            vec.send(np.zeros((3, 1), np.float32), env_ids=[5])
        vec.send(np.zeros((3, 1), np.float32), env_ids=[1])
        with pytest.raises(InvalidInputError, match=r"env\(s\) \[1\] were sent a step"):
            vec.send(np.zeros((3, 1), np.float32), env_ids=[1])
        with pytest.raises(InvalidInputError, match=r"recv\(2\)"):
            vec.recv(2)
        assert vec.recv(1).env_ids.tolist() == [1]


def test_groups_need_their_own_arrays():
    with ParallelVectorEnv([envs.adversary], timeout=30) as vec:
        vec.reset(seed=0)
        with pytest.raises(InvalidInputError, match="form 2 groups"):
            vec.step(np.zeros(3, np.int64))
        with pytest.raises(InvalidInputError, match=r"group 'agent' have shape \(1,\), expected \(2,\)"):
            vec.step({"adversary": np.zeros(1, np.int64), "agent": np.zeros(1, np.int64)})
        nothing_sent(vec)
        batch = vec.step({"adversary": np.zeros(1, np.int64), "agent": np.zeros(2, np.int64)})
        assert batch.active.all()


def test_construction_rejects_bad_options_before_any_process_starts():
    for kwargs, message in [({"agent_groups": {"a": "agent_0"}}, "must list its agents"),
                            ({"agent_groups": {"a": ["agent_0"], "b": ["agent_0"]}}, "two groups"),
                            ({"turn_based": "yes"}, "turn_based")]:
        with pytest.raises(InvalidInputError, match=message):
            ParallelVectorEnv([envs.spread], **kwargs)
    with pytest.raises(InvalidInputError, match="env_fns"):
        ParallelVectorEnv([])
    with ParallelVectorEnv([envs.spread]) as vec:
        with pytest.raises(InvalidInputError, match="never reset"):
            vec.step(np.zeros(3, np.int64))
        for seed in ("x", [1, 2], [True]):
            with pytest.raises(InvalidInputError, match="seed must be"):
                vec.reset(seed=seed)
        assert not vec.manager.in_flight()


def test_envs_with_other_agents_or_spaces_are_refused():
    with pytest.raises(SpaceMismatchError, match="env 1"):
        ParallelVectorEnv([envs.spread, envs.adversary])
    with pytest.raises(WorkerError, match="not one of possible_agents"):
        ParallelVectorEnv([envs.spread], agent_groups={"a": ["agent_0", "agent_1", "agent_7"]})


def test_import_without_pettingzoo_names_the_extra():
    code = ("import sys; sys.modules['pettingzoo'] = None\n"
            "try:\n    import envmanager.pettingzoo\nexcept ModuleNotFoundError as e:\n    print(e.name, '|', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("pettingzoo |") and 'pip install "envmanager[pettingzoo]"' in out, out


def test_an_env_restarted_while_idle_comes_back_once_from_recv():
    with ParallelVectorEnv([envs.spread] * 2, timeout=10.0, restart_workers=True) as vec:
        vec.reset(seed=0)
        vec.send(np.zeros(3, np.int64), env_ids=[0])
        pid = vec.manager.process_of(1).pid
        os.kill(pid, signal.SIGKILL)  # env 1 has nothing in flight
        dead_by = time.monotonic() + 10
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < dead_by:
            time.sleep(0.01)  # dead before the wait below, so that wait sees it and restarts it
        got = vec.recv(1)
        seen = {int(e): bool(r) for e, r in zip(got.env_ids, got.restarted, strict=True)}
        if 1 not in seen:  # the restart came back after env 0's step (the usual order)
            vec.manager.wait_idle(timeout=10.0)
            # Its episode is gone: these actions are dropped (taken aside by send when the restart
            # was noticed, else lost with the dead process); either way the env comes back once, reset.
            vec.send(np.zeros(3, np.int64), env_ids=[1])
            got = vec.recv(1)
            assert not got.episode_length.any()
            assert got.env_ids.tolist() == [1]
            seen[1] = bool(got.restarted[0])
        assert seen == {0: False, 1: True}
        assert got.active.reshape(-1, 3)[list(got.env_ids).index(1)].all()
        batch = vec.step(np.zeros(6, np.int64))  # both go on
        assert not batch.restarted.any() and batch.episode_length.tolist() == [2, 2, 2, 1, 1, 1]
