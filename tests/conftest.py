"""Shared fixtures: every test must leave no child process, fd or shared memory behind."""

from __future__ import annotations

import gc
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
    """Named segments of this test process (``envmgr_<pid>_...``: the fallback where the shared
    memory cannot be passed as a descriptor)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"envmgr_{os.getpid()}_")}


def _shared_mappings() -> set[str]:
    """This process's mappings of shared memory it made: a memfd or unlinked file named
    ``envmgr_<pid>`` (they have no name in /dev/shm, so only the maps show them), or a segment."""
    marks = (f"/memfd:envmgr_{os.getpid()}", f"/dev/shm/envmgr_{os.getpid()}_")
    with open("/proc/self/maps") as maps:
        return {line.strip() for line in maps if any(mark in line for mark in marks)}


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _describe_fds(fds: set[int]) -> list[str]:
    """Each fd with what it points to (a pipe, socket, eventfd, file), for the failure message."""
    described = []
    for fd in sorted(fds):
        try:
            described.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            described.append(f"{fd} (closed meanwhile)")
    return described


@pytest.fixture(scope="session", autouse=True)
def _sb3_log_folder(tmp_path_factory):
    """SB3's ``learn()`` makes a log folder in /tmp on every call unless ``SB3_LOGDIR`` names
    one: keep them in pytest's temporary directory (the examples run as children inherit it)."""
    os.environ.setdefault("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))


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
    """After each test: no child processes, no new fds, no shared memory of ours."""
    fds_before = _fds()
    shm_before = _shm_segments()
    mappings_before = _shared_mappings()
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
    leaked_maps = _shared_mappings() - mappings_before
    if leaked_maps:  # arrays the test still held, freed with their reference cycles
        gc.collect()
        leaked_maps = _shared_mappings() - mappings_before
    assert not leaked_maps, f"shared memory still mapped: {leaked_maps}"
    leaked_fds = _fds() - fds_before
    if leaked_fds:  # freed with reference cycles, or by a thread still letting go (gRPC's server stop)
        gc.collect()
        fd_deadline = time.monotonic() + 5.0
        while (_fds() - fds_before) and time.monotonic() < fd_deadline:
            time.sleep(0.05)
        leaked_fds = _fds() - fds_before
    assert not leaked_fds, f"file descriptors left open: {_describe_fds(leaked_fds)}"
