"""RaySampler when its Ray session goes away under it (the user calls ``ray.shutdown()``): every
call raises ``RaySessionError`` at once, ``close()`` returns cleanly, and no Ray session is ever
started behind the user's back (a Ray call without a session starts one)."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager.errors import EnvManagerError  # noqa: E402
from envmanager.ray import RaySampler, RaySessionError  # noqa: E402
from ray_helpers import IdPolicy, alive, children, node_pids, pickle_by_value  # noqa: E402
from sampler_envs import kind_env  # noqa: E402


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check: the test checks its processes itself."""
    yield


def test_a_session_shut_down_by_the_user_is_an_error_at_once_and_nothing_starts_a_new_one(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    pickle_by_value()
    temp_dir = tempfile.mkdtemp(prefix="rays")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        sampler = RaySampler(kind_env, IdPolicy(), nodes=2, envs_per_node=2, fragment_steps=16, seed=0, timeout=30.0,
                             start_timeout=60.0)
        pids = node_pids(sampler)
        assert len(sampler.obtain_steps(32)) == 32
        ray.shutdown()  # the user's own session, ended by the user
        started = time.monotonic()
        for call in (lambda: sampler.obtain_steps(32), lambda: sampler.update(agent_update=1),
                     lambda: sampler.obtain_exact_episodes(1), lambda: sampler.kill_node(0)):
            with pytest.raises(RaySessionError, match="session"):
                call()
            assert not ray.is_initialized(), "a call started a new Ray session"
        assert time.monotonic() - started < 10  # known at once, not after a deadline
        sampler.close()  # returns cleanly
        sampler.close()
        assert not ray.is_initialized()
        with pytest.raises(EnvManagerError, match="closed"):
            sampler.update(agent_update=2)
        assert not ray.is_initialized()
    finally:
        ray.shutdown()
        left = alive([p.pid for p in children()], timeout=15)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not alive(pids), "node actors or env processes outlived the session"
    assert not left, f"processes left after the session ended: {left}"
