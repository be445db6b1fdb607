"""LearnerFeed (a learner thread) and the sampler's stream into it, with real worker processes."""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref

import numpy as np
import pytest

from envmanager.errors import InvalidInputError
from envmanager.sampler import LearnerError, LearnerFeed, LearnerStarvedError, Sampler, Stats, TransitionBatch
from envmanager.sampler.batches import Step
from sampler_envs import RandomPolicy, kind_env


def batch_of(n: int, version: int = 0) -> TransitionBatch:
    return TransitionBatch.from_steps([
        Step(np.zeros(2), 0, 1.0, False, False, np.zeros(2), 0, 0, version, 0, {}, {}) for _ in range(n)
    ])


def test_learns_every_batch_with_passes_and_minibatches_then_publishes_versions():
    seen: list[int] = []
    published: list[int] = []
    feed = LearnerFeed(lambda b: seen.append(len(b)) or {"n": len(b)}, queue_size=2, num_passes=3, num_minibatches=2,
                       on_update=lambda version, metrics: published.append(version))
    for _ in range(4):
        feed.put(batch_of(10))
    feed.drain(timeout=30)
    assert [n for n, _ in feed.results()] == [10] * 4
    feed.stop()
    assert seen == [5] * 24  # 4 batches x 3 passes x 2 minibatches
    assert published == [1, 2, 3, 4] and feed.version == 4
    assert feed.stats.counters["steps_learned"] == 40


def test_put_blocks_while_the_queue_is_full():
    release = threading.Event()
    feed = LearnerFeed(lambda b: release.wait(30) and {}, queue_size=1)
    try:
        feed.put(batch_of(1))  # taken by the learner, which now waits
        feed.put(batch_of(1))  # waits in the queue
        with pytest.raises(TimeoutError):
            feed.put(batch_of(1), timeout=0.2)
        assert feed.qsize() == 1
    finally:
        release.set()
        feed.stop()


def test_batches_still_queued_at_stop_are_counted_unlearned():
    """``stop()`` learns nothing more from the batches still queued (RLlib's learner thread does
    the same): they were dropped without a trace; now every step put is learned or counted
    ``unlearned_steps``. The learner holds the first batch until ``stop()`` has begun."""
    inside, release = threading.Event(), threading.Event()

    def learn(batch):
        inside.set()
        release.wait(30)
        return {}

    feed = LearnerFeed(learn, queue_size=3, num_passes=2)
    feed.put(batch_of(4))
    assert inside.wait(30)  # taken by the learner, which now waits
    feed.put(batch_of(5))
    feed.put(batch_of(6))
    join = feed._thread.join

    def released_then_joined(timeout=None):  # the learner goes on only once stop() has begun
        release.set()
        join(timeout)

    feed._thread.join = released_then_joined
    feed.stop(timeout=30)
    feed.stop()  # (again: nothing counted twice)
    counters = feed.stats.counters
    assert counters["steps_learned"] == 4 and counters["updates"] == 1
    assert counters["unlearned_batches"] == 2 and counters["unlearned_steps"] == 11
    assert feed.qsize() == 0 and not feed.alive


def test_learn_fn_exception_is_raised_in_the_caller_with_its_traceback():
    def learn(batch):
        raise ValueError("bad gradient")

    feed = LearnerFeed(learn, queue_size=1)
    feed.put(batch_of(2))
    with pytest.raises(LearnerError, match="bad gradient") as caught:
        for _ in range(100):
            feed.put(batch_of(2), timeout=10)
    assert isinstance(caught.value.__cause__, ValueError)
    assert "in learn" in str(caught.value)  # the learner thread's traceback
    feed.stop(raise_error=False)
    assert not feed.alive


def test_starved_queue_is_an_error_and_stop_always_ends():
    feed = LearnerFeed(lambda b: {}, starve_timeout=0.1)
    feed._thread.join(30)
    with pytest.raises(LearnerStarvedError):
        feed.check()
    release = threading.Event()
    hung = LearnerFeed(lambda b: release.wait(30) and {})
    hung.put(batch_of(1))
    hung.stop(timeout=0.1)  # returns although learn_fn is still inside
    release.set()
    hung._thread.join(30)


def test_stale_steps_dropped_or_masked_and_counted():
    kept: list[TransitionBatch] = []
    for mode in ("drop", "mask"):
        kept.clear()
        feed = LearnerFeed(lambda b: kept.append(b) or {}, max_policy_lag=1, stale=mode)
        feed.version = 3
        mixed = TransitionBatch.concatenate([batch_of(2, version=3), batch_of(3, version=1), batch_of(1, version=2)])
        feed.put(mixed)
        feed.drain(timeout=30)
        feed.stop()
        assert feed.stats.counters["stale_steps"] == 3
        if mode == "drop":
            assert len(kept[0]) == 3 and kept[0].policy_versions.tolist() == [3, 3, 2]
        else:
            assert kept[0].valid.tolist() == [True, True, False, False, False, True]
            assert mixed.valid.all()  # the caller's batch (a stream yielded it) as it was
        assert feed.stats.stats()["policy_lag_max"] == 2
        assert feed.stats.counters["steps_learned"] == 3  # the masked steps were not learned from


def test_minibatches_are_never_empty():
    sizes: list[int] = []
    feed = LearnerFeed(lambda b: sizes.append(len(b)) or {}, num_minibatches=4)
    feed.put(batch_of(3))
    feed.put(batch_of(6))
    feed.drain(timeout=30)
    feed.stop()
    assert sizes == [1, 1, 1, 1, 2, 1, 2]  # three rows: three minibatches of one (not one empty)


def test_bad_settings_are_refused_before_anything_runs():
    for bad in ({"starve_timeout": 0}, {"starve_timeout": float("nan")}, {"put_timeout": float("inf")},
                {"put_timeout": -1}, {"max_policy_lag": -1}):
        with pytest.raises(InvalidInputError):
            LearnerFeed(lambda b: {}, **bad)
    for never in (None, float("inf")):  # no starve check
        feed = LearnerFeed(lambda b: {}, starve_timeout=never)
        feed.put(batch_of(1))
        feed.drain(timeout=30)
        assert feed.alive
        feed.stop()
    calls: list[int] = []
    with Sampler(kind_env, 1, RandomPolicy(), seed=0) as sampler:
        feed = LearnerFeed(lambda b: {})
        try:
            for bad in ({"max_batches_waiting": 0}, {"max_fragments": -3}, {"max_fragments": 2.0}):
                with pytest.raises(InvalidInputError):
                    next(sampler.stream(4, feed, **{"max_batches_waiting": 2, **bad}))
            calls.append(sampler.stats.counters.get("env_steps", 0))
        finally:
            feed.stop()
    assert calls == [0]  # nothing was stepped for them


def test_stream_feeds_the_learner_and_new_weights_reach_the_sampler():
    policy = RandomPolicy()
    with Sampler(kind_env, 2, policy, seed=0) as sampler:
        feed = LearnerFeed(lambda b: {"mean_reward": float(b.rewards.mean())}, queue_size=2,
                           on_update=lambda version, metrics: sampler.update(agent_update=version, version=version))
        fragments = list(sampler.stream(16, feed=feed, max_batches_waiting=2, max_fragments=12))
        feed.drain(timeout=30)
        feed.stop()
    assert [len(f) for f in fragments] == [16] * 12
    both = TransitionBatch.concatenate(fragments)
    assert both.policy_versions[0] == 0 and both.policy_versions.max() > 0  # published versions were used to act
    for w in (0, 1):  # per worker, in collection order, versions only go up
        assert (np.diff(both.policy_versions[both.worker_ids == w]) >= 0).all()
    assert sampler.stats.counters["fragments"] == 12
    assert sampler.stats.counters["policy_updates"] >= 1
    stats = feed.stats.stats()
    assert stats["updates"] >= 10 and "policy_lag_mean" in stats and "learn_ms_mean" in stats


def test_a_feed_started_at_the_samplers_version_goes_on_from_it():
    """Training resumed (or after manual updates): the sampler acts with version 5, and a feed
    counting from 0 would publish 1, 2, ... (versions going backwards, negative lags). With
    ``start_version=sampler.policy_version`` the published versions go on from 6 and every lag
    the feed measures is what happened: at least 0."""
    with Sampler(kind_env, 2, RandomPolicy(), seed=0) as sampler:
        for v in range(1, 6):
            sampler.update(agent_update=v)
        published: list[int] = []
        feed = LearnerFeed(lambda b: {}, queue_size=2, start_version=sampler.policy_version,
                           on_update=lambda version, metrics: (published.append(version),
                                                               sampler.update(agent_update=version, version=version)))
        try:
            fragments = list(sampler.stream(8, feed=feed, max_batches_waiting=2, max_fragments=6))
            feed.drain(timeout=30)
        finally:
            feed.stop()
    both = TransitionBatch.concatenate(fragments)
    assert both.policy_versions.min() == 5  # nothing acted with a version below where it began
    assert published == list(range(6, 6 + len(published))) and len(published) == 6
    assert feed.version == 11 and sampler.policy_version == 11
    assert feed.stats.stats()["policy_lag_min"] >= 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidInputError):
            LearnerFeed(lambda b: {}, start_version=bad)


@pytest.mark.parametrize("buffer_size", [1, 3])
@pytest.mark.parametrize("fails", [False, True])
def test_a_feed_dropped_without_stop_is_freed_with_what_its_learn_fn_holds_and_its_thread_ends(buffer_size, fails):
    """A feed the caller drops without ``stop()`` (or ``with``): its thread held it, so the feed,
    its ``learn_fn`` and the model that holds lived on with the thread -- forever with
    ``starve_timeout=None``, else until the starve error, logged by nobody's feed. Now the
    thread holds the feed only while it learns: dropping the last reference frees them and
    ends the thread (no garbage collection needed) -- a feed whose ``learn_fn`` raised too (the
    error it keeps must not hold the feed through its traceback's frames)."""

    class Model:
        pass

    model = Model()
    model_gone = weakref.ref(model)
    learned: list[int] = []

    def learn(batch, model=model):
        learned.append(len(batch))
        if fails:
            raise RuntimeError("the learner failed")
        return {}

    feed = LearnerFeed(learn, starve_timeout=None, buffer_size=buffer_size, num_passes=2)
    feed.put(batch_of(4))
    if fails:
        with pytest.raises(LearnerError, match="the learner failed"):
            feed.drain(timeout=30)
    else:
        feed.drain(timeout=30)
    thread, feed_gone = feed._thread, weakref.ref(feed)
    del feed, model, learn
    thread.join(30)
    assert not thread.is_alive()
    if fails:  # (the error raised here held the feed through its frames: drain's ``self``)
        gc.collect()
    assert feed_gone() is None
    if not fails:  # (a failed one's error, kept by the log's capture, holds learn's frame, so learn and its model)
        assert model_gone() is None
    assert learned == ([4] if fails else [4, 4])  # (what was put was learned first)


def test_stats_dict_and_summary_line(caplog):
    now = [100.0]
    stats = Stats("sampler", log_interval=5.0, clock=lambda: now[0])
    stats.count("env_steps", 50)
    now[0] += 10.0
    stats.count("env_steps", 50)
    stats.count("interrupted_episodes")
    stats.gauge("queue_size", 2)
    stats.gauge("queue_size", 4)
    stats.lag(np.array([0, 1, 3]))
    with stats.timer("learn"):
        pass
    s = stats.stats()
    assert s["env_steps"] == 100
    assert s["env_steps_per_s_10s"] == pytest.approx(10.0)  # 100 in the 10 s window
    assert s["env_steps_per_s_300s"] == pytest.approx(10.0)  # 100 over the 10 s since start
    assert s["queue_size_mean"] == 3 and s["queue_size_max"] == 4
    assert (s["policy_lag_min"], s["policy_lag_max"]) == (0, 3) and s["learn_ms_total"] >= 0
    with caplog.at_level(logging.INFO, logger="envmanager.sampler.stats"):
        stats.maybe_log()
    assert "sampler: env_steps/s=10.0" in caplog.text and "interrupted_episodes=1" in caplog.text


def test_learn_fn_failure_stops_the_stream_in_the_caller():
    calls = []

    def learn(batch):
        calls.append(len(batch))
        if len(calls) == 2:
            raise ArithmeticError("nan loss")
        return {}

    with Sampler(kind_env, 2, RandomPolicy(), seed=0) as sampler:
        feed = LearnerFeed(learn, queue_size=1)
        with pytest.raises(LearnerError, match="nan loss"):
            for _ in sampler.stream(8, feed=feed, max_batches_waiting=1, max_fragments=50):
                pass
        feed.stop(raise_error=False)
        assert sampler.stats.counters["fragments"] < 50
        assert len(sampler.obtain_steps(4)) == 4  # the sampler itself is still usable


def test_buffer_replays_batches_in_turn_and_never_waits_with_passes_left():
    gate = threading.Event()
    seen: list[int] = []

    def learn(batch):
        gate.wait(30)  # the first pass waits until every batch is queued: the order is then fixed
        seen.append(len(batch))
        return {}

    feed = LearnerFeed(learn, queue_size=4, num_passes=2, buffer_size=2, starve_timeout=2.0)
    for n in (1, 2, 3):
        feed.put(batch_of(n))
    gate.set()
    feed.drain(timeout=30)  # would starve (an error) if the buffer waited for a 4th batch
    feed.stop()
    assert seen == [1, 2, 1, 2, 3, 3]  # two batches in turn, each twice; the third joins when there is room
    assert feed.version == 6 and feed.stats.counters["updates"] == 6
    with pytest.raises(Exception, match="buffer_size"):
        LearnerFeed(learn, buffer_size=0)


def test_worker_killed_during_stream_is_restarted_and_the_stream_goes_on(tmp_path):
    from sampler_envs import KindEnv

    marker = str(tmp_path / "killed")

    def factory(worker_id):
        return KindEnv(crash_marker=marker if worker_id == 1 else None, crash_at=20, crash="sigkill")

    with Sampler(factory, 2, RandomPolicy(), seed=0, restart_workers=True, timeout=30) as sampler:
        with LearnerFeed(lambda b: {}, queue_size=1) as feed:
            fragments = list(sampler.stream(8, feed=feed, max_batches_waiting=1, max_fragments=10))
            feed.drain(timeout=30)
        counters, cut = dict(sampler.stats.counters), list(sampler.cut_episodes)
    assert os.path.exists(marker)
    assert [len(f) for f in fragments] == [8] * 10  # exact fragments, the stream never stopped
    both = TransitionBatch.concatenate(fragments)
    assert counters["interrupted_episodes"] == 1 and len(cut) == 1
    # the cut episode is worker 1's, it never ended, and its steps still held when the worker
    # died are flagged (those an earlier fragment handed out cannot be)
    rows = both.episode_ids == cut[0]
    assert rows.any() and set(both.worker_ids[rows].tolist()) == {1} and not both.dones[rows].any()
    assert set(both.episode_ids[both.interrupted].tolist()) <= {cut[0]}
    keys = list(zip(both.worker_ids.tolist(), both.episode_ids.tolist(), both.next_observations[:, 0].tolist(), strict=True))
    assert len(keys) == len(set(keys))  # nothing duplicated
