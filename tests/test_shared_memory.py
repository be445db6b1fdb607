"""Shared memory that cannot leak: it has no name, so nothing stays in /dev/shm even when the
parent, its workers and multiprocessing's helpers are all killed at once; workers (restarted
ones too) map the very memory the parent reads, under every start method."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from envmanager import SubprocessEnvManager
from envmanager.testing.envs import EnvFactory
from envmanager.wire import shm
from process_helpers import alive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXTS = ["fork", "spawn", "forkserver"]

# A job as a user runs it: a manager stepping its envs, in a process of its own.
SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {repo!r})
    from envmanager import SubprocessEnvManager
    from envmanager.testing.envs import EnvFactory
    from envmanager.wire import shm
    if {named!r}:  # the fallback of platforms that cannot pass descriptors
        shm.SharedFile.create = classmethod(lambda cls: None)
    m = SubprocessEnvManager(EnvFactory(step_time=0.01), 4, envs_per_worker={k!r}, context={context!r})
    m.reset()
    print(os.getpid(), m.buffers.layout.name or "-", *[w.pid for w in m.processes], flush=True)
    while True:
        m.step({{w: 1 for w in m.idle_worker_ids}})
    """
)


def _start_job(context: str, envs_per_worker: int, named: bool = False) -> tuple[subprocess.Popen, list[int], str]:
    code = SCRIPT.format(repo=REPO, named=named, k=envs_per_worker, context=context)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if not line:
        proc.kill()
        raise AssertionError(f"the job did not start: {proc.communicate()[1]}")
    parent, name, *workers = line
    assert int(parent) == proc.pid
    return proc, [int(w) for w in workers], name


def _open_files(pid: int) -> list[str]:
    """What ``pid`` holds: the targets of its descriptors and the files it has mapped."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    with open(f"/proc/{pid}/maps") as maps:
        found += [line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6]
    return found


def _files_held(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of every file ``pid`` has a descriptor on."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        found.add((st.st_dev, st.st_ino))
    return found


def _kill_everything(pids: list[int]) -> None:
    """SIGKILL every process of the job, one right after another."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _ours(entries: set[str], pids: list[int]) -> set[str]:
    """Entries of /dev/shm that name one of ``pids`` (other jobs on the machine make their own)."""
    return {e for e in entries if any(str(pid) in e for pid in pids)}


@pytest.mark.parametrize("envs_per_worker", [1, 2])
@pytest.mark.parametrize("context", CONTEXTS)
def test_killing_every_process_at_once_leaves_nothing_in_dev_shm(context, envs_per_worker):
    before = set(os.listdir("/dev/shm"))
    proc, workers, name = _start_job(context, envs_per_worker)
    # The parent's helpers (resource tracker, forkserver) die with it, as in a killed job.
    family = [proc.pid, *workers, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    family = list(dict.fromkeys(family))
    try:
        assert name == "-", f"a named segment was used: {name}"
        for pid in [proc.pid, *workers]:
            held = _open_files(pid)
            assert any(f.startswith("/memfd:envmgr") for f in held), f"process {pid} does not map the shared memory"
            named = [f for f in held if f.startswith("/dev/shm/") and not f.endswith("(deleted)")]
            assert not named, f"process {pid} holds memory with a name: {named}"
    finally:
        _kill_everything(family)
        proc.communicate(timeout=30)
    assert not alive(family), "processes outlived SIGKILL"
    left = _ours(set(os.listdir("/dev/shm")) - before, family)
    assert not left, f"shared memory left behind: {left}"


def test_the_named_fallback_is_what_leaks_when_everything_is_killed():
    """The check above has teeth: named segments (platforms without descriptor passing) stay
    when the resource tracker dies with the job."""
    before = set(os.listdir("/dev/shm"))
    proc, workers, name = _start_job("fork", 1, named=True)
    helpers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True) if p.pid not in workers]
    family = [*helpers, proc.pid, *workers]  # the tracker first: it would unlink what it knows of
    try:
        assert name.startswith(f"envmgr_{proc.pid}_")
    finally:
        _kill_everything(family)
        proc.communicate(timeout=30)
    try:
        assert not alive(family)
        assert _ours(set(os.listdir("/dev/shm")) - before, family) == {name}
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def _step_all(m, action):
    """Step every slot once (restarted ones included); their StepInfos by slot."""
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < m.n_env:
        assert time.monotonic() < deadline, f"only slots {sorted(got)} answered"
        for info in m.step({w: action for w in m.idle_worker_ids if w not in got}):
            got[info.worker_id] = info
    return got


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_restarted_worker_writes_into_the_same_memory(context):
    with SubprocessEnvManager(EnvFactory(), 4, envs_per_worker=2, context=context, timeout=30, restart_workers=True) as m:
        m.reset()
        _step_all(m, 1)
        buffers, victim = m.buffers, m.process_of(0)
        os.kill(victim.pid, signal.SIGKILL)
        interrupted = {}
        deadline = time.monotonic() + 30
        while len(interrupted) < 2:
            assert time.monotonic() < deadline, "the restart never answered"
            infos = m.step({w: 1 for w in m.idle_worker_ids if w not in interrupted})
            interrupted.update({i.worker_id: i for i in infos if i.interrupted})
        assert sorted(interrupted) == [0, 1]
        for slot, info in interrupted.items():  # the new process's fresh reset
            assert info.current_result.observation.tolist() == [0, slot, -1, 1]
        restarted = m.process_of(0)
        assert restarted.pid != victim.pid and m.buffers is buffers
        # The new process maps the very file the parent reads (same inode), not a copy.
        stat = os.fstat(m.pool.file.fd)
        assert (stat.st_dev, stat.st_ino) in _files_held(restarted.pid)
        for step in (1, 2):
            got = _step_all(m, 2)
            for slot in (0, 1):  # [steps in episode, env id, last action, episode], written by the worker
                assert got[slot].current_result.observation.tolist() == [step, slot, 2.0, 1.0]
                assert buffers.observation[slot].tolist() == [step, slot, 2.0, 1.0]
                assert buffers.reward[slot] == 2.0


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_named_segments_still_work_where_descriptors_cannot_be_passed(context, monkeypatch):
    monkeypatch.setattr(shm.SharedFile, "create", classmethod(lambda cls: None))
    with SubprocessEnvManager(EnvFactory(), 2, context=context) as m:
        m.reset()
        name = m.buffers.layout.name
        assert name.startswith(f"envmgr_{os.getpid()}_") and os.path.exists(f"/dev/shm/{name}")
        got = _step_all(m, 2)
        assert [got[s].current_result.observation.tolist() for s in (0, 1)] == [[1, 0, 2, 1], [1, 1, 2, 1]]
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_an_unlinked_file_in_dev_shm_where_there_is_no_memfd(context, monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    before = set(os.listdir("/dev/shm"))
    with SubprocessEnvManager(EnvFactory(), 2, context=context) as m:
        m.reset()
        assert m.buffers.layout.name == ""
        assert _ours(set(os.listdir("/dev/shm")) - before, [os.getpid()]) == set()
        held = _open_files(m.processes[1].pid)
        assert any(f.startswith(f"/dev/shm/envmgr_{os.getpid()}_") and f.endswith("(deleted)") for f in held)
        got = _step_all(m, 2)
        assert [got[s].current_result.observation.tolist() for s in (0, 1)] == [[1, 0, 2, 1], [1, 1, 2, 1]]


def test_the_shared_file_travels_only_with_a_starting_process():
    file = shm.SharedFile.create()
    assert file is not None
    try:
        with pytest.raises(TypeError, match="as it starts"):
            pickle.dumps(file)
    finally:
        file.close()


def test_shared_arrays_of_one_file_are_one_memory():
    file = shm.SharedFile.create()
    parent = shm.SharedBuffers.create(3, None, None, file)
    worker = shm.SharedBuffers.attach(parent.layout, file)
    try:
        worker.reward[:] = np.arange(3)
        assert parent.reward.tolist() == [0.0, 1.0, 2.0]
    finally:
        worker.close()
        parent.close()
        file.close()
