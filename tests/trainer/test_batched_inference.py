"""Batched inference with ML-Agents' own torch policy (``TorchPolicy``) and ``AgentManager``:
one ``evaluate`` per behaviour for every ready player, split back per player.

Exactness: a stochastic policy samples with torch's random generator, and one sample of a joined
batch draws other numbers than one sample per player, so two such runs never pick the same
actions. The runs compared here therefore use ML-Agents' deterministic actions
(``network_settings.deterministic``: the distribution's mode) and the same initial weights (no
training updates during a run), on deterministic fake players: each agent's action then depends
only on its observations, its memory and the weights, whatever the players' timing and whoever
shared a batch with it. The actions every player received, and the experiences ML-Agents'
``AgentProcessor`` built (observations, actions, log-probs, memories), must be the same with and
without batching: discrete actions exactly, floats to 1e-5 (a matrix product over more rows may
round otherwise). For stochastic sampling, :func:`test_one_call_for_all_players_matches_one_per_player`
checks what does not depend on the draw: the distribution (entropies), the memories, and the
log-probability of each sampled action.
"""
from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

if os.environ.get("ENVMANAGER_REQUIRE_TRAINER") == "1":
    import mlagents.trainers.policy.torch_policy  # noqa: F401  (the trainer leg: an ImportError fails the run)
else:
    pytest.importorskip("mlagents.trainers.policy.torch_policy", reason="ML-Agents' trainer (mlagents) is not installed")

import torch
from mlagents.trainers.agent_processor import AgentManager, AgentManagerQueue
from mlagents.trainers.policy.torch_policy import TorchPolicy
from mlagents.trainers.settings import NetworkSettings
from mlagents.trainers.stats import StatsReporter
from mlagents.trainers.torch_entities.networks import SimpleActor

from envmanager.mlagents import (
    MLAgentsEnvManager,
    UnityEnvironmentFactory,
    batched,
)
from envmanager.mlagents.batched import BatchedInferenceError, TorchPolicyBatch, batched_call
from envmanager.testing.fake_unity import free_base_port, write_launcher

pytestmark = pytest.mark.timeout(300)

WALKER, PICKER = "Walker?team=0", "Picker?team=1"
N_ENV = 3
CRASHING = 1  # this worker's player exits on its 10th step, every time: restarted again and again
BEHAVIORS = [
    # continuous actions, recurrent policy; agents end their episodes at different steps
    {"name": WALKER, "agents": 2, "continuous": 2, "discrete": [], "observation_shapes": [[3], [2]],
     "episode_length": [3, 5]},
    # discrete branches with a mask, feed-forward policy; each agent decides every other step
    # (so the agents in a decision batch change from step to step), episodes of 4 steps
    {"name": PICKER, "agents": 3, "discrete": [3, 2], "action_masks": [[1], []], "decision_period": 2,
     "episode_length": 4},
]


def make_policy(spec: Any, recurrent: bool, deterministic: bool, seed: int = 7) -> TorchPolicy:
    """ML-Agents' own PPO policy (``PPOTrainer.create_policy``'s actor), its weights from ``seed``."""
    torch.manual_seed(seed)
    memory = NetworkSettings.MemorySettings(sequence_length=4, memory_size=8) if recurrent else None
    settings = NetworkSettings(hidden_units=16, num_layers=2, memory=memory, deterministic=deterministic)
    return TorchPolicy(seed, spec, settings, SimpleActor, {"conditional_sigma": False, "tanh_squash": False})


def start(tmp_path, name: str, batched_inference: bool | None) -> tuple[MLAgentsEnvManager, str]:
    record = tmp_path / f"{name}-players.jsonl"
    launcher = write_launcher(tmp_path, {"behaviors": BEHAVIORS, "record": str(record)}, f"player-{name}")
    latency = {0: ["--step-latency", "0"], 1: ["--step-latency", "0.003"], 2: ["--step-latency", "0.008"]}
    latency[CRASHING] += ["--crash-after-steps", "9", "--crash-mode", "exit"]
    base = UnityEnvironmentFactory(launcher, base_port=free_base_port(N_ENV), timeout_wait=20)

    def factory(worker_id, side_channels):  # a closure: shipped by value to the workers
        import dataclasses

        return dataclasses.replace(base, additional_args=tuple(latency[worker_id]))(worker_id, side_channels)

    manager = MLAgentsEnvManager(factory, N_ENV, timeout=60, batched_inference=batched_inference,
                                 max_lifetime_restarts=100, restarts_rate_limit_n=100)
    return manager, str(record)


def run(tmp_path, name: str, batched_inference: bool, deterministic: bool = True,
        player_steps: int = 30) -> dict[str, Any]:
    """Train-loop the three players (as ML-Agents' trainer does: get_steps, process_steps) with
    real TorchPolicies and AgentManagers until every worker's current player took
    ``player_steps`` steps and the crashing one was restarted twice; return what the players got,
    the AgentProcessor's experiences and the manager's inference counts."""
    manager, record = start(tmp_path, name, batched_inference)
    experiences: dict[str, list[Any]] = defaultdict(list)
    try:
        specs = manager.training_behaviors
        policies = {WALKER: make_policy(specs[WALKER], recurrent=True, deterministic=deterministic),
                    PICKER: make_policy(specs[PICKER], recurrent=False, deterministic=deterministic)}
        managers = {}
        for behavior, policy in policies.items():
            managers[behavior] = AgentManager(policy, behavior, StatsReporter(f"{name}-{behavior}"),
                                              max_trajectory_length=6, threaded=False)
            manager.set_agent_manager(behavior, managers[behavior])
            manager.set_policy(behavior, policy)
        manager.reset()
        steps_since_reset: dict[int, int] = defaultdict(int)
        restarted = 0  # fresh resets of the crashing worker the trainer was handed
        for _ in range(5000):
            steps = manager.get_steps()
            for step in steps:
                steps_since_reset[step.worker_id] = 0 if step.interrupted else steps_since_reset[step.worker_id] + 1
                restarted += step.interrupted and step.worker_id == CRASHING
            manager.process_steps(steps)
            if restarted >= 2 and all(
                    steps_since_reset[w] >= (5 if w == CRASHING else player_steps) for w in range(N_ENV)):
                break
        else:
            raise AssertionError("the run did not get there")
        for agent_manager in managers.values():
            queue: AgentManagerQueue = agent_manager.trajectory_queue
            while not queue.empty():
                trajectory = queue.get_nowait()
                experiences[trajectory.agent_id] += trajectory.steps
        counts = manager.inference_counts
    finally:
        manager.close()
    return {"players": players_actions(record), "experiences": dict(experiences),
            "calls": dict(counts.calls), "requests": dict(counts.requests)}


def players_actions(record: str) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """``(worker, incarnation) -> [actions of each STEP]`` from the players' record."""
    port_of: dict[int, int] = {}
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    with open(record, encoding="utf-8") as f:
        for line in f:
            event = json.loads(line)
            if event["event"] == "start":
                port_of[event["pid"]] = event["port"]
            elif event["event"] == "input" and event["command"] == "STEP":
                out[event["pid"]].append(event["actions"])
    base = min(port_of.values())
    by_worker: dict[int, list[int]] = defaultdict(list)
    for pid, port in port_of.items():  # in the order the players started
        by_worker[port - base].append(pid)
    return {(w, k): out[pid] for w, pids in by_worker.items() for k, pid in enumerate(pids)}


def same_actions(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    for behavior in a:
        assert a[behavior]["agents"] == b[behavior]["agents"]
        assert a[behavior]["discrete"] == b[behavior]["discrete"]
        np.testing.assert_allclose(np.array(a[behavior]["continuous"], dtype=np.float64),
                                   np.array(b[behavior]["continuous"], dtype=np.float64), rtol=1e-5, atol=1e-5)


def same_experience(a: Any, b: Any) -> None:
    for x, y in zip(a.obs, b.obs, strict=True):
        np.testing.assert_array_equal(x, y)
    # the player's reward is a function of the continuous action, so it carries the same float
    # noise between one batched call and one call per player as the action (compared below)
    assert a.reward == pytest.approx(b.reward, rel=1e-5, abs=1e-5)
    assert (a.done, a.interrupted) == (b.done, b.interrupted)
    np.testing.assert_array_equal(a.action.discrete, b.action.discrete)
    np.testing.assert_allclose(a.action.continuous, b.action.continuous, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.action_probs.continuous, b.action_probs.continuous, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.action_probs.discrete, b.action_probs.discrete, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a.prev_action, b.prev_action)
    if a.memory is None:
        assert b.memory is None
    else:
        np.testing.assert_allclose(a.memory, b.memory, rtol=1e-5, atol=1e-5)


def test_batched_run_acts_as_the_unbatched_one(tmp_path):
    """Same seed, deterministic players and actions: with batched inference every player receives
    the same actions per agent, and ML-Agents' AgentProcessor builds the same experiences, as
    with one inference per player — two behaviours (a recurrent and a feed-forward policy),
    players of uneven speed, one restarted again and again mid-run, agents ending episodes and
    dropping in and out of the decision batch."""
    plain = run(tmp_path, "plain", batched_inference=False)
    joined = run(tmp_path, "joined", batched_inference=True)

    # unbatched: one call per player and behaviour; batched: fewer calls than player requests
    for behavior in (WALKER, PICKER):
        assert plain["calls"][behavior] == plain["requests"][behavior]
        assert joined["calls"][behavior] < joined["requests"][behavior], joined
    compared = 0
    for key in sorted(set(plain["players"]) & set(joined["players"])):
        a, b = plain["players"][key], joined["players"][key]
        n = min(len(a), len(b))
        assert n > 0 or key[1] > 0, key
        for x, y in zip(a[:n], b[:n], strict=True):
            same_actions(x, y)
            compared += 1
    assert {k for k in plain["players"] if k[0] == CRASHING} & {k for k in joined["players"] if k[0] == CRASHING} \
        >= {(CRASHING, 0), (CRASHING, 1), (CRASHING, 2)}
    assert compared > 80
    # the same experiences, agent by agent, as far as both runs got
    assert set(plain["experiences"]) == set(joined["experiences"])
    checked = 0
    for agent_id, mine in plain["experiences"].items():
        theirs = joined["experiences"][agent_id]
        n = min(len(mine), len(theirs))
        assert n > 0, agent_id
        for a, b in zip(mine[:n], theirs[:n], strict=True):
            same_experience(a, b)
            checked += 1
    recurrent = [e for gid, es in plain["experiences"].items() for e in es if e.memory is not None]
    assert recurrent and any(np.abs(e.memory).sum() > 0 for e in recurrent)  # memories were carried
    assert checked > 80


def decision_steps_of_three_players(tmp_path) -> tuple[Any, dict[int, Any]]:
    """Real DecisionSteps from three fake players (reset and one step), via the manager."""
    manager, _ = start(tmp_path, "requests", batched_inference=False)
    try:
        specs = manager.training_behaviors
        manager.reset()
        requests = {s.worker_id: s.current_all_step_result[PICKER][0] for s in manager.first_step_infos}
        return specs, requests
    finally:
        manager.close()


def test_one_call_for_all_players_matches_one_per_player(tmp_path):
    """Stochastic sampling (the default): on the same DecisionSteps, one batched call and one call
    per player give each player an ActionInfo of the same shape and types, for the same agents;
    what the draw does not change is equal per agent — the distribution (entropy), the recurrent
    memories saved under each player's global agent ids, and the log-probability of each
    sampled action (evaluated again by the per-player policy)."""
    specs, requests = decision_steps_of_three_players(tmp_path)
    spec = specs[PICKER]
    one_each = make_policy(spec, recurrent=True, deterministic=False)
    together = make_policy(spec, recurrent=True, deterministic=False)
    for _ in range(3):  # memories build up over calls
        separate = {w: one_each.get_action(steps, w) for w, steps in requests.items()}
        joined = TorchPolicyBatch(together).get_actions(requests)
    assert list(joined) == list(requests)
    assert one_each.memory_dict.keys() == together.memory_dict.keys() and len(together.memory_dict) == 3 * 3
    for gid, memory in one_each.memory_dict.items():
        np.testing.assert_allclose(together.memory_dict[gid], memory, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(together.previous_memory_dict[gid], one_each.previous_memory_dict[gid],
                                   rtol=1e-5, atol=1e-6)
    for w, mine in separate.items():
        theirs = joined[w]
        assert type(theirs) is type(mine) and theirs.agent_ids == mine.agent_ids
        assert set(theirs.outputs) == set(mine.outputs)
        assert theirs.env_action.discrete.shape == mine.env_action.discrete.shape == (len(requests[w]), 2)
        np.testing.assert_allclose(theirs.outputs["entropy"], mine.outputs["entropy"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(theirs.outputs["memory_out"], mine.outputs["memory_out"], rtol=1e-5, atol=1e-6)
        # the log-prob the batched call gave its sampled action, as the per-player policy sees it
        steps = requests[w]
        masks = 1 - torch.as_tensor(np.concatenate(steps.action_mask, axis=1), dtype=torch.float32)
        gids = [f"agent_{w}-{int(a)}" for a in steps.agent_id]
        memories = torch.as_tensor(one_each.retrieve_previous_memories(gids)).unsqueeze(0)
        from mlagents.trainers.torch_entities.agent_action import AgentAction

        sampled = theirs.outputs["action"]
        action = AgentAction(torch.as_tensor(sampled.continuous),
                             [torch.as_tensor(sampled.discrete[:, b]) for b in range(sampled.discrete.shape[1])])
        with torch.no_grad():
            stats = one_each.actor.get_stats([torch.as_tensor(o) for o in steps.obs], action, masks=masks,
                                             memories=memories)
        np.testing.assert_allclose(stats["log_probs"].discrete_tensor.numpy(),
                                   theirs.outputs["log_probs"].discrete, rtol=1e-4, atol=1e-5)
    # no decision requested: the empty ActionInfo, as get_action returns
    empty = type(requests[0]).empty(spec)
    assert TorchPolicyBatch(together).get_actions({0: empty, 1: requests[1]})[0] == one_each.get_action(empty, 0)


def test_refused_clearly_on_another_mlagents_version(tmp_path, monkeypatch, caplog):
    """Batched inference relies on TorchPolicy.get_action's internals in mlagents 1.1.0: on another
    version it is refused — an error naming both versions where it was required
    (``batched_inference=True``, ``--batched-inference=on``), a warning and one inference per
    player where it was not; a subclass overriding get_action is never batched behind its back."""
    specs, _ = decision_steps_of_three_players(tmp_path)
    policy = make_policy(specs[PICKER], recurrent=False, deterministic=True)
    assert batched_call(policy, PICKER, required=True) is not None  # 1.1.0: batched
    monkeypatch.setattr(batched, "mlagents_version", lambda: "1.0.0")
    with pytest.raises(BatchedInferenceError, match=r"mlagents 1\.1\.0, and mlagents 1\.0\.0 is installed"):
        batched_call(policy, PICKER, required=True)
    with caplog.at_level(logging.WARNING, logger="envmanager.mlagents.batched"):
        assert batched_call(policy, PICKER, required=False) is None
    assert "batched inference off for behaviour 'Picker?team=1'" in caplog.text and "1.0.0" in caplog.text
    monkeypatch.undo()

    class Custom(TorchPolicy):
        def get_action(self, decision_requests, worker_id=0):
            return super().get_action(decision_requests, worker_id)

    custom = Custom.__new__(Custom)
    custom.__dict__.update(policy.__dict__)
    assert batched_call(custom, PICKER, required=False) is None
    with pytest.raises(BatchedInferenceError, match=r"overrides TorchPolicy\.get_action"):
        batched_call(custom, PICKER, required=True)

    # through the manager: refused at set_policy, before anything is stepped
    monkeypatch.setattr(batched, "mlagents_version", lambda: "1.0.0")
    manager, _ = start(tmp_path, "refuse", batched_inference=True)
    try:
        with pytest.raises(BatchedInferenceError, match=r"mlagents 1\.0\.0"):
            manager.set_policy(PICKER, policy)
        assert PICKER not in manager.policies
    finally:
        manager.close()
