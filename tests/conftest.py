"""Shared fixtures: every test must leave no child process, fd or shared-memory segment."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing import resource_tracker

import psutil
import pytest


def _infrastructure(proc: psutil.Process) -> bool:
    """multiprocessing's own long-lived helpers (resource tracker, forkserver)."""
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def _our_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if not _infrastructure(p)]


def _shm_segments() -> set[str]:
    """Segments of this test process (named ``envmgr_<pid>_...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"envmgr_{os.getpid()}_")}


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.fixture(scope="session", autouse=True)
def _start_infrastructure():
    """Start multiprocessing's helpers once, so they are not mistaken for leaks."""
    resource_tracker.ensure_running()
    if "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        forkserver.ensure_running()
    yield


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After each test: no child processes, no new fds, no shared-memory segments of ours."""
    fds_before = _fds()
    shm_before = _shm_segments()
    yield
    deadline = time.monotonic() + 10.0
    while _our_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = _our_children()
    for child in children:  # do not poison later tests
        child.kill()
    assert not children, f"child processes left behind: {[c.pid for c in children]}"
    leaked_shm = _shm_segments() - shm_before
    assert not leaked_shm, f"shared memory left behind: {leaked_shm}"
    leaked_fds = _fds() - fds_before
    assert not leaked_fds, f"file descriptors left open: {sorted(leaked_fds)}"
