"""The fake Unity player under the real mlagents_envs client, over real gRPC."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import uuid

import pytest

pytest.importorskip("mlagents_envs")
psutil = pytest.importorskip("psutil")

import numpy as np  # noqa: E402
from mlagents_envs.base_env import ActionTuple  # noqa: E402
from mlagents_envs.exception import (  # noqa: E402
    UnityEnvironmentException,
    UnityException,
    UnityTimeOutException,
)
from mlagents_envs.side_channel.engine_configuration_channel import EngineConfigurationChannel  # noqa: E402
from mlagents_envs.side_channel.environment_parameters_channel import EnvironmentParametersChannel  # noqa: E402
from mlagents_envs.side_channel.raw_bytes_channel import RawBytesChannel  # noqa: E402
from mlagents_envs.side_channel.stats_side_channel import StatsSideChannel  # noqa: E402

from envmanager.testing.fake_unity import (  # noqa: E402
    CONFIG_ENV_VAR,
    free_base_port,
    main,
    parse_args,
    write_launcher,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B = "FakeBehavior?team=0"


def stats_dict(stats_channel):
    """``{key: [value, ...]}`` from a StatsSideChannel (resets it)."""
    return {k: [v for v, _ in vals] for k, vals in stats_channel.get_and_reset_stats().items()}


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def targets(decision_steps, n_branch):
    """The discrete target of each agent, read from observation 0 (one-hot prefix)."""
    return np.argmax(decision_steps.obs[0][:, :n_branch], axis=1)


@pytest.mark.timeout(60)
def test_reset_step_get_steps_and_rewards(make_fake_env):
    cfg = {"behaviors": [{"agents": 3, "discrete": [4], "episode_length": 0}]}
    env = make_fake_env(cfg)
    spec = env.behavior_specs[B]
    assert spec.action_spec.discrete_branches == (4,)
    assert spec.action_spec.continuous_size == 0
    assert [o.shape for o in spec.observation_specs] == [(4,)]
    env.reset()
    dec, term = env.get_steps(B)
    assert list(dec.agent_id) == [0, 1, 2] and len(term) == 0
    assert dec.obs[0].shape == (3, 4) and np.all(dec.obs[0].sum(axis=1) == 1)
    for _ in range(3):
        right = targets(dec, 4)
        env.set_actions(B, ActionTuple(discrete=right.reshape(3, 1).astype(np.int32)))
        env.step()
        dec, term = env.get_steps(B)
        assert list(dec.reward) == [1.0, 1.0, 1.0]
    wrong = (targets(dec, 4) + 1) % 4
    env.set_actions(B, ActionTuple(discrete=wrong.reshape(3, 1).astype(np.int32)))
    env.step()
    dec, _ = env.get_steps(B)
    assert list(dec.reward) == [0.0, 0.0, 0.0]


@pytest.mark.timeout(60)
def test_two_behaviours_in_one_player(make_fake_env):
    cfg = {"behaviors": [
        {"name": "Walker?team=0", "agents": 2, "continuous": 3, "discrete": [], "observation_shapes": [[6], [2, 3]]},
        {"name": "Picker?team=1", "agents": 1, "discrete": [2, 5], "group_id": 3},
    ]}
    env = make_fake_env(cfg)
    assert set(env.behavior_specs) == {"Walker?team=0", "Picker?team=1"}
    walker, picker = env.behavior_specs["Walker?team=0"], env.behavior_specs["Picker?team=1"]
    assert walker.action_spec.continuous_size == 3 and walker.action_spec.discrete_branches == ()
    assert [o.shape for o in walker.observation_specs] == [(6,), (2, 3)]
    assert picker.action_spec.discrete_branches == (2, 5)
    env.reset()
    for step in range(1, 4):
        env.set_actions("Walker?team=0", ActionTuple(continuous=np.zeros((2, 3), np.float32)))
        env.step()
        wd, _ = env.get_steps("Walker?team=0")
        pd, _ = env.get_steps("Picker?team=1")
        assert list(wd.agent_id) == [0, 1] and list(pd.agent_id) == [2]
        assert list(wd.group_id) == [0, 0] and list(pd.group_id) == [3]
        assert list(pd.group_reward) == list(pd.reward)  # one agent: the group mean is its reward
        assert np.all(wd.obs[1] == step)  # observations after the first count episode steps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["terminate", "interrupt"])
def test_terminal_and_interrupted_agents(make_fake_env, end):
    cfg = {"behaviors": [{"agents": 2, "episode_length": [2, 3], "episode_end": end}]}
    env = make_fake_env(cfg)
    env.reset()
    seen = []
    for _ in range(6):
        env.step()
        dec, term = env.get_steps(B)
        seen.append(list(term.agent_id))
        assert list(dec.agent_id) == [0, 1]  # a finished agent starts again in the same step
        assert list(term.interrupted) == [end == "interrupt"] * len(term)
    assert seen == [[], [0], [1], [0], [], [0, 1]]


@pytest.mark.timeout(60)
def test_discrete_action_masks_visible(make_fake_env):
    cfg = {"behaviors": [{"agents": 2, "discrete": [3, 4], "action_masks": [[0, 2], [3]]}]}
    env = make_fake_env(cfg, side_channels=[stats := StatsSideChannel()])
    env.reset()
    dec, _ = env.get_steps(B)
    assert len(dec.action_mask) == 2
    assert dec.action_mask[0].tolist() == [[True, False, True]] * 2
    assert dec.action_mask[1].tolist() == [[False, False, False, True]] * 2
    assert np.all(targets(dec, 3) == 1)  # the target is never a masked action
    env.set_actions(B, ActionTuple(discrete=np.array([[1, 0], [0, 3]], np.int32)))
    env.step()
    assert stats_dict(stats)["Fake/MaskViolations"] == [2.0]  # agent 1 chose two masked actions


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["continuous", "discrete", "hybrid"])
def test_action_specs(make_fake_env, kind):
    beh = {"continuous": {"continuous": 2, "discrete": []},
           "discrete": {"continuous": 0, "discrete": [3, 2]},
           "hybrid": {"continuous": 1, "discrete": [3]}}[kind]
    env = make_fake_env({"behaviors": [dict(agents=2, **beh)]})
    spec = env.behavior_specs[B].action_spec
    assert spec.continuous_size == beh["continuous"]
    assert spec.discrete_branches == tuple(beh["discrete"])
    env.reset()
    dec, _ = env.get_steps(B)
    obs = dec.obs[0]
    n_d = beh["discrete"][0] if beh["discrete"] else 0
    cont = disc = None
    if spec.continuous_size:
        cont = np.zeros((2, spec.continuous_size), np.float32)
        cont[:, 0] = obs[:, n_d]  # the continuous target follows the one-hot part
    if spec.discrete_size:
        disc = np.zeros((2, spec.discrete_size), np.int32)
        disc[:, 0] = np.argmax(obs[:, :n_d], axis=1)
    env.set_actions(B, ActionTuple(continuous=cont, discrete=disc))
    env.step()
    dec, _ = env.get_steps(B)
    np.testing.assert_allclose(dec.reward, [1.0, 1.0], atol=1e-6)
    if spec.continuous_size:  # continuous reward is 1 - |action - target|
        cont = np.zeros((2, spec.continuous_size), np.float32)
        cont[:, 0] = np.clip(dec.obs[0][:, n_d] + 0.5, -1, 1)
        disc = None if disc is None else np.zeros_like(disc)
        if disc is not None:
            disc[:, 0] = np.argmax(dec.obs[0][:, :n_d], axis=1)
        expected = 1 - np.abs(cont[:, 0] - dec.obs[0][:, n_d])
        expected = (expected + 1) / 2 if disc is not None else expected
        env.set_actions(B, ActionTuple(continuous=cont, discrete=disc))
        env.step()
        np.testing.assert_allclose(env.get_steps(B)[0].reward, expected, atol=1e-5)


@pytest.mark.timeout(60)
def test_env_parameters_and_engine_settings_arrive(make_fake_env):
    stats, params, engine = StatsSideChannel(), EnvironmentParametersChannel(), EngineConfigurationChannel()
    env = make_fake_env({"behaviors": [{"episode_length": 0}]}, side_channels=[stats, params, engine], seed=123)
    params.set_float_parameter("gravity", 9.5)
    params.set_uniform_sampler_parameters("mass", 1.0, 2.0, seed=7)
    engine.set_configuration_parameters(width=64, height=48, quality_level=2, time_scale=7.0,
                                        target_frame_rate=30, capture_frame_rate=50)
    env.reset()
    got = stats_dict(stats)
    assert got["Fake/EnvParam/gravity"] == [9.5]
    assert 1.0 <= got["Fake/EnvParam/mass"][0] <= 2.0
    assert got["Fake/Engine/time_scale"] == [7.0]
    assert (got["Fake/Engine/width"], got["Fake/Engine/height"]) == ([64.0], [48.0])
    assert got["Fake/Engine/quality_level"] == [2.0]
    assert got["Fake/Engine/target_frame_rate"] == [30.0]
    assert got["Fake/Engine/capture_frame_rate"] == [50.0]
    assert got["Fake/Seed"] == [123.0] and got["Fake/NumAreas"] == [1.0]
    assert got["Fake/Pid"] == [float(env.player_process.pid)]  # the launcher execs the player
    env.step()
    got = stats_dict(stats)
    assert "Fake/EnvParam/gravity" not in got and got["Fake/Step"] == [1.0]
    # parameters that change the simulation
    params.set_float_parameter("episode_length", 2)
    params.set_float_parameter("reward_scale", 3.0)
    env.reset()
    for _ in (1, 2):
        dec, _ = env.get_steps(B)
        env.set_actions(B, ActionTuple(discrete=targets(dec, 3).reshape(1, 1).astype(np.int32)))
        env.step()
    dec, term = env.get_steps(B)
    assert list(term.agent_id) == [0] and list(term.reward) == [3.0]
    assert stats_dict(stats)["Fake/EpisodeReturn"] == [6.0]


@pytest.mark.timeout(60)
def test_echo_channel_and_record_file(make_fake_env, tmp_path):
    cid = uuid.UUID("11111111-2222-3333-4444-555555555555")
    raw, record = RawBytesChannel(cid), tmp_path / "rec.jsonl"
    cfg = {"behaviors": [{"agents": 2, "continuous": 1, "discrete": [2]}],
           "echo_channels": [str(cid)], "record": str(record)}
    env = make_fake_env(cfg, side_channels=[raw], worker_id=2, log_folder=str(tmp_path),
                        no_graphics=True, additional_args=["-screen-fullscreen", "0", "--unknown-flag"])
    env.reset()
    raw.send_raw_data(b"hello")
    env.set_actions(B, ActionTuple(continuous=np.full((2, 1), 0.25, np.float32),
                                   discrete=np.array([[1], [0]], np.int32)))
    env.step()
    assert raw.get_and_clear_received_messages() == [b"hello"]
    env.close()
    assert env.player_process.returncode == 0
    recs = records(record)
    start = recs[0]
    assert start["event"] == "start" and start["port"] == env._port
    assert start["log_file"] == str(tmp_path / "Player-2.log")
    assert {"-nographics", "-batchmode", "-screen-fullscreen"} <= set(start["unity_flags"])
    assert "--unknown-flag" in start["ignored_args"]
    assert [r["command"] for r in recs if r["event"] == "input"] == ["RESET", "STEP"]
    step = [r for r in recs if r["event"] == "input"][1]
    assert step["actions"][B] == {"agents": 2, "continuous": [[0.25], [0.25]], "discrete": [[1], [0]]}
    assert recs[-1]["event"] == "exit" and recs[-1]["reason"] == "status_400"
    assert "connected" in (tmp_path / "Player-2.log").read_text()


@pytest.mark.timeout(60)
def test_cli_flags_and_env_var_config(make_fake_env, tmp_path, monkeypatch):
    cfg_path = tmp_path / "from_env.json"
    cfg_path.write_text(json.dumps({"behaviors": [{"name": "EnvVar?team=0", "agents": 5}]}))
    monkeypatch.setenv(CONFIG_ENV_VAR, str(cfg_path))
    args = ["--agents", "3", "--discrete", "2,2", "--continuous", "1", "--episode-length", "2",
            "--interrupt", "--obs-shape", "5", "--obs-shape", "2,3", "--action-mask", "1", "--action-mask", ""]
    env = make_fake_env(None, additional_args=args)
    spec = env.behavior_specs["EnvVar?team=0"]
    assert spec.action_spec.continuous_size == 1 and spec.action_spec.discrete_branches == (2, 2)
    assert [o.shape for o in spec.observation_specs] == [(5,), (2, 3)]
    env.reset()
    assert env.get_steps("EnvVar?team=0")[0].action_mask[0].tolist() == [[False, True]] * 3
    env.step()
    env.step()
    _, term = env.get_steps("EnvVar?team=0")
    assert list(term.agent_id) == [0, 1, 2] and term.interrupted.all()


def test_parse_args_rejects_bad_config_and_keeps_negative_values():
    cfg, facts = parse_args(["--wrong-reward", "-0.5", "-logFile", "/x/y.log", "-batchmode", "--mlagents-port", "7"])
    assert cfg.behaviors[0].wrong_reward == -0.5
    assert facts["port"] == 7 and facts["log_file"] == "/x/y.log" and facts["unity_flags"] == ["-batchmode"]
    with pytest.raises(ValueError):
        parse_args(["--crash-mode", "exit", "--agents", "0"])
    assert main(["--agents", "0"]) == 2  # bad configuration
    assert main(["--crash-on-start", "--crash-exit-code", "4"]) == 4


@pytest.mark.timeout(60)
def test_decision_period(make_fake_env):
    env = make_fake_env({"behaviors": [{"agents": 2, "decision_period": 2, "episode_length": 0}]})
    env.reset()
    ids = []
    for _ in range(4):
        env.step()
        ids.append(list(env.get_steps(B)[0].agent_id))
    assert ids == [[1], [0], [1], [0]]


@pytest.mark.timeout(90)
def test_small_task_is_learnable(make_fake_env):
    """A tabular learner that reads the target from the observation reaches reward ~1."""
    stats = StatsSideChannel()
    env = make_fake_env({"behaviors": [{"agents": 4, "discrete": [3], "episode_length": 25}]},
                        side_channels=[stats], seed=1)
    rng = random.Random(0)
    q = np.zeros((3, 3))
    env.reset()
    last = {}  # agent id -> (state, action)
    for t in range(200):
        dec, term = env.get_steps(B)
        for steps in (term, dec):
            for i, aid in enumerate(steps.agent_id):
                if aid in last:
                    s, a = last.pop(aid)
                    q[s, a] += 0.5 * (steps.reward[i] - q[s, a])
        states = targets(dec, 3)
        eps = max(0.0, 1.0 - t / 100)
        acts = [rng.randrange(3) if rng.random() < eps else int(np.argmax(q[s])) for s in states]
        last = {aid: (s, a) for aid, s, a in zip(dec.agent_id, states, acts, strict=True)}
        env.set_actions(B, ActionTuple(discrete=np.array(acts, np.int32).reshape(-1, 1)))
        env.step()
    rewards = stats_dict(stats)["Fake/Reward"]
    assert np.mean(rewards[:20]) < 0.6  # mostly random at first
    assert np.mean(rewards[-50:]) == 1.0  # greedy policy always right at the end


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,code", [("exit", 7), ("raise", 1), ("kill", -9)])
def test_crash_after_n_steps_surfaces_as_unity_error(make_fake_env, mode, code):
    env = make_fake_env({"crash_after_steps": 2, "crash_mode": mode, "crash_exit_code": 7}, timeout_wait=10)
    env.reset()
    env.step()
    env.step()
    with pytest.raises(UnityEnvironmentException, match="return code"):
        env.step()
    assert env.player_process.returncode == code
    env.close()


@pytest.mark.timeout(60)
def test_step_latency_and_its_env_parameter(make_fake_env):
    params = EnvironmentParametersChannel()
    # timeout_wait is also the player's start-up deadline: 1 s failed on a loaded machine
    env = make_fake_env({"step_latency": 0.01, "latency_jitter": 0.01}, side_channels=[params], timeout_wait=5)
    env.reset()
    env.step()
    params.set_float_parameter("step_latency", 30.0)  # far beyond timeout_wait
    with pytest.raises(UnityTimeOutException):
        env.step()
    env.close()  # kills the sleeping player after timeout_wait


@pytest.mark.timeout(60)
def test_hang_surfaces_as_timeout_and_close_kills(make_fake_env):
    env = make_fake_env({"crash_after_steps": 1, "crash_mode": "hang"}, timeout_wait=2)
    env.reset()
    env.step()
    with pytest.raises(UnityTimeOutException):
        env.step()
    proc = env.player_process
    assert proc.poll() is None  # still hanging
    env.close()  # waits timeout_wait, then kills (without reaping)
    assert proc.wait(10) == -9


@pytest.mark.timeout(60)
def test_crash_on_start(fake_player):
    from mlagents_envs.environment import UnityEnvironment

    path = fake_player({"crash_on_start": True, "crash_exit_code": 3})
    with pytest.raises(UnityException, match="return code 3"):
        UnityEnvironment(path, base_port=free_base_port(), timeout_wait=10)


@pytest.mark.timeout(60)
def test_quit_command_ends_player(make_fake_env, tmp_path):
    from mlagents_envs.communicator_objects.command_pb2 import QUIT
    from mlagents_envs.communicator_objects.unity_input_pb2 import UnityInputProto

    record = tmp_path / "quit.jsonl"
    env = make_fake_env({"record": str(record)}, timeout_wait=10)
    env.reset()
    msg = UnityInputProto()
    msg.rl_input.command = QUIT
    with pytest.raises(UnityEnvironmentException, match="return code 0"):
        env._communicator.exchange(msg, env._poll_process)  # the real communicator, real gRPC
    assert records(record)[-1]["reason"] == "quit"
    env.close()


@pytest.mark.timeout(60)
def test_close_leaves_no_player_process(make_fake_env):
    envs = [make_fake_env(worker_id=w) for w in (0, 1)]  # two players side by side
    for env in envs:
        env.reset()
        env.step()
    pids = [env.player_process.pid for env in envs]
    assert all(psutil.pid_exists(p) for p in pids)
    for env in envs:
        env.close()
        assert env.player_process.returncode == 0
    assert not any(psutil.pid_exists(p) for p in pids)
    players = [c for c in psutil.Process().children(recursive=True)
               if any("fake_unity" in part for part in c.cmdline())]
    assert players == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("watchdog", [True, False])
def test_player_exits_when_python_side_dies(tmp_path, watchdog, process_gone):
    """SIGKILL the Python process that owns the server: the orphaned player must go by itself."""
    record = tmp_path / "orphan.jsonl"
    path = write_launcher(tmp_path, {"parent_watchdog": watchdog, "stats": False, "record": str(record)})
    code = textwrap.dedent(f"""
        import sys, time
        from mlagents_envs.environment import UnityEnvironment
        env = UnityEnvironment({path!r}, base_port={free_base_port()}, timeout_wait=20)
        env.reset()
        env.step()
        print("PLAYER_PID", env._process.pid, flush=True)
        time.sleep(120)
    """)
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=str(REPO_ROOT))
    try:
        lines = iter(host.stdout.readline, "")
        line = next((ln for ln in lines if ln.startswith("PLAYER_PID")), "")
        assert line, "the host process did not start the player"
        player = int(line.split()[1])
        assert psutil.pid_exists(player)
        host.kill()
        host.wait(10)
        gone = process_gone(player, 30)
        if not gone:
            os.kill(player, 9)
        assert gone, "fake player lingered after its Python side died"
        reason = records(record)[-1]["reason"]
        if watchdog:
            assert reason == "parent_died" or reason.startswith("connection_lost")
        else:  # only the failed RPC can have ended it
            assert reason.startswith("connection_lost")
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(10)
        host.stdout.close()
