"""Where the processes run (``envmanager.core.cores``) and the spin permission that follows it
(``envmanager.wire.mailbox``): spinning only where the parent and every worker process each have
a core, judged while they run; nothing lost when the permission changes under way."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envmanager.core.batch import BatchEnvManager
from envmanager.core.cores import CoreUse, machine_cores, own_cores
from envmanager.testing.envs import EnvFactory
from envmanager.wire.mailbox import mailbox_supported


def brute_force(sets: list[frozenset[int]]) -> bool:
    """Whether distinct cores can be picked, one from each set (tried every way)."""
    return any(len(set(pick)) == len(pick) for pick in itertools.product(*sets)) if all(sets) else False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.frozensets(st.integers(0, 4), max_size=5), min_size=1, max_size=5))
def test_own_cores_is_a_core_for_each_process_within_its_affinity(sets):
    assert own_cores(sets, cores=5) == brute_force(sets)


def test_more_processes_than_cores_never_have_one_each():
    assert not own_cores([frozenset({0}), frozenset({1}), frozenset({2})], cores=2)
    assert own_cores([frozenset({0}), frozenset({1})], cores=2)
    assert not own_cores([frozenset({0}), frozenset({0})], cores=2)  # both pinned to one core
    assert machine_cores() >= 1


@pytest.mark.skipif(not mailbox_supported() or not hasattr(os, "sched_setaffinity"), reason="the mailbox and affinities")
def test_the_spin_permission_follows_where_the_processes_run_and_nothing_is_lost(monkeypatch):
    """One worker process and the parent: both on every core (2 here) may spin; both pinned to one
    core may not; the permission changes under way, steps keep coming back, each its own."""
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "on")
    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")
    monkeypatch.setattr("envmanager.core.pool.CORE_CHECK_S", 0.0)  # look at every wait
    monkeypatch.setattr(CoreUse, "others", lambda self, pids, cores: 0.0)  # (the affinities alone: the machine may be busy)
    cores = sorted(os.sched_getaffinity(0))
    with BatchEnvManager(EnvFactory(), 2, envs_per_worker=2, timeout=30) as m:
        box, pid = m.pool.mailboxes, m.processes[0].pid
        assert box is not None
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        steps = np.zeros(2, dtype=np.int64)
        for k in range(60):
            shared = k % 20 < 10 or len(cores) < 2  # then both on one core, else each on its own
            os.sched_setaffinity(pid, {cores[0]} if shared else {cores[-1]})
            os.sched_setaffinity(0, {cores[0]})
            try:
                m.send_batch([0, 1], [1, 1])
                steps += 1
                got = m.receive_batch(2, timeout=30)
            finally:
                os.sched_setaffinity(0, cores)
            assert sorted(got.slots.tolist()) == [0, 1]
            np.testing.assert_array_equal(m.results.observation[:, 0], steps)  # each its own step, none lost
            assert box.spin_allowed == (not shared)


def test_core_use_counts_other_programs_not_ours():
    """A process of ours burning a core is ours; the same burn in a process not named is another
    program's. Two looks over one window, one naming the burner ours and one not, differ by the
    burner's own share of a core, whatever else the machine carries (the kernel counts in 10 ms
    ticks: a loose tolerance)."""

    cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))
    burn = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"
    hog = subprocess.Popen([sys.executable, "-c", burn])
    try:
        burner = psutil.Process(hog.pid)
        looks = {True: CoreUse(), False: CoreUse()}
        pids = {True: [os.getpid(), hog.pid], False: [os.getpid()]}
        time.sleep(0.3)  # (past the interpreter's start)
        before, began = burner.cpu_times(), time.monotonic()
        assert all(use.others(pids[ours], cores) is None for ours, use in looks.items())  # one sample: no figure yet
        time.sleep(1.0)
        figures = {ours: use.others(pids[ours], cores) for ours, use in looks.items()}
        after, ended = burner.cpu_times(), time.monotonic()
    finally:
        hog.kill()
        hog.wait(10)
    share = (after.user + after.system - before.user - before.system) / (ended - began)
    if share < 0.3:
        pytest.skip(f"the burner hardly ran ({share:.2f} of a core): the machine is too loaded to tell")
    assert figures[True] is not None and figures[False] is not None
    assert abs(figures[False] - figures[True] - share) < 0.15, (figures, share)


@pytest.mark.skipif(not mailbox_supported() or not hasattr(os, "sched_setaffinity"), reason="the mailbox and affinities")
def test_nothing_spins_where_other_programs_keep_the_cores_busy(monkeypatch):
    """The parent and one worker process on the machine's cores, but other programs burning one
    core per core of the machine: the pool takes the permission to spin away, and the steps go on,
    each its own."""
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "on")
    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")
    monkeypatch.setattr("envmanager.core.pool.CORE_CHECK_S", 0.0)
    burn = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass\n"
    hogs: list[subprocess.Popen] = []
    with BatchEnvManager(EnvFactory(), 1, envs_per_worker=1, timeout=30) as m:
        box = m.pool.mailboxes
        assert box is not None
        m.send_reset({0: (0, None)})
        m.receive_reset_batch()
        try:
            hogs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(os.cpu_count() or 1)]
            deadline = time.monotonic() + 10
            steps = 0
            while box.spin_allowed and time.monotonic() < deadline:
                m.send_batch([0], [1])
                steps += 1
                got = m.receive_batch(1, timeout=30)
                assert got.slots.tolist() == [0]
                assert m.results.observation[0, 0] == steps  # each its own step, none lost
            assert not box.spin_allowed, "other programs burn every core, yet the processes may spin"
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait(10)
