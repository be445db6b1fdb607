"""Randomized fault schedules for ``MLAgentsEnvManager`` (issue 30, item 8): two fake players under
the real ``mlagents_envs`` client, driven through random interleavings of ``get_steps`` calls,
environment-parameter changes, players killed (SIGKILL) or frozen (SIGSTOP: a hang), and env
worker processes killed, with restarts on and off; after every call the test checks:

* it returned or raised within its deadline;
* every step's ActionInfo holds the actions its player received (the players echo them);
* an interrupted step (a restarted worker's fresh reset) comes only from a worker whose player or
  process was killed or frozen, and carries no ActionInfo;
* restarts off: the error names the worker whose player or process failed, and every later call
  raises at once;
* after ``close()`` no player and no worker process is left running.

The seed, count and length of the schedules: ``test_fault_schedules``' variables.
"""
from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import pytest

pytest.importorskip("mlagents_envs")

from hypothesis import strategies as st

from envmanager.errors import (
    EnvManagerError,
    InvalidInputError,
    RestartLimitError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from player_policies import UniquePolicy
from process_helpers import alive
from test_fault_schedules import MARGIN, TALLY, kill, run, within
from test_recorded_actions import SLOW, Checker, start

N = 2  # players
TIMEOUT = 8.0  # the manager's deadline per answer: a frozen player costs this much


class MLAgentsSchedule:
    """An ``MLAgentsEnvManager`` of ``N`` fake players, stepped through faults."""

    def __init__(self, fake_player: Any, tmp_path: Any, restarts: bool) -> None:
        self.restarts = restarts
        self.m = start(fake_player, tmp_path, N, {key: [*SLOW[:1], "0.002"] for key in range(N)},
                       timeout=TIMEOUT, restart_workers=restarts, max_lifetime_restarts=-1,
                       restarts_rate_limit_n=-1)
        self.pids: set[int] = set()
        self.faulted: set[int] = set()  # worker ids whose player or process was killed or frozen
        self.frozen: list[int] = []
        self.check = Checker()
        self.given_up: EnvManagerError | None = None
        try:
            self.note_pids()
            self.m.set_policy("FakeBehavior?team=0", UniquePolicy())
            with within(TIMEOUT + MARGIN, "reset()"):
                self.m.reset()
        except BaseException:
            self.m.close()
            raise

    def note_pids(self) -> None:
        self.pids |= {pid for pid in self.m.player_pids.values() if pid is not None}
        self.pids |= {w.pid for w in self.m.manager.processes if w.pid is not None}

    def bound(self) -> float:
        return TIMEOUT * (1 + len(self.frozen)) + MARGIN

    def steps(self, calls: int) -> None:
        for _ in range(calls):
            try:
                with within(self.bound(), "get_steps()"):
                    steps = self.m.get_steps()
            except EnvManagerError as error:
                self.failed(error)
                return
            for step in steps:
                if step.interrupted:
                    TALLY["interrupted"] += 1
                    assert self.restarts, f"worker {step.worker_id}: an interrupted step without restarts"
                    assert step.worker_id in self.faulted, f"worker {step.worker_id} interrupted, yet nothing failed"
            self.check(steps)
            TALLY["env steps"] += len(steps)
            self.note_pids()

    def failed(self, error: EnvManagerError) -> None:
        TALLY[type(error).__name__] += 1
        if isinstance(error, RestartLimitError):
            raise AssertionError(f"restart limits are off, yet: {error}") from error
        assert not self.restarts, f"a failure with restarts on was not absorbed: {error}"
        assert isinstance(error, (WorkerError, WorkerDiedError, WorkerTimeoutError)), error
        assert error.worker_id in self.faulted, f"{error} names worker {error.worker_id}; failed: {self.faulted}"
        self.given_up = error

    def params(self, gravity: int) -> None:
        try:
            with within(self.bound(), "set_env_parameters()"):
                self.m.set_env_parameters({"gravity": float(gravity)})
        except EnvManagerError as error:
            self.failed(error)

    def kill_player(self, w: int) -> None:
        pid = self.m.player_pids.get(w)
        if pid is None:  # its replacement is still starting
            return
        self.pids.add(pid)
        kill(pid)
        self.faulted.add(w)

    def freeze_player(self, w: int) -> None:
        pid = self.m.player_pids.get(w)
        if pid is None or self.frozen:  # one per schedule at most: each costs the deadline
            return
        self.pids.add(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        self.frozen.append(pid)
        self.faulted.add(w)

    def kill_worker(self, w: int) -> None:
        pid = self.m.manager.process_of(w).pid
        assert pid is not None
        self.pids.add(pid)
        kill(pid)
        self.faulted.add(w)

    def use_after_give_up(self) -> None:
        """After a failure (restarts off) no step of a worker given up comes back: each later
        call raises at once naming a worker that failed — its error again, or, where its
        process serves on (its player was lost), the refusal to step it before a reset — or
        serves the other workers only (``test_env_manager``'s "the other workers are still
        served"); and a reset fails on the failed worker."""
        assert self.given_up is not None
        gone = getattr(self.given_up, "worker_id", None)
        held = True  # results it delivered before it failed may still be handed out, once
        with within(self.bound(), "get_steps() after a worker failed"):
            for _ in range(20):
                try:
                    steps = self.m.get_steps()
                except EnvManagerError as again:
                    self.names_a_failed_worker(again)
                    break
                if gone in {step.worker_id for step in steps}:
                    assert held, f"worker {gone} stepped after it failed"
                held = False
                self.check(steps)
        with within(TIMEOUT + MARGIN, "reset() after a worker failed"), pytest.raises(EnvManagerError) as again:
            self.m.reset()
        self.names_a_failed_worker(again.value)

    def names_a_failed_worker(self, error: EnvManagerError) -> None:
        if isinstance(error, InvalidInputError):
            assert any(f"worker {w} must be reset" in str(error) for w in self.faulted), error
        else:
            assert getattr(error, "worker_id", None) in self.faulted, error

    def teardown(self) -> None:
        try:
            if self.given_up is not None:
                self.use_after_give_up()
            self.note_pids()
        finally:
            with within(TIMEOUT + MARGIN, "close()"):
                self.m.close()
            for pid in self.frozen:  # a frozen player that outlived its worker: it must be dying
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert not alive(sorted(self.pids), timeout=15.0), "players or workers left running after close()"


WORKERS = st.integers(0, N - 1)
OPS = st.one_of(
    st.tuples(st.just("steps"), st.integers(1, 8)),
    st.tuples(st.just("steps"), st.integers(1, 8)),
    st.tuples(st.just("steps"), st.integers(1, 8)),
    st.tuples(st.just("params"), st.integers(1, 9)),
    st.tuples(st.just("kill_player"), WORKERS),
    st.tuples(st.just("kill_worker"), WORKERS),
    st.tuples(st.just("freeze_player"), WORKERS).filter(lambda op: op[1] == 0),
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("restarts", [True, False], ids=["restarts", "no-restarts"])
def test_mlagents_fault_schedules(fake_player, tmp_path, restarts: bool) -> None:
    run(lambda: MLAgentsSchedule(fake_player, tmp_path, restarts), OPS)

