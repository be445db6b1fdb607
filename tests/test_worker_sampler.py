"""The worker-side policy (``WorkerPolicySampler``) with real worker processes: whole fragments
written in the workers, first-ready pieces, faults mid-fragment (SIGKILL, an env raising) with
nothing lost or duplicated, and env updates replayed after a restart."""

from __future__ import annotations

import os

import numpy as np
import pytest

from envmanager.errors import EnvManagerError, RestartLimitError, WorkerError, WorkerTimeoutError
from envmanager.sampler import LearnerFeed, TransitionBatch, WorkerPolicySampler
from envmanager.sampler.rollout import ARENAS
from sampler_envs import KindEnv, check_episode_infos, kind_env, recorded_kind_env, set_bonus, true_lengths


class ParityAgent:
    """A batched worker-side agent: the action is the step count's parity; an agent info."""

    def __init__(self, tag: int = 0) -> None:
        self.tag = tag

    def get_actions(self, observations, worker_ids):
        assert observations.shape == (len(worker_ids), 3)
        return observations[:, 0].astype(np.int64) % 2, {"tag": np.full(len(worker_ids), self.tag)}


def crashing(marker: str, slot: int, at: int, crash: str, made: str | None = None):
    def factory(worker_id):
        if made is not None:  # "pid slot" per env made: what was rebuilt, and where
            with open(made, "a") as f:
                f.write(f"{os.getpid()} {worker_id}\n")
        return KindEnv(crash_marker=marker if worker_id == slot else None, crash_at=at, crash=crash)
    return factory


def check_no_gap_no_repeat(batch, fresh: bool = True) -> None:
    """Within every episode the step count goes 1, 2, 3... (from 1 if it started in the call):
    nothing lost in the middle, nothing duplicated; an episode lives on one worker."""
    for episode in np.unique(batch.episode_ids):
        rows = batch.episode_ids == episode
        assert len(set(batch.worker_ids[rows].tolist())) == 1
        ts = batch.next_observations[rows, 0].astype(int).tolist()
        first = 1 if fresh else ts[0]
        assert ts == list(range(first, first + len(ts))), (episode, ts)


def test_fragments_in_pieces_continue_across_calls():
    # A small arena: each 50-step fragment comes in several pieces per process.
    with WorkerPolicySampler(kind_env, 4, ParityAgent(), seed=8, envs_per_worker=2, fragment_bytes=2048) as sampler:
        first = sampler.obtain_steps(50)
        second = sampler.obtain_steps(20, agent_update=ParityAgent(tag=1))
        assert sampler.stats.counters["fragments"] >= 6  # 2 processes x 3 pieces at least
        assert sampler.stats.counters["env_steps"] == 280
    assert len(first) == 200 and np.bincount(first.worker_ids).tolist() == [50] * 4
    assert (first.actions == first.observations[:, 0].astype(int) % 2).all()  # chosen in the worker
    assert (first.agent_infos["tag"] == 0).all() and (second.agent_infos["tag"] == 1).all()
    assert (second.policy_versions == 1).all() and (first.policy_versions == 0).all()
    check_no_gap_no_repeat(first)
    both = type(first).concatenate([first, second])
    check_no_gap_no_repeat(both)  # episodes running at the end of a call go on in the next
    ends = np.flatnonzero(first.dones)
    assert (first.next_observations[ends, 0] == first.next_observations[ends, 1]).all()  # ended at its length


def test_exact_episodes_are_unbiased_and_ordered():
    with WorkerPolicySampler(kind_env, 2, ParityAgent(), seed=11) as sampler:
        sampler.obtain_steps(3)  # leaves episodes mid-way: they are not admitted
        batch = sampler.obtain_exact_episodes(4)
        assert sampler.stats.counters["discarded_episodes"] == 2
    assert batch.n_episodes == 8
    assert batch.worker_ids[batch.starts].tolist() == [0] * 4 + [1] * 4  # (worker, admission) order
    assert (batch.observations[batch.starts, 0] == 0).all()
    # Each slot's episodes are the ones that started next, whatever their length: the second
    # to fifth episodes of each slot's seeded sequence (the first was abandoned).
    for slot in (0, 1):
        lengths = batch.lengths[batch.worker_ids[batch.starts] == slot].tolist()
        assert lengths == true_lengths(11, slot, 5)[1:]


def test_garage_obtain_samples_and_obtain_episodes_take_episodes_by_admission():
    with WorkerPolicySampler(kind_env, 2, ParityAgent(), seed=11) as sampler:
        samples = sampler.obtain_samples(0, 60, agent_update=ParityAgent(tag=3))
        assert len(samples) >= 60 and samples.dones[samples.starts + samples.lengths - 1].all()
        rounds = samples.n_episodes // 2
        # rounds of one episode per slot: each slot's episodes are its next ones, in order
        assert sorted(samples.worker_ids[samples.starts].tolist()) == [0] * rounds + [1] * rounds
        for slot in (0, 1):
            lengths = samples.lengths[samples.worker_ids[samples.starts] == slot].tolist()
            assert lengths == true_lengths(11, slot, rounds)
        assert (samples.agent_infos["tag"] == 3).all() and (samples.policy_versions == 1).all()
        some = sampler.obtain_episodes(3)  # quotas 2 + 1, decided before collection
        assert some.worker_ids[some.starts].tolist() == [0, 0, 1]
        for slot, k in ((0, 2), (1, 1)):
            lengths = some.lengths[some.worker_ids[some.starts] == slot].tolist()
            assert lengths == true_lengths(11, slot, rounds + 2)[rounds : rounds + k]
        assert sampler.obtain_episodes(1, per_worker=True).n_episodes == 2
        with pytest.raises(EnvManagerError):
            sampler.obtain_samples(0, 0)


def test_episode_statistics_reach_env_infos_on_each_last_step():
    """gymnasium's RecordEpisodeStatistics in the workers: ``info["episode"]`` on an episode's
    last step only, in fragments of several pieces (some with no episode ending)."""
    with WorkerPolicySampler(recorded_kind_env, 4, ParityAgent(), seed=5, envs_per_worker=2, fragment_bytes=2048) as sampler:
        episodes = sampler.obtain_episodes(6)
        steps = [sampler.obtain_steps(30), sampler.obtain_steps(30)]
    assert check_episode_infos(episodes) == 6
    assert check_episode_infos(TransitionBatch.concatenate(steps)) >= 1


def test_worker_killed_mid_fragment_keeps_its_rows_and_replays_the_env_update(tmp_path):
    marker = str(tmp_path / "killed")
    with WorkerPolicySampler(crashing(marker, 1, 7, "sigkill"), 4, ParityAgent(), seed=3, envs_per_worker=2,
                             restart_workers=True, timeout=30) as sampler:
        batch = sampler.obtain_steps(30, env_update=set_bonus(2.0))
        counters = dict(sampler.stats.counters)
        assert sampler.manager.restart_count(1) == 1
    assert os.path.exists(marker)
    assert len(batch) == 120 and np.bincount(batch.worker_ids).tolist() == [30] * 4
    assert counters["worker_restarts"] == 1
    assert counters["recovered_steps"] == 12  # 6 whole ticks of slots 0 and 1 before the kill
    assert counters["interrupted_episodes"] >= 1
    cut = batch.interrupted
    assert cut.any() and set(batch.worker_ids[cut].tolist()) <= {0, 1}
    check_no_gap_no_repeat(batch)
    # The restarted process's envs got the latest env update before their first episode.
    assert (batch.observations[:, 2] == 2.0).all() and (batch.env_versions == 1).all()
    assert (batch.agent_infos["tag"] == 0).all()


def test_exact_episodes_with_a_killed_worker_fill_their_admissions(tmp_path):
    marker = str(tmp_path / "killed")
    with WorkerPolicySampler(crashing(marker, 0, 4, "sigkill"), 2, ParityAgent(), seed=1, restart_workers=True,
                             timeout=30) as sampler:
        batch = sampler.obtain_exact_episodes(3)
        counters = dict(sampler.stats.counters)
    assert batch.n_episodes == 6  # a cut one fills its admission; one cut before its first step is given another
    assert batch.episode_interrupted.sum() >= 1 and counters["interrupted_episodes"] >= 1
    for episode in batch.split_episodes():
        assert episode.observations[0, 0] == 0  # started in this call
        assert episode.dones[-1] != episode.episode_interrupted[0]  # whole, or cut and flagged
    check_no_gap_no_repeat(batch)


@pytest.mark.parametrize("crash", ["raise", "sys_exit", "interrupt"])  # an env's sys.exit() / KeyboardInterrupt too
def test_env_raising_mid_fragment_is_rebuilt_in_place_and_collection_goes_on(tmp_path, crash):
    marker, made = str(tmp_path / "raised"), tmp_path / "made"
    with WorkerPolicySampler(crashing(marker, 1, 7, crash, str(made)), 4, ParityAgent(), seed=3, envs_per_worker=2,
                             restart_workers=True, timeout=30) as sampler:
        pid = sampler.manager.process_of(1).pid
        batch = sampler.obtain_steps(30)
        assert sorted(made.read_text().split("\n")[4:-1]) == [f"{pid} 1"]  # made again, there, and nothing else
        # The env that raised is rebuilt in its process (issue 30 item 7: RLlib's granularity):
        # its episode is cut, kept and flagged; its neighbour in the process (slot 0) goes on.
        assert sampler.stats.counters["interrupted_episodes"] == 1
        assert sampler.manager.supervisor.restart_count(0) == 1  # counted against the process's quota
        assert sampler.manager.restarts == 1 and sampler.stats.counters["worker_restarts"] == 1
        assert sampler.manager.process_of(1).pid == pid  # not restarted
        assert [sampler.manager.generation(s) for s in range(4)] == [0, 1, 0, 0]
        more = sampler.obtain_steps(10)  # the rebuilt env serves on
    assert len(batch) == 120 and np.bincount(batch.worker_ids).tolist() == [30] * 4
    assert batch.interrupted[batch.worker_ids == 1].any()
    assert not batch.interrupted[batch.worker_ids != 1].any()  # the neighbour's episode was not cut
    assert set(batch.episode_ids[batch.interrupted].tolist()) == set(sampler.cut_episodes)
    assert len(sampler.cut_episodes) == 1
    check_no_gap_no_repeat(batch)
    assert not more.interrupted.any() and np.bincount(more.worker_ids).tolist() == [10] * 4
    assert not set(more.episode_ids[more.worker_ids == 1].tolist()) & set(sampler.cut_episodes)  # ids not reused


class RemadeOnceFails:
    """Slot 1's env raises at its 7th step; remaking it in the same process fails once (the
    second env made for slot 1 raises in the factory): the rebuild cannot be made."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> KindEnv:
        if worker_id == 1:
            count = os.path.join(self.directory, "made-1")
            with open(count, "a") as f:
                f.write(f"{os.getpid()}\n")
            with open(count) as f:
                if len(f.read().split()) == 2:
                    raise RuntimeError("cannot remake env 1")
        return KindEnv(crash_marker=os.path.join(self.directory, "raised") if worker_id == 1 else None, crash_at=7,
                       crash="raise")


def test_an_env_that_cannot_be_rebuilt_takes_its_process_through_a_restart(tmp_path):
    with WorkerPolicySampler(RemadeOnceFails(str(tmp_path)), 4, ParityAgent(), seed=3, envs_per_worker=2,
                             restart_workers=True, restarts_rate_limit_n=5, timeout=30) as sampler:
        pid = sampler.manager.process_of(1).pid
        batch = sampler.obtain_steps(30)
        assert sampler.manager.process_of(1).pid != pid  # the rebuild failed: the process was restarted
        assert sampler.manager.supervisor.restart_count(0) == 2  # the rebuild, then the restart: one policy
        assert sampler.manager.generation(0) == 1 and sampler.manager.generation(1) == 2
    made = (tmp_path / "made-1").read_text().split()
    assert made[:2] == [str(pid)] * 2 and made[2] != str(pid)  # made, remade there (raised), made in the new process
    assert len(batch) == 120 and np.bincount(batch.worker_ids).tolist() == [30] * 4
    assert batch.interrupted[batch.worker_ids == 1].any() and batch.interrupted[batch.worker_ids == 0].any()
    assert not batch.interrupted[batch.worker_ids >= 2].any()
    assert set(batch.episode_ids[batch.interrupted].tolist()) == set(sampler.cut_episodes)
    check_no_gap_no_repeat(batch)


def test_a_rebuild_past_the_restart_limits_is_an_error_naming_the_slot(tmp_path):
    def factory(worker_id):  # both envs of process 0 raise once, at different steps: two decisions
        return KindEnv(crash_marker=str(tmp_path / f"raised-{worker_id}") if worker_id < 2 else None,
                       crash_at=5 if worker_id == 0 else 40, crash="raise")

    with WorkerPolicySampler(factory, 4, ParityAgent(), seed=3, envs_per_worker=2, restart_workers=True,
                             restarts_rate_limit_n=1, timeout=30) as sampler:
        sampler.obtain_steps(20)  # slot 0 raised: rebuilt, within the limit
        assert sampler.manager.restart_count(0) == 1 and sampler.manager.generation(0) == 1
        with pytest.raises(RestartLimitError) as caught:
            sampler.obtain_steps(40)  # slot 1 raised: past 1 per 60 s
        assert caught.value.worker_id == 1 and "env blew up" in str(caught.value.failure)
        assert sampler.manager.restart_count(0) == 1  # refused: not counted


@pytest.mark.parametrize("order", [(1, 0), (0, 1)])
def test_with_two_processes_given_up_every_call_raises_the_same_error(order):
    """Found by the fault schedules (no restarts, two envs per process, both processes killed):
    the call that found the deaths raised one process's error, the next call the other's. A
    sampler raises the first process given up's error, on that call and every later one."""
    sampler = WorkerPolicySampler(kind_env, 4, ParityAgent(), seed=0, envs_per_worker=2, timeout=30)
    try:
        sampler.obtain_steps(2)
        for p in order:
            pid = sampler.manager.processes[p].pid
            os.kill(pid, 9)
        with pytest.raises(EnvManagerError) as first:
            sampler.obtain_steps(5)
        assert first.value is sampler.manager.first_failure()
        for _ in range(2):
            with pytest.raises(EnvManagerError) as again:
                sampler.obtain_steps(5)
            assert again.value is first.value
    finally:
        sampler.close()


@pytest.mark.parametrize("crash", ["raise", "sigkill"])
def test_fault_without_restarts_names_the_worker(tmp_path, crash):
    marker = str(tmp_path / "crashed")
    sampler = WorkerPolicySampler(crashing(marker, 1, 5, crash), 2, ParityAgent(), seed=0, timeout=30)
    try:
        with pytest.raises(EnvManagerError, match="worker 1") as caught:
            sampler.obtain_steps(20)
        if crash == "raise":
            assert isinstance(caught.value, WorkerError) and "env blew up" in str(caught.value)  # the remote traceback
    finally:
        sampler.close()
    assert sampler.manager.closed and sampler._token not in ARENAS


def test_spawned_workers_send_fragments_in_the_answer():
    with WorkerPolicySampler(kind_env, 2, ParityAgent(), seed=8, context="spawn", timeout=60) as sampler:
        steps = sampler.obtain_steps(12)
        episodes = sampler.obtain_exact_episodes(1)
    assert len(steps) == 24 and (steps.actions == steps.observations[:, 0].astype(int) % 2).all()
    check_no_gap_no_repeat(steps)
    assert episodes.n_episodes == 2 and episodes.dones[-1]


def test_bad_input_is_refused():
    with pytest.raises(EnvManagerError, match="get_actions"):
        WorkerPolicySampler(kind_env, 2, object())
    with WorkerPolicySampler(kind_env, 1, ParityAgent()) as sampler:
        for bad in (0, -1, 1.5, "3", True, None):  # (True would be one step)
            with pytest.raises(EnvManagerError, match="steps_per_worker"):
                sampler.obtain_steps(bad)
            with pytest.raises(EnvManagerError, match="n_eps_per_worker"):
                sampler.obtain_exact_episodes(bad)
        with pytest.raises(EnvManagerError, match="env_update"):
            sampler.update(env_update=[set_bonus(1.0), set_bonus(2.0)])
        assert len(sampler.obtain_steps(2)) == 2  # still usable


def test_stream_feeds_the_learner_and_published_agents_reach_the_workers():
    with WorkerPolicySampler(kind_env, 2, ParityAgent(), seed=0) as sampler:
        publish = lambda version, metrics: sampler.update(agent_update=ParityAgent(tag=version), version=version)  # noqa: E731
        with LearnerFeed(lambda b: {}, queue_size=1, on_update=publish) as feed:
            fragments = list(sampler.stream(8, feed=feed, max_batches_waiting=1, max_fragments=10))
            feed.drain(timeout=30)
    both = TransitionBatch.concatenate(fragments)
    assert len(both) == 160 and both.policy_versions.max() > 0
    assert (both.agent_infos["tag"] == both.policy_versions).all()  # each step acted by the agent of its version
    for w in (0, 1):
        assert (np.diff(both.policy_versions[both.worker_ids == w]) >= 0).all()
    check_no_gap_no_repeat(both)


def test_worker_killed_during_stream_keeps_its_rows_and_the_stream_goes_on(tmp_path):
    marker = str(tmp_path / "killed")
    with WorkerPolicySampler(crashing(marker, 0, 30, "sigkill"), 2, ParityAgent(), seed=2, restart_workers=True,
                             timeout=30) as sampler:
        with LearnerFeed(lambda b: {}, queue_size=1) as feed:
            fragments = list(sampler.stream(8, feed=feed, max_batches_waiting=1, max_fragments=8))
            feed.drain(timeout=30)
        counters = dict(sampler.stats.counters)
    assert os.path.exists(marker)
    assert [len(f) for f in fragments] == [16] * 8
    both = TransitionBatch.concatenate(fragments)
    assert counters["worker_restarts"] == 1 and counters["recovered_steps"] == 5  # rows of the 4th fragment before the kill
    assert counters["interrupted_episodes"] == 1
    assert set(both.worker_ids[both.interrupted].tolist()) == {0}  # the cut episode's rows in that fragment
    check_no_gap_no_repeat(both, fresh=False)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_fragment_bytes_too_small_for_one_row_is_refused_and_the_workers_reaped(context):
    # One row of KindEnv needs ~74 bytes per slot plus the arena's headers: 64 bytes cannot
    # hold it. The workers had started (the spaces come from them): close() must reap them
    # and free the arena (the autouse leak check).
    before = set(ARENAS)
    with pytest.raises(EnvManagerError, match=r"fragment_bytes=64 is too small: .* needs \d+ bytes per slot"):
        WorkerPolicySampler(kind_env, 2, ParityAgent(), fragment_bytes=64, context=context, timeout=60)
    assert set(ARENAS) == before
    with pytest.raises(EnvManagerError, match="fragment_bytes"):
        WorkerPolicySampler(kind_env, 2, ParityAgent(), fragment_bytes=0)  # refused before any worker starts


def test_env_raising_on_the_first_step_of_an_episode_is_counted_and_its_admission_given_back(tmp_path):
    # Slot 0's second episode starts in the same fragment as its first and its env raises on
    # that episode's first step: no row carries it -- it is counted, and (nothing of it seen, the
    # cut not depending on its length) another episode is admitted in its place, as the Sampler does.
    marker = str(tmp_path / "raised")
    first = true_lengths(5, 0, 1)[0]
    with WorkerPolicySampler(crashing(marker, 0, first + 1, "raise"), 2, ParityAgent(), seed=5, restart_workers=True,
                             timeout=30) as sampler:
        batch = sampler.obtain_exact_episodes(3)
        counters = dict(sampler.stats.counters)
    assert os.path.exists(marker)
    starts = batch.worker_ids[batch.starts]
    assert (starts == 0).sum() == 3 and (starts == 1).sum() == 3
    assert counters["empty_cut_episodes"] == 1 and counters["interrupted_episodes"] == 1
    assert not batch.episode_interrupted.any()  # the episodes that have rows are whole
    check_no_gap_no_repeat(batch)


@pytest.mark.parametrize("crash", ["raise", "sigkill"])
def test_exact_episodes_whose_every_admitted_episode_was_cut_before_its_first_step_go_on(tmp_path, crash):
    # One slot; its env fails on the first step of its first episode (once), restarts on: the
    # call gives that admission back and returns a whole episode (it raised "every admitted
    # episode was cut before its first step": fault schedule seed 62700).
    marker = str(tmp_path / "crashed")
    with WorkerPolicySampler(crashing(marker, 0, 1, crash), 1, ParityAgent(), seed=5, restart_workers=True,
                             timeout=30) as sampler:
        batch = sampler.obtain_exact_episodes(1)
        counters = dict(sampler.stats.counters)
    assert os.path.exists(marker) and batch.n_episodes == 1 and not batch.episode_interrupted.any()
    assert counters["empty_cut_episodes"] == 1
    check_no_gap_no_repeat(batch)


def test_worker_killed_in_its_first_fragment_does_not_replay_its_seed(tmp_path):
    # Slot 0's process dies on the 3rd step of its first (seeded) episode. The restarted
    # process must not reset with that seed again: its episodes would repeat the seeded
    # sequence from the start, the cut episode's prefix twice. (20 lengths of 5 or 50 drawn
    # afresh match the seeded ones by chance with probability 2**-20.)
    marker = str(tmp_path / "killed")
    with WorkerPolicySampler(crashing(marker, 0, 3, "sigkill"), 2, ParityAgent(), seed=4, restart_workers=True,
                             timeout=30) as sampler:
        batch = sampler.obtain_exact_episodes(21)
        counters = dict(sampler.stats.counters)
    assert os.path.exists(marker) and counters["worker_restarts"] == 1
    slot0 = [e for e in batch.split_episodes() if e.worker_ids[0] == 0]
    assert len(slot0) == 21 and slot0[0].episode_interrupted[0] and len(slot0[0]) == 2
    assert slot0[0].observations[0, 1] == true_lengths(4, 0, 1)[0]  # the cut one was the seeded first
    after = [int(e.observations[0, 1]) for e in slot0[1:]]
    assert after != true_lengths(4, 0, 20)
    check_no_gap_no_repeat(batch)


def test_an_unclosed_sampler_frees_its_arena_when_collected():
    import gc

    sampler = WorkerPolicySampler(kind_env, 1, ParityAgent(), context="fork")
    token = sampler._token
    assert token in ARENAS
    sampler.manager.close()  # the workers are reaped here; the sampler itself is never closed
    del sampler
    gc.collect()
    assert token not in ARENAS


def slow_env(worker_id: int) -> KindEnv:
    return KindEnv(step_s=0.03)


def hanging_env(worker_id: int) -> KindEnv:
    return KindEnv(hang_at=5 if worker_id == 1 else 0)


def test_a_fragment_longer_than_the_deadline_is_not_hung_while_it_writes_rows():
    # 150 steps of 30 ms: 4.5 s per fragment, over twice the deadline; rows keep coming, so the
    # process is not killed as hung (it was: the deadline covered the whole fragment)
    with WorkerPolicySampler(slow_env, 2, ParityAgent(), seed=1, timeout=2.0, context="fork") as sampler:
        batch = sampler.obtain_steps(150)
    assert len(batch) == 300 and np.bincount(batch.worker_ids).tolist() == [150, 150]
    check_no_gap_no_repeat(batch)


def first_step_hangs(worker_id: int) -> KindEnv:
    return KindEnv(hang_at=1)  # its reset is done, then its first step sleeps a minute


def test_a_fragment_that_stops_is_hung_a_deadline_after_its_last_progress():
    # The pool's looks are made here with made-up times (nothing waits for them). The fragment's
    # reset is its progress, then it hangs. A look a quarter of the deadline in sees that progress
    # and moves its clock there; past the deadline from then it is hung. (It was hung a deadline
    # after the first look past the deadline, which saw the reset: up to twice the deadline.)
    import time

    with WorkerPolicySampler(first_step_hangs, 1, ParityAgent(), seed=1, timeout=100.0, context="fork") as sampler:
        pool, process = sampler.manager.pool, sampler.manager.processes[0]
        sampler._send(0, [5], [-1])
        sent_at = process.clock
        give_up = time.monotonic() + 60  # (a bound on the loop, not a timing assertion)
        while sampler._progress([0]) == 0 and time.monotonic() < give_up:
            time.sleep(0.01)
        assert sampler._progress([0]) == 1  # its episode started
        assert pool._check_deadlines(sent_at + 25.0) == [] and process.clock == sent_at + 25.0
        assert pool._check_deadlines(sent_at + 110.0) == []  # no progress since, but not a deadline yet
        failed = pool._check_deadlines(sent_at + 126.0)
        assert [type(c.error) for c in failed] == [WorkerTimeoutError]
        assert failed[0].error.hung and failed[0].error.worker_ids == [0]


def test_a_fragment_that_stops_writing_rows_is_hung():
    # slot 1 hangs on its 5th step: no row for a whole deadline, so it is called hung (and named)
    with (WorkerPolicySampler(hanging_env, 2, ParityAgent(), seed=1, timeout=2.0, context="fork") as sampler,
          pytest.raises(WorkerTimeoutError) as caught):
        sampler.obtain_steps(20)
    assert 1 in caught.value.worker_ids and 0 not in caught.value.worker_ids
