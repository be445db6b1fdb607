"""The ActionInfo that comes with a step is the one whose actions the env received.

Fake players echo each agent's last continuous action in their second observation
(``echo_actions``), and the policy gives every agent of every call an action of its own, so a
step's ``brain_name_to_action_info`` can be checked against what its player got: after settings
changes (ML-Agents' lesson changes, ``set_env_parameters`` without a reset) while another worker
is stepping, after a restart noticed during such a change, and after a change while a restarted
player was still starting (its first episode must run with the new settings).
"""
from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

pytest.importorskip("mlagents_envs")

from envmanager.mlagents import MLAgentsEnvManager, UnityEnvironmentFactory, UnityPortInUseError
from envmanager.testing.fake_unity import free_base_port
from player_policies import UniquePolicy
from process_helpers import alive

B = "FakeBehavior?team=0"
AGENTS = 2
SLOW = ["--step-latency", "0.05"]


def start(fake_player, tmp_path, n_env, extra_args, **kwargs):
    config = {"record": str(tmp_path / "players.jsonl"), "behaviors": [{
        "agents": AGENTS, "continuous": 1, "discrete": [], "observation_shapes": [[1], [1]], "echo_actions": True,
        "episode_length": 0}]}
    path = fake_player(config)

    def make(worker_id, side_channels):
        base = UnityEnvironmentFactory(path, base_port=base_port, timeout_wait=10,
                                       additional_args=tuple(extra_args.get(worker_id, ())))
        return base(worker_id, side_channels)

    for attempt in range(3):
        base_port = free_base_port(n_env)
        try:
            return MLAgentsEnvManager(make, n_env, **{"timeout": 30, **kwargs})
        except UnityPortInUseError:
            if attempt == 2:
                raise


class Checker:
    """Checks every step handed out: the actions its ActionInfo holds are those its player got."""

    def __init__(self) -> None:
        self.checked = {}  # worker_id -> steps checked
        self.interrupted = {}  # worker_id -> interrupted steps seen
        self.restarts = []  # the interrupted steps

    def __call__(self, steps) -> None:
        for step in steps:
            w = step.worker_id
            info = step.brain_name_to_action_info.get(B)
            if step.interrupted:  # a restarted player's fresh reset: no action led to it
                assert info is None, f"worker {w}: an interrupted step with actions {info}"
                self.interrupted[w] = self.interrupted.get(w, 0) + 1
                self.restarts.append(step)
                continue
            assert info is not None, f"worker {w}: a step without the ActionInfo that led to it"
            decision, _ = step.current_all_step_result[B]
            sent = dict(zip(info.agent_ids, info.env_action.continuous[:, 0].tolist(), strict=True))
            got = dict(zip(decision.agent_id.tolist(), decision.obs[1][:, 0].tolist(), strict=True))
            assert got == sent, f"worker {w}: the env got {got}, the step's ActionInfo says {sent}"
            self.checked[w] = self.checked.get(w, 0) + 1


def run_until(manager, check, done, act=lambda steps: None, seconds=60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        steps = manager.get_steps()
        check(steps)
        act(steps)
        if done():
            return
    raise AssertionError(f"not done in {seconds:g} s of get_steps calls")


@pytest.mark.timeout(120)
def test_after_settings_changes_while_another_worker_steps(fake_player, tmp_path):
    """ML-Agents' lesson change: set_env_parameters while worker 1 is in the middle of a step."""
    manager = start(fake_player, tmp_path, 2, {1: SLOW})
    try:
        manager.set_policy(B, UniquePolicy())
        manager.reset(config={"gravity": 1.0})
        check, changes = Checker(), []

        def change(steps):
            if 1 in manager.manager.waiting_worker_ids and len(changes) < 3 and check.checked.get(1, 0) > 2 * len(changes):
                changes.append(check.checked.get(0, 0))
                manager.set_env_parameters({"gravity": 2.0 + len(changes)})
                manager.set_engine_config(time_scale=float(len(changes)))

        run_until(manager, check, lambda: len(changes) == 3 and check.checked.get(1, 0) > 8, change)
        assert check.interrupted == {} and manager.restart_counts == [0, 0]
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_after_a_restart_noticed_during_a_settings_change(fake_player, tmp_path):
    """Worker 1's player stops on every 4th step; the change waits for that step, so the restart
    happens inside it. The restarted worker's next steps come with their own ActionInfos (none
    is taken by its fresh reset)."""
    crash = ["--crash-after-steps", "3", "--crash-mode", "exit", "--crash-exit-code", "0"]
    manager = start(fake_player, tmp_path, 2, {1: SLOW + crash}, restarts_rate_limit_n=10)
    try:
        manager.set_policy(B, UniquePolicy())
        manager.reset(config={"gravity": 1.0})
        check = Checker()
        since_start = {"steps": 0, "changes": 0}

        def change(steps):
            for step in steps:
                if step.worker_id == 1:
                    since_start["steps"] = 0 if step.interrupted else since_start["steps"] + 1
            # its 4th step (the one its player stops on) in flight: change a setting now
            if since_start["steps"] == 3 and 1 in manager.manager.waiting_worker_ids:
                since_start["changes"] += 1
                manager.set_env_parameters({"gravity": 1.0 + since_start["changes"]})

        run_until(manager, check, lambda: check.interrupted.get(1, 0) >= 2 and since_start["steps"] >= 2, change)
        assert manager.restart_counts[1] >= 2 and manager.restart_counts[0] == 0
        assert check.checked[1] >= 3 * 2 + 2  # its steps before each stop, and after the last restart
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_a_change_while_a_player_restarts_reaches_its_first_episode(fake_player, tmp_path):
    """Worker 1's player stops on its 4th step; while its replacement starts (a slow reset), the
    environment parameters change. The replacement's first episode — the first the trainer sees
    of it — runs with the new parameters, and the interrupted step reports them."""
    crash = ["--crash-after-steps", "3", "--crash-mode", "exit", "--crash-exit-code", "0", "--reset-latency", "1"]
    manager = start(fake_player, tmp_path, 2, {1: SLOW + crash}, restarts_rate_limit_n=10)
    try:
        manager.set_policy(B, UniquePolicy())
        manager.reset(config={"gravity": 1.0})
        pids = dict(manager.player_pids)
        check, changed = Checker(), []

        def change(steps):  # once worker 1's replacement is on its way up, not yet seen
            if not changed and manager.manager.generation(1) == 1 and 1 in manager.manager.waiting_worker_ids \
                    and not check.interrupted:
                changed.append(True)
                manager.set_env_parameters({"gravity": 7.0})

        run_until(manager, check, lambda: check.checked.get(1, 0) >= 5, change)
        assert changed and check.interrupted == {1: 1}
        (restarted,) = check.restarts
        gravity = [value for value, _ in restarted.environment_stats["Fake/EnvParam/gravity"]]
        assert gravity[-1] == 7.0, gravity  # what its player reported on the reset the trainer saw
        new_pid = manager.player_pids[1]
        assert new_pid != pids[1]
    finally:
        manager.close()
    inputs = [r for r in map(json.loads, (tmp_path / "players.jsonl").read_text().splitlines())
              if r["event"] == "input" and r["pid"] == new_pid]
    first_step = next(i for i, r in enumerate(inputs) if r["command"] == "STEP")
    resets = [r for r in inputs[:first_step] if r["command"] == "RESET"]
    gravity = [r["env_params"]["gravity"]["sampled"] for r in resets if "gravity" in r.get("env_params", {})]
    assert resets and gravity and gravity[-1] == 7.0, inputs[:first_step]  # its first episode: the new value


@pytest.mark.timeout(120)
def test_a_player_left_behind_by_a_worker_killed_while_it_started_is_killed(fake_player, tmp_path):
    """A worker killed while its player starts (inside ``env_factory``, before a reset reported
    the player) leaves that player running, reaching for the worker's port. The next worker on
    that port kills it before it launches its own; else both players would talk to it and their
    answers mix (a fault schedule, seed 54000, saw a step whose player had not got its actions).
    The player left behind is stood in for by one started by hand for worker 0's port."""
    config = {"behaviors": [{"agents": AGENTS, "continuous": 1, "discrete": [], "observation_shapes": [[1], [1]],
                             "echo_actions": True, "episode_length": 0}]}
    path = fake_player(config)
    base_port = free_base_port(1)
    left = subprocess.Popen([path, "--mlagents-port", str(base_port)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        manager = MLAgentsEnvManager(UnityEnvironmentFactory(path, base_port=base_port, timeout_wait=10), 1, timeout=30)
        try:
            assert left.wait(timeout=10) == -signal.SIGKILL  # killed before worker 0 launched its own
            manager.set_policy(B, UniquePolicy())
            manager.reset()
            check = Checker()
            run_until(manager, check, lambda: check.checked.get(0, 0) >= 10)
            assert manager.player_pids[0] not in (None, left.pid)
        finally:
            manager.close()
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()


@pytest.mark.timeout(120)
def test_a_player_no_worker_reported_is_killed_by_close(fake_player, stopped_player, tmp_path):
    """A worker killed while it launched its player, with no worker after it on its port (the
    manager closing): ``close()`` kills that player too, found by its port, as well as the players
    the workers reported. Stood in for by a real player launched by hand for worker 1's port."""
    config = {"behaviors": [{"agents": AGENTS, "continuous": 1, "discrete": [], "observation_shapes": [[1], [1]],
                             "echo_actions": True, "episode_length": 0}]}
    path = fake_player(config)
    base_port = free_base_port(2)
    manager = MLAgentsEnvManager(UnityEnvironmentFactory(path, base_port=base_port, timeout_wait=10), 2, timeout=30)
    try:
        reported = [pid for pid in manager.player_pids.values() if pid is not None]
        assert len(reported) == 2
        left = stopped_player(path, base_port + 1)
    finally:
        manager.close()
    assert alive([left.pid], timeout=10) == []  # (stopped, it cannot end by itself; here psutil reaps it)
    assert alive(reported) == []
