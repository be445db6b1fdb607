"""Fixtures for the vector-env conformance suite.

The implementation under test is selected by ``ENVMANAGER_CONFORMANCE_REFERENCE``:

* unset / ``0``: ``envmanager.AsyncVectorEnv`` and ``envmanager.sb3.SubprocVecEnv`` (tests skip with a
  clear reason while those do not exist yet);
* ``1``: gymnasium's ``AsyncVectorEnv`` and SB3's ``SubprocVecEnv``, to validate the tests themselves.
  Tests marked ``gym_defect`` then become ``xfail(strict=True)``: they must fail on gymnasium 1.4.
"""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing
import os
import sys

import psutil
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # so ``import envs`` works here and in spawned / forkserver workers
    sys.path.insert(0, HERE)
if HERE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # and in any other kind of child
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)

import envs  # noqa: E402
from envs import worker_children  # noqa: E402

REFERENCE = envs.REFERENCE
IMPL_NAME = "reference (gymnasium / stable-baselines3)" if REFERENCE else "envmanager"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gym_defect: a defect of gymnasium 1.4's AsyncVectorEnv that ours must not have "
        "(xfail strict under ENVMANAGER_CONFORMANCE_REFERENCE=1)",
    )
    config.addinivalue_line("markers", "ours_only: extension API of envmanager; skipped on the reference")


def pytest_report_header(config):
    return f"vector conformance suite: implementation under test = {IMPL_NAME}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REFERENCE and item.get_closest_marker("gym_defect"):
            item.add_marker(
                pytest.mark.xfail(strict=True, reason="known defect of gymnasium 1.4 AsyncVectorEnv")
            )
        if REFERENCE and item.get_closest_marker("ours_only"):
            item.add_marker(pytest.mark.skip(reason="envmanager extension, not part of gymnasium's API"))


@pytest.fixture(scope="session", autouse=True)
def _prewarm_multiprocessing_heap():
    """gymnasium's shared memory (``ctx.Array``) lives in multiprocessing's process-wide heap, whose
    arenas (each an open fd) are kept for the whole session once created.  Create one roomy arena
    up front, so the first test using shared memory is not blamed for it by the fd-leak check."""
    block = multiprocessing.Array("b", 1 << 20, lock=False)
    del block
    gc.collect()
    yield


@pytest.fixture(scope="session")
def impl():
    """The ``AsyncVectorEnv`` class under test."""
    if REFERENCE:
        from gymnasium.vector import AsyncVectorEnv

        return AsyncVectorEnv
    import envmanager

    if not hasattr(envmanager, "AsyncVectorEnv"):
        pytest.skip(
            "envmanager.AsyncVectorEnv does not exist yet; "
            "run with ENVMANAGER_CONFORMANCE_REFERENCE=1 to check the suite against gymnasium"
        )
    return envmanager.AsyncVectorEnv


@pytest.fixture(scope="session")
def sb3_impl():
    """The SB3 ``SubprocVecEnv`` class under test."""
    pytest.importorskip("stable_baselines3")
    if REFERENCE:
        from stable_baselines3.common.vec_env import SubprocVecEnv

        return SubprocVecEnv
    if importlib.util.find_spec("envmanager.sb3") is None:
        pytest.skip(
            "envmanager.sb3 does not exist yet; "
            "run with ENVMANAGER_CONFORMANCE_REFERENCE=1 to check the suite against stable-baselines3"
        )
    from envmanager.sb3 import SubprocVecEnv

    return SubprocVecEnv


def _close(env) -> None:
    """Close ``env``; if close() raises, still terminate its workers, then re-raise."""
    if getattr(env, "closed", False):
        return
    try:
        env.close()
    except Exception:
        try:
            env.close(terminate=True)
        except Exception:
            pass
        raise


@pytest.fixture
def closing():
    """``closing(obj)`` registers anything with ``close()`` to be closed at teardown; returns obj.
    An exception from a close() is reported (as a teardown error) after everything was closed."""
    opened = []

    def register(obj):
        opened.append(obj)
        return obj

    yield register
    errors = []
    for obj in reversed(opened):
        try:
            _close(obj)
        except Exception as exc:
            errors.append(exc)
        if REFERENCE:
            _release_reference_leftovers(obj)
    opened.clear()
    if errors:
        raise errors[0]


def _release_reference_leftovers(env) -> None:
    """gymnasium / SB3 leave their error queue and Process sentinels (open fds) to the garbage
    collector, which a failed test's traceback can keep alive; release them explicitly so the
    fd-leak check in tests/conftest.py judges only the test.  Never applied to envmanager's
    classes: their close() must free everything by itself."""
    queue = getattr(env, "error_queue", None)
    if queue is not None:
        queue.close()
        queue.join_thread()
        for end in (getattr(queue, "_reader", None), getattr(queue, "_writer", None)):
            if end is not None:  # Queue.close() leaves both pipe ends open if nothing was put
                end.close()
    for proc in getattr(env, "processes", []) or []:
        try:
            proc.close()
        except ValueError:  # still running (should not happen after close)
            pass


@pytest.fixture
def make_async(impl, closing):
    """``make_async(env_fns, **kwargs)``: the implementation under test, closed at teardown."""
    return lambda env_fns, **kwargs: closing(impl(env_fns, **kwargs))


@pytest.fixture
def make_sync(closing):
    from gymnasium.vector import SyncVectorEnv

    return lambda env_fns, **kwargs: closing(SyncVectorEnv(env_fns, **kwargs))


class Gate:
    """A file whose existence lets gated env calls proceed (see ``envs.wait_for_gate``)."""

    def __init__(self, path: str):
        self.path = path

    def open(self) -> None:
        with open(self.path, "w"):
            pass


@pytest.fixture
def gates(tmp_path, closing):
    """``gates()`` makes a new closed gate; every gate is opened at teardown *before* envs close
    (this fixture depends on ``closing``, so it is torn down first)."""
    made = []

    def new_gate() -> Gate:
        gate = Gate(str(tmp_path / f"gate{len(made)}"))
        made.append(gate)
        return gate

    yield new_gate
    for gate in made:
        gate.open()


@pytest.fixture(autouse=True, scope="module")
def no_leaked_workers():
    """After each module every vector env has been closed: no worker process may remain."""
    yield
    leaked = worker_children()
    for proc in leaked:  # clean up so one leak does not cascade into other modules
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not leaked, f"worker processes leaked: pids {[p.pid for p in leaked]}"
