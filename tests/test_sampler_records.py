"""One record per slot, closed to outside writes (#30 item 3): a record's fields change only
through ``EpisodeSlots``' methods, and a cut is one step (``replaced`` closes the episode it
cuts). Plain records, no processes: the samplers' fault tests drive them end to end."""

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
    episodes.ready(0, "obs")
    episodes.record(0, _step(0, first))
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
    episodes.record(0, _step(0, episode))
    assert episodes.recorded_running() == 1
    assert episodes.stop_recording() == 1
    assert stats.counters["dropped_steps"] == 1 and not episodes[0].recording and episodes.recorded_running() == 0
