"""The one supervisor (``envmanager.core.supervisor``) through the real pools: the same fault —
a unit of remote work killed — gives the same restart counting and, past the limits, the same
error shape in the core's process pool (real worker processes) and in the Ray sampler's node
pool (real actors in a local Ray session: ``test_ray_supervisor.py``): one restart counted once, then ``RestartLimitError``
naming the slots and the process or node, with the failure, raised at once on every later use.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from envmanager import RestartLimitError, SubprocessEnvManager, WorkerDiedError
from envmanager.testing.envs import EnvFactory
from process_helpers import alive

LIMITS = {"max_lifetime_restarts": 1, "restarts_rate_limit_n": -1}  # one restart per unit, then refused


def step_until(m, done, seconds: float = 60.0) -> list:
    """Step every idle slot until ``done(infos)``; a bound on the loop, not a timing assertion."""
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        infos = m.step(dict.fromkeys(m.idle_worker_ids, 1))
        if done(infos):
            return infos
    raise AssertionError("stepping never got there")


def shape(error: RestartLimitError) -> tuple:
    """What a user catching ``RestartLimitError`` reads, as types and presence (not values)."""
    return (isinstance(error, RestartLimitError), "max_lifetime_restarts" in error.reason,
            bool(error.worker_ids), error.worker_id == error.worker_ids[0] or error.worker_id in error.worker_ids,
            error.failure is not None, "not restarted" in str(error) or "was not restarted" in str(error))


def kill_process(m, process: int) -> None:
    os.kill(m.processes[process].pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# The core's process pool


def core_limit_error() -> tuple[RestartLimitError, int, int]:
    """Kill process 1 (slots 2–3) twice: restarted once, then refused. Returns the error, the
    restarts counted and process 1's count."""
    with SubprocessEnvManager(EnvFactory(), 4, envs_per_worker=2, timeout=30, restart_workers=True, **LIMITS) as m:
        m.reset()
        assert m.restarts == 0 and m.supervisor.failure(1) is None
        first = m.processes[1].pid
        kill_process(m, 1)
        step_until(m, lambda infos: any(i.interrupted for i in infos))
        restarts, count = m.restarts, m.restart_count(2)
        assert m.processes[1].pid != first and m.supervisor.failure(1) is None
        kill_process(m, 1)
        with pytest.raises(RestartLimitError) as caught:
            step_until(m, lambda infos: False)
        error = caught.value
        # given up: its error is the supervisor's, the same object on every later use, at once
        assert m.supervisor.failure(1) is error and m.failure_of(3) is error
        for _ in range(2):
            with pytest.raises(RestartLimitError) as again:
                m.step({2: 1})
            assert again.value is error
        assert not alive([m.processes[1].pid], timeout=5.0)
        assert m.restarts == restarts  # a refusal is not a restart
    return error, restarts, count


def test_core_pool_restarts_once_then_gives_up_with_the_one_error_shape():
    error, restarts, count = core_limit_error()
    assert restarts == 1 and count == 1  # the kill, counted once (the pool's count and the process's)
    assert error.worker_ids == [2, 3] and error.process == 1 and "process 1" in str(error)
    assert isinstance(error.failure, WorkerDiedError) and error.failure.process == 1
    assert error.cause is None and error.remote_traceback is None  # a death carries no remote exception
    assert shape(error) == (True, True, True, True, True, True)


def test_restarts_off_raise_the_failure_itself_and_give_the_process_up():
    with SubprocessEnvManager(EnvFactory(), 2, timeout=30, restart_workers=False) as m:
        m.reset()
        kill_process(m, 1)
        with pytest.raises(WorkerDiedError) as caught:
            step_until(m, lambda infos: False)
        assert not isinstance(caught.value, RestartLimitError) and caught.value.worker_id == 1
        assert m.supervisor.failure(1) is caught.value and m.restarts == 0
        with pytest.raises(WorkerDiedError) as again:
            m.step({1: 1})
        assert again.value is caught.value
        # the other process serves on: its step may still have been in flight when slot 1's error
        # came, or its result held back by that error (nothing lost: it comes with this call)
        infos = m.step({0: 1} if 0 in m.idle_worker_ids else {})
        assert infos and {i.worker_id for i in infos} == {0} and not any(i.interrupted for i in infos)
