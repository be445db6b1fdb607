"""``envmanager-learn``: ML-Agents' own trainer (PPO) with envmanager's env manager, on fake
Unity players over real gRPC. Each run is checked for what a user would check (exit code,
checkpoints, TensorBoard, learning) and for what it did to the players and the machine (every
decision acted on, with the action recorded that its player got, settings delivered, nothing lost
or left running)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest

if os.environ.get("ENVMANAGER_REQUIRE_TRAINER") == "1":
    import mlagents.trainers.learn  # noqa: F401  (the trainer leg: an ImportError fails the run)
else:
    pytest.importorskip("mlagents.trainers.learn", reason="ML-Agents' trainer (mlagents) is not installed")

from trainer_run import AGENTS, ANALYTICS_CHANNEL, BEHAVIOR, TIME_HORIZON, TrainerRun, check_accounting, trainer_config

pytestmark = pytest.mark.timeout(600)


def check_clean_exit(run: TrainerRun) -> None:
    assert not run.left_running(), f"processes left running: {run.left_running(0)}"
    assert not run.new_shared_memory(), f"left in /dev/shm: {run.new_shared_memory()}"
    for player in run.players():
        assert player.exit is not None or player.pid in run.killed, f"player {player.pid} never exited"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One full run: 2 envs, 3000 steps, a curriculum, --time-scale; the results are reused."""
    run = TrainerRun(tmp_path_factory.mktemp("learn"), trainer_config(3000, curriculum=True), run_id="base",
                     extra_args=["--time-scale=7", "--width=96", "--height=64"])
    run.killed = set()
    try:
        run.start()
        run.wait()
    finally:
        run.kill()
    return run


def test_trains_to_the_end(trained):
    run = trained
    assert run.returncode == 0, run.log_text()[-3000:]
    log = run.log_text()
    for trouble in ("restarted", "did not close", "killed player", "Learning was interrupted"):
        assert trouble not in log, log[-3000:]
    behavior = run.behavior_dir()
    assert (run.results / run.run_id / f"{BEHAVIOR}.onnx").stat().st_size > 0
    assert sorted(behavior.glob(f"{BEHAVIOR}-*.pt")) and sorted(behavior.glob(f"{BEHAVIOR}-*.onnx"))
    assert run.final_steps() >= 3000
    # it learned: the mean episode return (50 steps, 1 per right action) rose well above chance (~17)
    rewards = [value for _, value in run.scalars("Environment/Cumulative Reward")]
    assert len(rewards) >= 4, rewards
    assert rewards[-1] > 35 and rewards[-1] > rewards[0] + 10, rewards
    check_clean_exit(run)
    check_accounting(run)  # batched inference (the default): every experience holds its player's action
    # one policy call acted for both players whenever both were ready (TensorBoard: the mean per period)
    per_call = [value for _, value in run.scalars("Env Manager/Players per Inference")]
    assert per_call and all(1.0 <= v <= 2.0 for v in per_call) and max(per_call) > 1.0, per_call
    # the workers' timers are in timers.json, as ML-Agents' own manager puts them
    timers = json.loads((run.results / run.run_id / "run_logs" / "timers.json").read_text())
    workers = find_timer(timers, "workers")
    assert workers and workers["children"]["worker_root"]["children"]["UnityEnvironment.step"]["count"] > 100
    # the workers log at ML-Agents' level, as its own workers do (mlagents_envs' INFO lines were lost)
    assert "Connected new brain" in log, log[-3000:]


def find_timer(node, name):
    for child_name, child in node.get("children", {}).items():
        found = child if child_name == name else find_timer(child, name)
        if found:
            return found
    return None


def test_settings_reach_every_player(trained):
    """Engine settings, curriculum parameters and training analytics arrive as ML-Agents' own
    manager sends them; every decision of every agent got its action."""
    run = trained
    players = run.players_by_worker()
    assert sorted(players) == [0, 1] and all(len(p) == 1 for p in players.values())  # nothing restarted
    for worker_id, (player,) in players.items():
        first = player.inputs[0]
        assert first["command"] == "RESET"
        assert first["engine"] == {"width": 96, "height": 64, "quality_level": 5, "time_scale": 7.0,
                                   "target_frame_rate": -1, "capture_frame_rate": 60}, first["engine"]
        gravity = [i["env_params"]["gravity"]["sampled"] for i in player.inputs if "gravity" in i["env_params"]]
        assert gravity[0] == 1.0 and gravity[-1] == 2.0, gravity  # the lesson changed mid-run
        assert all(s["actions"][f"{BEHAVIOR}?team=0"]["agents"] == AGENTS for s in player.steps)
        analytics = [o for i in player.inputs for o in i["other"] if o["channel"] == ANALYTICS_CHANNEL]
        # ML-Agents' worker 0 tells its player about the run (its options: large) and the behaviour;
        # the others send mlagents_envs' default announcement (versions only)
        if worker_id == 0:
            assert len(analytics) == 2 and analytics[0]["bytes"] > 500, analytics
        else:
            assert len(analytics) == 1 and analytics[0]["bytes"] < 200, analytics
    lessons = [value for _, value in run.scalars("Environment/Lesson Number/gravity")]
    assert lessons[0] == 0 and lessons[-1] == 1, lessons


def test_resume_and_initialize_from(trained, tmp_path):
    """--resume goes on from the last checkpoint; --initialize-from starts a new run from it."""
    results = tmp_path / "results"
    shutil.copytree(trained.results, results)
    resumed = TrainerRun(tmp_path, trainer_config(4000), run_id=trained.run_id, results_dir=results,
                         extra_args=["--resume"])
    resumed.killed = set()
    try:
        assert resumed.start().wait() == 0, resumed.log_text()[-3000:]
    finally:
        resumed.kill()
    assert "Resuming from" in resumed.log_text()
    steps = [step for step, _ in resumed.scalars("Environment/Cumulative Reward")]
    assert resumed.final_steps() >= 4000 and steps[-1] > 3000
    assert resumed.agent_steps() < 2000  # it did not start again from 0
    check_clean_exit(resumed)
    check_accounting(resumed, start_steps=trained.final_steps())

    warm = TrainerRun(tmp_path / "warm", trainer_config(600), run_id="warm",
                      extra_args=[f"--initialize-from={trained.run_id}"], results_dir=results)
    warm.killed = set()
    try:
        assert warm.start().wait() == 0, warm.log_text()[-3000:]
    finally:
        warm.kill()
    assert "Initializing from" in warm.log_text()
    rewards = [value for _, value in warm.scalars("Environment/Cumulative Reward")]
    assert rewards and rewards[0] > 35, rewards  # the trained policy from its first episodes
    check_clean_exit(warm)
    check_accounting(warm)


def _steps_of(run: TrainerRun, worker_id: int) -> int:
    return sum(len(p.steps) for p in run.players() if p.worker_id == worker_id)


def test_killed_player_is_restarted_alone(tmp_path):
    """A player SIGKILLed mid-run: only that one is started again (the other keeps its player and
    its episodes), the run completes, and its accounting holds (what the cut dropped is counted)."""
    # --timeout-wait 10: mlagents_envs looks at a silent player's process every timeout_wait / 10 s
    run = TrainerRun(tmp_path, trainer_config(4000), extra_args=["--time-scale=5", "--timeout-wait=10"])
    run.killed = set()
    try:
        run.start()
        assert run.watch(lambda r: _steps_of(r, 1) >= 150), run.log_text()[-3000:]
        (victim,) = run.players_by_worker()[1]
        run.killed.add(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
        assert run.wait() == 0, run.log_text()[-3000:]
    finally:
        run.kill()
    players = run.players_by_worker()
    assert len(players[0]) == 1, players[0]  # worker 0's player ran through
    old, new = players[1]
    assert old.pid == victim.pid and old.exit is None and new.exit is not None
    assert new.inputs[0]["command"] == "RESET" and new.inputs[0]["engine"]["time_scale"] == 5.0  # replayed
    assert len(new.steps) > 0  # it went on training with the others
    log = run.log_text()
    match = re.search(r"worker 1 restarted: (\d+) agents' unfinished episodes cut, (\d+) of their steps dropped", log)
    assert match, log[-3000:]
    agents, dropped = int(match.group(1)), int(match.group(2))
    assert agents == AGENTS and dropped <= AGENTS * TIME_HORIZON
    # ... and in the trainer's statistics (TensorBoard): the cut and what it dropped
    assert sum(v for _, v in run.scalars("Env Manager/Cut Agent Episodes")) == agents
    assert sum(v for _, v in run.scalars("Env Manager/Dropped Experiences")) == dropped
    assert "Traceback" in log and "SIGKILL" in log  # the failure is reported, with the worker's traceback
    assert run.final_steps() >= 4000
    assert sorted(run.behavior_dir().glob(f"{BEHAVIOR}-*.onnx"))
    check_clean_exit(run)
    check_accounting(run, dropped=dropped)


def test_ctrl_c_saves_and_exits_cleanly(tmp_path):
    """Ctrl-C (SIGINT to the trainer's process group, as a terminal sends it): ML-Agents saves a
    checkpoint of where it got to and exits 0; nothing is left running."""
    # the console script, as typed; one inference per player (the switch off)
    run = TrainerRun(tmp_path, trainer_config(1_000_000), hooked=False, extra_args=["--batched-inference=off"])
    run.killed = set()
    try:
        run.start()
        assert run.watch(lambda r: _steps_of(r, 0) >= 300), run.log_text()[-3000:]
        run.interrupt()
        assert run.wait() == 0, run.log_text()[-3000:]
    finally:
        run.kill()
    log = run.log_text()
    assert "Learning was interrupted" in log, log[-3000:]
    steps = run.final_steps()
    assert 0 < steps < 1_000_000
    assert (run.behavior_dir() / f"{BEHAVIOR}-{steps}.onnx").exists()
    assert (run.behavior_dir() / f"{BEHAVIOR}-{steps}.pt").exists()
    assert (run.results / run.run_id / f"{BEHAVIOR}.onnx").exists()
    assert all(p.exit is not None for p in run.players()), [p.pid for p in run.players() if p.exit is None]
    check_clean_exit(run)
    per_call = [value for _, value in run.scalars("Env Manager/Players per Inference")]
    assert per_call and all(v == 1.0 for v in per_call), per_call


def test_help_only_before_env_args(tmp_path, monkeypatch, capsys):
    """``-h`` after ``--env-args`` is the player's (ML-Agents passes everything after it on):
    training runs with it in ``env_args``; before ``--env-args`` it prints the help."""
    import yaml
    from mlagents.trainers import learn as mlagents_learn

    from envmanager.mlagents import learn

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(trainer_config(100)))
    runs = []
    monkeypatch.setattr(mlagents_learn, "run_cli", lambda options: runs.append(options))
    assert learn.main([str(config), "--env=player", "--env-args", "-h", "--level", "2"]) == 0
    assert "usage" not in capsys.readouterr().out
    (options,) = runs
    assert options.env_settings.env_args == ["-h", "--level", "2"]
    assert learn.main([str(config), "-h", "--env=player", "--env-args", "--level", "2"]) == 0
    assert "--ray-address" in capsys.readouterr().out and len(runs) == 1


def test_past_the_restart_limits_the_run_ends_as_on_a_unity_failure(tmp_path):
    """A player failing past the restart limits ends the run as a player's failure ends ML-Agents'
    own: the trainer joins its threads, says the learning was interrupted, saves the model and
    exits 1 with the error (RestartLimitError, naming the worker); nothing is left running."""
    run = TrainerRun(tmp_path, trainer_config(4000), player={"crash_after_steps": 30, "crash_mode": "exit"},
                     extra_args=["--timeout-wait=10", "--max-lifetime-restarts=0"])
    run.killed = set()
    try:
        run.start()
        assert run.wait() == 1, run.log_text()[-3000:]
    finally:
        run.kill()
    log = run.log_text()
    assert "Learning was interrupted" in log, log[-3000:]
    assert re.search(r"RestartLimitError: worker [01] ", log), log[-3000:]
    assert (run.results / run.run_id / f"{BEHAVIOR}.onnx").exists()
    check_clean_exit(run)


def test_a_player_failing_at_startup_ends_the_run_as_in_mlagents(tmp_path):
    """Players that fail as they start: the failure reaches the trainer at its first reset, as
    ML-Agents' own manager hands it over. The trainer says the learning was interrupted, writes
    its configuration and run logs, and exits 1 with the error; nothing is left running. Before,
    it was raised while the env manager was made, outside the trainer's own handling."""
    run = TrainerRun(tmp_path, trainer_config(300), player={"crash_on_start": True},
                     extra_args=["--timeout-wait=10", "--max-lifetime-restarts=0"])
    run.killed = set()
    try:
        run.start()
        assert run.wait() == 1, run.log_text()[-3000:]
    finally:
        run.kill()
    log = run.log_text()
    assert "Learning was interrupted" in log, log[-3000:]
    assert (run.results / run.run_id / "configuration.yaml").exists()
    assert (run.results / run.run_id / "run_logs" / "timers.json").exists()
    check_clean_exit(run)


def test_batched_inference_switch(tmp_path, monkeypatch):
    """``--batched-inference`` (auto by default, on, off) reaches the env manager ML-Agents'
    ``run_training`` builds; a bad value is refused by the parser; ML-Agents' options pass on."""
    from mlagents.trainers import learn as mlagents_learn

    from envmanager.mlagents import learn

    for argv, expected in (([], None), (["--batched-inference=on"], True), (["--batched-inference", "off"], False)):
        ours, rest, _ = learn.split_arguments(["config.yaml", "--num-envs=3", *argv])
        assert rest == ["config.yaml", "--num-envs=3"]
        factory = learn.env_manager_factory(ours.ray_address, ours.batched_inference)
        assert factory.keywords == {"batched_inference": expected}
    with pytest.raises(SystemExit):
        learn.split_arguments(["--batched-inference=sometimes"])
    built = []
    monkeypatch.setattr(mlagents_learn, "run_cli", lambda options: built.append(mlagents_learn.SubprocessEnvManager))
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(trainer_config(100)))
    assert learn.main([str(config), "--env=player", "--batched-inference=off"]) == 0
    (factory,) = built  # what run_training would have called, during the run
    assert factory.__wrapped__.keywords == {"batched_inference": False}  # (wrapped: startup errors deferred)


def test_gather_window_switch(tmp_path, monkeypatch, capsys):
    """``--gather-window-ms`` / ``--gather-share`` reach the env manager as a ``GatherWindow``
    (none by default); out of range, or with ``--ray-address``, the run is refused (exit 2)
    before ML-Agents' run starts."""
    from mlagents.trainers import learn as mlagents_learn

    from envmanager.mlagents import learn
    from envmanager.mlagents.gathering import GatherWindow

    built = []
    monkeypatch.setattr(mlagents_learn, "run_cli", lambda options: built.append(mlagents_learn.SubprocessEnvManager))
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(trainer_config(100)))
    assert learn.main([str(config), "--env=player", "--gather-window-ms=20", "--gather-share", "0.5"]) == 0
    assert built.pop().__wrapped__.keywords == {"batched_inference": None, "gather_window": GatherWindow(0.02, 0.5)}
    assert learn.main([str(config), "--env=player"]) == 0
    assert built.pop().__wrapped__.keywords == {"batched_inference": None}
    for bad in (["--gather-window-ms=20", "--gather-share=0"], ["--gather-window-ms=-5"],
                ["--gather-window-ms=20", "--ray-address=auto"]):
        assert learn.main([str(config), "--env=player", *bad]) == 2
        assert "gather" in capsys.readouterr().err
    assert not built
