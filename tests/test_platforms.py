"""Platform choices: the transport and start method picked per platform, the portable
transport end to end, process trees found through psutil, and an import without the POSIX
modules the step queue needs (as on Windows)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import psutil
import pytest

from envmanager import SubprocessEnvManager
from envmanager.core import platforms
from envmanager.testing.envs import EnvFactory
from envmanager.worker.family import family

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_cartpole(worker_id: int) -> gym.Env:
    return gym.make("CartPole-v1")


def test_transport_names(monkeypatch):
    monkeypatch.delenv(platforms.TRANSPORT_ENV, raising=False)
    assert platforms.transport_name() == ("step_queue" if platforms.step_queue_available() else "portable")
    assert platforms.transport_name("portable") == "portable"
    monkeypatch.setenv(platforms.TRANSPORT_ENV, "portable")
    assert platforms.transport_name() == "portable"
    monkeypatch.setenv(platforms.TRANSPORT_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match="carrier_pigeon"):
        platforms.transport_name()


@pytest.mark.parametrize("platform, expected", [("linux", "fork"), ("darwin", "spawn"), ("win32", "spawn")])
def test_default_start_method(monkeypatch, platform, expected):
    monkeypatch.setattr(platforms.sys, "platform", platform)
    methods = ["spawn"] if platform == "win32" else ["fork", "spawn", "forkserver"]
    monkeypatch.setattr(platforms.mp, "get_all_start_methods", lambda: methods)
    assert platforms.default_start_method() == expected


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_portable_transport_steps_first_ready(monkeypatch, envs_per_worker):
    """Forced portable: answers come on each worker's own pipe, and a step returns as soon as
    one worker finished, whatever the others do."""
    monkeypatch.setenv(platforms.TRANSPORT_ENV, "portable")
    with SubprocessEnvManager(make_cartpole, n_env=4, envs_per_worker=envs_per_worker, timeout=30) as manager:
        assert manager.pool.transport == "portable"
        assert manager.pool.queue.writer is None
        infos = manager.reset(seed=0)
        assert sorted(i.worker_id for i in infos) == [0, 1, 2, 3]
        steps = 0
        for _ in range(50):
            actions = {w: manager.action_space.sample() for w in manager.idle_worker_ids}
            for info in manager.step(actions):
                assert np.shape(info.current_result.observation) == (4,)
                steps += 1
        assert steps >= 50


def test_portable_transport_keeps_first_ready_stepping(monkeypatch):
    """A slow worker does not hold back the fast ones on the portable transport."""
    monkeypatch.setenv(platforms.TRANSPORT_ENV, "portable")
    factory = EnvFactory(per_env={0: {"step_time": [0.0, 30.0]}})  # env 0: its 2nd step takes 30 s
    with SubprocessEnvManager(factory, n_env=3, timeout=60) as manager:
        manager.reset(seed=0)
        first = 0
        while not first:  # until env 0's instant first step is back
            actions = {w: manager.action_space.sample() for w in manager.idle_worker_ids}
            first = sum(i.worker_id == 0 for i in manager.step(actions))
        fast = 0
        for _ in range(10):  # the first of these sends env 0 its slow step
            infos = manager.step({w: manager.action_space.sample() for w in manager.idle_worker_ids})
            assert 0 not in [i.worker_id for i in infos]
            fast += len(infos)
        assert fast >= 10
        assert 0 not in manager.idle_worker_ids


def test_portable_transport_carries_large_answers(monkeypatch):
    """An answer far bigger than any pipe buffer arrives whole on the worker's own pipe."""
    monkeypatch.setenv(platforms.TRANSPORT_ENV, "portable")
    with SubprocessEnvManager(make_cartpole, n_env=2, timeout=30) as manager:
        manager.reset(seed=0)
        big = manager.call_on([0, 1], _big_payload, (3_000_000,))
        assert [len(b) for b in big] == [3_000_000, 3_000_000]


def _big_payload(env: gym.Env, size: int) -> bytes:
    return bytes(size)


def test_family_finds_a_grandchild():
    """Process trees come from psutil: a child's own child is found, with its start time."""
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert family(child.pid)[grandchild] == psutil.Process(grandchild).create_time()
        assert child.pid in family() and child.pid in family(os.getpid())
    finally:
        for pid in family(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()
        child.stdout.close()
    assert family(child.pid) == {}  # gone: nothing below it


def test_imports_and_steps_without_fcntl_and_poll():
    """As on Windows: no ``fcntl``, no ``select.poll``. The package imports, picks the portable
    transport by itself and steps."""
    code = textwrap.dedent(
        """
        import select, sys
        sys.modules["fcntl"] = None          # import fcntl -> ImportError
        del select.poll                     # as on Windows
        import gymnasium as gym
        import envmanager
        from envmanager import SubprocessEnvManager
        from envmanager.core import platforms
        assert not platforms.step_queue_available()

        def make(worker_id):
            return gym.make("CartPole-v1")

        with SubprocessEnvManager(make, n_env=3, timeout=30) as m:
            assert m.pool.transport == "portable", m.pool.transport
            m.reset(seed=0)
            n = 0
            for _ in range(20):
                n += len(m.step({w: m.action_space.sample() for w in m.idle_worker_ids}))
            assert n >= 20, n
        assert "fcntl" not in sys.modules or sys.modules["fcntl"] is None
        print("stepped", n)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != platforms.TRANSPORT_ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "stepped" in out.stdout
