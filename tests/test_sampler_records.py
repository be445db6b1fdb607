"""One record per slot, closed to outside writes (#30 item 3): a record's fields change only
through its own methods (#39 item 3; those that number, count or list an episode through
``EpisodeSlots``'), and a cut is one step (``replaced`` closes the episode it cuts). Plain
records, no processes: the samplers' fault tests drive them end to end."""

from __future__ import annotations

import dataclasses

import pytest

from envmanager.sampler.batches import Step
from envmanager.sampler.slots import EpisodeSlots, EpisodeState, Outcome
from envmanager.sampler.stats import Stats


def _step(slot: int, episode: int) -> Step:
    return Step(0, 0, 0.0, False, False, 0, slot, episode, 0, 0, {}, {})


def test_a_record_cannot_be_written_from_outside():
    episodes = EpisodeSlots([None, None], Stats("test"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        episodes[0].state = EpisodeState.READY  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        episodes[1].steps = []  # type: ignore[misc]


def test_replaced_cuts_and_closes_in_one_step():
    stats = Stats("test")
    episodes = EpisodeSlots([None, None], stats)
    first = episodes.start(0, recording=True)
    episodes[0].ready("obs")
    episodes[0].record(_step(0, first))
    assert episodes.replaced(0, 0) is None  # the same generation: nothing happens
    cut = episodes.replaced(0, 1)
    assert cut is not None and cut.episode_id == first and cut.outcome is Outcome.CUT and cut.recording
    assert [s.interrupted for s in cut.steps] == [True]
    assert episodes.cut_episodes == [first] and stats.counters["interrupted_episodes"] == 1
    record = episodes[0]
    assert record.state is EpisodeState.NONE and record.generation == 1 and record.env_version == 0
    idle = episodes.replaced(1, 1)  # nothing running: the generation moves, nothing is listed
    assert idle is not None and idle.episode_id == -1 and episodes.cut_episodes == [first]
    assert episodes.next_id(0) == first + 2  # the cut id is never given again


def test_a_collection_that_stops_recording_counts_the_steps_nobody_took():
    stats = Stats("test")
    episodes = EpisodeSlots([None], stats)
    episode = episodes.start(0, recording=True)
    episodes[0].record(_step(0, episode))
    assert episodes.recorded_running() == 1
    assert episodes.stop_recording() == 1
    assert stats.counters["dropped_steps"] == 1 and not episodes[0].recording and episodes.recorded_running() == 0


def test_a_record_changes_through_its_own_methods():
    stats = Stats("test")
    episodes = EpisodeSlots([7], stats)
    record = episodes[0]
    assert record.take_seed() == 7 and record.seed is None and record.take_seed() is None
    episode = episodes.start(0, recording=True)
    record.ready("obs")
    assert record.state is EpisodeState.READY and record.observation == "obs"
    record.step_sent(("obs", 1, {}, 0))
    assert record.state is EpisodeState.STEPPING and record.sent == ("obs", 1, {}, 0)
    record.record(_step(0, episode))
    assert [s.episode_id for s in record.take_steps()] == [episode] and record.steps == []
    record.applied(3)
    record.applied(2)
    assert record.env_version == 3
    record.record(_step(0, episode))
    failed = episodes.close(0, Outcome.FAILED)
    assert failed.steps == [] and failed.episode_id == episode and record.state is EpisodeState.NONE
    assert stats.counters["failed_episodes"] == 1 and stats.counters["dropped_steps"] == 1
    episodes.advanced(0, 2, episode + 2)
    assert record.state is EpisodeState.RUNNING and record.episode_id == episode + 2 and record.started == 3
    assert stats.counters["episodes_started"] == 3
