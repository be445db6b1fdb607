"""Process checks the test modules share."""

from __future__ import annotations

import time

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
