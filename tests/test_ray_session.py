"""The Ray session envmanager's Ray managers run in (``RaySession``, one helper for RaySampler and
RayMLAgentsEnvManager): when it goes away under them (the user calls ``ray.shutdown()``) every
call raises ``RaySessionError`` at once, ``close()`` returns cleanly, and no Ray session is ever
started behind the user's back (a Ray call without a session starts one); a session envmanager
started is shared and ended by its last holder, the user's never; a failed ``ray.init`` is
``RaySessionError`` and leaves nothing behind. Each test starts its own sessions."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import tempfile

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager.errors import EnvManagerError  # noqa: E402
from envmanager.ray import RaySampler, RaySession, RaySessionError  # noqa: E402
from ray_helpers import IdPolicy, alive, children, node_pids, pickle_by_value  # noqa: E402
from sampler_envs import kind_env  # noqa: E402


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check: the test checks its processes itself."""
    yield


@pytest.mark.timeout(240)
def test_a_session_shut_down_by_the_user_is_an_error_at_once_and_nothing_starts_a_new_one(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    pickle_by_value()
    temp_dir = tempfile.mkdtemp(prefix="rays")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        # A deadline far past the test's own timeout: a call that waited for it, instead of
        # knowing at once, fails the test (no timing is asserted).
        sampler = RaySampler(kind_env, IdPolicy(), nodes=2, envs_per_node=2, fragment_steps=16, seed=0, timeout=900.0,
                             start_timeout=60.0)
        pids = node_pids(sampler)
        assert len(sampler.obtain_steps(32)) == 32
        ray.shutdown()  # the user's own session, ended by the user
        for call in (lambda: sampler.obtain_steps(32), lambda: sampler.update(agent_update=1),
                     lambda: sampler.obtain_exact_episodes(1), lambda: sampler.kill_node(0)):
            with pytest.raises(RaySessionError, match="session"):
                call()
            assert not ray.is_initialized(), "a call started a new Ray session"
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


# ----------------------------------------------------------------------------------------------
# One session helper (RaySession) for both Ray managers: a session envmanager started is shared
# and shut down by its last holder; the user's session is never shut down; failures are ours.

LOCAL = {"num_cpus": 2, "log_to_driver": False}  # what the managers pass to the ray.init they make


def our_temp_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "envmgr-ray-*")))


@pytest.fixture
def clean(monkeypatch):
    """No Ray session before; after the test none is left running, nor any process it started."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    pickle_by_value()
    assert not ray.is_initialized()
    dirs = our_temp_dirs()
    yield
    ray.shutdown()
    left = alive([p.pid for p in children()], timeout=15)
    for pid in left:
        psutil.Process(pid).kill()
    for path in our_temp_dirs() - dirs:
        shutil.rmtree(path, ignore_errors=True)
    assert not left, f"processes left: {left}"


def ml_agents_manager(tmp_path, **kwargs):
    """A RayMLAgentsEnvManager of one fake Unity player on one node actor."""
    pytest.importorskip("mlagents_envs")
    from envmanager.mlagents import UnityEnvironmentFactory
    from envmanager.mlagents.ray_env_manager import RayMLAgentsEnvManager
    from envmanager.testing.fake_unity import free_base_port, write_launcher

    factory = UnityEnvironmentFactory(write_launcher(tmp_path), base_port=free_base_port(1), timeout_wait=10)
    return RayMLAgentsEnvManager(factory, 1, n_nodes=1, timeout=30, **kwargs)


def manager_pids(manager) -> list[int]:
    return [pid for info in manager.node_info() for pid in
            [info["pid"], *info["worker_pids"], *(p for p in info["player_pids"].values() if p)]]


@pytest.mark.timeout(240)
def test_a_session_the_ml_agents_manager_started_is_shared_and_ended_by_its_last_holder(clean, tmp_path):
    """The ML-Agents manager starts the session, a RaySampler joins it; the manager closes and
    the sampler goes on in it; the sampler, its last holder, shuts it down and removes its files."""
    dirs = our_temp_dirs()
    manager = ml_agents_manager(tmp_path, ray_init=LOCAL)
    assert ray.is_initialized() and len(our_temp_dirs() - dirs) == 1
    sampler = RaySampler(kind_env, IdPolicy(), nodes=1, envs_per_node=1, fragment_steps=8, seed=0, timeout=30.0)
    pids = manager_pids(manager) + node_pids(sampler)
    manager.close()
    assert ray.is_initialized(), "the ML-Agents manager shut down a session the sampler still holds"
    assert len(sampler.obtain_steps(16, agent_update=1)) == 16
    sampler.close()
    assert not ray.is_initialized(), "the session's last holder left it running"
    assert our_temp_dirs() == dirs
    assert not alive(pids)


@pytest.mark.timeout(240)
def test_the_users_session_is_never_shut_down_and_a_session_gone_is_ray_session_error(clean, tmp_path):
    """Both managers hold the session the ML-Agents manager started; the user shuts it down
    under them: every call is RaySessionError (not Ray's own error) and starts no new session.
    Then the user starts a session of their own (same job id as the one before: a new local
    session numbers its jobs from 1 again): closing either manager leaves it running."""
    manager = ml_agents_manager(tmp_path, ray_init=LOCAL)
    sampler = RaySampler(kind_env, IdPolicy(), nodes=1, envs_per_node=1, fragment_steps=8, seed=0, timeout=30.0)
    pids = manager_pids(manager) + node_pids(sampler)
    stale = sampler._pool.nodes[0].actor  # an actor handle of that session
    ray.shutdown()  # the user ends it under both
    for call in (manager.reset, lambda: sampler.obtain_steps(8), lambda: sampler.update(agent_update=1)):
        with pytest.raises(RaySessionError, match=r"session .*is gone"):
            call()
        assert not ray.is_initialized(), "a call started a new Ray session"
    assert not alive(pids), "the managers' actors, workers or players outlived their session"
    user_dir = tempfile.mkdtemp(prefix="rayu")
    try:
        ray.init(**LOCAL, include_dashboard=False, _temp_dir=user_dir)
        with pytest.raises(RaySessionError, match=r"session .*is gone"):
            manager.reset()  # the user's session is not the one it ran in
        manager.close()
        sampler.close()
        assert ray.is_initialized(), "a manager shut down the user's session"
        held = RaySession.join()  # a holder of the user's session: its errors are the package's
        with pytest.raises(RaySessionError, match="Ray failed killing") as info:
            try:
                ray.kill(stale)  # Ray's error: a handle of another session
            except Exception as exc:
                held.reraise(exc, "killing")
        assert isinstance(info.value.cause, ray.exceptions.RayError) and info.value.__cause__ is info.value.cause
        with pytest.raises(TypeError, match="not Ray's"):
            held.reraise(TypeError("not Ray's"), "pickling")
        held.leave()
        assert ray.is_initialized()
    finally:
        ray.shutdown()
        shutil.rmtree(user_dir, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_failed_ray_init_is_ray_session_error_naming_it_and_leaves_nothing_behind(clean, tmp_path):
    """A local ray.init that fails (invalid options) has already started its head's processes:
    they are killed and its temp dir removed; a failed connection names the address."""
    dirs = our_temp_dirs()
    with pytest.raises(RaySessionError, match="could not start a local Ray session: ValueError") as info:
        RaySampler(kind_env, IdPolicy(), nodes=1, envs_per_node=1, ray_init_options={"num_cpus": -1})
    assert isinstance(info.value.__cause__, ValueError) and info.value.address is None
    assert not ray.is_initialized()
    assert not alive([p.pid for p in children()], timeout=0), "a failed ray.init left processes running"
    assert our_temp_dirs() == dirs
    with pytest.raises(RaySessionError, match=r"Ray cluster at '127\.0\.0\.1:1'") as info:
        ml_agents_manager(tmp_path, address="127.0.0.1:1", ray_init={"num_cpus": 1})
    assert info.value.address == "127.0.0.1:1"
    assert not ray.is_initialized()
    # Nothing listens at the address: an error at once (Ray itself retries for minutes, past the
    # test's timeout), for both managers.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(RaySessionError, match="nothing accepts a connection") as info:
        RaySampler(kind_env, IdPolicy(), nodes=1, envs_per_node=1, ray_address=address)
    assert info.value.address == address and isinstance(info.value.cause, ConnectionRefusedError)
    with pytest.raises(RaySessionError, match="nothing accepts a connection"):
        ml_agents_manager(tmp_path, address=address)
    assert not ray.is_initialized()
