"""The processes a worker's envs start (simulators: Unity players, CARLA servers), found and
killed by pid and start time.

Once a worker is gone, a simulator it started in a session of its own is no longer below it nor
in its process group: a record kept while the worker lived still finds it, and so does the tag
the worker puts in its environment, which the programs its envs start inherit (a simulator
started at a reset, after the worker's record was taken, or one a launcher daemonized, which
was never below it). The start time tells the process recorded from a later one given the same
pid.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import psutil

__all__ = ["family", "kill_family", "left_behind", "tag", "tagged"]

#: The environment variable that tags what a worker's envs start: ``<parent pid>:<worker pid>:<nonce>``
#: (the nonce: that start's own, so a later worker given the same pid does not carry the same tag).
TAG = "ENVMANAGER_WORKER"

#: Start times as read in two processes differ where the clock was stepped in between (psutil
#: derives them from the boot time, cached per process on some platforms): within this, the same.
START_TOLERANCE_S = 2.0


def family(pid: int | None = None) -> dict[int, float]:
    """The processes below ``pid`` (this process by default), by pid, with their start times;
    ``{}`` if ``pid`` is gone. multiprocessing's resource tracker is not one of them: it ends by
    itself once its users have, unlinking what it tracks."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # gone meanwhile, or not ours to look at
        return {}
    found = {}
    for child in below:
        try:
            born = child.create_time()
        except psutil.Error:  # gone meanwhile
            continue
        try:
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.Error:  # its command line not ours to read: one of the envs' all the same
            pass
        found[child.pid] = born
    return found


def tag(parent_pid: int, nonce: str) -> None:
    """Tag this worker's environment: the programs its envs start carry the tag."""
    os.environ[TAG] = f"{parent_pid}:{os.getpid()}:{nonce}"


def tagged(parent_pid: int, pid: int, nonce: str, since: float = 0.0) -> dict[int, float]:
    """The processes (ours to read) carrying the tag of worker ``pid`` of ``parent_pid`` started
    with ``nonce``, by pid, with their start times: one scan of the processes started since
    ``since`` (the worker's own start, in ``time.time()``), for a worker that did not close by
    itself."""
    return _carrying(f"{parent_pid}:{pid}:{nonce}", since)


def left_behind() -> dict[int, float]:
    """In a worker: what its envs started that still runs, below it or carrying its tag (a
    simulator a launcher script daemonized in a session of its own is nobody's child)."""
    found = family()
    if TAG in os.environ:
        found.update(_carrying(os.environ[TAG], psutil.Process().create_time()))
    found.pop(os.getpid(), None)
    return found


def _carrying(mark: str, since: float) -> dict[int, float]:
    """The processes started since ``since`` whose environment carries ``mark`` (an older one
    cannot: their start times are read first, cheaper than an environment)."""
    found = {}
    for process in psutil.process_iter():
        try:
            born = process.create_time()
            if born >= since - START_TOLERANCE_S and process.environ().get(TAG) == mark \
                    and "resource_tracker" not in " ".join(process.cmdline()):
                found[process.pid] = born
        except psutil.Error:  # gone meanwhile, or not ours to read
            pass
    return found


def kill_family(processes: Mapping[int, float]) -> None:
    """SIGKILL each of ``processes`` (``family``'s record) still running with its start time."""
    for pid, born in processes.items():
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - born) < START_TOLERANCE_S:
                process.kill()  # SIGKILL on POSIX, TerminateProcess on Windows
        except psutil.Error:  # gone, or not ours
            pass
