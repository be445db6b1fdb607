"""RaySampler on a real local Ray session (``ray.init(num_cpus=2)``, one per module): fragments
first-ready across nodes, versions and lag, unbiased exact episodes, env updates, faults."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager.errors import EnvManagerError, InvalidInputError, WorkerError  # noqa: E402
from envmanager.ray import RayNodeError, RaySampler  # noqa: E402
from envmanager.ray.node import SamplerNode  # noqa: E402
from envmanager.sampler import EpisodeBatch, TransitionBatch  # noqa: E402
from fault_envs import FaultFactory, FaultPolicy, check_rows, update_raising_once  # noqa: E402
from ray_helpers import (HangEnv, IdPolicy, alive, children, no_contiguity_gaps, node_pids,  # noqa: E402
                         pickle_by_value, pid_file_factory, raising_factory, seed_env, slow_restart_factory)
from sampler_envs import RandomPolicy, kind_env, set_bonus, true_lengths  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """One local Ray session for the module (the user's session: samplers must leave it running)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local test session: no token written to ~/.ray
    pickle_by_value()
    temp_dir = tempfile.mkdtemp(prefix="rayt")  # short: Ray's socket paths live under it
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    yield
    ray.shutdown()
    left = alive([p.pid for p in children()], timeout=15)
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"processes left after ray.shutdown(): {left}"


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check: Ray's processes live for the module; each test
    checks that the node actors and env processes it started are gone after close."""
    yield


def _sampler(**kwargs) -> RaySampler:
    options = {"nodes": 2, "envs_per_node": 2, "fragment_steps": 32, "seed": 1, "timeout": 30.0, "start_timeout": 60.0}
    return RaySampler(kind_env, kwargs.pop("policy", None) or IdPolicy(), **{**options, **kwargs})


def test_fragments_first_ready_versions_lag_and_the_users_session_stays():
    sampler = _sampler()
    pids = node_pids(sampler)
    try:
        infos = sampler.node_info()
        assert [i["index"] for i in infos] == [0, 1] and len(set(pids)) == len(pids) == 2 + 4
        first = sampler.obtain_steps(50)
        second = sampler.obtain_steps(70)
        assert len(first) == 50 and len(second) == 70  # exact, whatever the fragment size
        versions = sampler.update(agent_update=7)
        assert versions == (1, 0)
        later = [sampler.obtain_steps(32) for _ in range(8)]
        stats = sampler.stats.stats()
    finally:
        sampler.close()
    assert ray.is_initialized()  # a session the user started is left running
    assert not alive(pids), "node actors or env processes left after close"
    everything = TransitionBatch.concatenate([first, second, *later])
    assert set(everything.worker_ids.tolist()) == {0, 1, 2, 3}
    assert (everything.agent_infos["ids"] == everything.worker_ids).all()  # the policy saw global slot ids
    no_contiguity_gaps(everything)  # episodes continue across calls and fragments: nothing lost or repeated
    assert len(np.unique(everything.episode_ids)) == len({(w, e) for w, e in zip(everything.worker_ids, everything.episode_ids)})
    # Each step is stamped with the version that chose it on its node: params match the version.
    assert ((everything.policy_versions == 1) == (everything.agent_infos["params"] == 7)).all()
    assert (everything.policy_versions[:120] == 0).all() and everything.policy_versions[-1] == 1
    assert stats["policy_lag_max"] >= 1 and stats["policy_lag_min"] == 0  # lag measured across the cluster
    assert stats["env_steps"] >= len(everything) and stats["fragments"] >= len(everything) // 32


def test_exact_episodes_unbiased_across_nodes_env_updates_and_samples():
    """Quotas per global slot, admission at each episode's start on its node: the collected
    lengths are exactly each slot's first k episodes (5- and 50-step kinds), in (worker,
    admission) order; env updates and weights reach every node before the call's episodes."""
    seed, k = 11, 5
    sampler = _sampler(seed=seed, policy=RandomPolicy())
    pids = node_pids(sampler)
    try:
        batch = sampler.obtain_exact_episodes(k)
        sampler.obtain_steps(10)  # leaves episodes mid-way on both nodes
        assert sampler.update(agent_update=3, env_update=set_bonus(10.0)) == (1, 1)
        updated = sampler.obtain_episodes(6)
        listed = sampler.obtain_exact_episodes([0, 2, 1, 0])
        samples = sampler.obtain_samples(0, 300)
        with pytest.raises(InvalidInputError):
            sampler.obtain_exact_episodes([1, 1])
        with pytest.raises(InvalidInputError):
            sampler.update(env_update=[set_bonus(1.0)] * 3)
    finally:
        sampler.close()
    assert not alive(pids)
    expected = [length for slot in range(4) for length in true_lengths(seed, slot, k)]
    assert isinstance(batch, EpisodeBatch) and batch.lengths.tolist() == expected
    assert batch.worker_ids[batch.starts].tolist() == [s for s in range(4) for _ in range(k)]
    assert not batch.episode_interrupted.any() and batch.dones.sum() == batch.n_episodes
    assert np.bincount(updated.worker_ids[updated.starts], minlength=4).tolist() == [2, 2, 1, 1]
    assert (updated.observations[updated.starts, 0] == 0).all()  # each started during the call
    assert (updated.observations[:, 2] == 10.0).all() and (updated.env_versions == 1).all()
    assert (updated.policy_versions == 1).all()
    assert listed.worker_ids[listed.starts].tolist() == [1, 1, 2]
    # obtain_samples: whole episodes, each started in the call, from every node, in worker order.
    assert len(samples) >= 300 and samples.lengths.sum() == len(samples)
    ends = samples.starts + samples.lengths - 1
    assert samples.dones[ends].all() and samples.dones.sum() == samples.n_episodes
    assert (samples.observations[samples.starts, 0] == 0).all() and (samples.policy_versions == 1).all()
    assert set(samples.worker_ids.tolist()) == {0, 1, 2, 3}
    assert samples.worker_ids[samples.starts].tolist() == sorted(samples.worker_ids[samples.starts].tolist())


def test_killed_node_restarts_with_the_newest_weights_and_cut_episodes_are_counted():
    sampler = _sampler(in_flight=2)
    try:
        sampler.update(agent_update=9)
        before = [sampler.obtain_steps(40) for _ in range(3)]
        old = sampler.node_info()[0]
        sampler.kill_node(0)
        after = [sampler.obtain_steps(40) for _ in range(8)]
        new = sampler.node_info()[0]
        pids = node_pids(sampler)
        assert sampler.restart_count(0) == 1 and sampler.restart_count(1) == 0
        stats = sampler.stats.stats()
        cut = list(sampler.cut_episodes)
    finally:
        sampler.close()
    assert not alive([old["pid"], *old["worker_pids"]]), "the killed node's env processes outlived it"
    assert not alive(pids)
    assert new["pid"] != old["pid"]
    everything = TransitionBatch.concatenate([*before, *after])
    no_contiguity_gaps(everything)  # nothing duplicated, no episode resumed after its node died
    steps_after = TransitionBatch.concatenate(after)
    assert (steps_after.agent_infos["params"][steps_after.worker_ids < 2] == 9).all()  # weights replayed
    assert (steps_after.policy_versions == 1).all()
    assert 1 <= len(cut) <= 2 and stats["interrupted_episodes"] == len(cut) and stats["lost_requests"] >= 1
    for episode in cut:  # a cut episode never ends and never continues on the new node
        rows = everything.episode_ids == episode
        assert rows.any() and not everything.dones[rows].any()
        assert set(everything.worker_ids[rows].tolist()) <= {0, 1}


def test_hung_node_is_killed_and_restarted_within_limits(tmp_path):
    marker = str(tmp_path / "hung")
    factory = _hang_factory(marker)
    sampler = RaySampler(factory, IdPolicy(), nodes=2, envs_per_node=1, fragment_steps=16, seed=0, timeout=3.0)
    try:
        old = sampler.node_info()[1]
        batches, give_up = [], time.monotonic() + 60  # a bound on the loop, not a timing assertion
        while sampler.restart_count(1) == 0 and time.monotonic() < give_up:
            batches.append(sampler.obtain_steps(16))  # node 0 goes on while node 1 hangs
        assert os.path.exists(marker) and sampler.restart_count(1) == 1
        batches += [sampler.obtain_steps(16) for _ in range(8)]
        assert 1 in TransitionBatch.concatenate(batches[-8:]).worker_ids  # the new node 1 delivers
        pids = node_pids(sampler)
    finally:
        sampler.close()
    assert not alive([old["pid"], *old["worker_pids"]]), "the hung node's processes outlived it"
    assert not alive(pids)
    no_contiguity_gaps(TransitionBatch.concatenate(batches))


def _hang_factory(marker: str):
    def factory(worker_id: int):
        return HangEnv(marker, 20) if worker_id == 1 else kind_env(worker_id)
    return factory


def test_a_slow_restart_does_not_make_a_healthy_node_hung(tmp_path):
    """Node 0 dies and its restart takes longer than ``timeout``; node 1, whose fragment was
    under way and finished meanwhile, is not judged hung by the time the restart took."""
    factory = slow_restart_factory(str(tmp_path / "built"), start_delay=5.0, step_delay=0.03)
    sampler = RaySampler(factory, IdPolicy(), nodes=2, envs_per_node=1, fragment_steps=16, in_flight=1, seed=0, timeout=3.0)
    try:
        sampler.obtain_steps(16)
        sampler.kill_node(0)
        batches = [sampler.obtain_steps(16) for _ in range(4)]
        assert sampler.restart_count(0) == 1
        assert sampler.restart_count(1) == 0, "a healthy node was killed as hung"
        pids = node_pids(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    assert 1 in TransitionBatch.concatenate(batches).worker_ids


def test_a_node_that_fails_to_start_leaves_no_node_behind(tmp_path):
    """Node 0 cannot build an env: the error names it, and every node's env processes end
    (each live node is closed, not only those whose start was seen)."""
    with pytest.raises(RayNodeError, match=r"(?s)node 0 .*cannot be built"):
        RaySampler(pid_file_factory(str(tmp_path), fail_slot=0), IdPolicy(), nodes=2, envs_per_node=2, seed=0)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert not alive(pids), "env processes outlived their failed sampler"
    assert (tmp_path / "closed-2").exists() and (tmp_path / "closed-3").exists(), "node 1 was killed, not closed"
    assert ray.is_initialized()


def test_answers_taken_before_a_node_error_are_handed_out_by_the_next_wait(tmp_path):
    """Both nodes' requests are done when the driver looks: node 1's raised, node 0's answer was
    taken first; the error names node 1 and node 0's answer comes with the next wait."""
    factory = raising_factory(str(tmp_path / "raised"), slot=1, at=3)
    sampler = RaySampler(factory, IdPolicy(), nodes=2, envs_per_node=1, fragment_steps=8, seed=0, restart_workers=False)
    pool = sampler._pool
    try:
        requests = [pool.submit(node, "steps", 8) for node in pool.nodes]
        ray.wait([r.ref for r in requests], num_returns=2, timeout=60)
        with pytest.raises(RayNodeError, match=r"(?s)node 1 .*env blew up"):
            pool.wait()
        held = pool.wait()
        assert [(request.node, len(answer[0])) for request, answer in held] == [(0, 8)]
    finally:
        sampler.close()


def test_an_update_that_raises_on_the_node_is_raised_by_the_next_request():
    """The node's sampler rejects an update: the next request raises that error at once (not
    after waiting for an update that was counted as never arrived)."""
    node = SamplerNode(0, kind_env, 1, 0, IdPolicy(), [0], [0], 1, {})
    try:
        with pytest.raises(InvalidInputError):
            node.update(None, None, ["not callable"])
        with pytest.raises(EnvManagerError, match=r"node 0: an update sent before this request raised InvalidInputError") as caught:
            node.steps(4, updates=1)
        assert isinstance(caught.value.__cause__, InvalidInputError)
    finally:
        node.close()


def test_past_the_restart_limits_the_error_names_the_node():
    sampler = _sampler(restart_nodes=False)
    pids = node_pids(sampler)
    try:
        sampler.obtain_steps(10)
        sampler.kill_node(1)
        with pytest.raises(RayNodeError, match=r"node 1 \(slots 2–3, host .*\) died .*not restarted: restarts are disabled"):
            for _ in range(10):
                sampler.obtain_steps(32)
        with pytest.raises(RayNodeError, match="node 1"):  # and on every later use
            sampler.obtain_steps(32)
    finally:
        sampler.close()
    assert not alive(pids)


def test_unplaceable_node_is_an_error_after_start_timeout_and_bad_input_first():
    with pytest.raises(InvalidInputError):
        RaySampler(kind_env, IdPolicy(), nodes=0)
    with pytest.raises(InvalidInputError):
        RaySampler(kind_env, IdPolicy(), nodes=2, envs_per_node=[1, 2, 3])
    with pytest.raises(InvalidInputError):
        RaySampler(kind_env, IdPolicy(), fragment_steps=0)
    with pytest.raises(RayNodeError, match=r"node 0 .*did not start within 2 s"):
        RaySampler(kind_env, IdPolicy(), nodes=1, start_timeout=2.0, actor_options={"resources": {"no-such-thing": 1}})
    assert ray.is_initialized()


def test_a_node_whose_runtime_env_fails_is_a_node_error():
    # Ray raises its own RuntimeEnvSetupError for the actor's first call: it reaches the user
    # as RayNodeError naming the node (it came through raw)
    with pytest.raises(RayNodeError, match=r"(?s)node 0 .*could not start: RuntimeEnvSetupError"):
        RaySampler(kind_env, IdPolicy(), nodes=1, start_timeout=60.0, actor_options={"runtime_env": {"conda": "no-such-env-xyz"}})
    assert ray.is_initialized()


def test_ray_is_imported_only_by_the_ray_backend():
    import subprocess
    import sys

    code = ("import sys, envmanager, envmanager.sampler, envmanager.bench, envmanager.cli; "
            "assert 'ray' not in sys.modules, 'ray imported'; import envmanager.ray; assert 'ray' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# The fault matrix across nodes: faults inside a node go through its sampler's one failure path
# (restarts of its env processes); a node that dies or hangs through the driver's; errors name
# the global slot; the data is checked, not only the error.


def _fault_sampler(fault, marker, slot=3, restart_workers=True, restart_nodes=True, **kwargs) -> RaySampler:
    # Rounds over every node (first_ready=False): the faulty node's fragments are in each round,
    # however long its restart takes, so what it did is seen.
    options = {"nodes": 2, "envs_per_node": 2, "fragment_steps": 16, "seed": 0, "timeout": 30.0, "start_timeout": 60.0,
               "restart_workers": restart_workers, "restart_nodes": restart_nodes, "env_timeout": 5.0, "first_ready": False}
    return RaySampler(FaultFactory(fault, marker, slot=slot), FaultPolicy(fault, marker, slot=slot), **{**options, **kwargs})


@pytest.mark.parametrize("fault", ["step_raise", "step_kill", "update_raise"])
def test_env_faults_inside_a_node_with_its_restarts_are_absorbed(fault, tmp_path):
    marker = str(tmp_path / "struck")
    sampler = _fault_sampler(fault, marker)
    pids = node_pids(sampler)
    try:
        if fault == "update_raise":
            sampler.update(env_update=update_raising_once(marker, slot=3))
        batches = [sampler.obtain_steps(40) for _ in range(6)]
        stats, cut = sampler.stats.stats(), list(sampler.cut_episodes)
        assert sampler.restart_count(1) == 0  # absorbed inside the node, by its own sampler
    finally:
        sampler.close()
    assert not alive(pids)
    assert os.path.exists(marker) and stats["worker_restarts"] == 1
    everything = TransitionBatch.concatenate(batches)
    check_rows(everything, cut, 4, whole=False)  # fragments of several calls
    if fault.startswith("step"):  # the cut episode (one step done) is listed by the driver
        assert stats["interrupted_episodes"] >= 1 and set(cut) & set(everything.episode_ids.tolist())
        # its rows not handed out before the cut are flagged (one fragment may have handed them all out)
        assert set(everything.worker_ids[everything.interrupted].tolist()) <= {2, 3}  # node 1's slots
    if fault == "update_raise":
        assert (everything.env_versions == 1).all()


def test_an_env_fault_on_a_node_names_the_global_slot(tmp_path):
    marker = str(tmp_path / "struck")
    sampler = _fault_sampler("step_raise", marker, restart_workers=False)
    pids = node_pids(sampler)
    try:
        with pytest.raises(RayNodeError) as caught:
            for _ in range(6):
                sampler.obtain_steps(40)
        error = caught.value
        assert error.node == 1 and isinstance(error.cause, WorkerError) and error.cause.worker_id == 3
        assert "worker 3" in str(error) and "env step blew up" in str(error)
        later = TransitionBatch.concatenate([sampler.obtain_steps(40) for _ in range(3)])  # the node serves on
        cut = list(sampler.cut_episodes)
    finally:
        sampler.close()
    assert not alive(pids)
    check_rows(later, cut, 4, whole=False)


def test_a_policy_that_raises_on_a_node_is_a_node_error_and_collection_goes_on(tmp_path):
    marker = str(tmp_path / "struck")
    sampler = _fault_sampler("policy_raise", marker)
    pids = node_pids(sampler)
    try:
        with pytest.raises(RayNodeError) as caught:
            for _ in range(6):
                sampler.obtain_steps(40)
        assert caught.value.node == 1 and isinstance(caught.value.cause, RuntimeError)
        assert "policy blew up" in str(caught.value)
        later = TransitionBatch.concatenate([sampler.obtain_steps(40) for _ in range(3)])
        cut = list(sampler.cut_episodes)
    finally:
        sampler.close()
    assert not alive(pids)
    check_rows(later, cut, 4, whole=False)


def test_a_restarted_node_replays_no_seeded_episode_and_its_ids_go_on():
    sampler = RaySampler(seed_env, IdPolicy(), nodes=2, envs_per_node=2, fragment_steps=32, seed=100, timeout=30.0,
                         start_timeout=60.0)
    try:
        before = [sampler.obtain_steps(64) for _ in range(2)]
        sampler.kill_node(0)
        after = [sampler.obtain_steps(64) for _ in range(6)]
        assert sampler.restart_count(0) == 1
    finally:
        sampler.close()
    everything = TransitionBatch.concatenate([*before, *after])
    no_contiguity_gaps(everything)
    seeds: dict[int, int] = {}
    for episode in np.unique(everything.episode_ids).tolist():
        rows = everything.episode_ids == episode
        assert len(set(everything.observations[rows, 2].tolist())) == 1
        seed = int(everything.observations[rows, 2][0])
        if seed >= 0:
            assert seed not in seeds, f"seed {seed} replayed by episodes {seeds[seed]} and {episode}"
            seeds[seed] = episode
    assert sorted(seeds) == [100, 101, 102, 103]  # each slot's first episode, once
    first = TransitionBatch.concatenate(before)
    for slot in (0, 1):  # the restarted node's episodes are numbered on from what was seen
        old = first.episode_ids[first.worker_ids == slot]
        new = TransitionBatch.concatenate(after)
        new_ids = set(new.episode_ids[new.worker_ids == slot].tolist()) - set(old.tolist())
        assert new_ids and min(new_ids) > old.max() and all(e % 4 == slot for e in new_ids)


def test_close_from_another_thread_ends_a_ray_call():
    import threading

    sampler = _fault_sampler(None, "unused", fragment_steps=64)
    pids = node_pids(sampler)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(1000):
                sampler.obtain_steps(64)
        except BaseException as exc:  # noqa: BLE001 - what the call raised is the point
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(2.0)
    sampler.close()
    thread.join(60)
    assert not thread.is_alive() and len(raised) == 1 and isinstance(raised[0], EnvManagerError), raised
    assert not alive(pids)
