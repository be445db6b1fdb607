"""``envmanager-learn --env-addresses``: ML-Agents' own trainer on players it did not start (fake
players the test starts first, each outliving its trainer: ``--sessions 0``), over real gRPC."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

if os.environ.get("ENVMANAGER_REQUIRE_TRAINER") == "1":
    import mlagents.trainers.learn  # noqa: F401  (the trainer leg: an ImportError fails the run)
else:
    pytest.importorskip("mlagents.trainers.learn", reason="ML-Agents' trainer (mlagents) is not installed")

from trainer_run import BEHAVIOR, TrainerRun, check_accounting, trainer_config

from envmanager.testing import fake_unity

pytestmark = pytest.mark.timeout(600)
CRASH_CODE = 7


class AttachedRun(TrainerRun):
    """A :class:`TrainerRun` whose players the test starts (ports ``base_port + worker_id``, so
    the run's records name their workers), attached with ``--env-addresses`` instead of ``--env``."""

    def __init__(self, *args, crash_after: dict[int, int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.addresses = [f"127.0.0.1:{self.base_port + w}" for w in range(self.num_envs)]
        self.args = [a for a in self.args if not a.startswith(("--env=", "--base-port="))]
        self.args.append(f"--env-addresses={','.join(self.addresses)}")
        config = self.directory / f"player-{self.run_id}.json"  # the launcher's config (write_launcher)
        self.player_procs: list[subprocess.Popen] = []
        for w in range(self.num_envs):
            crash = []
            if crash_after and w in crash_after:
                crash = ["--crash-after-steps", str(crash_after[w]), "--crash-mode", "exit",
                         "--crash-exit-code", str(CRASH_CODE)]
            self.player_procs.append(subprocess.Popen(
                [sys.executable, fake_unity.__file__, "--config", str(config), "--mlagents-port",
                 str(self.base_port + w), "--sessions", "0", "--connect-timeout", "300", *crash],
                stdin=subprocess.DEVNULL))

    def close_players(self) -> None:
        for proc in self.player_procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

    def trainer_left_running(self) -> list[str]:
        """The trainer's processes (not the players: they are not the run's) still running."""
        players = {p.pid for p in self.player_procs}
        self.seen = {(pid, created) for pid, created in self.seen if pid not in players}
        return [line for line in self.left_running() if int(line.split()[0]) not in players]


def test_trains_on_attached_players_and_leaves_them_running(tmp_path):
    run = AttachedRun(tmp_path, trainer_config(1000), extra_args=["--timeout-wait=60"])
    try:
        run.start()
        assert run.wait() == 0, run.log_text()[-3000:]
        assert [p.poll() for p in run.player_procs] == [None, None], "the run ended a player it did not start"
        log = run.log_text()
        for trouble in ("restarting worker", "restarted:", "killed player", "Learning was interrupted"):
            assert trouble not in log, log[-3000:]
        assert run.final_steps() >= 1000
        assert (run.results / run.run_id / f"{BEHAVIOR}.onnx").stat().st_size > 0
        players = run.players_by_worker()
        assert sorted(players) == [0, 1] and all(len(p) == 1 for p in players.values())
        assert [p.pid for p in (players[0][0], players[1][0])] == [p.pid for p in run.player_procs]
        assert all(p.exit is None for p in run.players())  # still serving: waiting for the next trainer
        check_accounting(run)
        assert not run.trainer_left_running(), run.trainer_left_running()
    finally:
        run.kill()
        run.close_players()


def test_a_lost_attached_player_ends_the_run_naming_its_address(tmp_path):
    run = AttachedRun(tmp_path, trainer_config(100_000), extra_args=["--timeout-wait=10"], crash_after={1: 40})
    try:
        run.start()
        assert run.wait() == 1, run.log_text()[-3000:]
        log = run.log_text()
        assert "Learning was interrupted" in log, log[-3000:]  # ML-Agents ended it as on a player's failure
        assert f"PlayerLostError: the player at {run.addresses[1]} (worker 1) is lost" in log, log[-3000:]
        assert f"the player at {run.addresses[1]} closed its connection" in log  # seen by its connection
        assert (run.results / run.run_id / f"{BEHAVIOR}.onnx").exists()  # the model was saved
        assert run.player_procs[1].wait(10) == CRASH_CODE  # it ended by itself, not killed
        assert run.player_procs[0].poll() is None  # the other one was left alone
        assert "restarting worker" not in log and "worker 1 restarted" not in log
        assert not run.trainer_left_running(), run.trainer_left_running()
    finally:
        run.kill()
        run.close_players()


def test_bad_env_addresses_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    import yaml
    from mlagents.trainers import learn as mlagents_learn

    from envmanager.mlagents import learn
    from envmanager.testing.fake_unity import free_base_port

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(trainer_config(100)))
    runs = []
    options = []
    monkeypatch.setattr(mlagents_learn, "run_cli", lambda o: (runs.append(mlagents_learn.SubprocessEnvManager),
                                                             options.append(o)))
    base = free_base_port(2)
    two = f"--env-addresses=127.0.0.1:{base},127.0.0.1:{base + 1}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        for argv, why in [
            (["--env-addresses=localhost", "--num-envs=1"], "is not 'host:port'"),
            ([two, "--num-envs", "3"], "names 2 player(s) and --num-envs is 3: give --num-envs=2"),
            ([two, "--num-envs=2", "--env=player"], "--env launches players"),
            ([two, "--num-envs=2", "--ray-address=auto"], "not a Ray cluster"),
            ([two, "--num-envs=2"],
             f"cannot listen for the player at 127.0.0.1:{base + 1} (worker 1): port {base + 1} is in use"),
        ]:
            assert learn.main([str(config), *argv]) == 2, argv
            err = capsys.readouterr().err
            assert why in err, (argv, err)
    assert runs == []  # ML-Agents' run never started
    assert learn.main([str(config), two, "--env-args", "--num-envs=5"]) == 0  # the count from the addresses
    assert "--env-args ignored" in capsys.readouterr().err
    (factory,) = runs  # what run_training would have called (wrapped: startup errors deferred)
    factory = factory.__wrapped__
    assert factory.func is learn.attached_env_manager
    assert factory.args == (f"127.0.0.1:{base},127.0.0.1:{base + 1}",)
    assert factory.keywords == {"batched_inference": None}
    assert (options[0].env_settings.num_envs, options[0].env_settings.env_args) == (2, ["--num-envs=5"])
