"""The worker-side sampler's records (#30 item 3): an error raised out of a collection (not
returned by a fragment) drops what the call collected, counted, and lets the running episodes
go, as a returned one does. Real worker processes, real envs."""

from __future__ import annotations

import numpy as np
import pytest

from envmanager.sampler import WorkerPolicySampler
from envmanager.sampler.slots import EpisodeState
from sampler_envs import kind_env


class ParityAgent:
    def get_actions(self, observations, worker_ids):
        return observations[:, 0].astype(np.int64) % 2


def test_an_error_raised_mid_collection_counts_the_rows_it_drops(monkeypatch):
    # A small arena: each process's 50 steps come in several pieces, so the call waits again
    # after rows are in; a Ctrl-C at that wait is an error raised, not one a fragment returned.
    with WorkerPolicySampler(kind_env, 4, ParityAgent(), seed=3, envs_per_worker=2, fragment_bytes=2048) as sampler:
        m = sampler.manager
        real, waits = m.wait_for, []

        def wait_for(done, timeout, what, *args, **kwargs):
            waits.append(what)
            if waits.count("rollout fragments") == 2:  # the wait for the next piece
                raise KeyboardInterrupt
            return real(done, timeout, what, *args, **kwargs)

        monkeypatch.setattr(m, "wait_for", wait_for)
        with pytest.raises(KeyboardInterrupt):
            sampler.obtain_steps(50)
        collected = sampler.stats.counters["env_steps"]
        assert collected > 0
        assert sampler.stats.counters["dropped_steps"] == collected  # nothing silently dropped
        assert not sampler.episodes.in_state(EpisodeState.RUNNING)  # let go: none goes on with a gap
        assert sampler.stats.counters["discarded_episodes"] > 0
