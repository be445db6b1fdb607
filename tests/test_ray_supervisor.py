"""The one supervisor through the Ray sampler's node pool (real actors in a local Ray session):
the fault of ``test_supervisor.py`` — a unit of remote work killed — on a node gives the same
restart counting and, past the limits, the same error shape as in the core's process pool."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager import RestartLimitError  # noqa: E402
from envmanager.ray import RayNodeError, RaySampler  # noqa: E402
from envmanager.ray.nodes import RayNodeRestartLimitError  # noqa: E402
from process_helpers import alive  # noqa: E402
from ray_helpers import NODE_START_S, IdPolicy, node_trees, ray_session, seed_env  # noqa: E402,F401
from test_supervisor import LIMITS, core_limit_error, shape  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):  # noqa: F811
    yield


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check (Ray's processes live for the module): the test
    checks that every process its nodes ran is gone after close."""
    yield


def test_ray_node_pool_restarts_once_then_gives_up_with_the_same_error_shape():
    sampler = RaySampler(seed_env, IdPolicy(), nodes=2, envs_per_node=2, fragment_steps=8, seed=0, timeout=60.0,
                         start_timeout=NODE_START_S, restart_nodes=True, **LIMITS)
    pids: set[int] = set()
    try:
        sampler.obtain_steps(16)
        pids |= set(node_trees(sampler))
        assert sampler.restarts == 0
        sampler.kill_node(1)
        give_up = time.monotonic() + 120  # a bound on the loop, not a timing assertion
        while sampler.restart_count(1) < 1 and time.monotonic() < give_up:
            sampler.obtain_steps(16)
        pids |= set(node_trees(sampler))
        restarts, count = sampler.restarts, sampler.restart_count(1)
        sampler.kill_node(1)
        with pytest.raises(RestartLimitError) as caught:
            while time.monotonic() < give_up + 120:
                sampler.obtain_steps(16)
        error = caught.value
        with pytest.raises(RestartLimitError) as again:  # at once, the same error
            sampler.obtain_steps(16)
        assert again.value is error
        assert sampler.restarts == restarts
    finally:
        sampler.close()
    assert not alive(sorted(pids), timeout=10.0)
    assert restarts == 1 and count == 1  # the kill, counted once, as in the core pool
    # the same shape as the core pool's, and still the node error users catch
    assert isinstance(error, RayNodeRestartLimitError) and isinstance(error, RayNodeError)
    assert error.node == 1 and error.worker_ids == [2, 3] and "node 1" in str(error) and "slots 2–3" in str(error)
    assert isinstance(error.failure, RayNodeError) and "died" in str(error.failure)
    core_error, _, _ = core_limit_error()
    assert shape(error) == shape(core_error) == (True, True, True, True, True, True)
