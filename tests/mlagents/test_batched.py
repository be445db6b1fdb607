"""Batched inference in MLAgentsEnvManager: one policy call per behaviour for every idle worker
(a policy's own ``get_actions``), split back per worker; joining and splitting rows.

With ML-Agents' own torch policy and trainer: tests/trainer/test_batched_inference.py."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("mlagents_envs")

import numpy as np
from mlagents_envs.base_env import ActionTuple, DecisionSteps

from envmanager import InvalidInputError
from envmanager.mlagents import ActionInfo, MLAgentsEnvManager, UnityEnvironmentFactory
from envmanager.mlagents.batched import (
    BatchedInferenceError,
    BatchedPolicy,
    join_decision_steps,
    split_rows,
)
from envmanager.testing.fake_unity import free_base_port

B = "FakeBehavior?team=0"


class EchoPolicy:
    """Discrete action ``(worker + agent + call) % 3`` for every agent; with ``batched`` it has
    the batched call. Records who was asked in each call."""

    def __init__(self, batched: bool = True, skip_worker: int | None = None) -> None:
        self.calls: list[list[int]] = []
        self.single_calls = 0
        self.skip_worker = skip_worker
        if batched:
            self.get_actions = self._get_actions

    def _choose(self, steps, worker_id, call):
        actions = ((worker_id + np.asarray(steps.agent_id) + call) % 3).astype(np.int32).reshape(-1, 1)
        return ActionInfo.for_steps(steps, ActionTuple(discrete=actions))

    def _get_actions(self, requests):
        self.calls.append(sorted(requests))
        call = len(self.calls)
        return {w: self._choose(steps, w, call) for w, steps in requests.items() if w != self.skip_worker}

    def get_action(self, steps, worker_id):
        self.single_calls += 1
        return self._choose(steps, worker_id, self.single_calls)


def start(fake_player, n_env, batched_inference, latencies=(0.0, 0.004, 0.0)):
    config = {"behaviors": [{"agents": 3, "discrete": [3], "observation_shapes": [[3], [1]],
                             "echo_actions": True, "episode_length": 4}]}
    path = fake_player(config)
    base = UnityEnvironmentFactory(path, base_port=free_base_port(n_env), timeout_wait=10)

    def factory(worker_id, side_channels):  # a closure: shipped by value to the workers
        import dataclasses

        args = ("--step-latency", str(latencies[worker_id % len(latencies)]))
        return dataclasses.replace(base, additional_args=args)(worker_id, side_channels)

    return MLAgentsEnvManager(factory, n_env, timeout=30, batched_inference=batched_inference)


def run_steps(manager, n_steps, seconds=60.0):
    got = []
    deadline = time.monotonic() + seconds
    while len(got) < n_steps and time.monotonic() < deadline:
        got += manager.get_steps()
    assert len(got) >= n_steps
    return got


def check_echoes(steps):
    """Each agent's next observation echoes the action its worker's ActionInfo gave it."""
    checked = 0
    for step in steps:
        info = step.brain_name_to_action_info.get(B)
        if info is None:
            continue
        decision, terminal = step.current_all_step_result[B]
        given = dict(zip(info.agent_ids, info.env_action.discrete[:, 0], strict=True))
        ended = set(terminal.agent_id)  # a new episode starts at 0 for an agent that just ended
        for agent_id, echo in zip(decision.agent_id, decision.obs[1][:, 0], strict=True):
            if agent_id not in ended:
                assert echo == given[agent_id], (step.worker_id, agent_id)
                checked += 1
    return checked


@pytest.mark.timeout(120)
def test_one_call_for_every_idle_worker_split_back_per_worker(fake_player):
    policy = EchoPolicy()
    assert isinstance(policy, BatchedPolicy)
    manager = start(fake_player, 3, batched_inference=None)
    try:
        manager.set_policy(B, policy)
        manager.reset()
        steps = run_steps(manager, 60)
        assert policy.single_calls == 0 and policy.calls
        assert max(len(c) for c in policy.calls) >= 2  # several workers in one call
        assert manager.inference_counts.calls[B] == len(policy.calls)
        assert manager.inference_counts.requests[B] == sum(len(c) for c in policy.calls)
        assert check_echoes(steps) > 100  # every worker got the actions of its own rows
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_switched_off_required_and_incomplete(fake_player):
    manager = start(fake_player, 2, batched_inference=False)
    try:
        policy = EchoPolicy()
        manager.set_policy(B, policy)
        manager.reset()
        steps = run_steps(manager, 20)
        assert policy.calls == [] and policy.single_calls >= 20  # off: one get_action per worker
        assert manager.inference_counts.calls[B] == manager.inference_counts.requests[B]
        assert check_echoes(steps) > 20
    finally:
        manager.close()

    manager = start(fake_player, 2, batched_inference=True)
    try:
        with pytest.raises(BatchedInferenceError, match=r"'FakeBehavior\?team=0'.*EchoPolicy has no batched call"):
            manager.set_policy(B, EchoPolicy(batched=False))  # required: refused before any step
        assert B not in manager.policies
        manager.set_policy(B, EchoPolicy(skip_worker=1))
        manager.reset()
        with pytest.raises(InvalidInputError, match=r"gave no ActionInfo for worker\(s\) \[1\]"):
            run_steps(manager, 10)
        assert manager.manager.idle_worker_ids == [0, 1]  # nothing was sent
    finally:
        manager.close()


def steps_of(agent_ids, mask=None, obs_width=2, first=0.0):
    n = len(agent_ids)
    obs = [np.arange(n * obs_width, dtype=np.float32).reshape(n, obs_width) + first]
    return DecisionSteps(obs, np.full(n, first, np.float32), np.asarray(agent_ids, np.int32), mask,
                         np.zeros(n, np.int32), np.zeros(n, np.float32))


def test_join_and_split_rows():
    a = steps_of([0, 1], mask=[np.array([[True, False, False], [False, True, False]])])
    b = steps_of([0], first=100.0)  # no mask: nothing masked
    c = steps_of([], mask=[np.zeros((0, 3), bool)])
    joined = join_decision_steps([a, b, c])
    assert len(joined) == 3 and list(joined.agent_id) == [0, 1, 0]  # ids are per player: they may repeat
    np.testing.assert_array_equal(joined.obs[0], np.concatenate([a.obs[0], b.obs[0]]))
    assert joined.action_mask[0].tolist() == [[True, False, False], [False, True, False], [False, False, False]]
    assert list(joined.reward) == [0.0, 0.0, 100.0]
    assert join_decision_steps([a]) is a
    assert join_decision_steps([b, b]).action_mask is None

    bounds = [(0, 2), (2, 3), (3, 3)]
    action = ActionTuple(continuous=np.arange(6, dtype=np.float32).reshape(3, 2),
                         discrete=np.array([[1], [2], [0]], np.int32))
    outputs = {"action": action, "entropy": np.array([0.1, 0.2, 0.3]), "learning_rate": 0.5,
               "nested": {"value": np.array([1.0, 2.0, 3.0])}, "ids": ["x", "y", "z"]}
    pieces = split_rows(outputs, bounds, 3)
    assert len(pieces) == 3
    assert pieces[0]["action"].discrete.tolist() == [[1], [2]] and pieces[1]["action"].continuous.tolist() == [[4, 5]]
    assert pieces[2]["action"].discrete.shape == (0, 1) and isinstance(pieces[2]["action"], ActionTuple)
    assert pieces[1]["entropy"].tolist() == [0.3] and pieces[0]["nested"]["value"].tolist() == [1.0, 2.0]
    assert all(p["learning_rate"] == 0.5 for p in pieces)  # not per row: the same in every piece
    assert [p["ids"] for p in pieces] == [["x", "y"], ["z"], []]
