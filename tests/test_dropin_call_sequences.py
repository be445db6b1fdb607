"""The drop-ins under the call sequences users produce, with faults: a ``step_wait`` that times
out or is interrupted (Ctrl-C) and is called again, an env that raises while another still
steps, a failed ``get_attr`` between partial batches, a masked reset while other envs step, a
Ctrl-C in SB3's ``step()``, a ``recv`` that times out or raises after taking results, a restart
inside SuperSuit's in-step reset, a step to an env whose process died. Each checks the data: what was answered is handed out once,
as its own step, and nothing is lost.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from dropin_envs import Make, PZEnv
from envmanager import AsyncVectorEnv
from envmanager.errors import InvalidInputError, WorkerDiedError, WorkerTimeoutError
from process_helpers import alive, ctrl_c_twice_in_close


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # as Ctrl-C in the calling process


def _sb3():
    pytest.importorskip("stable_baselines3")
    from envmanager.sb3 import SubprocVecEnv

    return SubprocVecEnv


def _pettingzoo():
    pytest.importorskip("pettingzoo", minversion="1.24")  # (mlagents-envs 1.1.0 pins 1.15)
    import envmanager.pettingzoo

    return envmanager.pettingzoo


# -- gym copy ahead timeout

@pytest.mark.timeout(60)
def test_step_wait_again_after_timeout_keeps_rows_of_envs_already_answered():
    # 30 KB observations: step_wait copies each env's row out as it answers (COPY_AHEAD_BYTES)
    fns = [Make("ImgEnv", env_id=0), Make("ImgEnv", env_id=1, step_time=1.5)]
    envs = AsyncVectorEnv(fns, envs_per_worker=1, worker_timeout=20)
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([0, 0]))
        with pytest.raises(multiprocessing.TimeoutError):
            envs.step_wait(timeout=0.5)  # env 0 answers within it, env 1 does not
        obs, rew, _term, _trunc, _infos = envs.step_wait()
        assert rew.tolist() == [1.0, 1.0]
        assert int(obs[1].flat[0]) == 11  # env 1's row: 10*1 + t
        assert int(obs[0].flat[0]) == 1, f"env 0's row is {obs[0].flat[:4]} not its observation (1)"
    finally:
        envs.close(terminate=True)


@pytest.mark.timeout(60)
def test_step_wait_again_after_ctrl_c_keeps_rows_of_envs_already_answered():
    import signal
    fns = [Make("ImgEnv", env_id=0), Make("ImgEnv", env_id=1, step_time=1.5)]
    envs = AsyncVectorEnv(fns, envs_per_worker=1, worker_timeout=20)
    old = signal.signal(signal.SIGALRM, _interrupt)
    try:
        envs.reset(seed=0)
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # Ctrl-C while step() waits for env 1
        with pytest.raises(KeyboardInterrupt):
            envs.step(np.array([0, 0]))
        signal.setitimer(signal.ITIMER_REAL, 0)
        obs, _rew, _term, _trunc, _infos = envs.step_wait()  # the step stays pending, as gymnasium's does
        assert int(obs[1].flat[0]) == 11
        assert int(obs[0].flat[0]) == 1, f"env 0's row is {obs[0].flat[:4]} not its observation (1)"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        envs.close(terminate=True)


# -- gym error wait past timeout

@pytest.mark.timeout(60)
@pytest.mark.parametrize("partial", [False, True])
def test_error_path_honours_callers_timeout(partial, tmp_path):
    # An env raises at once while the other steps for 10 minutes: the caller's timeout bounds the
    # call (gymnasium's does), not the other env's step (the test's own 60 s timeout would fail it).
    fns = [Make("CountEnv", env_id=0, fault="raise", fault_at=1, marker=str(tmp_path / "m")),
           Make("CountEnv", env_id=1, step_time=600.0)]
    envs = AsyncVectorEnv(fns, envs_per_worker=1, worker_timeout=900, batch_size=1 if partial else None)
    try:
        envs.reset(seed=0)
        with pytest.raises(RuntimeError, match="fails on purpose"):
            if partial:
                envs.send(np.array([0, 0]))
                envs.recv(timeout=1.0)
            else:
                envs.step_async(np.array([0, 0]))
                envs.step_wait(timeout=1.0)
    finally:
        envs.close(terminate=True)


@pytest.mark.timeout(60)
def test_ctrl_c_in_the_drain_leaves_a_usable_state(tmp_path):
    """The user, tired of the over-long step_wait(timeout=1) above, presses Ctrl-C: the env's
    exception was already taken off the core and the adapter's state still says WAITING_STEP with
    2 envs left, so step_wait() then raises "nothing can finish" instead of anything about env 0."""
    import signal
    fns = [Make("CountEnv", env_id=0, fault="raise", fault_at=1, marker=str(tmp_path / "m")),
           Make("CountEnv", env_id=1, step_time=4.0)]
    envs = AsyncVectorEnv(fns, envs_per_worker=1, worker_timeout=30)
    old = signal.signal(signal.SIGALRM, _interrupt)
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([0, 0]))
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises((KeyboardInterrupt, RuntimeError)):
            envs.step_wait(timeout=1.0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        from envmanager.errors import InvalidInputError
        try:
            envs.step_wait()
        except InvalidInputError as exc:
            pytest.fail(f"step_wait() after Ctrl-C: {exc!r} (env 0's RuntimeError is gone, the state is stuck)")
        except Exception:
            pass  # NoAsyncCallError (the step was abandoned) or the env's own error: both clear
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        envs.close(terminate=True)


# -- gym call error drops partial

@pytest.mark.timeout(60)
def test_failed_get_attr_keeps_partial_steps_in_flight():
    fns = [Make("CountEnv", env_id=i, step_time=0.3 * i) for i in range(4)]
    envs = AsyncVectorEnv(fns, envs_per_worker=1, worker_timeout=20, batch_size=2)
    try:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        obs, *_, infos = envs.recv(timeout=10)
        first = sorted(infos["env_id"].tolist())
        with pytest.raises(AttributeError):
            envs.get_attr("no_such_attribute")
        obs, *_, infos = envs.recv(timeout=10)  # the other two envs' steps
        assert sorted(first + infos["env_id"].tolist()) == [0, 1, 2, 3]
        assert obs[:, 1].tolist() == [1.0, 1.0]  # their step t=1
    finally:
        envs.close(terminate=True)


# -- gym a process given up

@pytest.mark.timeout(60)
def test_an_env_whose_process_died_raises_that_death_on_every_later_call():
    """gymnasium's own class restarts nothing; after a worker died, stepping its env (all envs
    at once, or EnvPool's ``send``) raises the death that ``reset()`` raises, not ``ResetNeeded``,
    which would send the user to a reset that cannot help. The other env serves on."""
    fns = [Make("CountEnv", env_id=i, fault="kill" if i == 0 else None, fault_at=1) for i in range(2)]
    envs = AsyncVectorEnv(fns, envs_per_worker=1, worker_timeout=20, batch_size=1)
    try:
        envs.reset(seed=0)
        with pytest.raises(WorkerDiedError) as died:
            envs.step(np.zeros(2, dtype=np.int64))
        for call in (lambda: envs.step(np.zeros(2, dtype=np.int64)), lambda: envs.send(np.zeros(1, np.int64), [0]),
                     lambda: envs.reset(seed=1)):
            with pytest.raises(WorkerDiedError) as again:
                call()
            assert again.value is died.value
        envs.send(np.zeros(1, dtype=np.int64), [1])
        obs, *_, infos = envs.recv(timeout=10)
        assert infos["env_id"].tolist() == [1] and obs[0, 0] == 1.0
    finally:
        envs.close(terminate=True)


# -- gym partial masked reset

@pytest.mark.timeout(60)
def test_masked_reset_keeps_other_envs_steps_in_flight():
    fns = [Make("CountEnv", env_id=0, episode_length=1)] + [Make("CountEnv", env_id=i, step_time=0.5) for i in (1, 2)]
    envs = AsyncVectorEnv(fns, envs_per_worker=1, worker_timeout=20, batch_size=1,
                          autoreset_mode=AutoresetMode.DISABLED)
    try:
        envs.reset(seed=0)
        envs.send(np.zeros(3, dtype=np.int64))
        _obs, _rew, term, _trunc, infos = envs.recv(timeout=10)
        assert infos["env_id"].tolist() == [0] and term.tolist() == [True]
        with pytest.raises(AssertionError, match="reset_mask"):
            envs.send(np.zeros(1, dtype=np.int64), [0])
        envs.reset(options={"reset_mask": np.array([True, False, False])})
        envs.send(np.zeros(1, dtype=np.int64), [0])
        got = []
        for _ in range(3):
            _obs, _rew, term, _trunc, infos = envs.recv(timeout=10)
            got += infos["env_id"].tolist()
        assert sorted(got) == [0, 1, 2]
    finally:
        envs.close(terminate=True)


# -- sb3 interrupt

@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["step_wait", "step"])
def test_interrupted_step_is_not_lost(then):
    venv = _sb3()([Make("CountEnv", env_id=0, step_time=1.0, episode_length=2)], envs_per_worker=1, timeout=20)
    old = signal.signal(signal.SIGALRM, _interrupt)
    try:
        obs = venv.reset()
        assert obs[0, 1:3].tolist() == [0.0, 1.0]  # t=0, episode 1
        obs, _rew, dones, _infos = venv.step(np.array([1]))
        assert obs[0, 1:3].tolist() == [1.0, 1.0] and not dones[0]  # t=1 of episode 1
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            venv.step(np.array([1]))  # ends episode 1 (t=2): done, terminal_observation
        signal.setitimer(signal.ITIMER_REAL, 0)
        if then == "step_wait":
            obs, _rew, dones, _infos = venv.step_wait()  # the step the interrupt left in flight
        else:
            try:
                obs, _rew, dones, _infos = venv.step(np.array([1]))
            except InvalidInputError as exc:  # a clear refusal will do: the pending step is then step_wait()'s
                assert "pending" in str(exc)
                obs, _rew, dones, _infos = venv.step_wait()
        seen_end = bool(dones[0])
        assert seen_end or obs[0, 2] == 1.0, (
            f"episode 1's end was never reported: next result is t={obs[0, 1]:.0f} of episode {obs[0, 2]:.0f}, "
            f"done={dones[0]}, env stepped {obs[0, 3]:.0f} times, caller saw 2 results")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        venv.close()


# -- pz recv loses taken

@pytest.mark.timeout(90)
def test_recv_timeout_keeps_results_set_aside_by_send():
    fns = [Make("PZEnv", env_id=0),
           Make("PZEnv", env_id=1, step_time=2.5),  # (slow enough that envs 0 and 3 come first on a loaded machine)
           Make("PZEnv", env_id=2, step_time=3.0),
           Make("PZEnv", env_id=3, step_time=[0.0, 3.0])]  # fast first step, then slow
    v = _pettingzoo().ParallelVectorEnv(fns, envs_per_worker=1, timeout=20, restart_workers=True, context="fork")
    try:
        v.reset(seed=0)
        v.send(np.ones(8, np.int64))
        assert sorted(v.recv(2, timeout=5).env_ids.tolist()) == [0, 3]
        os.kill(v.manager.processes[0].pid, signal.SIGKILL)  # env 0's process dies while idle
        v.call("render", env_ids=[2])  # waits out env 2's step: env 1's and 2's results, env 0's restart come in
        v.send(np.ones(2, np.int64), env_ids=[3])  # sets them aside for the next recv
        with pytest.raises(WorkerTimeoutError):
            v.recv(4, timeout=0.5)  # env 3 takes 3 s
        time.sleep(3.5)
        got = v.recv(1, timeout=5).env_ids.tolist()
        if len(got) < 4:
            try:
                got += v.recv(1, timeout=5).env_ids.tolist()
            except InvalidInputError as exc:
                pytest.fail(f"recv returned only {got}, then: {exc}. Envs 0 (restarted), 1 and 2 were lost")
        assert sorted(got) == [0, 1, 2, 3]
    finally:
        v.close()


@pytest.mark.timeout(60)
def test_a_step_to_an_env_whose_process_died_raises_that_death():
    """Its step was never answered; no ``recv()`` can return it: a later ``step`` or ``send``
    raises the death (as ``reset()`` does), not "a result recv() has not returned yet"."""
    fns = [Make("PZEnv", env_id=i, fault="kill" if i == 0 else None, fault_at=1) for i in range(2)]
    v = _pettingzoo().ParallelVectorEnv(fns, envs_per_worker=1, timeout=20)
    try:
        v.reset(seed=0)
        with pytest.raises(WorkerDiedError) as died:
            v.step(np.ones(4, np.int64))
        for call in (lambda: v.step(np.ones(4, np.int64)), lambda: v.send(np.ones(2, np.int64), [0])):
            with pytest.raises(WorkerDiedError) as again:
                call()
            assert again.value is died.value
        assert v.recv(1, timeout=10).env_ids.tolist() == [1]  # env 1's step, kept
        with pytest.raises(WorkerDiedError) as again:
            v.reset()
        assert again.value is died.value
    finally:
        v.close()


@pytest.mark.timeout(90)
def test_recv_after_a_failed_step_keeps_the_other_envs_results(tmp_path):
    fns = [Make("PZEnv", env_id=i, fault="raise" if i == 1 else None, fault_at=1, marker=str(tmp_path / "m"))
           for i in range(3)]
    v = _pettingzoo().ParallelVectorEnv(fns, envs_per_worker=1, timeout=20)
    try:
        v.reset(seed=0)
        with pytest.raises(Exception, match="fails on purpose"):
            v.step(np.ones(6, np.int64))  # env 1 raises; envs 0 and 2 stepped fine
        with pytest.raises(InvalidInputError):
            v.recv(3, timeout=2)  # env 1 cannot come: raises (fine) ...
        # ... but envs 0 and 2 must still be there (recv(2): the step's error may come before either)
        got = v.recv(2, timeout=10).env_ids.tolist()
        assert sorted(got) == [0, 2]
    finally:
        v.close()


# -- supersuit restart in autoreset

@pytest.mark.timeout(90)
def test_restart_during_in_step_reset_is_reported(tmp_path):
    # seeds 0, 1: env 0's episodes last 2 steps, env 1's 3; the 2nd reset of any copy kills its process (once)
    env = PZEnv(length_by_seed=True, fault="kill_reset", fault_at=2, marker=str(tmp_path / "m"))
    pz = _pettingzoo()
    venv = pz.concat_vec_envs_v1(pz.pettingzoo_env_to_vec_env_v1(env), 2, num_cpus=1, restart_workers=True,
                              context="fork", timeout=10)
    try:
        assert venv.envs_per_worker == 2
        venv.reset(seed=0)
        venv.step(np.ones(4, np.int64))
        obs, _rew, term, trunc, infos = venv.step(np.ones(4, np.int64))  # env 0 ends; its reset kills the process
        assert term[:2].all()  # env 0's agents: the episode ended
        assert trunc[2:].all(), "env 1's episode was cut by the restart: its rows must be truncated"
        assert obs[2:, 1].tolist() == [0.0, 0.0]  # env 1's rows: its fresh reset
        for row in (2, 3):  # its last observation, of this step (t = 2 of its episode)
            assert infos[row]["terminal_observation"][1] == 2.0
    finally:
        venv.close()


# -- close cut short by a second Ctrl-C

def _slow_to_close(dropin):
    """``dropin`` on 2 envs whose close() takes 30 s, reset, and its core manager."""
    if dropin == "AsyncVectorEnv":
        envs = AsyncVectorEnv([Make("CountEnv", env_id=i, close_s=30) for i in range(2)], envs_per_worker=1)
        envs.reset(seed=0)
        return envs, envs._manager
    if dropin == "SubprocVecEnv":
        envs = _sb3()([Make("CountEnv", env_id=i, close_s=30) for i in range(2)], envs_per_worker=1)
        envs.reset()
        return envs, envs._manager
    pz = _pettingzoo()
    if dropin == "ParallelVectorEnv":
        envs = pz.ParallelVectorEnv([Make("PZEnv", env_id=i, close_s=30) for i in range(2)])
        envs.reset(seed=0)
        return envs, envs.manager
    envs = pz.concat_vec_envs_v1(pz.pettingzoo_env_to_vec_env_v1(PZEnv(close_s=30)), 2, num_cpus=2)
    envs.reset(seed=0)
    return envs, envs.vector.manager


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dropin", ["AsyncVectorEnv", "SubprocVecEnv", "ParallelVectorEnv", "PettingZooVecEnv"])
def test_a_close_cut_short_by_ctrl_c_twice_is_finished_by_the_next(dropin, monkeypatch):
    """As the core's (``test_core_faults.py``): Ctrl-C while the envs close, and again while
    close() ends the workers by force; the drop-in's next close() ends every worker. The
    PettingZoo drop-ins dropped their manager as their close() began: the next one did nothing
    and the workers ran on (until the manager was collected, or exit)."""
    envs, manager = _slow_to_close(dropin)  # (the manager held here: its __del__ is not what should end them)
    pids = [w.pid for w in manager.processes]
    presses = ctrl_c_twice_in_close(monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            envs.close()
        assert presses == ["wait", "stop"] and manager.closed
        envs.close()
        assert not alive(pids, timeout=5.0), "a close cut short left workers running"
        assert envs.closed
        envs.close()  # and again: nothing left to do
    finally:
        manager.close(timeout=0.0)
