"""A worker closes its envs whatever SIGTERM does while it stops."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref

import envmanager.worker.main as worker_main
from envmanager import SubprocessEnvManager
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

