"""RaySampler on a real local Ray session (``ray.init(num_cpus=2)``, one per module): fragments
first-ready across nodes, versions and lag, unbiased exact episodes, env updates, restarts (the
fault matrix is ``test_ray_faults.py``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager.errors import EnvManagerError, InvalidInputError  # noqa: E402
from envmanager.ray import RayNodeError, RaySampler  # noqa: E402
from envmanager.ray.node import SamplerNode  # noqa: E402
from envmanager.sampler import EpisodeBatch, TransitionBatch  # noqa: E402
from ray_helpers import (  # noqa: E402
    NODE_START_S,
    IdPolicy,
    alive,
    no_contiguity_gaps,
    node_pids,
    pid_file_factory,
    raising_factory,
    ray_session,  # noqa: F401  # a fixture: pytest finds it by name (``_ray`` below)
    seed_env,
    slow_restart_factory,
)
from sampler_envs import RandomPolicy, add_bonus, kind_env, set_bonus, true_lengths  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # a node's start may take minutes on a loaded machine (``NODE_START_S``)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):  # noqa: F811  # the imported fixture, requested by name
    """One local Ray session for the module (``ray_helpers.ray_session``)."""
    yield


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check: Ray's processes live for the module; each test
    checks that the node actors and env processes it started are gone after close."""
    yield


def _sampler(**kwargs) -> RaySampler:
    options = {"nodes": 2, "envs_per_node": 2, "fragment_steps": 32, "seed": 1, "timeout": 30.0, "start_timeout": NODE_START_S}
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
        # First-ready: a node a loaded machine slowed may not have delivered yet (CI saw one node's
        # slots only in the first 376 steps); every node's fragments must come all the same.
        deadline = time.monotonic() + 120
        while not {0, 1, 2, 3} <= {w for b in later for w in b.worker_ids.tolist()} and time.monotonic() < deadline:
            later.append(sampler.obtain_steps(32))
        stats = sampler.stats.stats()
    finally:
        sampler.close()
    assert ray.is_initialized()  # a session the user started is left running
    assert not alive(pids), "node actors or env processes left after close"
    everything = TransitionBatch.concatenate([first, second, *later])
    assert set(everything.worker_ids.tolist()) == {0, 1, 2, 3}
    assert (everything.agent_infos["ids"] == everything.worker_ids).all()  # the policy saw global slot ids
    no_contiguity_gaps(everything)  # episodes continue across calls and fragments: nothing lost or repeated
    pairs = set(zip(everything.worker_ids.tolist(), everything.episode_ids.tolist(), strict=True))
    assert len(np.unique(everything.episode_ids)) == len(pairs)
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


def test_a_slow_restart_does_not_make_a_healthy_node_hung(tmp_path):
    """Node 0 dies and its restart takes longer than ``timeout``; node 1, whose fragment was
    under way and finished meanwhile, is not judged hung by the time the restart took."""
    factory = slow_restart_factory(str(tmp_path / "built"), start_delay=5.0, step_delay=0.03)
    sampler = RaySampler(factory, IdPolicy(), nodes=2, envs_per_node=1, fragment_steps=16, in_flight=1, seed=0, timeout=3.0)
    try:
        sampler.obtain_steps(16)
        killed = sampler.node_info()[0]["pid"]
        sampler.kill_node(0)
        assert not alive([killed], timeout=60)  # gone before the next call (ray.kill returns before)
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


def test_answers_come_before_a_node_error_and_the_error_next(tmp_path):
    """Both nodes' requests are done when the driver looks, node 1's with an error (restarts
    off): node 0's answer is handed out first, and the next wait raises the error naming node 1."""
    factory = raising_factory(str(tmp_path / "raised"), slot=1, at=3)
    sampler = RaySampler(factory, IdPolicy(), nodes=2, envs_per_node=1, fragment_steps=8, seed=0, restart_workers=False,
                         restart_nodes=False)
    pool = sampler._pool
    try:
        requests = [pool.submit(node, "steps", 8) for node in pool.nodes]
        ray.wait([r.ref for r in requests], num_returns=2, timeout=60)
        taken = pool.wait()
        assert [(request.node, len(answer[0])) for request, answer in taken] == [(0, 8)]
        with pytest.raises(RayNodeError, match=r"(?s)node 1 .*env blew up"):
            pool.wait()
    finally:
        sampler.close()


def test_a_wait_with_nothing_asked_of_any_node_raises_at_once():
    """Every request answered and booked, none asked: a wait could only return nothing for ever
    (a caller's loop on it would spin with nothing in flight), so it raises, and the sampler
    still collects afterwards."""
    sampler = _sampler(in_flight=1)
    pool = sampler._pool
    try:
        sampler.obtain_exact_episodes(1)
        while any(node.queue for node in pool.nodes):  # the top-ups of streaming, if any, come in
            sampler._wait()
        with pytest.raises(EnvManagerError, match="no node holds a request"):
            pool.wait()
        assert len(sampler.obtain_steps(8)) == 8
    finally:
        sampler.close()


def test_a_node_restarted_while_its_answers_are_taken_goes_on_from_them():
    """Node 1 answered one request and died in the next; the driver sees both at once. The
    answer is booked before the node restarts, so the new node numbers its episodes on from
    the ones in it (an id must never name two env episodes)."""
    sampler = _sampler(in_flight=1)
    pool = sampler._pool
    try:
        first = pool.submit(pool.nodes[1], "steps", 32)
        ray.wait([first.ref], timeout=60)
        killed = sampler.node_info()[1]["pid"]
        sampler.kill_node(1)
        assert not alive([killed], timeout=60)  # gone before the next request (ray.kill returns before)
        second = pool.submit(pool.nodes[1], "steps", 32)
        ray.wait([second.ref], timeout=60)
        sampler._wait()
        assert sampler.buffered_steps == 32 and sampler.restart_count(1) == 0  # the answer first
        sampler._wait()
        assert sampler.restart_count(1) == 1
        before = sampler._take(32)
        after = TransitionBatch.concatenate([sampler.obtain_steps(64) for _ in range(4)])
        pids = node_pids(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    for slot in (2, 3):
        old = set(before.episode_ids[before.worker_ids == slot].tolist())
        new = set(after.episode_ids[after.worker_ids == slot].tolist())
        assert old and new and min(new) > max(old), f"slot {slot}: ids {sorted(old)} reused by the new node: {sorted(new)}"


class LateHeads:
    """``ray.wait`` as the driver may see it: a node's answer reported ready only after the
    one it submitted next (Ray promises no order across refs; a big answer still being fetched
    from a remote node is one way). The first time a wait that covers both sees a node's
    oldest request done while the next one runs, it waits for that one too and reports it
    alone (a bound, not a timing assertion: the next answer takes milliseconds)."""

    def __init__(self, pool, wait) -> None:
        self.pool, self.wait, self.held = pool, wait, set()

    def __call__(self, refs, num_returns=1, timeout=None, **options):
        ready, _ = self.wait(refs, num_returns=num_returns, timeout=timeout, **options)
        ready = set(ready)
        for node in self.pool.nodes:
            queue = [r.ref for r in node.queue]
            late = len(queue) >= 2 and queue[0] in ready and queue[1] in refs and queue[0] not in self.held
            if late and self.wait([queue[1]], timeout=60, **options)[0]:
                self.held.add(queue[0])
                ready = (ready - {queue[0]}) | {queue[1]}
        return [r for r in refs if r in ready], [r for r in refs if r not in ready]


def test_a_nodes_answers_are_booked_in_the_order_it_was_asked(monkeypatch):
    """A node's later fragment reported ready before its earlier one is booked after it: every
    episode's steps come in order and contiguous, within and across calls, nothing lost or
    repeated (an episode spans fragments: 16 steps over two slots, episodes of 5 or 50)."""
    sampler = _sampler(fragment_steps=16, in_flight=2)
    pids = node_pids(sampler)
    late = LateHeads(sampler._pool, ray.wait)
    monkeypatch.setattr(ray, "wait", late)
    try:
        calls = [sampler.obtain_steps(40) for _ in range(12)]
        held = sampler.buffered_steps
    finally:
        monkeypatch.undo()
        sampler.close()
    assert not alive(pids)
    assert len(late.held) >= 10, "the later answers were never seen first"
    for batch in calls:
        no_contiguity_gaps(batch)
    everything = TransitionBatch.concatenate(calls)
    assert len(everything) == 12 * 40 and held >= 0
    no_contiguity_gaps(everything)  # across calls too: nothing lost, repeated or reordered
    for episode in np.unique(everything.episode_ids).tolist():
        rows = np.flatnonzero(everything.episode_ids == episode)
        assert everything.next_observations[rows[0], 0] == 1, f"episode {episode} lost its first steps"
        assert len(set(everything.worker_ids[rows].tolist())) == 1
        assert (everything.observations[rows[1:]] == everything.next_observations[rows[:-1]]).all()
    assert set(everything.worker_ids.tolist()) == {0, 1, 2, 3}


def test_an_update_that_raises_on_the_node_is_raised_by_the_next_request():
    """The node's sampler rejects an update: the next request raises that error at once (not
    after waiting for an update that was counted as never arrived)."""
    node = SamplerNode(0, kind_env, 1, 0, IdPolicy(), [0], [0], 1, {})
    try:
        with pytest.raises(InvalidInputError):
            node.update(None, None, ["not callable"])
        with pytest.raises(EnvManagerError,
                           match=r"node 0: an update sent before this request raised InvalidInputError") as caught:
            node.steps(4, updates=1)
        assert isinstance(caught.value.error.__cause__, InvalidInputError)
        assert caught.value.serves is False  # the error stays: the node cannot go on
    finally:
        node.close()


def test_an_update_that_cannot_be_sent_is_not_recorded_and_nodes_agree_after_a_restart():
    """An env update that does not pickle, or weights that cannot be put, are refused before
    any node hears of them: no version moves, and a node restarted afterwards replays only what
    every other node has, so both nodes run the same env version with the same env."""
    lock = threading.Lock()

    def unpicklable(env) -> None:  # closes over a lock: cannot travel
        with lock:
            env.unwrapped.bonus = 99.0

    sampler = _sampler(seed=0, policy=RandomPolicy())
    pids = node_pids(sampler)
    try:
        assert sampler.update(env_update=set_bonus(1.0)) == (0, 1)
        with pytest.raises(InvalidInputError, match="cannot be pickled"):
            sampler.update(agent_update=5, env_update=unpicklable)
        assert (sampler.policy_version, sampler.env_version) == (0, 1)
        with pytest.raises(TypeError):  # weights that cannot be put in the object store: raised as they are
            sampler.update(agent_update=lock, env_update=set_bonus(3.0))
        assert (sampler.policy_version, sampler.env_version) == (0, 1)
        sampler.obtain_exact_episodes(1)  # (no episode left running on either node)
        killed = sampler.node_info()[1]["pid"]
        sampler.kill_node(1)
        assert not alive([killed], timeout=60)  # gone before the next call (ray.kill returns before)
        restarted = sampler.obtain_exact_episodes(2)
        assert sampler.restart_count(1) == 1
        assert sampler.update(env_update=set_bonus(2.0)) == (0, 2)
        after = sampler.obtain_exact_episodes(1)
        pids += node_pids(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    for batch, version, bonus in ((restarted, 1, 1.0), (after, 2, 2.0)):
        assert set(batch.worker_ids.tolist()) == {0, 1, 2, 3}  # both nodes, the restarted one too
        assert (batch.env_versions == version).all() and (batch.observations[:, 2] == bonus).all()


def test_evaluations_between_training_calls_do_not_stock_ever_more_fragments():
    """Training with ``obtain_steps`` (three fragments) and an evaluation by exact episodes in
    turn: each evaluation books the fragments queued for streaming. Queueing a whole round more
    after it stocked one more round per evaluation: the buffer, and the age of the rows handed
    out, grew without end. It stays under two rounds."""
    sampler = RaySampler(kind_env, IdPolicy(), nodes=2, envs_per_node=1, fragment_steps=16, in_flight=2, seed=0,
                         timeout=60.0, start_timeout=NODE_START_S)
    round_ = 2 * 16 * 2  # in_flight fragments of every node
    try:
        held = []
        for _ in range(12):
            for _ in range(3):
                sampler.obtain_steps(16)
            sampler.obtain_exact_episodes(1)
            held.append(sampler.buffered_steps)
    finally:
        sampler.close()
    assert max(held) < 2 * round_, held


def test_updates_from_a_learner_thread_while_the_driver_collects():
    """``update`` from another thread (``LearnerFeed``'s ``on_update``) while ``obtain_steps``
    runs: neither call fails (Ray's own ``AssertionError`` reached the driver, the list of update
    refs it waited on growing under it), and afterwards every node acts with the newest agent."""
    sampler = RaySampler(kind_env, IdPolicy(), nodes=2, envs_per_node=1, fragment_steps=16, seed=0, timeout=60.0,
                         start_timeout=NODE_START_S)
    stop, raised, sent = threading.Event(), [], [0]

    def learner() -> None:
        try:
            while not stop.is_set() and sent[0] < 2000:
                sampler.update(agent_update=sent[0] + 1)
                sent[0] += 1
        except BaseException as exc:  # (reported below)
            raised.append(exc)

    thread = threading.Thread(target=learner)
    try:
        thread.start()
        try:
            for _ in range(60):
                sampler.obtain_steps(16)
        finally:
            stop.set()
            thread.join(60)
        assert not raised, raised
        batch = sampler.obtain_exact_episodes(1)
        assert set(batch.policy_versions.tolist()) == {sampler.policy_version} == {sent[0]}
    finally:
        sampler.close()


def test_an_update_from_a_learner_thread_while_a_node_restarts_is_applied_there_once(tmp_path):
    """Node 0 is lost and restarts slowly; an env update from another thread comes meanwhile. The
    new node gets every env update once, in order (the replay and the update sent to it both
    applied it: its env state and version ran ahead of the driver's)."""
    sampler = RaySampler(slow_restart_factory(str(tmp_path / "built"), 5.0, 0.0), IdPolicy(), nodes=2, envs_per_node=1,
                         fragment_steps=8, seed=0, timeout=60.0, start_timeout=NODE_START_S)
    raised: list[BaseException] = []

    def learner() -> None:
        try:
            give_up = time.monotonic() + 60  # (a bound on the loop, not a timing assertion)
            while sampler.restart_count(0) < 1 and time.monotonic() < give_up:
                time.sleep(0.01)
            time.sleep(0.5)  # node 0's replacement is being built (5 s)
            sampler.update(env_update=add_bonus(1.0))
        except BaseException as exc:  # (reported below)
            raised.append(exc)

    try:
        assert sampler.update(env_update=add_bonus(1.0)) == (0, 1)
        sampler.obtain_exact_episodes(1)
        killed = sampler.node_info()[0]["pid"]
        sampler.kill_node(0)
        assert not alive([killed], timeout=60)
        thread = threading.Thread(target=learner)
        thread.start()
        sampler.obtain_exact_episodes(1)  # node 0 restarted in it
        thread.join(60)
        assert not raised and sampler.restart_count(0) == 1 and sampler.env_version == 2
        batch = sampler.obtain_exact_episodes(2)
        for slot in (0, 1):
            rows = batch.worker_ids == slot
            assert set(batch.env_versions[rows].tolist()) == {2}, slot
            assert set(batch.observations[rows, 2].tolist()) == {2.0}, f"slot {slot}'s bonus: each update once"
    finally:
        sampler.close()


def test_unplaceable_node_is_an_error_after_start_timeout_and_bad_input_first():
    with pytest.raises(InvalidInputError):
        RaySampler(kind_env, IdPolicy(), nodes=0)
    with pytest.raises(InvalidInputError):
        RaySampler(kind_env, IdPolicy(), nodes=2, envs_per_node=[1, 2, 3])
    with pytest.raises(InvalidInputError):
        RaySampler(kind_env, IdPolicy(), fragment_steps=0)
    for deadline in ("timeout", "start_timeout", "env_timeout"):  # NaN never passes; inf is none at all
        for bad in (float("nan"), float("inf"), 0, "60"):
            with pytest.raises(InvalidInputError, match=f"{deadline} must be a positive, finite"):
                RaySampler(kind_env, IdPolicy(), nodes=1, **{deadline: bad})
    # no node has the resource: nothing can start, so a short deadline shows the error as well
    with pytest.raises(RayNodeError, match=r"node 0 .*did not start within 0\.5 s"):
        RaySampler(kind_env, IdPolicy(), nodes=1, start_timeout=0.5, actor_options={"resources": {"no-such-thing": 1}})
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


@pytest.mark.timeout(420)  # two node starts and a restart: each may take minutes on a loaded machine
def test_a_restarted_node_replays_no_seeded_episode_and_its_ids_go_on():
    sampler = RaySampler(seed_env, IdPolicy(), nodes=2, envs_per_node=2, fragment_steps=32, seed=100, timeout=30.0,
                         start_timeout=NODE_START_S)

    def slots_past(batches, past):  # node 0's slots with a row of an episode numbered past ``past[slot]``
        seen = TransitionBatch.concatenate(batches)
        return {s for s in (0, 1) if (seen.episode_ids[seen.worker_ids == s] > past.get(s, -1)).any()}

    try:
        # First-ready: the other node may deliver everything for a while; go on until node 0's two
        # slots have rows handed out (what the restart must number on from).
        before = [sampler.obtain_steps(64) for _ in range(2)]
        while len(before) < 50 and slots_past(before, {}) != {0, 1}:
            before.append(sampler.obtain_steps(64))
        first = TransitionBatch.concatenate(before)
        old_max = {s: int(first.episode_ids[first.worker_ids == s].max()) for s in slots_past(before, {})}
        killed = sampler.node_info()[0]["pid"]
        sampler.kill_node(0)
        assert not alive([killed], timeout=60)  # gone before the next call (ray.kill returns before)
        after = [sampler.obtain_steps(64) for _ in range(6)]
        while len(after) < 50 and slots_past(after, old_max) != {0, 1}:  # the new node's first rows may come late too
            after.append(sampler.obtain_steps(64))
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
    for slot in (0, 1):  # the restarted node's episodes are numbered on from what was seen
        old = first.episode_ids[first.worker_ids == slot]
        new = TransitionBatch.concatenate(after)
        new_ids = set(new.episode_ids[new.worker_ids == slot].tolist()) - set(old.tolist())
        assert new_ids and min(new_ids) > old.max() and all(e % 4 == slot for e in new_ids)
