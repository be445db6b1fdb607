"""An env that raises is rebuilt where it stands (#30 item 7): with restarts on, an env whose
``step`` or ``reset`` raised is made again from its factory inside its process, which is
otherwise healthy; its episode is cut (its fresh reset comes back ``interrupted``) and the envs
sharing the process keep theirs. A process is restarted only when it died, hung or cannot
rebuild; both count against the one restart policy. Real worker processes, real gymnasium envs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from envmanager import RestartLimitError, SubprocessEnvManager, WorkerError
from envmanager.core.batch import BatchEnvManager
from envmanager.sampler import Sampler
from envmanager.testing.envs import ControlledEnv, EnvFactory

DEADLINE_S = 30.0  # every loop below gives up after this long (a loaded machine, not a timing claim)


def step_all(m: SubprocessEnvManager, want: int, seconds: float = DEADLINE_S) -> list:
    """Step every idle slot until ``want`` results came back (bounded)."""
    out: list = []
    deadline = time.monotonic() + seconds
    while len(out) < want:
        assert time.monotonic() < deadline, f"only {len(out)} of {want} results came back"
        out += m.step(dict.fromkeys(m.idle_worker_ids, 1))
    return out


class FailsOnSecondMake:
    """``ControlledEnv`` s; slot 1's raises in its third step, and its second making raises
    (counted in a file, across processes): its rebuild fails, a process restart makes it again."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, slot: int) -> ControlledEnv:
        if slot == 1:
            path = os.path.join(self.directory, "makes")
            made = int(Path(path).read_text()) if os.path.exists(path) else 0
            Path(path).write_text(str(made + 1))
            if made + 1 == 2:
                raise RuntimeError("the factory cannot make env 1 twice")
            return ControlledEnv(slot, fault="raise", fault_at=3)
        return ControlledEnv(slot)


def test_an_env_that_raises_in_step_is_rebuilt_and_its_neighbour_goes_on():
    with SubprocessEnvManager(EnvFactory(per_env={1: {"fault": "raise", "fault_at": 3}}), 2, envs_per_worker=2,
                              timeout=30, restart_workers=True) as m:
        m.reset(seed=[10, 11])
        pid = m.processes[0].pid
        before = step_all(m, 4)  # two steps each; env 1's third raises
        assert not any(i.interrupted for i in before)
        seen: dict[int, list] = {0: [], 1: []}
        deadline = time.monotonic() + DEADLINE_S
        while not any(i.interrupted for i in seen[1]) or len(seen[0]) < 3:
            assert time.monotonic() < deadline
            back = any(i.interrupted for i in seen[1])  # then env 1 is left alone: still unstepped at the end
            for info in m.step(dict.fromkeys([s for s in m.idle_worker_ids if s == 0 or not back], 1)):
                seen[info.worker_id].append(info)
        # env 0 went on with its episode: its step counter kept counting, never cut
        assert [i.current_result.observation[0] for i in seen[0]] == list(range(3, 3 + len(seen[0])))
        assert not any(i.interrupted for i in seen[0])
        # env 1 came back fresh, flagged: a new env's reset (its first episode, step 0)
        cut = next(i for i in seen[1] if i.interrupted)
        assert cut.current_result.observation[0] == 0 and cut.current_result.observation[3] == 1
        assert m.processes[0].pid == pid and m.restart_count(1) == 1
        assert m.generation(1) == 1 and m.generation(0) == 0
        assert m.get_attr("total_steps", [1]) == [0]  # the rebuilt env, not stepped yet


def test_an_env_that_raises_in_reset_is_rebuilt_with_its_seed():
    factory = EnvFactory(per_env={1: {"fault": "raise_reset", "fault_at": 2}})
    with BatchEnvManager(factory, 2, envs_per_worker=2, autoreset_mode="disabled", restart_workers=True, timeout=30) as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        m.send_batch([0, 1], [1, 1])
        m.receive_batch(2)
        pid = m.processes[0].pid
        m.send_reset({0: (5, None), 1: (7, None)})  # env 1's second reset raises
        batch = m.receive_reset_batch([0, 1])
        assert batch.slots.tolist() == [0, 1] and batch.interrupted == {1}
        assert m.processes[0].pid == pid and m.restart_count(1) == 1 and m.generation(1) == 1 and m.generation(0) == 0
        assert m.get_attr("resets") == [2, 1]  # env 0 reset twice; env 1 is a new env, reset once
        assert m.call_on([1], lambda env: env.unwrapped.np_random_seed) == [7]  # the seed it was asked for


def test_a_rebuild_that_raises_restarts_the_process(tmp_path):
    with SubprocessEnvManager(FailsOnSecondMake(str(tmp_path)), 2, envs_per_worker=2, timeout=30, restart_workers=True,
                              restarts_rate_limit_n=-1) as m:
        m.reset()
        pid = m.processes[0].pid
        found = []
        deadline = time.monotonic() + DEADLINE_S
        while {i.worker_id for i in found} != {0, 1}:
            assert time.monotonic() < deadline
            found += [i for i in m.step(dict.fromkeys(m.idle_worker_ids, 1)) if i.interrupted]
        # the rebuild failed: the process was restarted, every env of it fresh
        assert m.processes[0].pid != pid and m.restart_count(0) == 2
        assert all(i.current_result.observation[0] == 0 for i in found)
        assert m.generation(0) == 1 and m.generation(1) == 2
        assert int((tmp_path / "makes").read_text()) == 3


def test_rebuilds_count_against_the_restart_limits_and_name_the_slot():
    factory = EnvFactory(per_env={1: {"fault": "raise", "fault_at": 2}})  # every env 1 raises in its second step
    with SubprocessEnvManager(factory, 2, envs_per_worker=2, timeout=30, restart_workers=True,
                              max_lifetime_restarts=2, restarts_rate_limit_n=-1) as m:
        m.reset()
        pid = m.processes[0].pid
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(RestartLimitError) as caught:
            while True:
                assert time.monotonic() < deadline
                m.step(dict.fromkeys(m.idle_worker_ids, 1))
        assert caught.value.worker_id == 1 and "max_lifetime_restarts" in str(caught.value)
        assert m.restart_count(0) == 2 and m.generation(1) == 2 and m.generation(0) == 0
        assert m.processes[0].pid == pid  # never restarted: rebuilt twice, then refused


def test_restarts_off_raise_the_env_error_as_before():
    with SubprocessEnvManager(EnvFactory(per_env={1: {"fault": "raise", "fault_at": 2}}), 2, envs_per_worker=2,
                              timeout=30) as m:
        m.reset()
        pid = m.processes[0].pid
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(WorkerError) as caught:
            while True:
                assert time.monotonic() < deadline
                m.step(dict.fromkeys(m.idle_worker_ids, 1))
        assert caught.value.worker_id == 1 and "failed on purpose" in str(caught.value)
        assert m.restart_count(0) == 0 and m.generation(1) == 0 and m.processes[0].pid == pid
        assert m.get_attr("total_steps") == [2, 2]  # env 1 is the same env (its second step raised)


class RaisesOnce:
    """``ControlledEnv`` s of 1000-step episodes; the first env made for slot 1 raises in its
    third step (a file remembers it: the rebuilt one does not)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, slot: int) -> ControlledEnv:
        if slot == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            return ControlledEnv(slot, episode_length=1000, fault="raise", fault_at=3)
        return ControlledEnv(slot, episode_length=1000)


class CountingPolicy:
    def __call__(self, observations, worker_ids):
        return np.ones(len(worker_ids), dtype=np.int64)


def test_the_sampler_cuts_only_the_rebuilt_slots_episode(tmp_path):
    with Sampler(RaisesOnce(str(tmp_path / "raised")), 2, CountingPolicy(), envs_per_worker=2, timeout=30,
                 restart_workers=True) as sampler:
        pid = sampler.manager.process_of(0).pid
        batch = sampler.obtain_steps(20)
        assert sampler.manager.process_of(0).pid == pid and sampler.manager.restart_count(1) == 1
    rows0 = batch.worker_ids == 0
    rows1 = batch.worker_ids == 1
    # slot 0: one episode (id 0), never cut, its step counter counting on through the fault
    assert set(batch.episode_ids[rows0].tolist()) == {0} and not batch.interrupted[rows0].any()
    t0 = batch.observations[rows0][:, 0]
    assert t0.tolist() == list(range(len(t0)))
    # slot 1: its first episode (id 1) cut after its two steps, the next one (id 3) fresh
    assert sampler.cut_episodes == [1]
    assert batch.episode_ids[rows1].tolist()[:2] == [1, 1] and batch.interrupted[rows1][:2].all()
    assert set(batch.episode_ids[rows1].tolist()[2:]) == {3} and not batch.interrupted[rows1][2:].any()
    t1 = batch.observations[rows1][2:, 0]
    assert t1.tolist() == list(range(len(t1)))
    counters = sampler.stats.counters
    assert counters["worker_restarts"] == 1 and counters["interrupted_episodes"] == 1
    assert counters.get("failed_episodes", 0) == 0


def test_the_sb3_drop_in_ends_only_the_rebuilt_envs_episode():
    pytest.importorskip("stable_baselines3")
    import functools

    from envmanager.sb3 import SubprocVecEnv

    fns = [functools.partial(ControlledEnv, 0), functools.partial(ControlledEnv, 1, fault="raise", fault_at=2)]
    vec = SubprocVecEnv(fns, "fork", envs_per_worker=2, restart_workers=True, timeout=30)
    try:
        vec.reset()
        pid = vec.manager.processes[0].pid
        before, _, _, _ = vec.step(np.ones(2, dtype=np.int64))
        obs, rewards, dones, infos = vec.step(np.ones(2, dtype=np.int64))  # env 1's second step raises
        assert dones[1] and rewards[1] == 0.0 and infos[1]["interrupted"] and infos[1]["TimeLimit.truncated"]
        np.testing.assert_array_equal(infos[1]["terminal_observation"], before[1])
        assert obs[1][0] == 0  # the rebuilt env's fresh episode
        assert not dones[0] and "interrupted" not in infos[0] and obs[0][0] == 2  # env 0 went on
        assert vec.manager.processes[0].pid == pid and vec.manager.restart_count(1) == 1
        assert vec.get_attr("total_steps") == [2, 0]
    finally:
        vec.close()
