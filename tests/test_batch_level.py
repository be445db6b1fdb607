"""The core's batch level: whole batches in, finished slots out, raw messages on the hot path."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from envmanager import InvalidInputError, SubprocessEnvManager, WorkerError
from envmanager.core.actions import ActionChecker
from envmanager.core.batch import BatchEnvManager
from envmanager.testing.envs import ControlledEnv, EnvFactory
from envmanager.wire.messages import (
    NOTICE_HEADER,
    PICKLED,
    RAW,
    REQUEST_HEADER,
    Step,
    Stepped,
    Values,
    decode_answer,
    decode_request,
    decode_request_header,
    encode_answer,
    encode_request,
)
from envmanager.wire.messages import (
    EnvironmentCommand as Cmd,
)


class InfoEveryThird(ControlledEnv):
    """A ControlledEnv whose info is empty except every third step."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, ({"third": self.t} if self.t % 3 == 0 else {})


def make_info_env(worker_id):
    return InfoEveryThird(worker_id)


def test_a_step_in_shared_memory_and_its_empty_answer_are_raw():
    data = encode_request(Cmd.STEP, 7, Step((0, 2, 3)))
    cmd, seq, form = decode_request_header(data)
    assert (cmd, seq, form) == (Cmd.STEP, 7, RAW)
    assert len(data) == REQUEST_HEADER.size + 3 * 2  # the header and three uint16 indices
    assert decode_request(cmd, form, data) == Step((0, 2, 3))
    header, payload = encode_answer(Cmd.STEP, 1, 7, 0.5, Stepped([1e-5, 2e-5, 3e-5], generations=(0, 2, 1)))
    assert NOTICE_HEADER.unpack(header)[-1] == RAW and len(payload) == 3 * (8 + 4)  # a float64 time and an int32 generation each
    assert tuple(decode_answer(RAW, payload).env_times) == (1e-5, 2e-5, 3e-5)
    assert decode_answer(RAW, payload).generations == (0, 2, 1)  # the worker's stamp
    # A non-empty info, or actions that travel with the request, need a pickle.
    header, payload = encode_answer(Cmd.STEP, 1, 7, 0.5, Stepped([1e-5], infos={0: {"a": 1}}))
    assert NOTICE_HEADER.unpack(header)[-1] == PICKLED
    # It travels as a bare tuple (cheaper than the NamedTuple's pickle) and comes back a Stepped.
    assert type(decode_answer(PICKLED, payload)) is Stepped and decode_answer(PICKLED, payload) == Stepped([1e-5], {0: {"a": 1}})
    _, payload = encode_answer(Cmd.CALL, 1, 7, 0.5, Values([(1, 2)]))
    assert type(decode_answer(PICKLED, payload)) is Values
    assert decode_request_header(encode_request(Cmd.STEP, 8, Step((0,), [1])))[2] == PICKLED


@pytest.mark.parametrize("shared_memory", [True, False])
def test_receive_batch_hands_out_slots_whose_rows_hold_their_results(shared_memory):
    with BatchEnvManager(make_info_env, 4, envs_per_worker=2, context="fork", shared_memory=shared_memory) as m:
        m.send_reset({i: (i, None) for i in range(4)})
        first = m.receive_reset_batch()
        assert first.slots.tolist() == [0, 1, 2, 3] and first.resets == {0, 1, 2, 3}
        np.testing.assert_array_equal(m.results.observation[:, 1], [0, 1, 2, 3])  # obs[1] is the env id
        for step in range(1, 7):
            m.send_batch(np.arange(4), np.array([2, 1, 0, 2]))
            got, seen = [], {}
            while len(got) < 4:
                batch = m.receive_batch()
                got += batch.slots.tolist()
                seen.update(batch.infos)
            assert sorted(got) == [0, 1, 2, 3]
            r = m.results
            np.testing.assert_array_equal(r.observation[:, 0], [step] * 4)  # steps in episode
            np.testing.assert_array_equal(r.observation[:, 2], [2, 1, 0, 2])  # the action taken
            np.testing.assert_array_equal(r.reward, [2.0, 1.0, 0.0, 2.0])
            assert not r.terminated.any() and not r.truncated.any()
            # Only non-empty infos travel, by slot.
            assert seen == ({s: {"third": step} for s in range(4)} if step % 3 == 0 else {})


def test_a_slot_whose_result_was_not_received_cannot_be_sent_again():
    with BatchEnvManager(EnvFactory(), 2, context="fork") as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        m.send_batch([0], np.array([1]))
        m.wait_idle()  # the answer is in, not received
        with pytest.raises(InvalidInputError, match="not received yet"):
            m.send_batch([0, 1], np.array([1, 1]))
        assert m.in_flight() is False  # slot 1 was not sent either
        assert m.receive_batch().slots.tolist() == [0]
        m.send_batch([0, 1], np.array([1, 1]))
        assert sorted(m.receive_batch(2).slots.tolist()) == [0, 1]


@pytest.mark.parametrize("slots", [[0.5], [True], np.array([[0, 1]]), ["0"], 1])
def test_slot_ids_that_are_not_integers_on_one_axis_are_refused(slots):
    """A float, bool or string id would name another slot (0.5 -> 0, True -> 1), a 2-d array a
    flattened batch: refused before any worker hears of it, in resets too."""
    with BatchEnvManager(EnvFactory(), 2, context="fork") as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        with pytest.raises(InvalidInputError, match="integers on one axis"):
            m.send_batch(slots, np.array([1, 1][: np.size(slots)]))
        with pytest.raises(InvalidInputError, match="unknown worker id"):
            m.send_reset({1.5: (0, None)})
        assert not m.in_flight() and m.get_attr("total_steps") == [0, 0]


def test_partial_batches_of_one_process_step_only_the_slots_asked_for():
    with BatchEnvManager(EnvFactory(), 4, envs_per_worker=4, context="fork") as m:
        m.send_reset(dict.fromkeys(range(4), (None, None)))
        m.receive_reset_batch()
        m.send_batch([3, 1], np.array([2, 1]))  # any order: rows follow the slots given
        assert sorted(m.receive_batch(2).slots.tolist()) == [1, 3]
        assert m.get_attr("total_steps") == [0, 1, 0, 1]
        np.testing.assert_array_equal(m.results.observation[[1, 3], 2], [1, 2])


def test_an_env_raising_mid_lane_names_its_slot_and_the_others_deliver():
    factory = EnvFactory(per_env={2: {"fault": "raise", "fault_at": 2}})
    with BatchEnvManager(factory, 4, envs_per_worker=4, context="fork") as m:
        m.send_reset(dict.fromkeys(range(4), (None, None)))
        m.receive_reset_batch()
        for step, actions in ((1, [1, 2, 0, 1]), (2, [2, 1, 1, 0])):
            m.send_batch(np.arange(4), np.array(actions))
            if step == 2:
                with pytest.raises(WorkerError) as caught:
                    m.receive_batch(4)
                assert caught.value.worker_id == 2 and "failed on purpose" in str(caught.value)
            got = m.receive_batch(3 if step == 2 else 4).slots.tolist()
            assert sorted(got) == ([0, 1, 3] if step == 2 else [0, 1, 2, 3])
            np.testing.assert_array_equal(m.results.observation[got, 0], [step] * len(got))
            np.testing.assert_array_equal(m.results.reward[got], np.array(actions, dtype=float)[got])


def test_step_infos_are_built_from_the_batch_with_previous_results_and_actions():
    with SubprocessEnvManager(EnvFactory(), 3, envs_per_worker=2, context="fork") as m:
        m.reset(seed=0)
        m.send_step({w: w % 3 for w in range(3)})
        infos = m.receive_steps(min_count=3)
        assert sorted(info.worker_id for info in infos) == [0, 1, 2]
        for info in infos:
            assert info.action == info.worker_id % 3
            assert info.previous_result is not None and info.previous_result.observation[0] == 0
            assert info.current_result.observation[0] == 1 and info.current_result.reward == info.action
            assert info.timings.env > 0


@pytest.mark.parametrize(
    "space, good, bad",
    [
        (spaces.Discrete(3, start=1), [1, 3], [[0, 1], [1, 4], [1.0, 2.0], ["1", "2"]]),
        (spaces.MultiDiscrete([2, 3]), [[1, 2], [0, 0]], [[[2, 0], [0, 0]], [[0.5, 0], [0, 0]]]),
        (spaces.MultiBinary(2), [[1, 0], [0, 1]], [[[2, 0], [0, 0]]]),
        (spaces.Box(-1, 1, (2,), np.float32), [[5.0, -5.0], [0.1, 0.2]], [[[np.nan, 0], [0, 0]], [[1e40, 0], [0, 0]]]),
        (spaces.Box(0, 10, (1,), np.int8), [[3], [4]], [[[1.5], [2]], [[300], [2]]]),
    ],
)
def test_action_batches_are_checked_whole_and_kept_as_given(space, good, bad):
    checker = ActionChecker(space)
    checked = checker.batch(np.asarray(good), [0, 1])
    np.testing.assert_array_equal(checked, np.asarray(good, dtype=space.dtype))  # out-of-bound Box values kept
    assert checked.dtype == space.dtype
    for actions in bad:
        with pytest.raises(InvalidInputError):
            checker.batch(np.asarray(actions), [0, 1])


@pytest.mark.parametrize("n", [1, 4, 32, 33, 200])  # a few checked as ints, many by numpy
def test_discrete_action_batches_are_range_checked_at_every_size(n):
    space = spaces.Discrete(3, start=-1)
    checker = ActionChecker(space)
    slots = list(range(n))
    good = np.resize(np.array([-1, 0, 1], dtype=np.int32), n)
    checked = checker.batch(good, slots)
    np.testing.assert_array_equal(checked, good)
    assert checked.dtype == space.dtype
    for value in (-2, 2):
        bad = good.copy()
        bad[n // 2] = value
        with pytest.raises(InvalidInputError, match=f"worker {n // 2}: value"):
            checker.batch(bad, slots)


def test_dict_action_batches_are_checked_per_key():
    space = spaces.Dict({"move": spaces.Discrete(2), "aim": spaces.Box(-1, 1, (2,), np.float32)})
    checker = ActionChecker(space)
    ok = checker.batch({"move": np.array([0, 1]), "aim": np.zeros((2, 2))}, [0, 1])
    assert ok["move"].dtype == np.int64 and ok["aim"].dtype == np.float32
    with pytest.raises(InvalidInputError, match=r"\['move'\]"):
        checker.batch({"move": np.array([0, 2]), "aim": np.zeros((2, 2))}, [0, 1])
    with pytest.raises(InvalidInputError, match="keys"):
        checker.batch({"move": np.array([0, 1])}, [0, 1])


def test_gym_envs_without_array_spaces_travel_pickled():
    def make(i):
        env = gym.make("CartPole-v1")
        env.observation_space = spaces.Text(5)  # no array layout: observations travel pickled
        return gym.wrappers.TransformObservation(env, lambda o: "abc", spaces.Text(5))

    with SubprocessEnvManager(make, 2, context="fork") as m:
        assert m.results.observation is None and m.observation_list == [None, None]
        assert [i.current_result.observation for i in m.reset(seed=0)] == ["abc", "abc"]
        assert {i.current_result.observation for i in m.step({0: 1, 1: 0})} == {"abc"}


def _order_enforced_cartpole(worker_id):
    env = gym.make("CartPole-v1")  # gymnasium.make adds OrderEnforcing
    if worker_id == 1:
        env.reset(seed=0)  # already reset: stepping it is fine
    return env


def test_workers_report_which_envs_refuse_a_step_before_reset():
    m = BatchEnvManager(_order_enforced_cartpole, 3, context="fork", timeout=10)
    try:
        assert m.order_enforced == [True, False, True]
        with pytest.raises(InvalidInputError, match="must be reset"):  # the core's rule stays
            m.send_batch([1], np.array([0]))
        m.allow_step_before_reset([1])
        m.send_batch([1], np.array([0]))
        assert m.receive_batch(1, timeout=10).slots.tolist() == [1]
    finally:
        m.close()


def test_check_spaces_runs_before_the_layout_and_ends_the_construction():
    seen = []

    def check(observation_spaces, action_spaces):
        seen.append((observation_spaces, action_spaces))
        raise RuntimeError("not these spaces")

    with pytest.raises(RuntimeError, match="not these spaces"):
        BatchEnvManager(lambda i: ControlledEnv(i), 2, context="fork", timeout=10, check_spaces=check)
    assert len(seen) == 1 and len(seen[0][0]) == 2 and seen[0][1] == [spaces.Discrete(3)] * 2


@pytest.mark.parametrize("shared_memory", [True, False])
def test_as_given_actions_reach_the_envs_unchanged(shared_memory):
    m = BatchEnvManager(lambda i: ControlledEnv(i), 2, context="fork", timeout=10, shared_memory=shared_memory)
    try:
        m.send_reset({0: (0, None), 1: (0, None)})
        m.receive_reset_batch(timeout=10)
        assert m.actions.exact(np.array([1, 2]), 2) is not None and m.actions.exact([1, 2], 2) is None
        m.send_batch([0, 1], [7, 0.5], per_slot=True, as_given=True)  # out of range, a fraction: the env decides
        m.receive_batch(2, timeout=10)
        np.testing.assert_array_equal(m.results.observation[:, 2], [7.0, 0.5])
        m.send_batch([0, 1], m.actions.exact(np.array([5, -1]), 2), as_given=True)
        m.receive_batch(2, timeout=10)
        np.testing.assert_array_equal(m.results.observation[:, 2], [5.0, -1.0])
    finally:
        m.close()


def test_send_batch_returns_what_the_envs_get():
    with BatchEnvManager(EnvFactory(), 2, autoreset_mode="disabled") as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        sent = m.send_batch([1, 0], np.array([1, 0], dtype=np.int8))  # converted to the space's dtype
        assert sent.dtype == m.action_space.dtype and sent.tolist() == [1, 0]
        m.receive_batch(2)
        assert m.results.action[[1, 0]].tolist() == [1, 0]


@pytest.mark.parametrize("restarts", [True, False])
def test_report_failure_goes_through_the_restart_policy(restarts):
    from envmanager.errors import RestartLimitError, WorkerError

    error = WorkerError(1, "builtins.RuntimeError", "found by the caller", "traceback", None, 1)
    with BatchEnvManager(EnvFactory(), 2, autoreset_mode="disabled", restart_workers=restarts) as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        pid = m.process_of(1).pid
        assert m.generation(1) == 0
        outcome = m.report_failure(1, error)
        if restarts:  # restarted: a new process, one generation on, its fresh reset an interrupted result
            assert outcome is None and m.generation(1) == 1 and m.restart_count(1) == 1
            batch = m.receive_batch(1)
            assert batch.slots.tolist() == [1] and batch.interrupted == {1}
            assert m.process_of(1).pid != pid
            # past the rate limit (1 per 60 s): refused, named, the process given up
            refused = m.report_failure(1, error)
            assert isinstance(refused, RestartLimitError) and refused.worker_id == 1 and refused.failure is error
            assert m.failure_of(1) is refused
        else:  # restarts off: the error to raise; the process serves on
            assert outcome is error and m.generation(1) == 0 and m.failure_of(1) is None
            assert m.get_attr("env_id") == [0, 1]
        assert m.generation(0) == 0


def test_a_failed_reset_keeps_the_resets_that_arrived():
    from envmanager.errors import WorkerError

    factory = EnvFactory(per_env={1: {"fault": "raise_reset", "fault_at": 1}})
    with BatchEnvManager(factory, 3, autoreset_mode="disabled") as m:
        m.send_reset({0: (0, None), 1: (1, None), 2: (2, None)})
        with pytest.raises(WorkerError) as caught:
            m.receive_reset_batch()
        assert caught.value.worker_id == 1
        batch = m.receive_reset_batch()  # the others' resets are still there, nothing lost
        assert batch.slots.tolist() == [0, 2]
        m.send_batch([0, 2], [1, 1])
        assert sorted(m.receive_batch(2).slots.tolist()) == [0, 2]
