"""The step board under faults, through real worker processes: an answer the caller takes late,
a process given up or replaced with board steps in flight, answers that do not pickle or do not
unpickle, a restart that cannot start a process. Each case checks what the caller gets (the
step's own result, or its error naming the env) and that nothing is left in flight, spinning
or lost; the ``off`` cases run the same on the pipe path (``ENVMANAGER_MAILBOX=off``), the
reference the board must match.
"""

from __future__ import annotations

import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from envmanager.core.batch import BatchEnvManager
from envmanager.errors import WorkerDiedError, WorkerError
from envmanager.testing.envs import EnvFactory
from envmanager.wire.mailbox import mailbox_supported
from envmanager.wire.messages import ON_PIPE

pytestmark = pytest.mark.skipif(not mailbox_supported(), reason="the mailbox is x86 only (its store order)")


@pytest.fixture(params=["on", "off"])
def mailbox(request, monkeypatch):
    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")  # the board is the step queue's (a leg forces the portable one)
    monkeypatch.setenv("ENVMANAGER_MAILBOX", request.param)
    return request.param


@pytest.fixture
def board(monkeypatch):
    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "on")


class InfoEnv(gym.Env):
    """Observation ``[t, action]``; at step ``at`` its info holds ``value()`` (else none)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, value, at=2):
        self.value, self.at, self.t = value, at, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t, float(action)]), 1.0, False, False, {"x": self.value()} if self.t == self.at else {}


class _Unimportable:
    """Pickles in the worker; unpickling it fails (as a class the parent cannot import would)."""

    def __reduce__(self):
        return (int, ("not a number",))


def lock_info_env(slot):
    return InfoEnv(threading.Lock)  # a lock does not pickle


def unimportable_info_env(slot):
    return InfoEnv(_Unimportable)


def reset_all(m, n):
    m.send_reset({s: (s, None) for s in range(n)})
    return m.receive_reset_batch()


@pytest.mark.parametrize("restart", [False, True], ids=["restarts-off", "restarts-on"])
def test_an_answer_that_came_in_time_is_taken_when_the_caller_looks_late(mailbox, restart):
    # A learner step longer than the deadline between send and receive: the worker answered at
    # once, so its answer is taken; it is not judged hung (restarted, its episode cut, or raised).
    m = BatchEnvManager(EnvFactory(), 1, timeout=2.5, restart_workers=restart)  # (a loaded CI machine starts it in time)
    try:
        assert (m.pool.mailboxes is not None) == (mailbox == "on")
        reset_all(m, 1)
        m.send_batch([0], np.array([2]))
        time.sleep(2.8)  # the caller is busy elsewhere, past the deadline
        batch = m.receive_batch()
        assert batch.slots.tolist() == [0] and not batch.interrupted
        assert m.results.observation[0][0] == 1 and m.results.observation[0][2] == 2  # step 1, action 2
        assert m.restarts == 0 and m.pool.processes[0].alive()
    finally:
        m.close()


def test_a_notice_of_the_replaced_process_is_not_read_from_the_replacements_pipe(board):
    # A board notice whose payload went on the old process's own pipe (too big for one atomic
    # write), still queued when the process was replaced: stale, dropped unread. Reading the new
    # process's pipe for it would block, then fail the healthy replacement.
    m = BatchEnvManager(EnvFactory(per_env={0: {"fault": "sigkill", "fault_at": 2}}), 1, timeout=10.0,
                        restart_workers=True)
    try:
        assert m.pool.mailboxes is not None
        reset_all(m, 1)
        old = m.pool.processes[0]
        m.send_batch([0], np.array([1]))
        m.receive_batch()
        m.send_batch([0], np.array([1]))  # dies in this step: restarted
        batch = m.receive_batch()
        assert batch.interrupted == {0} and m.restarts == 1
        new = m.pool.processes[0]
        assert new is not old and old.started_at < new.started_at
        completions = []
        m.pool._board_notice(new, ON_PIPE, b"", old.started_at, time.monotonic(), completions)  # (its payload is nowhere)
        assert completions == [] and m.restarts == 1 and new.alive()
        m.send_batch([0], np.array([2]))
        assert m.receive_batch().slots.tolist() == [0] and m.results.observation[0][2] == 2
    finally:
        m.close()


def test_a_process_given_up_with_a_board_step_in_flight_leaves_nothing_waiting(board):
    # Restarts off: process 0 dies in a board step and is given up. What its answer words were
    # left at must not read as an answer waiting, or every later wait returns at once (a spin).
    m = BatchEnvManager(EnvFactory(per_env={0: {"fault": "sigkill", "fault_at": 1}}), 2, timeout=10.0,
                        restart_workers=False)
    try:
        box = m.pool.mailboxes
        assert box is not None
        reset_all(m, 2)
        m.send_batch([0, 1], np.array([1, 1]))
        with pytest.raises(WorkerDiedError):
            m.receive_batch(min_count=2)
        if m.in_flight() or m.unreceived():
            assert m.receive_batch().slots.tolist() == [1]  # slot 1's step
        assert not m.in_flight() and not m.unreceived()
        assert not box.waiting()  # nothing posted, nothing in flight: the parent may sleep
        m.send_batch([1], np.array([2]))
        assert m.receive_batch().slots.tolist() == [1] and m.results.observation[1][2] == 2
        with pytest.raises(WorkerDiedError):
            m.send_batch([0], np.array([1]))  # the process given up: its error on every use
    finally:
        m.close()


@pytest.mark.parametrize("make, words", [(lock_info_env, "cannot pickle"),  # in the worker
                                         (unimportable_info_env, "could not be unpickled here")],  # in the parent
                         ids=["not-pickled", "not-unpickled"])
def test_an_answer_that_does_not_pickle_or_unpickle_fails_its_step_not_the_process(mailbox, make, words):
    # As on the pipe path: the step raises the error naming the env (not a death); its steps are
    # out of flight, and the process, alive and serving, is not judged hung later (the caller
    # looks again past the deadline): a reset, then steps.
    m = BatchEnvManager(make, 1, timeout=2.5, restart_workers=False)
    try:
        reset_all(m, 1)
        m.send_batch([0], np.array([1]))
        m.receive_batch()
        m.send_batch([0], np.array([1]))
        with pytest.raises(WorkerError, match=words) as raised:
            m.receive_batch()
        assert not isinstance(raised.value, WorkerDiedError) and raised.value.worker_id == 0
        assert not m.in_flight()
        if m.pool.mailboxes is not None:  # (the failure's notice comes first, its answer words a moment later)
            settled = time.monotonic() + 10
            while m.pool.mailboxes.waiting() and time.monotonic() < settled:
                time.sleep(0.001)
            assert not m.pool.mailboxes.waiting()  # then nothing reads as an answer waiting: the parent may sleep
        time.sleep(2.7)  # past the deadline
        reset_all(m, 1)
        m.send_batch([0], np.array([2]))
        assert m.receive_batch().slots.tolist() == [0] and m.results.observation[0][:2].tolist() == [1, 2]
        assert m.restarts == 0 and m.pool.processes[0].alive()
    finally:
        m.close()


def test_an_answer_taken_in_the_wait_that_restarts_its_process_keeps_its_info(board):
    # Two lanes of one process: lane 1 (slot 0) answers on the board with its info in the info
    # rows, lane 2 (slot 1) kills the process. Slot 0's answer is its own step, with its info.
    m = BatchEnvManager(EnvFactory(per_env={1: {"fault": "sigkill", "fault_at": 3}}), 2, envs_per_worker=2,
                        double_buffer=True, timeout=10.0, restart_workers=True)
    try:
        assert m.pool.mailboxes is not None and m.double_buffer
        reset_all(m, 2)
        for t in (1, 2):  # the info schema announced, the reward's shape decided
            m.send_batch([0, 1], np.array([t, t]))
            assert m.receive_batch(min_count=2).infos[0] == {"t": t}
        m.send_batch([0, 1], np.array([2, 2]))
        time.sleep(0.5)  # both lanes ended: slot 0 answered, the process died
        got: dict[int, list] = {0: [], 1: []}
        while len(got[1]) < 1:
            batch = m.receive_batch()
            for s in batch.slots.tolist():
                got[s].append((s in batch.interrupted, batch.infos.get(s), m.results.observation[s][0]))
        assert got[0][0] == (False, {"t": 3}, 3)  # its own step first, with its info
        assert [i for i, _, _ in got[0][1:]] == [True] * (len(got[0]) - 1)  # (then its env's fresh reset)
        assert got[1] == [(True, {"env_id": 1, "seed": None}, 0)] and m.restarts == 1  # the restart's reset
    finally:
        m.close()


def test_a_restart_that_cannot_start_a_process_gives_it_up_and_loses_no_answer(board, monkeypatch):
    # Out of memory or processes when a restart forks: the process is given up with an error
    # naming it and the cause; answers of other processes taken in the same wait are kept.
    # (The failed fork is injected: it cannot be caused here without starving the machine.)
    m = BatchEnvManager(EnvFactory(per_env={0: {"fault": "sigkill", "fault_at": 1}}), 2, timeout=10.0,
                        restart_workers=True)
    try:
        reset_all(m, 2)
        start = m.pool._start

        def no_fork(spec, boot=None):
            if boot is not None:
                raise OSError(11, "Resource temporarily unavailable")
            return start(spec, boot)

        monkeypatch.setattr(m.pool, "_start", no_fork)
        m.send_batch([0], np.array([1]))  # process 0 dies in this step
        m.send_reset({1: (7, None)})  # process 1's reset, answered meanwhile
        time.sleep(0.5)
        with pytest.raises(WorkerDiedError, match="could not start a process") as raised:
            m.receive_batch()
        assert raised.value.worker_id == 0
        got = m.receive_reset_batch([1])
        assert got.slots.tolist() == [1]
        with pytest.raises(WorkerDiedError, match="could not start a process"):
            m.send_batch([0], np.array([1]))
        m.send_batch([1], np.array([2]))
        assert m.receive_batch().slots.tolist() == [1] and m.results.observation[1][2] == 2
    finally:
        m.close()
