"""RaySampler across two raylets on this machine (``ray.cluster_utils.Cluster``): nodes spread
over both, and a raylet removed mid-collection (its node actor and env processes die with it)."""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402

from envmanager.ray import RaySampler  # noqa: E402
from envmanager.sampler import TransitionBatch  # noqa: E402
from ray_helpers import IdPolicy, alive, children, no_contiguity_gaps, node_pids, pickle_by_value  # noqa: E402
from sampler_envs import kind_env  # noqa: E402

#: Notice a lost raylet in about a second (Ray's default takes tens of seconds).
FAST_HEALTH_CHECK = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200, "health_check_failure_threshold": 3}


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check (Ray's processes are children of this process);
    the test checks its own processes and everything after the cluster's shutdown."""
    yield


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a local test session: no token written to ~/.ray
    temp_dir = tempfile.mkdtemp(prefix="rayc")  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)  # every file of the cluster's (its address too) goes there
    pickle_by_value()
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": FAST_HEALTH_CHECK})
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        left = alive([p.pid for p in children()], timeout=15)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes left after the cluster's shutdown: {left}"


def test_two_raylets_a_lost_raylet_mid_collection_is_restarted_elsewhere(cluster):
    worker = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    sampler = RaySampler(kind_env, IdPolicy(), nodes=2, envs_per_node=2, fragment_steps=32, seed=0, timeout=20.0)
    try:
        infos = sampler.node_info()
        where = [i["ray_node_id"] for i in infos]
        assert set(where) == {cluster.head_node.node_id, worker.node_id}  # one node actor per raylet
        lost = where.index(worker.node_id)
        old = infos[lost]
        sampler.update(agent_update=4)
        batches = [sampler.obtain_steps(40) for _ in range(3)]
        cluster.remove_node(worker, allow_graceful=False)  # fragments are under way on it
        give_up = time.monotonic() + 60  # a bound on the loop, not a timing assertion
        while sampler.restart_count(lost) == 0 and time.monotonic() < give_up:
            batches.append(sampler.obtain_steps(40))
        assert sampler.restart_count(lost) == 1
        batches += [sampler.obtain_steps(40) for _ in range(6)]
        new = sampler.node_info()[lost]
        pids = node_pids(sampler)
        cut = list(sampler.cut_episodes)
        stats = sampler.stats.stats()
    finally:
        sampler.close()
    assert not alive(pids)
    assert not alive([old["pid"], *old["worker_pids"]]), "the lost raylet's node left processes behind"
    assert new["ray_node_id"] == cluster.head_node.node_id  # the replacement runs on the raylet that is left
    everything = TransitionBatch.concatenate(batches)
    no_contiguity_gaps(everything)  # nothing duplicated, no episode continued across the loss
    slots = np.arange(infos[lost]["index"] * 2, infos[lost]["index"] * 2 + 2)
    assert np.isin(slots, TransitionBatch.concatenate(batches[-6:]).worker_ids).all()  # its slots deliver again
    assert (TransitionBatch.concatenate(batches[-6:]).agent_infos["params"] == 4).all()  # with the newest weights
    assert stats["interrupted_episodes"] == len(cut) <= 2 and stats["lost_requests"] >= 1


def test_a_session_samplers_started_ends_with_the_last_of_them(cluster):
    """The first sampler starts the Ray session, a second joins it: closing the first leaves
    the session to the second, and closing that one ends it."""
    first = RaySampler(kind_env, IdPolicy(), nodes=1, envs_per_node=1, fragment_steps=16, seed=0, ray_address=cluster.address)
    second = None
    try:
        second = RaySampler(kind_env, IdPolicy(), nodes=1, envs_per_node=1, fragment_steps=16, seed=1)
        first.obtain_steps(16)
        first.close()
        assert ray.is_initialized()
        assert len(second.obtain_steps(32)) == 32  # its node still runs
        pids = node_pids(second)
    finally:
        first.close()
        if second is not None:
            second.close()
    assert not ray.is_initialized()
    assert not alive(pids)
