"""The fault model: every failure of a worker becomes a clear error or a restart within limits."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from envmanager import (
    InvalidInputError,
    ManagerClosedError,
    RestartLimitError,
    SubprocessEnvManager,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from envmanager.testing.envs import ControlledEnv, EnvFactory
from process_helpers import alive, ctrl_c_twice_in_close

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_until_error(m, limit=50, seconds=30.0):
    """Step until something raises: at least ``limit`` steps, for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    n = 0
    while n < limit or time.monotonic() < deadline:
        m.step(dict.fromkeys(m.idle_worker_ids, 1))
        n += 1
    raise AssertionError("no error was raised")


def interrupted_infos(m, seconds=30.0):
    """Step everything idle until some results come back interrupted (a restart)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [i for i in m.step(dict.fromkeys(m.idle_worker_ids, 1)) if i.interrupted]
        if found:
            return found
    raise AssertionError("no interrupted result came back")


def faulty(fault, at=2, worker=1, **kwargs):
    return EnvFactory(per_env={worker: {"fault": fault, "fault_at": at}}, **kwargs)


def test_env_exception_in_step_names_worker_and_carries_traceback():
    with SubprocessEnvManager(faulty("raise"), 3, timeout=30) as m:
        m.reset()
        with pytest.raises(WorkerError) as caught:
            step_until_error(m)
        err = caught.value
        assert err.worker_id == 1
        assert err.exc_type == "builtins.ValueError"
        assert "failed on purpose" in err.message
        assert "in _fail" in err.remote_traceback and "raise ValueError" in err.remote_traceback
        assert isinstance(err.cause, ValueError)
        assert "worker 1" in str(err)
        # The worker keeps serving: after a reset, every env steps again.
        m.set_attr("fault", None)
        m.reset()
        got = set()
        while len(got) < 3:
            got |= {i.worker_id for i in m.step(dict.fromkeys(m.idle_worker_ids, 1))}


def test_results_of_other_workers_are_kept_when_one_raises():
    factory = EnvFactory(per_env={0: {"fault": "raise", "fault_at": 1}})
    with SubprocessEnvManager(factory, 2, timeout=30) as m:
        m.reset()
        m.send_step({0: 1, 1: 1})
        m.wait_idle(timeout=30)  # both answers in (kept, not raised): the error and the result come out together
        with pytest.raises(WorkerError):
            m.step({})
        # Worker 1's result is not lost with the error: the next call returns it.
        infos = m.step({})
        assert [i.worker_id for i in infos] == [1]
        assert infos[0].current_result.observation[0] == 1


def test_env_exception_in_reset():
    factory = EnvFactory(per_env={0: {"fault": "raise_reset", "fault_at": 1}})
    with SubprocessEnvManager(factory, 2, timeout=30) as m:
        with pytest.raises(WorkerError, match="failed to reset on purpose") as caught:
            m.reset()
        assert caught.value.worker_id == 0


def test_env_exception_in_factory():
    def factory(worker_id):
        if worker_id == 1:
            raise OSError("no such simulator")
        return EnvFactory()(worker_id)

    with pytest.raises(WorkerError, match="no such simulator") as caught:
        SubprocessEnvManager(factory, 2, timeout=30)
    assert caught.value.worker_id == 1


def test_restart_during_startup(tmp_path):
    marker = str(tmp_path / "failed-once")

    def factory(worker_id):
        if worker_id == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            raise OSError("simulator did not start")
        return EnvFactory()(worker_id)

    with SubprocessEnvManager(factory, 2, timeout=30, restart_workers=True) as m:
        assert m.supervisor.restart_count(0) == 1
        assert [i.worker_id for i in m.reset()] == [0, 1]
        assert m.get_attr("env_id") == [0, 1]


@pytest.mark.parametrize(
    "fault,how", [("sigkill", "SIGKILL"), ("segfault", "SIGSEGV"), ("exit", "exit code 3")]
)
def test_dead_worker_is_reported_not_eof(fault, how):
    with SubprocessEnvManager(faulty(fault), 3, timeout=60) as m:
        m.reset()
        with pytest.raises(WorkerDiedError) as caught:
            step_until_error(m)
        assert caught.value.worker_id == 1
        assert how in str(caught.value)
        # It stays reported: further steps name the same dead worker.
        with pytest.raises(WorkerDiedError, match="worker 1"):
            step_until_error(m)


def test_worker_killed_from_outside_mid_step(tmp_path):
    gate = str(tmp_path / "never")
    factory = EnvFactory(per_env={0: {"gate": gate}})
    with SubprocessEnvManager(factory, 2, timeout=60) as m:
        m.reset()
        m.step({0: 1, 1: 1})
        os.kill(m.process_of(0).pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"worker 0 died .killed by SIGKILL"):
            step_until_error(m)


def test_hung_worker_past_deadline_raises_and_close_still_ends():
    with SubprocessEnvManager(faulty("hang", at=1, worker=0), 2, timeout=1.0) as m:
        m.reset()
        with pytest.raises(WorkerTimeoutError) as caught:
            step_until_error(m)
        assert caught.value.worker_ids == [0]
        assert isinstance(caught.value, TimeoutError)


def test_close_while_steps_are_pending(tmp_path):
    gate = str(tmp_path / "never")
    m = SubprocessEnvManager(EnvFactory(gate=gate), 3, timeout=30)
    m.reset()
    m.step({0: 1, 1: 1, 2: 1}, timeout=0.5) if False else m.send_step({0: 1, 1: 1, 2: 1})
    pids = [w.pid for w in m.processes]
    m.close(timeout=1.0)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_grandchildren_are_reaped_on_close():
    factory = EnvFactory(fault="grandchild", fault_at=1)
    m = SubprocessEnvManager(factory, 1, timeout=30)
    m.reset()
    m.step({0: 1})
    worker = psutil.Process(m.processes[0].pid)
    grandchildren = worker.children()
    assert grandchildren, "the env should have started a child process"
    worker.kill()  # the worker cannot close its env: close() must still get the grandchild
    m.close()
    psutil.wait_procs(grandchildren, timeout=5)
    assert not any(g.is_running() and g.status() != psutil.STATUS_ZOMBIE for g in grandchildren)


def test_restart_within_quota_reports_interrupted_episode():
    with SubprocessEnvManager(faulty("segfault", at=3), 3, timeout=30, restart_workers=True) as m:
        m.reset()
        (info,) = interrupted_infos(m)
        assert info.worker_id == 1
        assert info.current_result.observation[0] == 0  # a fresh episode
        assert info.previous_result is not None and info.action == 1
        assert m.supervisor.restart_count(1) == 1
        # The others went on; the restarted worker steps again (its new env would fail at its
        # own third step, which the rate limit would then refuse to restart).
        seen: set[int] = set()
        deadline = time.monotonic() + 30
        while seen != {0, 1, 2} and time.monotonic() < deadline:
            seen |= {i.worker_id for i in m.step({w: 1 for w in m.idle_worker_ids if w != 1 or 1 not in seen})}
        assert seen == {0, 1, 2}


def test_restart_beyond_quota_raises():
    factory = faulty("exit", at=1, worker=0)
    with SubprocessEnvManager(factory, 2, timeout=30, restart_workers=True) as m:
        m.reset()
        with pytest.raises(RestartLimitError, match="restarts_rate_limit_n") as caught:
            step_until_error(m)
        assert caught.value.worker_id == 0
        assert m.supervisor.restart_count(0) == 1


def test_restart_lifetime_limit():
    factory = faulty("raise", at=1, worker=0)
    with SubprocessEnvManager(
        factory, 1, timeout=30, restart_workers=True, max_lifetime_restarts=2, restarts_rate_limit_n=-1
    ) as m:
        m.reset()
        with pytest.raises(RestartLimitError, match="max_lifetime_restarts"):
            step_until_error(m)
        assert m.supervisor.restart_count(0) == 2


def test_restart_hung_worker():
    factory = faulty("hang", at=1, worker=0)
    with SubprocessEnvManager(factory, 2, timeout=1.0, restart_workers=True) as m:
        m.reset()
        assert [i.worker_id for i in interrupted_infos(m)] == [0]


SCRIPT = textwrap.dedent(
    """
    import faulthandler, signal, sys, time
    faulthandler.dump_traceback_later(25)  # a parent still running then shows where it is (stderr)
    # As a program started from a terminal: Ctrl-C raises KeyboardInterrupt. The test runner may
    # hand its children SIGINT ignored or blocked (a library in it set that): say so, and undo it.
    inherited = signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
    if signal.SIGINT in inherited or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        print("inherited SIGINT: blocked" if signal.SIGINT in inherited else "inherited SIGINT: ignored", file=sys.stderr)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from envmanager import SubprocessEnvManager
    from envmanager.testing.envs import EnvFactory
    m = SubprocessEnvManager(EnvFactory(step_time=0.05), 2, context={context!r})
    m.reset()
    try:
        print(" ".join(str(w.pid) for w in m.processes), flush=True)
        while True:
            m.step({{w: 1 for w in m.idle_worker_ids}})
    except KeyboardInterrupt:
        m.close()
        print("closed", flush=True)
    """
)


def _start_parent(context="fork"):
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(repo=REPO, context=context)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids = proc.stdout.readline().split()
    return proc, [int(p) for p in pids]


def _wait_gone(pids, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_exit_when_parent_is_killed(context):
    proc, pids = _start_parent(context)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    left = _wait_gone(pids)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers outlived their parent: {left}"
    # Its shared memory has no name (tests/test_shared_memory.py kills everything at once).
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"envmgr_{proc.pid}_")]


def test_ctrl_c_in_parent_closes_cleanly():
    proc, pids = _start_parent()
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        _wait_gone(pids)
        pytest.fail(f"the parent had not closed 30 s after Ctrl-C; its output:\n{out}\nits stderr:\n{err}")
    assert "closed" in out and proc.returncode == 0, err
    assert not _wait_gone(pids)


class _FailsFirstReset(ControlledEnv):
    """Raises in its first reset ever (a marker file remembers it across restarts)."""

    def __init__(self, env_id, marker):
        super().__init__(env_id)
        self.marker = marker

    def reset(self, *, seed=None, options=None):
        if self.env_id == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise RuntimeError("first reset fails")
        return super().reset(seed=seed, options=options)


def test_restart_during_reset_answers_the_reset_with_its_seed(tmp_path):
    marker = str(tmp_path / "failed")
    with SubprocessEnvManager(lambda i: _FailsFirstReset(i, marker), 2, timeout=30, restart_workers=True) as m:
        infos = m.reset(seed=10)
        assert [i.worker_id for i in infos] == [0, 1]
        assert [i.interrupted for i in infos] == [False, True]
        assert [i.current_result.info["seed"] for i in infos] == [10, 11]  # the seed asked for
        assert m.supervisor.restart_count(1) == 1


def test_failing_call_does_not_restart_a_healthy_worker():
    with SubprocessEnvManager(EnvFactory(), 2, timeout=30, restart_workers=True) as m:
        m.reset()
        with pytest.raises(WorkerError) as caught:
            m.get_attr("no_such_attribute")
        assert isinstance(caught.value.cause, AttributeError)
        assert m.supervisor.restarts == 0
        seen = set()
        while len(seen) < 2:
            seen |= {i.worker_id for i in m.step(dict.fromkeys(m.idle_worker_ids, 1))}


def test_wait_idle_after_an_idle_worker_was_restarted():
    with SubprocessEnvManager(EnvFactory(), 2, timeout=30, restart_workers=True) as m:
        m.reset()
        os.kill(m.process_of(1).pid, signal.SIGKILL)
        m.wait_idle()
        assert m.idle_worker_ids == [0, 1]
        infos = m.step({0: 1, 1: 1})
        infos += m.receive_steps(min_count=3 - len(infos)) if len(infos) < 3 else []
        interrupted = [i for i in infos if i.interrupted]
        assert [i.worker_id for i in interrupted] == [1]  # the restart's fresh episode, reported once


def test_call_on_runs_a_function_on_the_env():
    with SubprocessEnvManager(EnvFactory(), 3, timeout=30, envs_per_worker=2) as m:
        assert m.call_on([2, 0], lambda env, k: env.env_id * k, (10,)) == [20, 0]


def test_hung_worker_is_killed_with_the_processes_it_started(tmp_path):
    gate = str(tmp_path / "never")
    factory = EnvFactory(per_env={0: {"fault": "grandchild_session", "fault_at": 1, "gate": gate}})
    with SubprocessEnvManager(factory, 2, timeout=2.0) as m:
        m.reset()
        worker = psutil.Process(m.process_of(0).pid)
        m.send_step({0: 1, 1: 1})
        deadline = time.monotonic() + 10
        while not worker.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (player,) = worker.children()  # started in a session of its own
        with pytest.raises(WorkerTimeoutError):
            step_until_error(m)
        psutil.wait_procs([player], timeout=5)
        assert not player.is_running() or player.status() == psutil.STATUS_ZOMBIE


def _unloadable():
    raise ImportError("this class only exists in the parent")


class Unloadable:
    """Pickles fine, but cannot be unpickled (as a class the other side cannot import)."""

    def __reduce__(self):
        return (_unloadable, ())


def test_an_answer_that_cannot_be_pickled_is_an_error_not_a_death():
    with SubprocessEnvManager(EnvFactory(), 2, timeout=30) as m:
        with pytest.raises(WorkerError, match="pickle") as caught:
            m.call_on([1], lambda env: threading.Lock())
        assert caught.value.worker_id == 1
        assert [w.alive() for w in m.processes] == [True, True]
        assert m.get_attr("env_id") == [0, 1]


def test_a_request_the_worker_cannot_unpickle_is_an_error_not_a_death():
    with SubprocessEnvManager(EnvFactory(), 2, timeout=30) as m:
        with pytest.raises(WorkerError, match="only exists in the parent"):
            m.set_attr("config", Unloadable())
        assert [w.alive() for w in m.processes] == [True, True]
        assert m.get_attr("env_id") == [0, 1]


def test_an_answer_the_parent_cannot_unpickle_names_the_worker():
    with SubprocessEnvManager(EnvFactory(), 2, timeout=30) as m:
        with pytest.raises(WorkerError, match="could not be unpickled") as caught:
            m.call_on([1], lambda env: Unloadable())
        assert caught.value.worker_id == 1
        assert m.get_attr("env_id") == [0, 1]


def test_a_wait_that_times_out_loses_no_result(tmp_path):
    gate = str(tmp_path / "open")
    with SubprocessEnvManager(EnvFactory(per_env={1: {"gate": gate}}), 2, timeout=30) as m:
        m.reset()
        m.send_step({0: 1, 1: 1})
        m.wait_idle([0], timeout=30)  # (worker 0 answered: the short wait below is slot 1's alone)
        with pytest.raises(WorkerTimeoutError) as caught:
            m.wait_idle(timeout=0.3)
        assert caught.value.hung is False and caught.value.worker_ids == [1]
        open(gate, "w").close()
        got = m.receive_steps(min_count=2)
        assert sorted(i.worker_id for i in got) == [0, 1]


def test_a_reset_that_timed_out_is_not_returned_by_the_next_one(tmp_path):
    gate = str(tmp_path / "open")

    class SlowFirstReset(ControlledEnv):
        def reset(self, *, seed=None, options=None):
            if self.env_id == 1 and self.resets == 0:
                self.gate = gate
                self._wait()
                self.gate = None
            return super().reset(seed=seed, options=options)

    with SubprocessEnvManager(lambda i: SlowFirstReset(i), 2, timeout=30) as m:
        with pytest.raises(WorkerTimeoutError):
            m.reset(seed=100, timeout=0.3)
        open(gate, "w").close()
        infos = m.reset(seed=200)
        assert [i.current_result.info["seed"] for i in infos] == [200, 201]
        assert m.waiting_worker_ids == []


class _HeldByAnotherThread:
    """Garbage in a cycle whose finalizer takes a lock: in a forked child the lock stays held
    (as a library's mutex held by one of its threads at the fork, gRPC's say), so a child that
    finalizes it hangs."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock, self.me = lock, self

    def __del__(self) -> None:
        with self.lock:
            pass


class _CollectingEnv(ControlledEnv):
    def reset(self, *, seed=None, options=None):
        import gc

        gc.collect()  # the child's collector runs (it would sooner or later anyway)
        return super().reset(seed=seed, options=options)


def _collecting_env(worker_id: int) -> _CollectingEnv:
    return _CollectingEnv(worker_id)


def test_forked_workers_never_finalize_what_they_inherited():
    import gc

    lock = threading.Lock()
    lock.acquire()
    gc.disable()  # keep the garbage uncollected here until the workers are forked
    try:
        _HeldByAnotherThread(lock)
        with SubprocessEnvManager(_collecting_env, 2, context="fork", timeout=10) as m:
            infos = m.reset(seed=0)
            assert sorted(i.worker_id for i in infos) == [0, 1]
    finally:
        lock.release()
        gc.enable()
        gc.collect()


def test_a_wait_with_nothing_in_flight_raises_at_once():
    # Nothing can finish: known before any deadline (a drain-until-idle loop must not hang
    # for the manager's timeout). The deadline here is far beyond the test's own timeout.
    with SubprocessEnvManager(EnvFactory(), 2, timeout=600) as m:
        m.reset()
        started = time.monotonic()
        with pytest.raises(InvalidInputError, match="nothing can finish"):
            m.step({})
        with pytest.raises(InvalidInputError, match="nothing can finish"):
            m.receive_batch(1)
        m.send_step({0: 1})
        assert [i.worker_id for i in m.receive_steps(min_count=2)] == [0]  # one could finish: it is returned
        assert time.monotonic() - started < 300, "a wait with nothing in flight waited for the deadline"


def test_a_dead_worker_is_raised_at_once_by_the_next_wait():
    with SubprocessEnvManager(faulty("exit", at=1, worker=0), 2, timeout=600) as m:
        m.reset()
        with pytest.raises(WorkerDiedError):
            m.step({0: 1})
        started = time.monotonic()
        with pytest.raises(WorkerDiedError) as caught:  # known already: not after the deadline
            m.receive_batch(1)
        assert caught.value.worker_id == 0
        assert time.monotonic() - started < 300


@pytest.mark.parametrize("caller_timeout", [None, 1.0])
def test_one_clock_per_request_a_hung_worker_is_hung_for_the_caller_too(caller_timeout):
    # The caller's wait and the pool's deadline agree: past the manager's timeout the worker is
    # hung (killed, hung=True), whether the caller gave no timeout or the same one.
    with SubprocessEnvManager(faulty("hang", at=1, worker=0), 2, timeout=1.0) as m:
        m.reset()
        pid = m.process_of(0).pid
        m.send_step({0: 1})
        with pytest.raises(WorkerTimeoutError) as caught:
            m.receive_steps(timeout=caller_timeout)
        assert caught.value.hung is True and caught.value.worker_ids == [0]
        assert not alive([pid], timeout=5.0), "the hung worker was left running"
        with pytest.raises(WorkerTimeoutError):  # and its failure is raised at once afterwards
            m.step({0: 1})
        assert m.get_attr("env_id", [1]) == [1]  # the other worker is untouched


def test_one_clock_with_restarts_the_hung_worker_is_restarted():
    with SubprocessEnvManager(faulty("hang", at=1, worker=0), 2, timeout=1.0, restart_workers=True) as m:
        m.reset()
        m.send_step({0: 1})
        (info,) = m.receive_steps()  # no clock of its own: the restart's answer ends the wait
        assert info.worker_id == 0 and info.interrupted
        assert m.restart_count(0) == 1


def test_close_from_another_thread_ends_a_waiting_call(tmp_path):
    from envmanager import ManagerClosedError

    gate = str(tmp_path / "never")
    m = SubprocessEnvManager(EnvFactory(per_env={0: {"gate": gate}}), 2, timeout=600)
    m.reset()
    pids = [w.pid for w in m.processes]
    m.send_step({0: 1})
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            m.receive_steps()
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # let it block on the workers
    m.close()
    waiter.join(30)
    assert not waiter.is_alive(), "the waiting call did not return after close()"
    assert len(raised) == 1 and isinstance(raised[0], ManagerClosedError), raised
    assert not alive(pids, timeout=5.0)


@pytest.mark.timeout(120)
def test_a_second_thread_s_wait_is_refused_while_one_waits_and_takes_nothing(tmp_path):
    """A thread waits in ``step()`` (its envs held at a gate); the main thread's calls that wait
    meanwhile (a logging thread's ``get_attr``, a second stepper's ``receive_steps``, a reset)
    each raise ``ConcurrentCallError`` naming the waiting thread, before anything is sent or
    taken: they raised a bare ``RuntimeError: concurrent poll() invocation`` from the shared
    poller (or took the other thread's answers). The waiting step gets each answer once."""
    from envmanager import ConcurrentCallError

    gate = tmp_path / "gate"
    m = SubprocessEnvManager(EnvFactory(gate=str(gate)), 2, timeout=60)
    got: list = []
    raised: list[BaseException] = []

    def steps() -> None:
        try:
            got.extend(m.step({0: 1, 1: 1}))
            while len(got) < 2:  # (first-ready: the other one may come in a second call)
                got.extend(m.receive_steps(timeout=60))
        except BaseException as exc:
            raised.append(exc)

    stepper = threading.Thread(target=steps, name="stepper", daemon=True)
    try:
        m.reset(seed=0)  # (the gate holds steps only)
        stepper.start()
        deadline = time.monotonic() + 30
        while m.pool._waiting.get(0) != stepper.ident:  # (inside its wait)
            assert time.monotonic() < deadline, "the stepper did not wait"
            time.sleep(0.005)
        for call in (lambda: m.get_attr("total_steps"), lambda: m.call_on([1], "render"),
                     lambda: m.receive_steps(timeout=5), lambda: m.receive_batch(1, timeout=5),
                     lambda: m.reset(seed=1), lambda: m.drain(timeout=5)):
            with pytest.raises(ConcurrentCallError) as caught:
                call()
            assert (caught.value.thread, caught.value.caller) == ("stepper", threading.current_thread().name)
            assert isinstance(caught.value, RuntimeError) and "'stepper' waits" in str(caught.value)
        assert m.waiting_worker_ids == [0, 1] and not got and not raised  # nothing sent, nothing taken
        gate.touch()
        stepper.join(60)
        assert not stepper.is_alive() and not raised, raised
        assert sorted(info.worker_id for info in got) == [0, 1]  # each answer once, to the step sent
        assert all(info.current_result.observation[0] == 1.0 for info in got)
        assert m.get_attr("total_steps") == [1, 1]  # the stepper is out: the main thread's calls work
        again = m.step({0: 2, 1: 2})
        while len(again) < 2:
            again += m.receive_steps(timeout=30)
        assert m.get_attr("total_steps") == [2, 2] and not m.unreceived()
    finally:
        gate.touch()
        stepper.join(60)
        m.close()


def test_an_env_that_raises_in_a_reset_of_some_slots_is_rebuilt_alone():
    from envmanager.core.batch import BatchEnvManager

    factory = EnvFactory(per_env={1: {"fault": "raise_reset", "fault_at": 2}})
    with BatchEnvManager(factory, 2, envs_per_worker=2, autoreset_mode="disabled", restart_workers=True, timeout=30) as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        pid = m.processes[0].pid
        m.send_reset({1: (7, None)})  # slot 1's second reset raises: its env is rebuilt in its process
        batch = m.receive_reset_batch([1])
        assert batch.slots.tolist() == [1] and batch.interrupted == {1} and m.generation(1) == 1
        assert m.results.observation[1][0] == 0
        # Slot 0 shared the process: its env was left alone, nothing of it comes back.
        assert m.generation(0) == 0 and not m.unreceived() and m.processes[0].pid == pid
        assert m.get_attr("resets") == [1, 1]  # slot 0's env as it was; slot 1's fresh one reset once
        m.send_batch([0, 1], [1, 1])
        assert sorted(m.receive_batch(2).slots.tolist()) == [0, 1]


def test_sigterm_while_closing_does_not_cut_the_close_short(tmp_path):
    """A worker that is closing its envs finishes closing even if a SIGTERM arrives meanwhile
    (the parent interrupts a worker it sees as busy at close; the worker may already have read
    CLOSE): the env's close runs to its end, so e.g. a Unity player is told to quit, not killed."""
    from fault_envs import SignalledOnCloseEnv

    marker = tmp_path / "closed"
    m = SubprocessEnvManager(lambda i: SignalledOnCloseEnv(str(marker)), 1, timeout=30)
    m.reset()
    pid = m.processes[0].pid
    m.close(timeout=10.0)
    assert marker.read_text() == "closed"
    assert not alive([pid], timeout=0)


def test_a_restart_whose_replayed_call_raises_failed_and_is_tried_again_within_the_limits():
    """A setting every restart replays (ML-Agents' env parameters) raises in the new process: that
    restart failed. It is tried again within the limits, then the limit's error names the slot
    and carries the call's error: not a process left on its way back for good, its slot never
    served and no deadline running. The other process serves on."""
    from envmanager.core.batch import BatchEnvManager

    m = BatchEnvManager(EnvFactory(), 2, timeout=30, restart_workers=True, max_lifetime_restarts=2,
                        restarts_rate_limit_n=-1)
    try:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        m.set_replay_calls([("no_such_setting", (), {})])
        first = m.process_of(0).pid
        os.kill(first, signal.SIGKILL)
        assert not alive([first])
        m.send_batch([1], [1])
        assert m.receive_batch(1, timeout=30).slots.tolist() == [1]
        with pytest.raises(RestartLimitError, match="max_lifetime_restarts") as caught:
            m.send_batch([0], [1])
            for _ in range(10):  # each failed restart is a wait of its own, at most
                m.receive_batch(1, timeout=30)
        assert caught.value.worker_id == 0 and m.restart_count(0) == 2
        assert "no_such_setting" in str(caught.value) or "no_such_setting" in str(caught.value.__cause__)
        m.send_batch([1], [2])
        assert m.receive_batch(1, timeout=30).slots.tolist() == [1] and m.results.observation[1][2] == 2
        pids = [w.pid for w in m.processes]
    finally:
        m.close()
    assert not alive(pids)


def test_the_gymnasium_drop_in_closed_from_another_thread_mid_step_raises_manager_closed(tmp_path, caplog):
    """As the core's: the step under way raises ``ManagerClosedError`` (it raised a bare
    ``AssertionError`` from the drop-in's clean-up, the closed error only chained to it), with
    no warning of a failed clean-up."""
    from envmanager import AsyncVectorEnv

    gate = str(tmp_path / "never")
    envs = AsyncVectorEnv([functools.partial(ControlledEnv, i, gate=gate if i == 0 else None) for i in range(2)],
                          worker_timeout=600)
    envs.reset(seed=0)
    pids = [w.pid for w in envs._manager.processes]
    closer = threading.Timer(0.3, envs.close)
    closer.start()
    try:
        with caplog.at_level("WARNING", logger="envmanager"), pytest.raises(ManagerClosedError):
            envs.step(np.ones(2, np.int64))
    finally:
        closer.join(30)
        envs.close()
    assert not alive(pids, timeout=5.0)
    assert not [r for r in caplog.records if "could not drain" in r.getMessage()], caplog.text


class _SlowClose(ControlledEnv):
    def close(self) -> None:
        time.sleep(30)  # a simulator taking its time to shut down


def test_a_close_cut_short_by_ctrl_c_twice_is_finished_by_the_next(monkeypatch):
    """Ctrl-C while the envs close, and again while close() ends the workers by force (a user
    pressing it twice): the next close() (or the one at exit) still ends every worker; it did
    nothing, the pool already forgotten, and the workers ran on."""
    m = SubprocessEnvManager(lambda i: _SlowClose(i), 3, timeout=30)
    m.reset()
    pids = [w.pid for w in m.processes]
    presses = ctrl_c_twice_in_close(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        m.close()
    assert presses == ["wait", "stop"] and m.closed
    with pytest.raises(ManagerClosedError):
        m.step({0: 1})
    m.close(timeout=1.0)
    assert not alive(pids, timeout=5.0), "a close cut short left workers running"
    m.close()  # and again: nothing left to do


def test_a_close_from_another_thread_meanwhile_waits_for_the_first(monkeypatch):
    """Two threads closing at once: the second waits for the first, then finds nothing left.
    It ended the workers and closed the pipes under the first, which raised a bare
    ``ValueError: process object is closed`` or ``OSError: Bad file descriptor`` (the step
    queue's pipe read after the other had closed it)."""
    import envmanager.core.pool as pool_module

    m = SubprocessEnvManager(lambda i: _SlowClose(i), 2, timeout=30)
    m.reset()
    pids = [w.pid for w in m.processes]
    waited = pool_module.wait_for_ready
    first_waits, go_on = threading.Event(), threading.Event()
    errors = []

    def paused(*args):  # the first close, held while its envs close
        if threading.current_thread() is first:
            first_waits.set()
            go_on.wait(10)
        return waited(*args)

    def close(timeout):
        try:
            m.close(timeout)
        except BaseException as exc:
            errors.append(exc)

    monkeypatch.setattr(pool_module, "wait_for_ready", paused)
    first = threading.Thread(target=close, args=(1.0,))
    second = threading.Thread(target=close, args=(10.0,))
    first.start()
    try:
        assert first_waits.wait(10)
        second.start()
        second.join(1.0)
        assert second.is_alive(), "the second close() returned while the first was still closing"
    finally:
        go_on.set()
        first.join(30)
        second.join(30)
        m.close()
    assert not errors, errors
    assert not alive(pids, timeout=5.0)


@pytest.mark.parametrize("call", ["reset", "step", "call"])
def test_a_close_from_another_thread_during_a_send_is_manager_closed(call, monkeypatch):
    """Another thread's ``close()`` lands while this thread's call is past its look at the pool
    and before its sends (this thread held there until the close is done): the call raises
    ``ManagerClosedError``, as a call waiting for the workers does, not what it reached for
    next (an ``IndexError`` from the emptied process list, 1 in 7 runs of a sampler closed by a
    timer thread). Every process is reaped."""
    import envmanager.core.batch as batch_module

    m = SubprocessEnvManager(EnvFactory(), 2, timeout=30)
    m.reset()
    pids = [w.pid for w in m.processes]
    closer = threading.Thread(target=m.close)

    def then_closed(original):
        def held(*args, **kwargs):
            result = original(*args, **kwargs)
            closer.start()
            closer.join(30)
            return result
        return held

    if call == "reset":
        monkeypatch.setattr(batch_module, "reset_plan", then_closed(batch_module.reset_plan))
        send = functools.partial(m.send_reset, {0: (1, None)})
    elif call == "step":
        monkeypatch.setattr(batch_module, "slot_array", then_closed(batch_module.slot_array))
        send = functools.partial(m.send_batch, [0, 1], np.ones(2, dtype=np.int64))
    else:
        monkeypatch.setattr(m, "wait_idle", then_closed(m.wait_idle))
        send = functools.partial(m.send_call, "reset")
    try:
        with pytest.raises(ManagerClosedError, match="closed by another thread during the call"):
            send()
        assert not closer.is_alive(), "the other thread's close() did not end"
    finally:
        m.close()
    assert not alive(pids, timeout=5.0)


_FORKS_AFTER_START = """
import os, sys
import numpy as np
from envmanager import SubprocessEnvManager
from envmanager.testing.envs import EnvFactory

if __name__ == "__main__":
    m = SubprocessEnvManager(EnvFactory(), 2, context="fork", timeout=10)
    m.reset()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a helper forked with os.fork, ending normally: its exit handlers run
    os.waitpid(pid, 0)
    infos = m.step({0: 1, 1: 1})
    while len(infos) < 2:
        infos += m.receive_steps(timeout=10)
    print("stepped", sorted(i.worker_id for i in infos), flush=True)
    m.close()
"""


_CLOSES_IN_A_FORKED_CHILD = """
import os, signal, sys, time
import envmanager.wire.shm as shm
shm.SharedFile.create = classmethod(lambda cls: None)  # no memfd: named segments, as on macOS
from envmanager import SubprocessEnvManager
from envmanager.testing.envs import EnvFactory

if __name__ == "__main__":
    m = SubprocessEnvManager(EnvFactory(), 2, context="fork", timeout=10, restart_workers=True)
    m.reset()
    pid = os.fork()
    if pid == 0:
        m.close()  # a helper forked with os.fork leaving the same with-block
        m.close()  # (again: idempotent, as __del__'s; the owner's part of close() is not this child's either)
        os._exit(0)
    os.waitpid(pid, 0)
    os.kill(m.processes[0].pid, signal.SIGKILL)
    until = time.monotonic() + 30  # (worker 1 steps on meanwhile: the restart takes what the machine lets it)
    while time.monotonic() < until:
        if any(i.interrupted for i in m.step(dict.fromkeys(m.idle_worker_ids, 1))):
            print("restarted", flush=True)
            break
    m.close()
"""


def test_a_close_in_a_child_forked_with_os_fork_frees_nothing_of_the_parent(tmp_path):
    """A ``close()`` in such a child only drops its references: it unlinked the parent's named
    shared memory (macOS), so the parent's next restart failed to map it."""
    script = tmp_path / "closes.py"
    script.write_text(_CLOSES_IN_A_FORKED_CHILD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "restarted" in done.stdout, done.stderr


def test_a_child_forked_with_os_fork_leaves_the_workers_to_the_parent(tmp_path):
    """multiprocessing's exit handler, run in a child made with ``os.fork``, SIGTERMed every
    daemonic worker it inherited the records of: the parent's next step found them dead. The
    child's own exit handlers no longer touch the parent's workers."""
    script = tmp_path / "forks.py"
    script.write_text(_FORKS_AFTER_START)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "stepped [0, 1]" in done.stdout, done.stderr
    assert "Traceback" not in done.stderr and "AssertionError" not in done.stderr, done.stderr


class RaisesThenDies(ControlledEnv):
    """Its step raises once it is told to (a marker file), and its process is killed half a
    second later, from a thread: the env's error is sent before the process dies."""

    def __init__(self, marker: str, worker_id: int = 0) -> None:
        super().__init__()
        self.marker = marker

    def step(self, action):
        if os.path.exists(self.marker):
            os.unlink(self.marker)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
            raise RuntimeError("the env raised, then its process was killed")
        return super().step(action)


@pytest.mark.parametrize("mailbox", ["on", "off"])
def test_an_env_error_sent_before_its_process_died_is_the_envs_and_the_death_the_processs(tmp_path, monkeypatch,
                                                                                          mailbox):
    """Restarts off: a process whose env raised and which died before its answer was read. The
    env's error is raised for its slot, and the process is given up for its death: its error on
    every later use is ``WorkerDiedError``, not the env's (which named one slot and hid the death)."""
    from envmanager.core.batch import BatchEnvManager

    monkeypatch.setenv("ENVMANAGER_MAILBOX", mailbox)
    marker = str(tmp_path / "raise")
    with BatchEnvManager(functools.partial(RaisesThenDies, marker), 2, timeout=30, context="fork") as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        process = psutil.Process(m.process_of(1).pid)
        open(marker, "w").close()
        m.send_batch([1], np.ones(1, np.int64))
        deadline = time.monotonic() + 60  # a bound on the loop, not a timing assertion
        while process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)  # dead, not yet reaped: its answer (the env's error) waits unread
        assert process.status() == psutil.STATUS_ZOMBIE
        with pytest.raises(WorkerError) as caught:
            m.receive_batch(1)
        assert not isinstance(caught.value, WorkerDiedError) and caught.value.worker_id == 1
        assert "the env raised, then its process was killed" in str(caught.value)
        with pytest.raises(WorkerDiedError) as again:  # the death: taken with the env's error, or at the next use
            m.send_reset({1: (1, None)})  # (an env that raised is reset before it steps again)
            m.receive_reset_batch([1])
        died = again.value
        assert m.failure_of(1) is died and died.worker_ids == [1], died
        for use in (lambda: m.send_reset({1: (1, None)}), lambda: m.send_batch([1], np.ones(1, np.int64))):
            with pytest.raises(WorkerDiedError) as again:  # and on every later use of that process
                use()
            assert again.value is died
        m.send_batch([0], np.ones(1, np.int64))  # the other process serves on
        for _ in range(2):  # (the death, if taken with the env's error, still waits to be raised once)
            try:
                assert m.receive_batch(1).slots.tolist() == [0]
                break
            except WorkerDiedError as waiting:
                assert waiting is died
        else:
            raise AssertionError("env 0's step never came")
