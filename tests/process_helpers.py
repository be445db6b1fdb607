"""Process checks the test modules share."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil


def alive(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Those of ``pids`` still running after up to ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def left_in_session(sid: int, timeout: float = 15.0) -> list[str]:
    """The processes of session ``sid`` (a program started with ``start_new_session=True``: its
    pid) still running after up to ``timeout`` seconds, zombies aside: what it left behind
    (multiprocessing's resource tracker ends on its own once the program is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:120]}")
            except (OSError, psutil.Error):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def ctrl_c_twice_in_close(monkeypatch: Any) -> list[str]:
    """Make the next close() meet Ctrl-C twice, as a user pressing it twice: once while it waits
    for the envs to close, again while it ends the workers by force. Returns the presses made."""
    import envmanager.core.pool as pool_module
    from envmanager.core.process import WorkerProcess

    waited, stop = pool_module.wait_for_ready, WorkerProcess.stop
    presses: list[str] = []

    def first_ctrl_c(*args: Any) -> Any:
        if not presses:
            presses.append("wait")
            raise KeyboardInterrupt
        return waited(*args)

    def second_ctrl_c(self: WorkerProcess) -> Any:
        if len(presses) == 1:
            presses.append("stop")
            raise KeyboardInterrupt
        return stop(self)

    monkeypatch.setattr(pool_module, "wait_for_ready", first_ctrl_c)
    monkeypatch.setattr(WorkerProcess, "stop", second_ctrl_c)
    return presses
