"""Where the processes run: whether the parent and every worker process each have a core of their
own — the condition for spinning (``envmanager.wire.mailbox``: a spin pays only on a core of its
own, and processes that spin on shared cores collapse throughput).

Judged from the cores each process may run on (its CPU affinity), not from the parent's alone when
the envs are made: a program may pin the parent to one core and its workers to the others after
they start (as ``envmanager bench`` does, and users who keep a core for their learner). The pool
looks again while it runs (``WorkerPool``), and gives or takes the permission to spin.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["machine_cores", "own_cores", "affinity"]


def affinity(pid: int = 0) -> frozenset[int] | None:
    """The cores process ``pid`` (0: this one) may run on, or ``None`` where that cannot be read
    (not Linux, or the process is gone)."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


def machine_cores() -> int:
    """The cores this program's processes could have: the machine's, within the CPU quota of
    its control group (a container limited to 2 CPUs of 64 has 2), whatever this process's own
    affinity is now."""
    cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, quota)) if quota else cores


def _cgroup_quota() -> int | None:
    """Whole CPUs of the cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or ``None``."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1, int(quota) // int(period))
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else max(1, quota_us // period_us)
    except (OSError, ValueError):
        return None


def own_cores(allowed: Sequence[frozenset[int] | None], cores: int | None = None) -> bool:
    """Whether each process can run on a core of its own, ``allowed[i]`` being the cores process
    ``i`` may run on (``None``: unknown, any of the machine's): a distinct core for each within
    its set (a matching of processes to cores), and no more processes than ``cores`` (the
    machine's, within its quota: ``machine_cores``)."""
    cores = machine_cores() if cores is None else cores
    if len(allowed) > cores:
        return False
    every = frozenset(range(os.cpu_count() or cores))
    sets = [every if a is None else a for a in allowed]
    matched: dict[int, int] = {}  # core -> process

    def place(p: int, seen: set[int]) -> bool:  # Kuhn's augmenting path
        for core in sets[p]:
            if core in seen:
                continue
            seen.add(core)
            if core not in matched or place(matched[core], seen):
                matched[core] = p
                return True
        return False

    return all(place(p, set()) for p in sorted(range(len(sets)), key=lambda p: len(sets[p])))
