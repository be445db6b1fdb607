"""Fixtures for running the fake Unity player under the real ``mlagents_envs`` client.

The reusable helpers live in the player module itself, so any test can import them::

    from envmanager.testing.fake_unity import write_launcher, free_base_port

Fixtures here:

* ``fake_player(config=None, name=None, extra_args=())`` -> path of a launcher script in
  ``tmp_path`` (``write_launcher``; pass it as ``UnityEnvironment(file_name=...)``);
* ``make_fake_env(config=None, *, worker_id=0, timeout_wait=30, file_name=None, **kwargs)`` -> a
  started ``UnityEnvironment`` on a free port (``kwargs`` go to UnityEnvironment); the launched
  process stays available as ``env.player_process``; every env is closed and every player
  killed at teardown.
"""
from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:  # plain ``pytest`` does not put the repo root on sys.path
    sys.path.insert(0, REPO_ROOT)

pytest.importorskip("mlagents_envs")

from envmanager.testing.fake_unity import free_base_port, write_launcher  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _grpc_initialized():
    """gRPC keeps an epoll fd and an eventfd for the life of the process once it is first used;
    start it before any test so the fd-leak check in tests/conftest.py does not blame a test."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    with ThreadPoolExecutor(max_workers=1) as pool:
        server = grpc.server(pool)
        server.add_insecure_port("127.0.0.1:0")
        server.start()
        server.stop(None).wait()
    yield


@pytest.fixture(autouse=True)
def _close_mlagents_pipes(monkeypatch):
    """mlagents_envs leaks one end of each RpcCommunicator's Pipe (close() closes only the other),
    atexit keeps every UnityEnvironment alive, and close() does not wait for the gRPC server to
    finish stopping; close the pipes and wait for the servers after each test."""
    from mlagents_envs.environment import UnityEnvironment

    made: list[Any] = []
    original = UnityEnvironment._get_communicator

    def tracking(worker_id: int, base_port: int, timeout_wait: int) -> Any:
        comm = original(worker_id, base_port, timeout_wait)
        made.append(comm)
        return comm

    monkeypatch.setattr(UnityEnvironment, "_get_communicator", staticmethod(tracking))
    yield
    for comm in made:
        comm.close()  # no-op when already closed
        if getattr(comm, "server", None) is not None:  # close() does not wait for gRPC to let go
            comm.server.stop(None).wait(5)
        servicer = getattr(comm, "unity_to_external", None)
        if servicer is not None:
            servicer.parent_conn.close()
            servicer.child_conn.close()


@pytest.fixture
def fake_player(tmp_path):
    counter = itertools.count()

    def make(config: dict[str, Any] | None = None, name: str | None = None,
             extra_args: Sequence[str] = ()) -> str:
        return write_launcher(tmp_path, config, name or f"fakeplayer{next(counter)}", extra_args)

    return make


@pytest.fixture
def stopped_player():
    """``launch(path, port)``: a real player launched for ``port`` and stopped (SIGSTOP) before it
    could connect -- a build still booting when its worker was killed; killed at teardown if it
    still runs."""
    import signal
    import subprocess

    launched: list[subprocess.Popen] = []

    def launch(path: str, port: int) -> subprocess.Popen:
        player = subprocess.Popen([path, "--mlagents-port", str(port)], start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.kill(player.pid, signal.SIGSTOP)
        launched.append(player)
        return player

    yield launch
    for player in launched:
        if player.poll() is None:
            player.kill()
            player.wait()


@pytest.fixture
def make_fake_env(fake_player):
    from mlagents_envs.environment import UnityEnvironment
    from mlagents_envs.exception import UnityWorkerInUseException

    made: list[Any] = []

    def make(config: dict[str, Any] | None = None, *, worker_id: int = 0, timeout_wait: int = 30,
             file_name: str | None = None, **kwargs: Any) -> Any:
        path = file_name or fake_player(config)
        for attempt in range(5):
            try:
                env = UnityEnvironment(file_name=path, worker_id=worker_id,
                                       base_port=free_base_port(worker_id + 1),
                                       timeout_wait=timeout_wait, **kwargs)
                break
            except UnityWorkerInUseException:
                if attempt == 4:
                    raise
        env.player_process = env._process  # kept after close() so tests can check the exit
        made.append(env)
        return env

    yield make
    for env in made:
        try:
            env.close()
        except Exception:
            pass
        proc = env.player_process
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def process_gone():
    """``process_gone(pid, timeout)``: True once ``pid`` no longer runs (a zombie nobody
    reaps counts as gone, as under some container inits)."""
    import time

    import psutil

    def gone(pid: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
            time.sleep(0.05)
        return False

    return gone
