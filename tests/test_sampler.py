"""The sampler layer with real worker processes and real gymnasium envs (no mocks, no timing)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from envmanager.core.batch import BatchEnvManager
from envmanager.errors import EnvManagerError, InvalidInputError
from envmanager.sampler import EpisodeBatch, Sampler, TransitionBatch
from sampler_envs import KindEnv, RandomPolicy, check_episode_infos, kind_env, recorded_kind_env, set_bonus, true_lengths

# ----------------------------------------------------------------------------------------------
# Batches


def _batch(n: int, start: int = 0) -> TransitionBatch:
    from envmanager.sampler.batches import Step

    steps = [Step(np.array([i, 0.0]), i % 2, float(i), i % 3 == 2, False, np.array([i + 1, 0.0]), 0, i // 3, 0, 0,
                  {"v": float(i)}, {"e": i}) for i in range(start, start + n)]
    return TransitionBatch.from_steps(steps)


def test_transition_batch_concatenate_split_select():
    a, b = _batch(4), _batch(5, start=4)
    both = TransitionBatch.concatenate([a, b])
    assert len(both) == 9
    assert both.rewards.tolist() == list(map(float, range(9)))
    assert both.agent_infos["v"].tolist() == both.rewards.tolist()
    assert both.env_infos["e"].tolist() == list(range(9))
    parts = both.split(3)
    assert [len(p) for p in parts] == [3, 3, 3]
    assert TransitionBatch.concatenate(parts).observations.tolist() == both.observations.tolist()
    picked = both.select(both.rewards > 6)
    assert picked.rewards.tolist() == [7.0, 8.0] and picked.next_observations[:, 0].tolist() == [8, 9]


def test_env_infos_of_any_shape_are_kept():
    from envmanager.sampler.batches import Step

    steps = [Step(np.zeros(1), 0, 0.0, False, False, np.zeros(1), 0, 0, 0, 0, {}, {"ragged": np.zeros(i + 1)}) for i in range(3)]
    batch = TransitionBatch.from_steps(steps)
    assert batch.env_infos["ragged"].dtype == object and [len(x) for x in batch.env_infos["ragged"]] == [1, 2, 3]


def test_env_infos_only_some_rows_have_are_kept_with_none_elsewhere():
    from envmanager.sampler.batches import Step

    def steps(n, start, infos):
        return TransitionBatch.from_steps([Step(np.zeros(1), 0, 0.0, False, False, np.zeros(1), 0, 0, 0, 0, {}, infos(i))
                                           for i in range(start, start + n)])

    a = steps(3, 0, lambda i: {"t": i, **({"episode": {"r": 1.0, "l": i}} if i == 2 else {})})
    assert a.env_infos["t"].tolist() == [0, 1, 2] and a.env_infos["t"].dtype.kind == "i"  # as before
    assert a.env_infos["episode"].dtype == object and a.env_infos["episode"].tolist() == [None, None, {"r": 1.0, "l": 2}]
    b = steps(2, 3, lambda i: {"t": i, "only_b": 1.5})  # no episode key; a key a lacks
    c = steps(1, 5, lambda i: {"t": i, "episode": {"r": 2.0, "l": i}})  # every row has it: stacked, as before
    assert isinstance(c.env_infos["episode"], dict)
    both = TransitionBatch.concatenate([a, b, c])
    assert both.env_infos["t"].tolist() == list(range(6)) and both.env_infos["t"].dtype.kind == "i"
    assert both.env_infos["only_b"].tolist() == [None] * 3 + [1.5, 1.5] + [None]
    assert [e if e is None else (float(e["r"]), int(e["l"])) for e in both.env_infos["episode"]] == \
        [None, None, (1.0, 2), None, None, (2.0, 5)]
    parts = both.split(3)
    assert parts[0].env_infos["episode"].tolist() == [None, None] and parts[1].env_infos["only_b"].tolist() == [None, 1.5]
    again = TransitionBatch.concatenate(parts)
    assert again.env_infos["episode"].tolist() == both.env_infos["episode"].tolist()
    assert both.select(both.env_infos["episode"] != None).env_infos["t"].tolist() == [2, 5]  # noqa: E711
    eb = EpisodeBatch.from_transitions([a, b, c], [False, False, False])
    assert EpisodeBatch.concatenate(eb.split_episodes()).env_infos["only_b"].tolist() == both.env_infos["only_b"].tolist()


def test_episode_statistics_reach_env_infos_on_each_last_step():
    """gymnasium's RecordEpisodeStatistics: ``info["episode"]`` on an episode's last step only."""
    with Sampler(recorded_kind_env, 2, RandomPolicy(), seed=5) as sampler:
        episodes = sampler.obtain_episodes(6)
        steps = [sampler.obtain_steps(40), sampler.obtain_steps(40)]
    assert check_episode_infos(episodes) == 6
    assert check_episode_infos(TransitionBatch.concatenate(steps)) >= 1


def test_episode_batch_lengths_padding_and_returns():
    episodes = [_batch(3), _batch(1, start=3), _batch(2, start=4)]
    eb = EpisodeBatch.from_transitions(episodes, [False, True, False])
    assert eb.lengths.tolist() == [3, 1, 2] and eb.n_episodes == 3
    assert eb.returns.tolist() == [0 + 1 + 2, 3, 4 + 5]
    assert eb.last_observations[:, 0].tolist() == [3, 4, 6]
    padded = eb.padded("rewards", fill=-1)
    assert padded.tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    pieces = eb.split_episodes()
    assert [p.lengths.tolist() for p in pieces] == [[3], [1], [2]]
    assert pieces[1].episode_interrupted.tolist() == [True]
    again = EpisodeBatch.concatenate(pieces)
    assert isinstance(again, EpisodeBatch) and again.rewards.tolist() == eb.rewards.tolist()


# ----------------------------------------------------------------------------------------------
# Sampler


def test_obtain_steps_is_exact_and_episodes_continue_across_calls():
    policy = RandomPolicy()
    with Sampler(kind_env, 3, policy, seed=1) as sampler:
        first = sampler.obtain_steps(7)
        second = sampler.obtain_steps(11)
    assert len(first) == 7 and len(second) == 11
    # Within one episode, t runs 1, 2, 3, ... across the two calls: nothing lost or repeated.
    both = TransitionBatch.concatenate([first, second])
    for episode in np.unique(both.episode_ids):
        ts = both.next_observations[both.episode_ids == episode, 0]
        assert ts.tolist() == list(range(int(ts[0]), int(ts[0]) + len(ts)))
        assert ts[0] == 1  # every episode here started during these calls
    # Each step's next observation is the following step's observation, within an episode.
    for w in range(3):
        rows = both.worker_ids == w
        obs, nxt, done = both.observations[rows], both.next_observations[rows], both.dones[rows]
        for i in range(len(obs) - 1):
            if not done[i]:
                assert obs[i + 1].tolist() == nxt[i].tolist()
    assert (both.agent_infos["logp"] == np.log(0.5)).all()
    assert set(np.concatenate(policy.calls).tolist()) == {0, 1, 2}


def test_obtain_samples_whole_episodes_and_policy_versions():
    policy = RandomPolicy()
    with Sampler(kind_env, 2, policy, seed=3) as sampler:
        batch = sampler.obtain_samples(0, 60)
        assert batch.policy_versions.tolist() == [0] * len(batch)
        later = sampler.obtain_samples(1, 20, agent_update=7)
        assert sampler.policy_version == 1
    assert isinstance(batch, EpisodeBatch) and len(batch) >= 60
    assert batch.lengths.sum() == len(batch)
    ends = batch.starts + batch.lengths - 1
    assert batch.dones[ends].all() and batch.dones.sum() == batch.n_episodes  # whole episodes only
    assert (batch.observations[batch.starts, 0] == 0).all()  # each starts at its reset
    assert len(later) >= 20
    assert later.policy_versions.tolist() == [1] * len(later)
    assert (later.agent_infos["params"] == 7).all()  # the update reached the policy first


def test_exact_episodes_are_unbiased_by_length():
    """Admission at the start, quotas per slot: the 5-step episodes (which finish first) are
    not over-represented; the collected lengths are exactly each slot's first k episodes."""
    seed, n_workers, k = 11, 4, 12
    with Sampler(kind_env, n_workers, RandomPolicy(), seed=seed) as sampler:
        batch = sampler.obtain_exact_episodes(k)
    assert batch.n_episodes == n_workers * k
    expected = [length for slot in range(n_workers) for length in true_lengths(seed, slot, k)]
    assert batch.lengths.tolist() == expected  # (worker, admission) order, each run to its end
    worker_of_episode = batch.worker_ids[batch.starts]
    assert worker_of_episode.tolist() == sorted(worker_of_episode.tolist())
    assert batch.lengths.mean() == pytest.approx(np.mean(expected))
    assert abs(batch.lengths.mean() - 27.5) < 8  # the true mean of the two kinds, within sampling noise
    assert not batch.episode_interrupted.any()


def test_obtain_episodes_spreads_quotas_and_per_worker_lists():
    with Sampler(kind_env, 3, RandomPolicy(), seed=0) as sampler:
        spread = sampler.obtain_episodes(5)
        assert np.bincount(spread.worker_ids[spread.starts], minlength=3).tolist() == [2, 2, 1]
        listed = sampler.obtain_exact_episodes([0, 3, 1])
        assert listed.worker_ids[listed.starts].tolist() == [1, 1, 1, 2]
        per = sampler.obtain_episodes(2, per_worker=True)
        assert per.worker_ids[per.starts].tolist() == [0, 0, 1, 1, 2, 2]
        with pytest.raises(InvalidInputError):
            sampler.obtain_exact_episodes([1, 1])
        for bad in (1.5, None, True, [1, True, 1]):  # (a TypeError, or True taken as one episode)
            with pytest.raises(InvalidInputError, match="n_eps_per_worker"):
                sampler.obtain_exact_episodes(bad)
        with pytest.raises(InvalidInputError):
            sampler.obtain_steps(0)


def test_running_episodes_are_not_admitted_and_env_updates_wait_for_boundaries():
    with Sampler(kind_env, 2, RandomPolicy(), seed=5) as sampler:
        sampler.obtain_steps(3)  # leaves episodes mid-way
        versions = sampler.update(agent_update=1, env_update=set_bonus(10.0))
        assert versions == (1, 1)
        batch = sampler.obtain_exact_episodes(2)
        assert sampler.stats.counters["discarded_steps"] > 0  # the old episodes ran out unrecorded
    assert (batch.observations[batch.starts, 0] == 0).all()  # every admitted episode started in the call
    assert (batch.observations[:, 2] == 10.0).all()  # the env update came before each episode
    assert (batch.rewards == 11.0).all() and (batch.env_versions == 1).all() and (batch.policy_versions == 1).all()


def test_env_update_in_steps_mode_changes_only_new_episodes():
    with Sampler(kind_env, 1, RandomPolicy(), seed=2) as sampler:
        sampler.obtain_steps(2)
        sampler.update(env_update=[set_bonus(3.0)])
        batch = sampler.obtain_steps(80)
    for episode in np.unique(batch.episode_ids):
        rows = batch.episode_ids == episode
        assert len(set(batch.observations[rows, 2].tolist())) == 1  # one env version per episode
        assert len(set(batch.env_versions[rows].tolist())) == 1
    assert batch.env_versions[0] == 0 and batch.env_versions[-1] == 1


def test_worker_restart_cuts_an_episode_which_is_kept_flagged_and_counted(tmp_path):
    marker = str(tmp_path / "crashed")

    def factory(worker_id):
        return KindEnv(crash_marker=marker if worker_id == 1 else None, crash_at=3)

    with Sampler(factory, 2, RandomPolicy(), seed=4, restart_workers=True, timeout=30) as sampler:
        batch = sampler.obtain_exact_episodes(3)
        assert sampler.stats.counters["interrupted_episodes"] == 1
    assert os.path.exists(marker)
    assert batch.n_episodes == 6  # the cut one fills its admission: not replaced
    cut = np.flatnonzero(batch.episode_interrupted)
    assert cut.size == 1
    first_of_1 = int(np.flatnonzero(batch.worker_ids[batch.starts] == 1)[0])
    assert cut[0] == first_of_1  # the first episode of worker 1, cut after 2 steps
    assert batch.lengths[first_of_1] == 2
    rows = slice(batch.starts[first_of_1], batch.starts[first_of_1] + 2)
    assert batch.interrupted[rows].all() and batch.interrupted.sum() == 2
    assert not batch.dones[rows].any()


def test_a_restarted_worker_gets_the_latest_env_update_again(tmp_path):
    marker = str(tmp_path / "crashed")

    def factory(worker_id):
        return KindEnv(crash_marker=marker if worker_id == 1 else None, crash_at=3)

    with Sampler(factory, 2, RandomPolicy(), seed=4, restart_workers=True, timeout=30) as sampler:
        sampler.update(env_update=set_bonus(7.0))
        batch = sampler.obtain_exact_episodes(3)
        assert sampler.stats.counters["interrupted_episodes"] == 1
    assert os.path.exists(marker)
    # Worker 1's envs after its restart are new: the update was applied to them again.
    assert (batch.observations[:, 2] == 7.0).all() and (batch.env_versions == 1).all()


@pytest.mark.parametrize("crash", ["raise", "exit"])
def test_fault_without_restart_names_the_worker_and_close_reaps(tmp_path, crash):
    marker = str(tmp_path / "crashed")

    def factory(worker_id):
        return KindEnv(crash_marker=marker if worker_id == 2 else None, crash_at=4, crash=crash)

    sampler = Sampler(factory, 3, RandomPolicy(), seed=0, timeout=30)
    try:
        with pytest.raises(EnvManagerError, match="worker 2") as caught:
            sampler.obtain_exact_episodes(2)
        if crash == "raise":
            assert "env blew up" in str(caught.value)  # the remote traceback
    finally:
        sampler.close()
    assert sampler.manager.closed


def test_env_raising_with_restarts_cuts_the_episode_and_collection_goes_on(tmp_path):
    marker = str(tmp_path / "crashed")

    def factory(worker_id):
        return KindEnv(crash_marker=marker if worker_id == 0 else None, crash_at=2, crash="raise")

    with Sampler(factory, 2, RandomPolicy(), seed=1, restart_workers=True, timeout=30) as sampler:
        batch = sampler.obtain_steps(40)
        assert sampler.stats.counters["interrupted_episodes"] == 1
    assert len(batch) == 40
    assert batch.interrupted[batch.worker_ids == 0][:1].tolist() == [True]
    assert not batch.interrupted[batch.worker_ids == 1].any()


@pytest.mark.parametrize("crash", ["raise", "exit"])
def test_an_episode_cut_after_a_call_handed_out_its_steps_is_not_counted_as_cut_before_its_first(tmp_path, crash):
    marker = str(tmp_path / "crashed")

    def factory(worker_id):
        return KindEnv(crash_marker=marker, crash_at=3, crash=crash)

    with Sampler(factory, 1, RandomPolicy(), seed=0, restart_workers=True, timeout=30) as sampler:
        first = sampler.obtain_steps(2)  # episode 0's first two steps, handed out
        sampler.obtain_steps(2)  # its third step fails: cut, then episode 1
        counters = dict(sampler.stats.counters)
        cut = list(sampler.cut_episodes)
    assert first.episode_ids.tolist() == [0, 0] and 0 in cut
    assert counters["interrupted_episodes"] == 1 and counters.get("empty_cut_episodes", 0) == 0


def test_core_does_not_import_the_sampler():
    import subprocess
    import sys

    code = ("import sys, envmanager, envmanager.core.batch, envmanager.core.manager; "
            "print(any(m.startswith('envmanager.sampler') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert out.stdout.strip() == "False"


def test_sampler_over_a_given_manager_needs_autoreset_disabled():
    with BatchEnvManager(kind_env, 1) as manager, pytest.raises(InvalidInputError, match="autoreset_mode"):
        Sampler(manager, policy=RandomPolicy())
    with BatchEnvManager(kind_env, 2, autoreset_mode="disabled") as manager:
        sampler = Sampler(manager, policy=RandomPolicy(), seed=0)
        assert len(sampler.obtain_steps(5)) == 5
        sampler.close()  # the caller's manager stays open
        assert not manager.closed


def test_partial_batches_with_several_envs_per_process():
    policy = RandomPolicy()
    with Sampler(kind_env, 4, policy, seed=8, envs_per_worker=2) as sampler:
        batch = sampler.obtain_exact_episodes(2)
    assert batch.n_episodes == 8
    assert batch.lengths.tolist() == [n for s in range(4) for n in true_lengths(8, s, 2)]
    assert all(len(c) <= 4 for c in policy.calls)


def test_progress_bar_on_long_collections(capsys):
    pytest.importorskip("tqdm")
    with Sampler(kind_env, 2, RandomPolicy(), seed=0, progress=10) as sampler:
        sampler.obtain_steps(30)
        assert "sampling" in capsys.readouterr().err
        sampler.obtain_steps(5)  # below the threshold: no bar
        assert "sampling" not in capsys.readouterr().err


class GreedyAgent:
    """A picklable worker-side agent: action from the observation's parity, with an info."""

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift

    def get_action(self, observation):
        return (int(observation[0]) + self.shift) % 2, {"shift": self.shift}


def test_a_worker_side_update_that_is_not_an_agent_is_refused_before_any_worker_gets_it():
    """WorkerPolicySampler's workers replace their agent with an update: weights (an int, an
    array) would fail every rollout after it (with restarts on, a restart each), so update()
    refuses them, no version moves, and collection goes on with the agent in force."""
    from envmanager.sampler.worker_policy import WorkerPolicySampler

    with WorkerPolicySampler(kind_env, 2, GreedyAgent(), seed=8, restart_workers=True) as sampler:
        sampler.obtain_steps(3)
        for weights in (1, np.zeros(3)):
            with pytest.raises(InvalidInputError, match="get_actions"):
                sampler.update(agent_update=weights)
        with pytest.raises(InvalidInputError, match="get_actions"):
            sampler.obtain_steps(3, agent_update=1)
        assert sampler.policy_version == 0
        steps = sampler.obtain_steps(5)
        assert len(steps) == 10 and (steps.policy_versions == 0).all()
        assert sampler.manager.restart_count(0) == 0 and sampler.manager.restart_count(1) == 0


def test_worker_side_policy_steps_continue_and_episodes_are_exact():
    from envmanager.sampler.worker_policy import WorkerPolicySampler

    with WorkerPolicySampler(kind_env, 4, GreedyAgent(), seed=8, envs_per_worker=2) as sampler:
        steps = sampler.obtain_steps(30)
        more = sampler.obtain_steps(10, agent_update=GreedyAgent(shift=1))
        episodes = sampler.obtain_exact_episodes(2)
        assert sampler.stats.counters["discarded_episodes"] > 0  # running ones are not admitted
    assert len(steps) == 120 and np.bincount(steps.worker_ids).tolist() == [30] * 4
    assert (steps.actions == steps.observations[:, 0].astype(int) % 2).all()  # chosen in the worker
    assert (more.policy_versions == 1).all() and (more.agent_infos["shift"] == 1).all()
    both = TransitionBatch.concatenate([steps, more])
    for episode in np.unique(both.episode_ids):  # episodes go on across calls: t keeps counting
        ts = both.next_observations[both.episode_ids == episode, 0]
        assert ts.tolist() == list(range(int(ts[0]), int(ts[0]) + len(ts)))
    assert episodes.n_episodes == 8
    assert (episodes.observations[episodes.starts, 0] == 0).all()
    ends = episodes.starts + episodes.lengths - 1
    assert episodes.dones[ends].all() and episodes.dones.sum() == 8
