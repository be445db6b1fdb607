"""A worker closes its envs whatever SIGTERM does while it stops."""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import weakref

import envmanager.worker.main as worker_main
from envmanager import SubprocessEnvManager
from envmanager.errors import ManagerClosedError
from fault_envs import MarkerEnv
from process_helpers import alive


def test_sigterm_as_the_worker_starts_closing_does_not_skip_the_close(tmp_path, monkeypatch):
    """A SIGTERM that lands as the worker leaves its loop, before it ignores SIGTERM, still lets
    it close its envs (forked workers run the patched module: the signal is sent at that very
    moment, once)."""
    original, sent = worker_main._ignore_sigterm, []

    def signalled_first() -> None:
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # handled here, before SIGTERM is ignored
        original()

    monkeypatch.setattr(worker_main, "_ignore_sigterm", signalled_first)
    marker = tmp_path / "closed"
    m = SubprocessEnvManager(lambda i: MarkerEnv(str(marker)), 1, context="fork", timeout=30)
    m.reset()
    pid = m.processes[0].pid
    m.close(timeout=10.0)
    assert marker.exists() and marker.read_text() == "closed"
    assert not alive([pid], timeout=0)


def test_a_manager_dropped_without_close_ends_its_workers_when_dropped():
    """A manager is no reference cycle: the last reference dropped closes it there and then
    (``__del__``), not whenever the garbage collector next runs. A sweep that drops managers
    without closing them would otherwise pile up every one's workers; here the collector is off."""
    gc.disable()
    try:
        m = SubprocessEnvManager(lambda i: MarkerEnv(os.devnull), 2, context="fork", timeout=30)
        m.reset()
        m.get_attr("marker")  # (the env calls' component too)
        pids, ref = [w.pid for w in m.processes], weakref.ref(m)
        del m
        assert ref() is None
        assert not alive(pids, timeout=0)
    finally:
        gc.enable()


class _Trainer:
    """A user's object in a reference cycle, holding a manager: freed by the garbage collector."""

    def __init__(self, manager: SubprocessEnvManager) -> None:
        self.manager = manager
        self.me = self


def test_a_manager_freed_by_the_garbage_collector_asks_every_worker_to_close(tmp_path, caplog):
    """The collector finalizes a cycle's objects in any order: a worker's pipe finalized before the
    manager closed its fd, so that worker was never sent CLOSE; it was terminated after ``close``'s
    grace ("did not close within 10.0 s"), and its fd number closed again later, whoever had it by
    then. Every worker is asked and closes its envs, as with ``close()``."""
    caplog.set_level(logging.WARNING, logger="envmanager.core.pool")
    for round_ in range(4):  # (the order differs from run to run: several rounds)
        markers = [tmp_path / f"closed-{round_}-{i}" for i in range(3)]
        m = SubprocessEnvManager(lambda i, markers=markers: MarkerEnv(str(markers[i])), 3, context="fork", timeout=30)
        m.reset()
        m.step([0, 0, 0])
        pids = [w.pid for w in m.processes]
        _Trainer(m)
        del m
        gc.collect()
        assert [marker.exists() for marker in markers] == [True] * 3
        assert not alive(pids, timeout=0)
    assert not [r.getMessage() for r in caplog.records if "did not close" in r.getMessage()]


class _CallsInDel:
    """A user's object in a reference cycle whose ``__del__`` still calls the manager it holds."""

    def __init__(self, manager: SubprocessEnvManager, outcome: list) -> None:
        self.manager, self.outcome, self.me = manager, outcome, self

    def __del__(self) -> None:
        try:
            self.outcome.append(self.manager.get_attr("marker"))
        except Exception as exc:
            self.outcome.append(exc)


def test_a_call_from_a_del_in_the_cycle_that_frees_the_manager_is_manager_closed():
    """The collector clears a cycle's weak references (closing the manager's workers) before any
    ``__del__`` runs: a call made from one then is ``ManagerClosedError``, not an internal error."""
    outcome: list = []
    m = SubprocessEnvManager(lambda i: MarkerEnv(os.devnull), 2, context="fork", timeout=30)
    m.reset()
    pids = [w.pid for w in m.processes]
    _CallsInDel(m, outcome)
    del m
    gc.collect()
    assert len(outcome) == 1 and isinstance(outcome[0], ManagerClosedError), outcome
    assert not alive(pids, timeout=0)
