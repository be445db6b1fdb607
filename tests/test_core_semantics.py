"""Step semantics of SubprocessEnvManager, with real worker processes and real gymnasium envs."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from envmanager import (
    InvalidInputError,
    ManagerClosedError,
    SpaceMismatchError,
    StepInfo,
    SubprocessEnvManager,
)
from envmanager.testing.envs import ControlledEnv, EnvFactory


def make_manager(n_env=3, **kwargs):
    factory = kwargs.pop("factory", EnvFactory())
    return SubprocessEnvManager(factory, n_env, timeout=kwargs.pop("timeout", 30), **kwargs)


def total_steps(manager):
    return manager.get_attr("total_steps")


def test_reset_returns_one_stepinfo_per_worker():
    with make_manager(3) as m:
        infos = m.reset(seed=10)
        assert [i.worker_id for i in infos] == [0, 1, 2]
        for info in infos:
            assert isinstance(info, StepInfo)
            assert info.previous_result is None and info.action is None
            assert info.current_result.observation[1] == info.worker_id  # env_id in obs
            assert info.current_result.info["seed"] == 10 + info.worker_id


def test_step_returns_previous_current_and_action():
    with make_manager(2) as m:
        first = {i.worker_id: i for i in m.reset()}
        got: dict[int, StepInfo] = {}
        while len(got) < 2:
            for info in m.step({w: 2 for w in m.idle_worker_ids if w not in got}):
                got[info.worker_id] = info
        for w, info in got.items():
            assert info.action == 2
            assert info.previous_result is first[w].current_result
            assert info.current_result.observation[0] == 1  # one step into the episode
            assert info.current_result.reward == 2.0
            assert info.timings.env >= 0 and info.timings.round_trip >= info.timings.queued >= 0


def test_slow_worker_does_not_hold_back_fast_ones(tmp_path):
    gate = str(tmp_path / "open")
    factory = EnvFactory(per_env={0: {"gate": gate}})
    with make_manager(3, factory=factory) as m:
        m.reset()
        seen: list[int] = []
        while min(seen.count(1), seen.count(2)) < 10:
            infos = m.step(dict.fromkeys(m.idle_worker_ids, 1))
            assert infos, "step() must return at least one result"
            seen.extend(info.worker_id for info in infos)
        # Worker 0 is stuck behind its gate: only the fast ones came back, many times each.
        assert 0 not in seen
        assert 0 in m.waiting_worker_ids
        open(gate, "w").close()
        slow = []
        while not slow:
            slow = [i for i in m.step(dict.fromkeys(m.idle_worker_ids, 1)) if i.worker_id == 0]
        # Worker 0 was queued once only: no step was sent to it while it was waiting.
        assert slow[0].current_result.observation[0] == 1
        assert m.get_attr("total_steps")[0] == 1


def test_only_idle_workers_are_queued(tmp_path):
    gate = str(tmp_path / "open")
    factory = EnvFactory(per_env={1: {"gate": gate}})
    with make_manager(2, factory=factory) as m:
        m.reset()
        actions_sent = {0: 0, 1: 0}
        for _ in range(5):
            idle = m.idle_worker_ids
            for w in idle:
                actions_sent[w] += 1
            m.step(dict.fromkeys(idle, 1))
        with pytest.raises(InvalidInputError, match="still stepping"):
            m.step({1: 1})
        open(gate, "w").close()
        m.reset()  # waits out worker 1's step
        assert total_steps(m) == [actions_sent[0], actions_sent[1]] == [5, 1]


def test_reset_drops_in_flight_results(tmp_path):
    factory = EnvFactory(per_env={0: {"step_time": 0.3}})
    with make_manager(2, factory=factory) as m:
        m.reset()
        early = m.step({0: 1, 1: 1})
        assert [i.worker_id for i in early] == [1]
        infos = m.reset()  # worker 0's step is still running
        assert all(i.previous_result is None for i in infos)
        assert [i.current_result.observation[0] for i in infos] == [0, 0]
        first: dict[int, StepInfo] = {}
        while len(first) < 2:
            for info in m.step(dict.fromkeys(m.idle_worker_ids, 1)):
                first.setdefault(info.worker_id, info)
        # The dropped step never shows up: each first result is step 1 of the new episode.
        assert [first[w].current_result.observation[0] for w in (0, 1)] == [1, 1]
        assert [first[w].current_result.observation[3] for w in (0, 1)] == [2, 2]


def test_policy_callable_chooses_actions():
    def policy(info: StepInfo) -> int:
        return int(info.current_result.observation[1]) % 3  # action = env id

    with make_manager(3, policy=policy) as m:
        m.reset()
        got = []
        while len(got) < 6:
            got += m.step()
        assert all(i.action == i.worker_id % 3 for i in got)
        assert all(i.current_result.reward == float(i.worker_id % 3) for i in got)


def test_sequence_of_actions_one_per_worker():
    with make_manager(3) as m:
        m.reset()
        got = {}
        while len(got) < 3:
            got.update({i.worker_id: i.action for i in m.step([0, 1, 2])})
        assert got == {0: 0, 1: 1, 2: 2}


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_start_methods(context):
    factory = EnvFactory(episode_length=3)
    with make_manager(2, factory=factory, context=context) as m:
        m.reset(seed=0)
        per_worker: dict[int, list[float]] = {0: [], 1: []}
        while min(len(ts) for ts in per_worker.values()) < 4:
            for info in m.step(dict.fromkeys(m.idle_worker_ids, 1)):
                per_worker[info.worker_id].append(info.current_result.observation[0])
        # NEXT_STEP autoreset: after the third step the next one is a reset (obs t = 0).
        for ts in per_worker.values():
            assert ts[:4] == [1, 2, 3, 0]


@pytest.mark.parametrize("spin_s", [0.0, 50e-6], ids=["block", "spin-then-block"])
def test_gymnasium_cartpole_matches_in_process_env(spin_s):
    seeds, actions = 7, [0, 1, 1, 0, 1, 0, 0, 1] * 8
    with SubprocessEnvManager(lambda i: gym.make("CartPole-v1"), 2, timeout=30, spin_s=spin_s) as m:
        m.reset(seed=seeds)
        results = {0: [], 1: []}
        step = {0: 0, 1: 0}
        while min(step.values()) < len(actions):
            todo = {w: actions[step[w]] for w in m.idle_worker_ids if step[w] < len(actions)}
            for info in m.step(todo):
                results[info.worker_id].append(info.current_result)
                step[info.worker_id] += 1
    for w in (0, 1):
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=seeds + w)
        pending = False
        for n, action in enumerate(actions):
            if pending:
                obs, _ = env.reset()
                reward, term, trunc = 0.0, False, False
            else:
                obs, reward, term, trunc, _ = env.step(action)
            pending = term or trunc
            got = results[w][n]
            np.testing.assert_array_equal(got.observation, obs)
            assert (got.reward, got.terminated, got.truncated) == (reward, term, trunc)
        env.close()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_envs_per_worker_share_a_process(shared_memory):
    with make_manager(4, envs_per_worker=2, shared_memory=shared_memory) as m:
        pids = m.get_attr("pid")
        assert pids[0] == pids[1] and pids[2] == pids[3] and pids[0] != pids[2]
        m.reset()
        got = []
        while len(got) < 8:
            infos = m.step({w: w % 3 for w in m.idle_worker_ids})
            # Envs of one process are stepped together, so they finish together.
            ids = {i.worker_id for i in infos}
            assert all((w ^ 1) in ids for w in ids)
            got += infos
        assert all(i.current_result.observation[1] == i.worker_id for i in got)
        assert all(i.current_result.reward == float(i.worker_id % 3) for i in got)


def test_same_step_autoreset_puts_final_obs_in_info():
    with make_manager(1, factory=EnvFactory(episode_length=2), autoreset_mode="same_step") as m:
        m.reset()
        m.step({0: 1})
        (info,) = m.step({0: 1})
        result = info.current_result
        assert result.terminated and result.observation[0] == 0  # already reset
        assert result.info["final_obs"][0] == 2 and result.info["final_info"] == {"t": 2}


def test_disabled_autoreset_rejects_stepping_a_finished_env():
    with make_manager(1, factory=EnvFactory(episode_length=1), autoreset_mode="disabled") as m:
        m.reset()
        (info,) = m.step({0: 1})
        assert info.current_result.terminated
        with pytest.raises(InvalidInputError, match="reset it first"):
            m.step({0: 1})
        m.reset()
        (info,) = m.step({0: 1})
        assert info.current_result.observation[0] == 1
        assert total_steps(m) == [2]


def test_bad_input_is_rejected_before_any_worker_hears_of_it():
    with make_manager(2) as m:
        with pytest.raises(InvalidInputError, match="reset"):
            m.step({0: 1, 1: 1})  # step before reset
        m.reset()
        with pytest.raises(InvalidInputError, match="unknown worker id"):
            m.step({0: 1, 5: 1})
        with pytest.raises(InvalidInputError, match="expected 2 actions"):
            m.step([1, 1, 1])
        with pytest.raises(InvalidInputError, match="shape"):
            m.step({0: 1, 1: [1, 2]})
        with pytest.raises(InvalidInputError, match="policy"):
            m.step()
        with pytest.raises(InvalidInputError, match="seeds"):
            m.reset(seed=[1, 2, 3])
        # Nothing was sent: no env moved, and stepping now works in lockstep.
        assert total_steps(m) == [0, 0]
        seen: set[int] = set()
        while len(seen) < 2:
            seen |= {i.worker_id for i in m.step({w: 1 for w in m.idle_worker_ids if w not in seen})}
        assert total_steps(m) == [1, 1]


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), "30", True, 0])
def test_a_worker_deadline_that_is_not_a_positive_finite_number_is_refused(timeout):
    """NaN never passes (a hung worker would hang the caller); inf is no deadline at all."""
    with pytest.raises(InvalidInputError, match="positive, finite"):
        make_manager(1, timeout=timeout)


def test_a_wait_s_own_timeout_is_checked_and_inf_means_the_deadline_alone():
    with make_manager(2, factory=EnvFactory(step_time=0.3)) as m:
        m.reset()
        m.send_batch([0, 1], np.array([1, 1]))
        for bad in (float("nan"), "1"):
            with pytest.raises(InvalidInputError, match="number of seconds or None"):
                m.receive_batch(2, timeout=bad)
        assert sorted(m.receive_batch(2, timeout=float("inf")).slots.tolist()) == [0, 1]  # nothing lost
        assert total_steps(m) == [1, 1]


def test_unpicklable_factory_is_rejected_before_any_worker_starts():
    import threading

    lock = threading.Lock()
    with pytest.raises(InvalidInputError, match="pickled"):
        SubprocessEnvManager(lambda i, lock=lock: ControlledEnv(i), 2)


def test_bad_constructor_arguments():
    with pytest.raises(InvalidInputError):
        SubprocessEnvManager(EnvFactory(), 0)
    with pytest.raises(InvalidInputError):
        SubprocessEnvManager(EnvFactory(), 1, autoreset_mode="sometimes")
    with pytest.raises(ValueError, match="cannot find context"):
        SubprocessEnvManager(EnvFactory(), 1, context="bogus")


def test_use_after_close_is_rejected():
    m = make_manager(1)
    m.reset()
    m.close()
    m.close()  # twice is fine
    assert m.closed
    with pytest.raises(ManagerClosedError):
        m.step({0: 1})
    with pytest.raises(ManagerClosedError):
        m.reset()
    with pytest.raises(ManagerClosedError):
        m.get_attr("t")


def test_call_get_attr_set_attr():
    with make_manager(3, envs_per_worker=2) as m:
        assert m.get_attr("env_id") == [0, 1, 2]
        m.set_attr("episode_length", [5, 6, 7])
        assert m.get_attr("episode_length") == [5, 6, 7]
        m.set_attr("episode_length", 9)
        assert m.get_attr("episode_length") == [9, 9, 9]
        frames = m.call("render")
        assert [f.shape for f in frames] == [(2, 2, 3)] * 3
        assert m.observation_space == ControlledEnv().observation_space
        assert m.action_space == ControlledEnv().action_space


class BigObservationEnv(ControlledEnv):
    """Observations far larger than a pipe's buffer (64 KiB)."""

    def __init__(self, env_id):
        super().__init__(env_id)
        self.observation_space = gym.spaces.Box(0, 255, (300, 300, 3), np.uint8)

    def _obs(self, action=-1.0):
        return np.full((300, 300, 3), self.t % 256, dtype=np.uint8)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_answers_larger_than_a_pipe_buffer(shared_memory):
    with make_manager(2, factory=BigObservationEnv, shared_memory=shared_memory) as m:
        assert [i.current_result.observation.shape for i in m.reset()] == [(300, 300, 3)] * 2
        got = {}
        while len(got) < 2:
            got.update({i.worker_id: i for i in m.step({w: 1 for w in m.idle_worker_ids if w not in got})})
        assert all(int(i.current_result.observation[0, 0, 0]) == 1 for i in got.values())
        blobs = m.call_on(None, lambda env: np.arange(1_000_000) + env.env_id)
        assert [int(b[0]) for b in blobs] == [0, 1] and all(len(b) == 1_000_000 for b in blobs)


def test_actions_that_cannot_be_converted_are_rejected_before_sending():
    with make_manager(2) as m:
        m.reset()
        with pytest.raises(InvalidInputError, match="integer actions only"):
            m.step({0: 1, 1: None})
        assert m.waiting_worker_ids == []
        with pytest.raises(InvalidInputError):
            m.set_attr("tag", [1, lambda: 2])
        assert total_steps(m) == [0, 0] and m.get_attr("env_id") == [0, 1]


def test_results_already_in_are_returned_with_a_zero_timeout():
    with make_manager(2) as m:
        m.reset()
        m.send_step({0: 1, 1: 1})
        m.wait_idle()
        assert sorted(i.worker_id for i in m.receive_steps(timeout=0)) == [0, 1]


def test_actions_are_checked_without_shared_memory_too():
    with make_manager(1, shared_memory=False) as m:
        m.reset()
        with pytest.raises(InvalidInputError, match="shape"):
            m.step({0: [1, 2, 3]})


class WiderEnv(ControlledEnv):
    def __init__(self, env_id):
        super().__init__(env_id)
        if env_id == 1:
            self.observation_space = gym.spaces.Box(-np.inf, np.inf, (5,), np.float64)


def test_spaces_that_cannot_share_one_layout_are_rejected_at_startup():
    with pytest.raises(SpaceMismatchError, match="worker 1 has observation space"):
        make_manager(2, factory=WiderEnv)
    with make_manager(2, factory=WiderEnv, shared_memory=False) as m:
        assert len(m.reset()) == 2
