"""Where the processes run: whether the parent and every worker process each have a core of their
own, the condition for spinning (``envmanager.wire.mailbox``: spinning on shared cores collapses
throughput).

Judged from each process's CPU affinity, not the parent's alone at start (a program may pin its
workers after they start, as ``envmanager bench`` does), and from how busy other programs keep
those cores (``CoreUse``). The pool looks again while it runs and gives or takes the permission.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

__all__ = ["machine_cores", "own_cores", "affinity", "CoreUse"]

#: Seconds between two samples of ``CoreUse`` (the kernel counts CPU time in 10 ms ticks).
MIN_SAMPLE_S = 0.2


def affinity(pid: int = 0) -> frozenset[int] | None:
    """The cores process ``pid`` (0: this one) may run on; ``None`` where unreadable (not Linux, or gone)."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


def machine_cores() -> int:
    """The machine's cores within its control group's CPU quota (2 in a container given 2 of 64), whatever our affinity."""
    cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, quota)) if quota else cores


def _cgroup_quota() -> int | None:
    """Whole CPUs of the cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or ``None``."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, int(quota) // int(period))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else max(1, quota_us // period_us)
    except (OSError, ValueError):
        return None


def own_cores(allowed: Sequence[frozenset[int] | None], cores: int | None = None) -> bool:
    """Whether each process can have a distinct core within ``allowed[i]``, the cores process ``i``
    may run on (``None``: any), and there are no more processes than ``cores`` (``machine_cores``)."""
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


class CoreUse:
    """Cores' worth of CPU that programs other than ours used between two looks on the cores ours
    may run on; under a CPU quota, inside our control group (other containers are the quota's
    business). Looks less than :data:`MIN_SAMPLE_S` apart return the last figure."""

    def __init__(self) -> None:
        self._sampled_at = 0.0
        self._busy = 0.0  # seconds of CPU, on ``_cores`` (or in the group), at the last sample
        self._cores: frozenset[int] = frozenset()
        self._ours: dict[int, float] = {}  # pid -> its CPU seconds at the last sample
        self._procs: dict[int, psutil.Process] = {}
        self._figure: float | None = None

    def others(self, pids: Sequence[int], cores: frozenset[int]) -> float | None:
        """Cores' worth of CPU others than ``pids`` used since the last sample; ``None`` until two samples (or unreadable)."""
        now = time.monotonic()
        if now - self._sampled_at < MIN_SAMPLE_S:
            return self._figure
        try:
            busy = _group_usage_s() if _cgroup_quota() else _cores_busy_s(cores)
            ours = {pid: self._cpu_s(pid) for pid in pids}
        except (psutil.Error, OSError, ValueError):
            return self._figure
        if self._sampled_at and busy is not None and cores == self._cores:
            spent = sum(t - self._ours.get(pid, 0.0) for pid, t in ours.items())
            self._figure = max(0.0, (busy - self._busy - spent) / (now - self._sampled_at))
        else:  # the first sample, or other cores: a figure from the next one
            self._figure = None
        self._sampled_at, self._busy, self._cores, self._ours = now, busy or 0.0, cores, ours
        for gone in self._procs.keys() - ours.keys():
            del self._procs[gone]
        return self._figure

    def _cpu_s(self, pid: int) -> float:
        proc = self._procs.get(pid)
        if proc is None:
            proc = self._procs[pid] = psutil.Process(pid)
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:  # gone since: what it had counted last
            return self._ours.get(pid, 0.0)
        return t.user + t.system


def _cores_busy_s(cores: frozenset[int]) -> float:
    """CPU seconds the machine's ``cores`` have been busy (anything but idle and I/O wait; a VM's
    stolen time counts as busy: another guest had the core)."""
    per_core = psutil.cpu_times(percpu=True)
    return sum((t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
                for t in (per_core[c] for c in cores if c < len(per_core))), 0.0)


def _group_usage_s() -> float | None:
    """CPU seconds used by this program's control group (v2 ``cpu.stat``, v1 ``cpuacct.usage``)."""
    try:
        with open("/sys/fs/cgroup/cpu.stat") as f:
            for line in f:
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) * 1e-6
    except OSError:
        pass
    try:
        return int(Path("/sys/fs/cgroup/cpuacct/cpuacct.usage").read_text()) * 1e-9
    except (OSError, ValueError):
        return None
