"""The ``unity-trainer`` scenarios: ML-Agents' own trainer with its own env manager
(``mlagents-learn``) against ``envmanager-learn``, same config, same fake players.

Each run is a real ``mlagents-learn`` / ``envmanager-learn`` process (PPO, a small network) on
fake Unity players (4 agents each, cheap: they sleep ``LATENCY`` s per step). Setups: 1, 2 and 4
envs; 4, 8 and 16 envs of uneven speed (odd workers' players ``SLOW`` times slower: where
returning the ready workers first matters). ``envmanager-learn`` runs with batched inference
(``--batched-inference=on``: one policy call per behaviour for every ready player) and, with 4
envs or more, also without (``envmanager-learn unbatched``: ``=off``, one call per player, as
``mlagents-learn``). ``unity-trainer-scale`` runs only the setups of issue 32's targets (4, 8 and
16 envs). Each setup runs ``steps x max(1, envs / 4)`` agent steps (more players, more steps per
second). Measured between the trainer's first and last summary lines (so start-up, model export
and shutdown are left out):

* steps/s: agent steps the trainer counted per second;
* trainer CPU s per 1,000 steps: user + system time of the trainer's own process (its pid only:
  not its workers or players), sampled at those lines; the table's ``cpu/step`` column is the
  same in microseconds per step. The CPU of the whole tree (trainer, workers, players) is in the
  notes and the JSON.

Contenders run one after another within a setup, in reverse order on odd repeats (so a drift in
the machine's load does not favour one). Needs ``mlagents`` (the scenarios are skipped with the
reason where it cannot be imported).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from envmanager.bench.runner import Measurement, ScenarioResult, Target
from envmanager.bench.scenarios import Scenario

logger = logging.getLogger(__name__)

__all__ = ["TrainerResult", "TrainerRun", "Setup", "Contender", "run", "measure", "measure_run", "setups_for",
           "contenders_for", "CONTENDERS"]

AGENTS, LATENCY, SLOW = 4, 2e-3, 4.0
OURS, THEIRS = "envmanager-learn", "mlagents-learn"
UNBATCHED = f"{OURS} unbatched"
RUN_DEADLINE = 600.0  # seconds one trainer run may take (then its process group is killed)
SUMMARY = re.compile(r"Step: (\d+)\. Time Elapsed")
#: Issue 32's targets: with this many cheap players, at least SPEED x mlagents-learn's steps/s and
#: at most 1 / CPU_SAVING x its trainer CPU per step; with BATCH_ENVS players, batched no slower.
TARGET_ENVS, SPEED, CPU_SAVING, BATCH_ENVS = 16, 2.0, 2.0, 4


@dataclass(frozen=True)
class Setup:
    """``n_env`` players; ``uneven``: odd workers' players ``SLOW`` times slower."""

    n_env: int
    uneven: bool = False

    @property
    def label(self) -> str:
        return f" {self.n_env} env{'s' * (self.n_env > 1)}" + (" uneven" if self.uneven else "")

    def steps(self, steps: int) -> int:
        """Agent steps of one run: more players step faster, so they run longer."""
        return steps * max(1, self.n_env // 4)


class Contender(NamedTuple):
    """A row of the table: ``tool`` on ``setup``; ``batched``: envmanager-learn's
    ``--batched-inference`` (``None`` for mlagents-learn)."""

    name: str
    tool: str
    setup: Setup
    batched: str | None


class TrainerRun(NamedTuple):
    """One trainer run, between its first and last summary."""

    steps: int
    seconds: float
    cpu: float  # the trainer process's own CPU seconds
    tree_cpu: float  # the trainer's and every process below it


#: The setups of each scenario, by name.
SETUPS: dict[str, tuple[Setup, ...]] = {
    "unity-trainer": (Setup(1), Setup(2), Setup(4), Setup(4, True), Setup(8, True), Setup(16, True)),
    "unity-trainer-scale": (Setup(4), Setup(8, True), Setup(16, True)),
}


def setups_for(scenario: Scenario) -> tuple[Setup, ...]:
    return SETUPS.get(scenario.name.split("@")[0], SETUPS["unity-trainer"])


def contenders_for(setups: tuple[Setup, ...]) -> list[Contender]:
    """mlagents-learn and envmanager-learn (batched) on every setup; unbatched too from 4 envs."""
    out = []
    for s in setups:
        out += [Contender(f"{THEIRS}{s.label}", THEIRS, s, None), Contender(f"{OURS}{s.label}", OURS, s, "on")]
        if s.n_env >= 4:
            out.append(Contender(f"{UNBATCHED}{s.label}", OURS, s, "off"))
    return out


CONTENDERS = [c.name for c in contenders_for(SETUPS["unity-trainer"])]


class TrainerResult(ScenarioResult):
    """A ``ScenarioResult`` with the trainer's CPU seconds per 1,000 steps and ratios against
    ``mlagents-learn`` (and batched against unbatched)."""

    def __init__(self, scenario: Scenario, steps: int, repeats: int) -> None:
        super().__init__(scenario, steps, repeats)
        self.cpu: dict[str, list[float]] = {}  # contender -> the trainer's CPU s per 1,000 steps, per repeat
        self.tree_cpu: dict[str, list[float]] = {}  # contender -> the whole tree's, per repeat
        self.notes: list[str] = []

    def ratios(self) -> dict[str, dict[str, float]]:
        m = {k: v.median for k, v in self.measurements.items()}
        cpu = {k: statistics.median(v) for k, v in self.cpu.items() if v}
        speed: dict[str, float] = {}
        saving: dict[str, float] = {}
        batched: dict[str, float] = {}
        for s in setups_for(self.scenario):
            theirs, ours, unbatched = (f"{t}{s.label}" for t in (THEIRS, OURS, UNBATCHED))
            for name in (ours, unbatched):
                if name in m and theirs in m:
                    speed[name] = m[name] / m[theirs]
                if name in cpu and theirs in cpu and cpu[name] > 0:
                    saving[name] = cpu[theirs] / cpu[name]
            if ours in m and unbatched in m:
                batched[ours] = m[ours] / m[unbatched]
        columns = (("vs mlagents-learn", speed), ("CPU saved x", saving), ("vs unbatched", batched))
        return {k: v for k, v in columns if v}

    def targets(self) -> list[Target]:
        r = self.ratios()
        speed, saving, batched = (r.get(k, {}) for k in ("vs mlagents-learn", "CPU saved x", "vs unbatched"))
        out = [Target(self.name, "steps/s x mlagents-learn", k, v, 1.0) for k, v in speed.items() if k.startswith(OURS + " ")
               and not k.startswith(UNBATCHED)]
        for s in setups_for(self.scenario):
            ours = f"{OURS}{s.label}"
            if s.n_env == TARGET_ENVS and ours in speed:
                out.append(Target(self.name, f"{TARGET_ENVS} players: steps/s x mlagents", ours, speed[ours],
                                  SPEED))
            if s.n_env == TARGET_ENVS and ours in saving:
                out.append(Target(self.name, f"{TARGET_ENVS} players: trainer CPU saved x",
                                  ours, saving[ours], CPU_SAVING))
            if s.n_env == BATCH_ENVS and not s.uneven and ours in batched:
                out.append(Target(self.name, f"{BATCH_ENVS} players: steps/s x unbatched", ours, batched[ours], 1.0))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "cpu_seconds_per_1000_steps": self.cpu,
                "tree_cpu_seconds_per_1000_steps": self.tree_cpu, "notes": self.notes}


def run(scenario: Scenario, steps: int, repeats: int, progress: Any = None, seed: int = 0) -> TrainerResult:
    """Measure every contender ``repeats`` times (interleaved), ``Setup.steps(steps)`` agent steps per run."""
    result = TrainerResult(scenario, steps, repeats)
    bin_dir = Path(sys.executable).parent
    setups = setups_for(scenario)
    contenders = contenders_for(setups)
    with tempfile.TemporaryDirectory(prefix="envmanager-bench-trainer-") as tmp:
        directory = Path(tmp)
        configs = {s: _write_config(directory, s.steps(steps)) for s in setups}
        launchers = {uneven: _write_launcher(directory, uneven) for uneven in (False, True)}
        for r in range(repeats):
            for s in setups:
                here = [c for c in contenders if c.setup == s]
                for c in here if r % 2 == 0 else here[::-1]:
                    if c.name in result.failed:
                        continue
                    extra = [f"--batched-inference={c.batched}"] if c.batched else []
                    try:
                        done = measure_run(bin_dir / c.tool, configs[s], launchers[s.uneven], s.n_env, directory, seed,
                                           extra)
                    except Exception as exc:
                        logger.warning("unity-trainer: %s failed: %r", c.name, exc)
                        result.failed[c.name] = f"{type(exc).__name__}: {exc}"
                        continue
                    m = result.measurements.setdefault(c.name, Measurement(c.name, scenario.name, s.n_env))
                    m.add(done.steps, done.seconds)
                    m.parent_cpu_s.append(done.cpu)  # the table's cpu/step: the trainer's
                    result.cpu.setdefault(c.name, []).append(1000.0 * done.cpu / done.steps)
                    result.tree_cpu.setdefault(c.name, []).append(1000.0 * done.tree_cpu / done.steps)
                    logger.info("unity-trainer: %s repeat %d: %.0f steps/s, trainer %.2f (tree %.2f) CPU s per 1000 "
                                "steps", c.name, r + 1, done.steps / done.seconds, 1000.0 * done.cpu / done.steps,
                                1000.0 * done.tree_cpu / done.steps)
    for c in contenders:
        if result.cpu.get(c.name):
            result.notes.append(f"{c.name}: {statistics.median(result.cpu[c.name]):.2f} trainer CPU s per 1,000 steps, "
                                f"{statistics.median(result.tree_cpu[c.name]):.2f} with its workers and players (medians)")
    result.notes.append(
        f"PPO (32 units), fake players with {AGENTS} agents, {LATENCY * 1e3:g} ms per step; uneven: odd workers "
        f"{SLOW:g}x slower; {steps:,} agent steps per run x max(1, envs / 4); envmanager-learn: --batched-inference=on, "
        "unbatched: =off; measured between the trainer's first and last summary (start-up and export left out); "
        "CPU saved x: mlagents-learn's trainer-process CPU per step / the contender's")
    return result


def measure(tool: Path, config: Path, launcher: str, n_env: int, directory: Path, seed: int) -> tuple[int, float, float]:
    """One trainer run: ``(steps, seconds, the trainer's CPU seconds)`` between its first and last summary."""
    done = measure_run(tool, config, launcher, n_env, directory, seed)
    return done.steps, done.seconds, done.cpu


def measure_run(tool: Path, config: Path, launcher: str, n_env: int, directory: Path, seed: int,
                extra: list[str] | None = None) -> TrainerRun:
    """One trainer run (``extra``: more arguments for it), measured between its first and last summary."""

    from envmanager.testing.fake_unity import free_base_port

    base_port = free_base_port(n_env + 1)
    base_port += base_port % 2  # even: a worker's parity is its port's (uneven players)
    command = [str(tool), str(config), f"--env={launcher}", f"--num-envs={n_env}", "--run-id=bench", "--force",
               f"--results-dir={directory / 'results'}", f"--base-port={base_port}", f"--seed={seed + 1}",
               *(extra or [])]
    marks: list[tuple[int, float, float, float]] = []
    proc = subprocess.Popen(command, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    # The deadline is a timer, not a check per line: a trainer that hangs silently is stopped
    # too (killed with everything it started: its output ends, and so does the loop below).
    expired = threading.Event()
    timer = threading.Timer(RUN_DEADLINE, _kill_group, (proc, expired))
    timer.daemon = True
    timer.start()
    tail: list[str] = []
    try:
        tree = TreeCpu(proc.pid)
        assert proc.stdout is not None
        for line in proc.stdout:  # the trainer prints a summary line every summary_freq steps
            tail = [*tail, line][-20:]
            found = SUMMARY.search(line)
            if found:
                marks.append((int(found.group(1)), time.perf_counter(), *tree.sample()))
        code = proc.wait(60)
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    if expired.is_set():
        raise TimeoutError(f"{tool.name} did not finish in {RUN_DEADLINE:.0f} s: its process group was killed")
    if code != 0 or len(marks) < 2:
        raise RuntimeError(f"{tool.name} exited {code} with {len(marks)} summaries: {''.join(tail)[-1500:]}")
    (n0, t0, c0, k0), (n1, t1, c1, k1) = marks[0], marks[-1]
    return TrainerRun(n1 - n0, t1 - t0, c1 - c0, k1 - k0)


def _kill_group(proc: subprocess.Popen, expired: threading.Event | None = None) -> None:
    """SIGKILL the run: its process group (it was started in a session of its own) and every
    process below it (workers have groups of their own, and hold its output open)."""
    import psutil

    if expired is not None:
        expired.set()
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        below = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in below:
        try:
            p.kill()
        except psutil.Error:
            pass


def own_cpu(process: Any) -> float:
    """User + system CPU seconds of ``process`` (a ``psutil.Process``) alone: not its children's
    (0 once it is gone)."""
    import psutil

    try:
        t = process.cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


class TreeCpu:
    """CPU seconds of a process and every process below it, each counted as of its latest sample:
    one that exits keeps what it had used when last seen (so the total never goes down)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.root = 0.0  # the process's own, as of its latest sample
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds of those below

    def sample(self) -> tuple[float, float]:
        """The process's own CPU seconds and its tree's, read in one pass (the root's once, for
        both: read apart, a busy trainer's CPU between the two reads could make the tree's share of
        an interval smaller than its own)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            below = root.children(recursive=True)
        except psutil.Error:  # gone, or a process went while the tree was walked: as last seen
            return self.root, self.root + sum(self.seen.values())
        for p in below:
            try:
                key = (p.pid, p.create_time())
            except psutil.Error:
                continue
            used = own_cpu(p)
            if used:
                self.seen[key] = max(used, self.seen.get(key, 0.0))
        self.root = max(self.root, own_cpu(root))
        return self.root, self.root + sum(self.seen.values())


def _write_config(directory: Path, steps: int) -> Path:
    """The PPO config of a run of ``steps`` agent steps (ten summaries)."""
    import yaml

    summary = max(500, steps // 10)
    config = {"behaviors": {"FakeBehavior": {
        "trainer_type": "ppo",
        "hyperparameters": {"batch_size": 256, "buffer_size": 2048, "learning_rate": 3e-3, "num_epoch": 1,
                            "learning_rate_schedule": "constant"},
        "network_settings": {"normalize": False, "hidden_units": 32, "num_layers": 1},
        "reward_signals": {"extrinsic": {"gamma": 0.9, "strength": 1.0}},
        "max_steps": steps + summary, "time_horizon": 64, "summary_freq": summary, "checkpoint_interval": 10 * steps,
    }}}
    path = directory / f"trainer-{steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _write_launcher(directory: Path, uneven: bool) -> str:
    """A player launcher; ``uneven``: players on odd ports (odd workers) are ``SLOW`` times slower."""
    from envmanager.testing import fake_unity
    from envmanager.testing.fake_unity import write_launcher

    player = {"behaviors": [{"name": "FakeBehavior?team=0", "agents": AGENTS, "discrete": [3]}],
              "step_latency": LATENCY, "stats": False}
    plain = write_launcher(directory, player, "player")
    if not uneven:
        return plain
    script = directory / "player-uneven"
    command = " ".join(shlex.quote(c) for c in (sys.executable, os.path.abspath(fake_unity.__file__),
                                                "--config", plain + ".json"))
    script.write_text(
        f"#!/bin/sh\nlatency={LATENCY:g}\nprev=\nfor a in \"$@\"; do\n"
        f"  if [ \"$prev\" = --mlagents-port ] && [ $((a % 2)) -eq 1 ]; then latency={LATENCY * SLOW:g}; fi\n  prev=$a\ndone\n"
        f"exec {command} --step-latency $latency \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)

