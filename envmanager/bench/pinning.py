"""Where users run it, simulated: the parent on a core of its own, the workers on the rest.

Users train on 8-64 cores, where the parent process has a core to itself; on two *shared*
cores its CPU is taken from the envs. ``envmanager bench`` simulates the first regime on a
small machine by pinning (``os.sched_setaffinity``, every thread) the parent to its first usable
core and every process it started -- workers, their helpers, any backend's -- to the others,
once the envs are built and just before the timed loop. The limit is then the worker cores x
one env's in-process rate. Linux only (elsewhere the pinned scenarios are unavailable).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

__all__ = ["ACTIVE", "Pinning", "on_worker_cores", "pin_for_timing", "pinned", "plan", "restore", "unavailable"]


@dataclass(frozen=True)
class Pinning:
    """The parent's cores and the workers' cores (disjoint)."""

    parent: frozenset[int]
    workers: frozenset[int]
    everything: frozenset[int]  # the affinity the parent had: restored after each run


#: The pinning of the run being measured, if any (set by the runner around a backend's run).
ACTIVE: list[Pinning] = []


def unavailable() -> str | None:
    """Why pinning cannot work here, or ``None``."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return "needs Linux's sched_setaffinity"
    if len(os.sched_getaffinity(0)) < 2:
        return "needs 2 usable cores (one for the parent, the rest for the workers)"
    return None


def plan(workers: int | None = None) -> Pinning:
    """The parent on the first usable core, the workers on the others (``workers``: on only that
    many of them, the next ones: the ``cycle`` scenarios' one worker core)."""
    cores = sorted(os.sched_getaffinity(0))
    rest = cores[1:] if workers is None else cores[1:1 + workers]
    return Pinning(frozenset(cores[:1]), frozenset(rest), frozenset(cores))


def _set(pid: int, cores: frozenset[int]) -> None:
    """Pin every thread of process ``pid`` (a thread's affinity is its own on Linux)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # gone meanwhile
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            pass


def pin_for_timing() -> None:
    """Apply the active pinning, if any: every descendant on the worker cores, this process on
    the parent's. Called by ``Progress.start`` just before a timed loop."""
    if not ACTIVE:
        return
    p = ACTIVE[-1]
    for child in psutil.Process().children(recursive=True):
        _set(child.pid, p.workers)
    _set(os.getpid(), p.parent)


def restore() -> None:
    """This process back on every core it had (the children end with the run)."""
    if ACTIVE:
        _set(os.getpid(), ACTIVE[-1].everything)


@contextlib.contextmanager
def pinned(pinning: Pinning | None) -> Iterator[None]:
    """Make ``pinning`` the active one for a backend's run; the parent's affinity is restored after."""
    if pinning is None:
        yield
        return
    ACTIVE.append(pinning)
    try:
        yield
    finally:
        restore()
        ACTIVE.pop()


@contextlib.contextmanager
def on_worker_cores(pinning: Pinning | None) -> Iterator[None]:
    """Run this process on the workers' cores meanwhile (one env's in-process rate, the limit's
    unit, measured where the workers run)."""
    if pinning is None:
        yield
        return
    _set(os.getpid(), pinning.workers)
    try:
        yield
    finally:
        _set(os.getpid(), pinning.everything)
