"""Run ``envmanager-learn`` (ML-Agents' real trainer) on fake Unity players, and read what it left.

A :class:`TrainerRun` starts ``envmanager-learn`` in its own session (so a Ctrl-C can be sent to
its process group as a terminal sends it) — the console script as a user types it, or with
``hooked=True`` the same ``main`` under ``trainer_hook.py``, which records what ML-Agents'
``AgentProcessor`` made of the steps — notes every process of its tree while it runs, and
afterwards reads the players' record files (every input each player got), the trainer's record,
log, ``training_status.json`` and the TensorBoard events.

The players echo each agent's last action in their second observation (``echo_actions``), so
the trainer's record can tell whether each experience holds the action its player got.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from envmanager.testing.fake_unity import free_base_port, write_launcher

BEHAVIOR = "FakeBehavior"
AGENTS = 4  # per player, each deciding every step
TIME_HORIZON = 16
ANALYTICS_CHANNEL = "b664a4a9-d86f-5a5f-95cb-e8353a7e8356"  # ML-Agents' training analytics side channel
RUN_DEADLINE = 240.0  # seconds any one trainer run may take before the test gives up on it
HOOK = Path(__file__).with_name("trainer_hook.py")


def trainer_config(max_steps: int, curriculum: bool = False) -> dict[str, Any]:
    """A small PPO that learns the fake player's task (reward 1 for the right one of 3 actions)."""
    config: dict[str, Any] = {"behaviors": {BEHAVIOR: {
        "trainer_type": "ppo",
        "hyperparameters": {"batch_size": 64, "buffer_size": 256, "learning_rate": 3e-3, "beta": 5e-3,
                            "epsilon": 0.2, "lambd": 0.95, "num_epoch": 3, "learning_rate_schedule": "constant"},
        "network_settings": {"normalize": False, "hidden_units": 32, "num_layers": 1},
        "reward_signals": {"extrinsic": {"gamma": 0.9, "strength": 1.0}},
        "max_steps": max_steps, "time_horizon": TIME_HORIZON, "summary_freq": 500, "checkpoint_interval": 1000,
    }}}
    if curriculum:  # ``gravity``: 1.0, then 2.0 from 30 % of max_steps (the players just report it)
        config["environment_parameters"] = {"gravity": {"curriculum": [
            {"name": "first", "value": 1.0, "completion_criteria": {
                "measure": "progress", "behavior": BEHAVIOR, "signal_smoothing": False, "threshold": 0.3}},
            {"name": "second", "value": 2.0},
        ]}}
    return config


def learn_command() -> list[str]:
    script = Path(sys.executable).parent / "envmanager-learn"
    assert script.exists(), f"{script}: envmanager is not installed in this venv (pip install -e .)"
    return [str(script)]


@dataclass
class Player:
    """One player process, from its record file."""

    pid: int
    worker_id: int
    inputs: list[dict[str, Any]] = field(default_factory=list)
    exit: dict[str, Any] | None = None

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [i for i in self.inputs if i["command"] == "STEP"]


class TrainerRun:
    """``envmanager-learn config.yaml --env=<fake player> ...`` in ``directory``."""

    def __init__(self, directory: Path, config: dict[str, Any], run_id: str = "run", num_envs: int = 2,
                 extra_args: Sequence[str] = (), player: dict[str, Any] | None = None,
                 results_dir: Path | None = None, hooked: bool = True) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run_id, self.num_envs = run_id, num_envs
        self.record = self.directory / f"{run_id}-players.jsonl"
        self.hooked = hooked
        self.trainer_record = self.directory / f"{run_id}-trainer.json"
        self.results = Path(results_dir or self.directory / "results")
        config_path = self.directory / f"{run_id}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        behavior = {"name": f"{BEHAVIOR}?team=0", "agents": AGENTS, "discrete": [3],
                    "observation_shapes": [[3], [1]], "echo_actions": True}
        player_config = {"behaviors": [behavior],
                         "step_latency": 0.002, "record": str(self.record), **(player or {})}
        launcher = write_launcher(self.directory, player_config, f"player-{run_id}")
        self.base_port = free_base_port(num_envs)
        self.args = [str(config_path), f"--env={launcher}", f"--num-envs={num_envs}", f"--run-id={run_id}",
                     f"--results-dir={self.results}", f"--base-port={self.base_port}", "--seed=1", *extra_args]
        self.log = self.directory / f"{run_id}.log"
        self.proc: subprocess.Popen | None = None
        self.seen: set[tuple[int, float]] = set()  # (pid, create time) of every process of the tree
        self.shm_before = set(os.listdir("/dev/shm"))
        self.returncode: int | None = None

    # -- running ----------------------------------------------------------------------------
    def start(self) -> TrainerRun:
        # SIGINT at its default, whatever this process inherited (a background job ignores it):
        # the trainer must get Python's KeyboardInterrupt, as at a terminal.
        shim = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
        command = [sys.executable, str(HOOK)] if self.hooked else learn_command()
        env = {**os.environ, "ENVMANAGER_TRAINER_RECORD": str(self.trainer_record)}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", shim, *command, *self.args],
                                         cwd=self.directory, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        return self

    def watch(self, until: Callable[[TrainerRun], bool], timeout: float = RUN_DEADLINE) -> bool:
        """Note the tree's processes every 0.1 s until ``until(self)`` or the trainer exits."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._note_tree()
            if self.proc.poll() is not None:
                return False
            if until(self):
                return True
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"trainer run {self.run_id} did not get there in {timeout:.0f} s; log:\n{self.log_text()[-3000:]}")

    def wait(self, timeout: float = RUN_DEADLINE) -> int:
        self.watch(lambda run: False, timeout)
        assert self.proc is not None
        self.returncode = self.proc.wait(10)
        return self.returncode

    def interrupt(self) -> None:
        """Ctrl-C at the terminal: SIGINT to the trainer's foreground process group."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid, _ in self.seen:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass

    def _note_tree(self) -> None:
        assert self.proc is not None
        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return
        for p in tree:
            try:
                self.seen.add((p.pid, p.create_time()))
            except psutil.Error:
                pass

    # -- what it left -----------------------------------------------------------------------
    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def left_running(self, timeout: float = 15.0) -> list[str]:
        """Processes of the run (trainer tree, every player) still running after ``timeout``."""
        known = set(self.seen) | {(p.pid, None) for p in self.players()}
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for pid, created in known:
                try:
                    p = psutil.Process(pid)
                    if p.status() != psutil.STATUS_ZOMBIE and (created is None or p.create_time() == created):
                        left.append(f"{pid} {' '.join(p.cmdline())[:160]}")
                except psutil.Error:
                    pass
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def new_shared_memory(self) -> list[str]:
        """Shared-memory files that appeared in /dev/shm during the run and are still there."""
        new = set(os.listdir("/dev/shm")) - self.shm_before
        return sorted(n for n in new if n.startswith(("envmgr", "psm_", "sem.mp", "wnsm_")))

    def players(self) -> list[Player]:
        players: dict[int, Player] = {}
        if not self.record.exists():
            return []
        for line in self.record.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                players[event["pid"]] = Player(event["pid"], event["port"] - self.base_port)
            elif event["event"] == "input":
                players[event["pid"]].inputs.append(event)
            elif event["event"] == "exit":
                players[event["pid"]].exit = event
        return list(players.values())

    def players_by_worker(self) -> dict[int, list[Player]]:
        out: dict[int, list[Player]] = defaultdict(list)
        for p in self.players():
            out[p.worker_id].append(p)
        return dict(out)

    def agent_steps(self) -> int:
        """Agent actions the players were sent (every agent decides every step)."""
        return sum(sum(i["actions"].get(f"{BEHAVIOR}?team=0", {}).get("agents", 0) for i in p.steps) for p in self.players())

    def trainer_view(self) -> dict[str, Any]:
        """What ML-Agents' AgentProcessor made of the steps (``trainer_hook.py``; hooked runs)."""
        return json.loads(self.trainer_record.read_text())

    def status(self) -> dict[str, Any]:
        return json.loads((self.results / self.run_id / "run_logs" / "training_status.json").read_text())[BEHAVIOR]

    def final_steps(self) -> int:
        return int(self.status()["final_checkpoint"]["steps"])

    def behavior_dir(self) -> Path:
        return self.results / self.run_id / BEHAVIOR

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        """``(step, value)`` of a TensorBoard scalar, from every events file of the run."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        out: list[tuple[int, float]] = []
        for path in sorted(self.behavior_dir().glob("events.out.tfevents.*")):
            acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
            acc.Reload()
            if tag in acc.Tags()["scalars"]:
                out += [(e.step, e.value) for e in acc.Scalars(tag)]
        return sorted(out)


def check_accounting(run: TrainerRun, dropped: int = 0, start_steps: int = 0) -> None:
    """Every action a player got is one experience of the trainer's, holding that action.

    From the trainer's record (a hooked run): every experience's action is the one its player
    echoed; per agent, exactly one experience per step result the trainer was handed, less one
    reset per player the worker had (the first, and one per restart). From the players' records:
    they got those steps, plus at most one per player (the step in flight when it stopped). The
    trainer counted (``final_checkpoint``, from ``start_steps``) at most what it recorded, less
    what restarts dropped."""
    view = run.trainer_view()
    assert view["mismatches"] == [], f"experiences holding another action than their player got: {view['mismatches']}"
    players = run.players_by_worker()
    assert sorted(int(w) for w in view["results"]) == sorted(players), (view["results"], sorted(players))
    recorded = 0
    for w, incarnations in sorted(players.items()):
        steps = sum(len(p.steps) for p in incarnations)
        assert all(s["actions"][f"{BEHAVIOR}?team=0"]["agents"] == AGENTS for p in incarnations for s in p.steps)
        results = view["results"][str(w)]
        agents = {gid: n for gid, n in view["experiences"].items() if gid.startswith(f"{w}-")}
        assert len(agents) == AGENTS, agents
        for gid, made in agents.items():
            assert made == results - len(incarnations), \
                f"agent {gid}: {made} experiences of {results} results handed over by {len(incarnations)} player(s)"
            assert 0 <= steps - made <= len(incarnations), f"agent {gid}: its players got {steps} steps, {made} recorded"
            recorded += made
    assert view["checked"] == recorded > 0
    counted = run.final_steps() - start_steps
    assert 0 < counted <= recorded - dropped, (counted, recorded, dropped)
