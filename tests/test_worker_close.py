"""A worker closes its envs whatever SIGTERM does while it stops."""

from __future__ import annotations

import os
import signal
import time

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
