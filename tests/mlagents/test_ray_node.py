"""PlayerNode, what each Ray node of RayMLAgentsEnvManager runs, in this process (no Ray): fake
Unity players over real gRPC. The failure paths inside a node: what its errors name, and a player
restarted while the driver held it idle."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

pytest.importorskip("mlagents_envs")

import numpy as np
from mlagents_envs.base_env import ActionTuple

from envmanager import RestartLimitError
from envmanager.mlagents import UnityEnvironmentFactory
from envmanager.mlagents.ray_node import PlayerNode
from envmanager.mlagents.worker_env import WorkerEnvFactory
from envmanager.testing.fake_unity import free_base_port
from process_helpers import alive

B = "FakeBehavior?team=0"
OPTIONS = {"timeout": 30, "restart_workers": True, "max_lifetime_restarts": 10, "restarts_rate_limit_n": 10,
           "restarts_rate_limit_period_s": 60}


def act(value):
    return {B: ActionTuple(continuous=np.full((1, 1), value, np.float32))}


def node_of(fake_player, tmp_path, ids, extra_args=None, **options):
    """A PlayerNode for global ``ids`` on fake players (one agent, a continuous action echoed)."""
    record = tmp_path / "players.jsonl"
    path = fake_player({"record": str(record), "behaviors": [{
        "agents": 1, "continuous": 1, "discrete": [], "observation_shapes": [[1], [1]], "echo_actions": True,
        "episode_length": 0}]})
    base_port = free_base_port(max(ids) + 1)
    extra_args = extra_args or {}

    def make(worker_id, side_channels):
        args = tuple(extra_args.get(worker_id, ()))
        return UnityEnvironmentFactory(path, base_port=base_port, timeout_wait=10, additional_args=args)(worker_id, side_channels)

    return PlayerNode(WorkerEnvFactory(make), ids, {**OPTIONS, **options}), record


def answered(answer):
    value, error = answer
    if error is not None:
        raise error
    return value


def inputs_of(record, pid):
    return [r for r in map(json.loads, record.read_text().splitlines()) if r.get("pid") == pid and r["event"] == "input"]


@pytest.mark.timeout(120)
def test_a_node_names_the_global_worker_ids(fake_player, tmp_path):
    """Node of global ids [2, 3]; 3's player stops past its limits: the error names worker 3 (the
    node's core knows it as its slot 1) and comes back as the answer's error; 2 is served on."""
    crash = ["--crash-after-steps", "2", "--crash-mode", "exit", "--crash-exit-code", "0"]
    node, _ = node_of(fake_player, tmp_path, [2, 3], {3: crash}, max_lifetime_restarts=0)
    pids = dict(node.players.pids)
    try:
        idle = {info.worker_id for info in answered(node.reset())}
        error, steps = None, {2: 0, 3: 0}
        deadline = time.monotonic() + 60
        while error is None and time.monotonic() < deadline:
            infos, error = node.step({w: act(1.0) for w in idle})
            idle = {info.worker_id for info in infos or []}
            for w in idle:
                steps[w] += 1
        assert isinstance(error, RestartLimitError), error
        assert error.worker_id == 3 and error.worker_ids == [3] and str(error).startswith("worker 3 "), error
        assert steps[3] == 2  # what its player answered before it stopped
        infos = answered(node.step({2: act(2.0)}))  # the node serves its other player on
        assert [info.worker_id for info in infos] == [2]
    finally:
        node.close()
    assert not alive(list(pids.values()), timeout=10)


@pytest.mark.timeout(120)
def test_a_player_restarted_while_the_driver_holds_it_idle_gets_no_stale_actions(fake_player, tmp_path):
    """Worker 1's process dies after its step was answered (the driver holds it idle); a call on
    worker 0 (ML-Agents' analytics) notices it and the node restarts it. The driver's next request
    carries actions for 1 chosen for its old env: the node does not send them (it raised
    InvalidInputError, or the fresh env got them) and answers with 1's fresh reset."""
    node, record = node_of(fake_player, tmp_path, [0, 1], {1: ["--reset-latency", "1"]})
    try:
        answered(node.reset())
        got = answered(node.step({0: act(1.0), 1: act(1.0)}))
        while len(got) < 2:
            got += answered(node.step({}))
        old_player = node.players.pids[1]
        os.kill(node.core.processes[1].pid, signal.SIGKILL)
        assert not alive([node.core.processes[1].pid], timeout=10)
        answered(node.call_on([0], "behavior_specs"))  # notices the death: worker 1 restarts (a slow reset)
        seen = answered(node.step({0: act(2.0), 1: act(777.0)}))  # 777: chosen for 1's old env
        deadline = time.monotonic() + 30
        while not any(info.worker_id == 1 for info in seen) and time.monotonic() < deadline:
            seen += answered(node.step({0: act(3.0)} if seen[-1].worker_id == 0 else {}))
        (fresh,) = [info for info in seen if info.worker_id == 1]
        assert fresh.interrupted and node.core.restart_count(1) == 1
        new_player = node.players.pids[1]
        assert new_player != old_player
        infos = answered(node.step({1: act(4.0)}))
        while not any(info.worker_id == 1 for info in infos):
            infos += answered(node.step({}))
    finally:
        node.close()
    sent = [i["actions"][B]["continuous"][0][0] for i in inputs_of(record, new_player) if i["command"] == "STEP"]
    assert sent and 777.0 not in sent and sent[0] == 4.0, sent


@pytest.mark.timeout(120)
def test_a_setting_reaches_a_player_restarted_before_it(fake_player, tmp_path):
    """Worker 5's process dies during a call (answered as an error naming worker 5) and the node
    restarts it with the settings so far. Then a setting changes while the node holds its fresh
    reset: the player is reset again with it, and the fresh reset the driver gets reports both.
    A setting during which a player dies is no error: its restart replays the setting."""
    exit_process = lambda env: os._exit(3)  # noqa: E731 (a lambda: cloudpickled by value to the worker)
    node, record = node_of(fake_player, tmp_path, [4, 5])
    try:
        answered(node.set_replay_calls([("set_env_parameters", ({"gravity": 1.0},), {})]))
        answered(node.call_on(None, "set_env_parameters", ({"gravity": 1.0},), replayed=True))
        answered(node.reset())
        _, error = node.call_on([5], exit_process)  # not a setting: the caller must know
        assert error is not None and error.worker_id == 5 and str(error).startswith("worker 5 (process 1) died"), error
        node.core.wait_idle([1])  # its restart (gravity 1.0 replayed) is done, its fresh reset held
        answered(node.set_replay_calls([("set_env_parameters", ({"gravity": 5.0},), {})]))
        answered(node.call_on(None, "set_env_parameters", ({"gravity": 5.0},), replayed=True))
        infos = answered(node.step({}))
        (fresh,) = [info for info in infos if info.worker_id == 5]
        gravity = [v for v, _ in fresh.current_result.info["environment_stats"]["Fake/EnvParam/gravity"]]
        assert fresh.interrupted and gravity == [1.0, 5.0], gravity  # both resets' reports, the last one new
        new_player = node.players.pids[5]
        answered(node.call_on([4], exit_process, replayed=True))  # as if a setting: no error
        node.core.wait_idle([0])
        (fresh,) = [info for info in answered(node.step({})) if info.worker_id == 4]
        gravity = [v for v, _ in fresh.current_result.info["environment_stats"]["Fake/EnvParam/gravity"]]
        assert fresh.interrupted and gravity == [5.0], gravity  # its restart replayed the settings so far
        assert [node.core.restart_count(i) for i in (0, 1)] == [1, 1]
    finally:
        node.close()
    resets = [i for i in inputs_of(record, new_player) if i["command"] == "RESET"]
    assert [r["env_params"]["gravity"]["sampled"] for r in resets] == [1.0, 5.0]


@pytest.mark.timeout(120)
def test_a_player_no_worker_reported_is_killed_when_the_node_closes(fake_player, stopped_player, tmp_path):
    """As the local manager's close (test_recorded_actions): a player its worker was killed while
    launching, on global worker 3's port, is killed when the node closes, found by its port."""
    path = fake_player({"behaviors": [{"agents": 1, "continuous": 1, "discrete": [], "observation_shapes": [[1]],
                                       "echo_actions": True, "episode_length": 0}]})
    base_port = free_base_port(4)
    node = PlayerNode(WorkerEnvFactory(UnityEnvironmentFactory(path, base_port=base_port, timeout_wait=10)), [2, 3], OPTIONS)
    try:
        assert node.start_error is None
        reported = [pid for pid in node.players.pids.values() if pid is not None]
        assert len(reported) == 2
        left = stopped_player(path, base_port + 3)
    finally:
        node.close()
    assert alive([left.pid], timeout=10) == []  # (stopped, it cannot end by itself; here psutil reaps it)
    assert alive(reported) == []
