"""The env that hung or crashed, named (issue #30, item 6).

A worker process hosting several envs marks, before each env call, which env and which call
(``envmanager.wire.marks``); the parent reads the mark when the process hangs or dies, so the
error says ``worker 3 (process 1, slots 2–3) hung in step()`` rather than naming the whole
process. Real worker processes: a hang, a segfault and a kill in a packed process, with the
mailbox on and off, through the core, the gymnasium and SB3 drop-ins and both samplers; and a
process killed while between calls names no env (nothing is guessed).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import signal
import time

import numpy as np
import pytest

from envmanager import AsyncVectorEnv, SubprocessEnvManager
from envmanager.errors import RestartLimitError, WorkerDiedError, WorkerTimeoutError, with_slot_offset
from envmanager.testing.envs import ControlledEnv, EnvFactory
from envmanager.wire.mailbox import mailbox_supported
from envmanager.wire.marks import CALL, STEP, CallMarks, WorkerMarks, mark
from fault_envs import FAULT_SLOT, FaultFactory, FaultPolicy

TIMEOUT = 1.0  # the managers' deadline per answer: a hung env is judged after it
NAMED = re.compile(r" in \w+\(\)")  # how an error names a call


@pytest.fixture(params=["mailbox-on", "mailbox-off"])
def mailbox(request, monkeypatch):
    """Every test twice: hot-path requests through the shared-memory mailbox, and not."""
    on = request.param == "mailbox-on"
    if on and not mailbox_supported():
        pytest.skip("the mailbox is x86 only (its store order)")
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "on" if on else "off")
    if on:  # the mailbox lives in the step-queue transport (the suite's portable run forces another)
        monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")
    return on


def step_until_error(m, seconds: float = 30.0):
    """Step every idle slot until something raises (bounded)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m.step(dict.fromkeys(m.idle_worker_ids, 1))
    raise AssertionError("no error was raised")


def manager(factory, n: int, epw: int, mailbox: bool, **kwargs) -> SubprocessEnvManager:
    m = SubprocessEnvManager(factory, n, envs_per_worker=epw, context="fork", timeout=TIMEOUT, **kwargs)
    assert (m.pool.mailboxes is not None) == mailbox
    return m


class ResetCrashEnv(ControlledEnv):
    """Segfaults in its first reset."""

    def reset(self, *, seed=None, options=None):
        ctypes.string_at(0)
        return super().reset(seed=seed, options=options)


class RenderHangEnv(ControlledEnv):
    def render(self):
        time.sleep(3600)


def crashing_reset(slot: int):
    return lambda env_id: ResetCrashEnv(env_id) if env_id == slot else ControlledEnv(env_id)


# ---------------------------------------------------------------------------------------------
# The core


@pytest.mark.parametrize("epw", [2, 3])
def test_a_hang_in_step_names_the_env_and_step(epw, mailbox):
    slot = epw + 1  # the second env of process 1
    with manager(EnvFactory(per_env={slot: {"fault": "hang", "fault_at": 2}}), 2 * epw, epw, mailbox) as m:
        m.reset()
        with pytest.raises(WorkerTimeoutError) as caught:
            step_until_error(m)
        err = caught.value
        assert err.hung and err.slot == slot and err.call == "step" and err.worker_id == slot
        assert err.worker_ids == list(range(epw, 2 * epw)) and err.processes == [1]  # every slot it holds, as before
        assert str(err).startswith(f"worker {slot} (process 1, slots {epw}–{2 * epw - 1}) hung in step(): "
                                   f"did not deliver an answer to STEP within {TIMEOUT:g} s")
        with pytest.raises(WorkerTimeoutError, match=rf"worker {slot} .* hung in step\(\)"):  # raised again, the same
            step_until_error(m)


@pytest.mark.parametrize("epw", [2, 3])
def test_a_segfault_in_reset_names_the_env_and_reset(epw, mailbox):
    slot = epw + 1
    with manager(crashing_reset(slot), 2 * epw, epw, mailbox) as m:
        with pytest.raises(WorkerDiedError) as caught:
            m.reset()
        err = caught.value
        assert err.slot == slot and err.call == "reset" and err.worker_id == slot and err.process == 1
        assert str(err) == f"worker {slot} (process 1, slots {epw}–{2 * epw - 1}) died (killed by SIGSEGV) in reset()"


def test_a_segfault_in_step_names_the_env_and_step(mailbox):
    with manager(EnvFactory(per_env={3: {"fault": "segfault", "fault_at": 3}}), 4, 2, mailbox) as m:
        m.reset()
        with pytest.raises(WorkerDiedError) as caught:
            step_until_error(m)
        assert (caught.value.slot, caught.value.call) == (3, "step")
        assert str(caught.value) == "worker 3 (process 1, slots 2–3) died (killed by SIGSEGV) in step()"


def test_a_hang_in_a_call_names_what_was_called(mailbox):
    with manager(lambda i: RenderHangEnv(i) if i == 3 else ControlledEnv(i), 4, 2, mailbox) as m:
        m.reset()
        with pytest.raises(WorkerTimeoutError) as caught:
            m.call("render")
        assert (caught.value.slot, caught.value.call) == (3, "render")
        assert "worker 3 (process 1, slots 2–3) hung in render()" in str(caught.value)


def test_a_process_killed_between_calls_names_no_env(mailbox):
    with manager(EnvFactory(), 4, 2, mailbox) as m:
        m.reset()
        infos = m.step(dict.fromkeys(range(4), 1))  # first-ready: wait for every answer
        while len(infos) < 4:
            infos += m.receive_steps()
        pid = m.process_of(3).pid
        os.kill(pid, signal.SIGKILL)  # idle: every answer is in, no request in flight
        with pytest.raises(WorkerDiedError) as caught:
            step_until_error(m)
        err = caught.value
        assert err.slot is None and err.call is None and not NAMED.search(str(err))
        assert err.worker_id == 2 and err.worker_ids == [2, 3]  # the process, as before
        assert str(err) == "worker 2 (process 1, slots 2–3) died (killed by SIGKILL)"


def test_past_the_restart_limit_the_error_names_the_env_and_call(mailbox):
    factory = EnvFactory(per_env={3: {"fault": "hang", "fault_at": 2}})
    with manager(factory, 4, 2, mailbox, restart_workers=True, max_lifetime_restarts=0) as m:
        m.reset()
        with pytest.raises(RestartLimitError) as caught:
            step_until_error(m)
        err = caught.value
        assert (err.slot, err.call, err.worker_id) == (3, "step", 3)
        assert isinstance(err.failure, WorkerTimeoutError) and err.failure.slot == 3
        assert str(err).startswith("worker 3 (process 1, slots 2–3) failed and was not restarted")
        assert "hung in step()" in str(err)


def test_a_restarted_process_starts_with_a_clear_record_and_names_its_own_calls(mailbox):
    """A segfault in step is restarted; the new process's record reads clear once it is idle,
    and killed then, between calls, it names no env."""
    factory = EnvFactory(per_env={3: {"fault": "segfault", "fault_at": 2}})
    with manager(factory, 4, 2, mailbox, restart_workers=True, max_lifetime_restarts=1) as m:
        m.reset()
        pid = m.process_of(3).pid
        deadline = time.monotonic() + 30
        while m.process_of(3).pid == pid and time.monotonic() < deadline:
            m.step(dict.fromkeys(m.idle_worker_ids, 1))
        assert m.restart_count(3) == 1
        m.wait_idle()
        assert m.pool.marks is not None and m.pool.marks.read(1) is None  # between calls (booted and idle)
        os.kill(m.process_of(3).pid, signal.SIGKILL)
        with pytest.raises(RestartLimitError) as caught:
            step_until_error(m)
        assert caught.value.slot is None and caught.value.call is None
        assert not NAMED.search(str(caught.value))


def test_a_remapped_error_keeps_its_env_and_call():
    hung = WorkerTimeoutError([2, 3], 1.0, "an answer to STEP", processes=[1], slot=3, call="step")
    moved = with_slot_offset(hung, 10)
    assert isinstance(moved, WorkerTimeoutError) and (moved.slot, moved.call, moved.worker_ids) == (13, "step", [12, 13])
    assert "worker 13 (process 1, slots 12–13) hung in step()" in str(moved)
    died = WorkerDiedError(3, -11, "", [2, 3], 1, call="reset")
    limit = RestartLimitError(3, "no restarts left", died, [2, 3], 1)
    moved_limit = with_slot_offset(limit, 10)
    assert isinstance(moved_limit, RestartLimitError) and (moved_limit.slot, moved_limit.call) == (13, "reset")
    assert "worker 13 (process 1, slots 12–13) died (killed by SIGSEGV) in reset()" in str(moved_limit)
    import pickle

    again = pickle.loads(pickle.dumps(died))
    assert (again.slot, again.call, str(again)) == (3, "reset", str(died))
    again_hung = pickle.loads(pickle.dumps(hung))
    assert (again_hung.slot, again_hung.call, str(again_hung)) == (3, "step", str(hung))


def test_the_record_in_one_process():
    """The record's two halves: a worker's stores read back by the parent; reset clears it."""
    marks = CallMarks.create(3)
    if marks is None:
        pytest.skip("no shared file here: no record")
    try:
        worker = WorkerMarks(marks.file, 2)
        assert marks.read(2) is None
        worker.words[worker.at] = mark(7, STEP)
        assert marks.read(2) == (7, "step") and marks.read(1) is None
        worker.name("render")
        worker.words[worker.at] = mark(8, CALL)
        assert marks.read(2) == (8, "render")
        marks.reset(2)
        assert marks.read(2) is None
    finally:
        marks.close()
    assert marks.read(2) is None  # closed: nothing to read


# ---------------------------------------------------------------------------------------------
# The drop-ins and the samplers pass it on


def test_gymnasium_drop_in_names_the_hung_env(mailbox):
    fns = [lambda i=i: ControlledEnv(i, fault="hang" if i == 3 else None, fault_at=2) for i in range(4)]
    env = AsyncVectorEnv(fns, context="fork", envs_per_worker=2, worker_timeout=TIMEOUT)
    try:
        env.reset(seed=0)
        with pytest.raises(WorkerTimeoutError, match=r"worker 3 \(process 1, slots 2–3\) hung in step\(\)") as caught:
            for _ in range(5):
                env.step(np.ones(4, dtype=np.int64))
        assert (caught.value.slot, caught.value.call) == (3, "step")
    finally:
        env.close()


def test_gymnasium_drop_in_names_the_env_that_crashed_in_reset(mailbox):
    fns = [lambda i=i: ResetCrashEnv(i) if i == 3 else ControlledEnv(i) for i in range(4)]
    env = AsyncVectorEnv(fns, context="fork", envs_per_worker=2, worker_timeout=TIMEOUT)
    try:
        with pytest.raises(WorkerDiedError, match=r"worker 3 \(process 1, slots 2–3\) died \(killed by SIGSEGV\) in reset\(\)"):
            env.reset(seed=0)
    finally:
        env.close()


def test_sb3_drop_in_names_the_hung_and_the_crashed_env(mailbox):
    pytest.importorskip("stable_baselines3")
    from envmanager.sb3 import SubprocVecEnv

    fns = [lambda i=i: ControlledEnv(i, fault="hang" if i == 3 else None, fault_at=2) for i in range(4)]
    venv = SubprocVecEnv(fns, start_method="fork", envs_per_worker=2, timeout=TIMEOUT)
    try:
        venv.reset()
        with pytest.raises(WorkerTimeoutError, match=r"worker 3 \(process 1, slots 2–3\) hung in step\(\)"):
            for _ in range(5):
                venv.step(np.ones(4, dtype=np.int64))
    finally:
        venv.close()
    fns = [lambda i=i: ResetCrashEnv(i) if i == 2 else ControlledEnv(i) for i in range(4)]
    venv = SubprocVecEnv(fns, start_method="fork", envs_per_worker=2, timeout=TIMEOUT)
    try:
        with pytest.raises(WorkerDiedError, match=r"worker 2 \(process 1, slots 2–3\) died \(killed by SIGSEGV\) in reset\(\)"):
            venv.reset()
    finally:
        venv.close()


@pytest.mark.parametrize("kind", ["sampler", "worker"])
@pytest.mark.parametrize("fault", ["step_hang", "reset_kill"])
def test_the_samplers_name_the_env(kind, fault, mailbox, tmp_path):
    """The second env of process 0 (``FAULT_SLOT``) hangs in a step or is killed in a reset,
    restarts off: both samplers raise the core's error naming it (the worker-side rollout marks
    each env's call as the core does)."""
    from envmanager.sampler import Sampler, WorkerPolicySampler

    marker = str(tmp_path / "struck")
    cls = Sampler if kind == "sampler" else WorkerPolicySampler
    with cls(FaultFactory(fault, marker), 4, FaultPolicy(fault, marker), seed=0, envs_per_worker=2, context="fork",
             timeout=TIMEOUT * 3, restart_workers=False) as sampler:
        error = WorkerTimeoutError if fault == "step_hang" else WorkerDiedError
        call = "step" if fault == "step_hang" else "reset"
        with pytest.raises(error) as caught:
            for _ in range(20):
                sampler.obtain_steps(30 * 4) if kind == "sampler" else sampler.obtain_steps(30)
        assert (caught.value.slot, caught.value.call) == (FAULT_SLOT, call)
        assert f"worker {FAULT_SLOT} (process 0, slots 0–1)" in str(caught.value)
        assert f" in {call}()" in str(caught.value)


@pytest.mark.parametrize("context,library", [("fork", "grpc"), ("fork", None), ("forkserver", "grpc")])
def test_a_hang_in_a_worker_forked_from_threads_says_so(context, library, monkeypatch):
    """Forked from a process running threads with a library loaded whose pool hangs a forked
    child (gRPC's, torch's), a worker whose env calls into it can hang: the error says how it
    was started and what avoids it. Without such a library (numpy's OpenBLAS threads alone,
    always there), or not forked, no hint."""
    import threading

    import envmanager.core.process as process

    if library is None:
        monkeypatch.setattr(process, "FORK_UNSAFE", ("no_such_library",))
    else:
        pytest.importorskip(library)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # a thread pool's worker, in the parent
    other.start()
    try:
        factory = EnvFactory(per_env={1: {"fault": "hang", "fault_at": 1}})
        with SubprocessEnvManager(factory, 2, context=context, timeout=10.0) as m:  # (forkserver starts slowly)
            m.reset()
            with pytest.raises(WorkerTimeoutError) as caught:
                step_until_error(m)
    finally:
        stop.set()
        other.join()
    err = caught.value
    assert (err.slot, err.call) == (1, "step")
    assert str(err).startswith("worker 1 hung in step(): did not deliver an answer to STEP within")
    hinted = context == "fork" and library is not None
    forked = re.search(r"forked from a process running threads, with (.*) loaded.*context='forkserver' or 'spawn'",
                       str(err))
    assert (forked is not None) == hinted, str(err)
    if forked:
        assert library in forked.group(1) and err.hint in str(err)
    else:
        assert err.hint == ""
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.hint == err.hint
    assert with_slot_offset(err, 10).hint == err.hint  # (as a Ray node's error reaches its caller)


def _builds_forever(worker_id):
    time.sleep(60)  # as an env whose construction calls into a pool that is not in the forked child


def test_a_startup_hang_of_several_forked_workers_carries_the_hint():
    """Every forked worker hangs while it builds its env (the likeliest torch case): the one
    error naming them all carries the hint too."""
    import threading

    pytest.importorskip("grpc")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        with pytest.raises(WorkerTimeoutError) as caught:
            SubprocessEnvManager(_builds_forever, 2, context="fork", timeout=1.5)
    finally:
        stop.set()
        other.join()
    assert caught.value.worker_ids == [0, 1] and "grpc" in caught.value.hint and caught.value.hint in str(caught.value)
