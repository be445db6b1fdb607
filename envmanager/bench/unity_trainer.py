"""The ``unity-trainer`` scenario: ML-Agents' own trainer with its own env manager
(``mlagents-learn``) against ``envmanager-learn``, same config, same fake players.

Each run is a real ``mlagents-learn`` / ``envmanager-learn`` process (PPO, a small network) on
fake Unity players (4 agents each, a step latency of ``LATENCY`` s), with 1, 2 and 4 envs, and
with 4 envs of uneven speed (odd workers' players ``SLOW`` times slower: where returning the
ready workers first matters). Measured between the trainer's first and last summary lines (so
start-up, model export and shutdown are left out):

* steps/s: agent steps the trainer counted per second;
* CPU s per 1,000 steps: user + system time of the trainer and every process it started
  (workers, players), sampled at those lines.

Needs ``mlagents`` (the scenario is skipped with the reason where it cannot be imported).
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
from pathlib import Path
from typing import Any

from envmanager.bench.runner import Measurement, ScenarioResult, Target
from envmanager.bench.scenarios import Scenario

logger = logging.getLogger(__name__)

__all__ = ["TrainerResult", "run", "CONTENDERS"]

AGENTS, LATENCY, SLOW = 4, 2e-3, 4.0
OURS, THEIRS = "envmanager-learn", "mlagents-learn"
#: (label suffix, number of envs, uneven)
SETUPS = ((" 1 env", 1, False), (" 2 envs", 2, False), (" 4 envs", 4, False), (" 4 envs uneven", 4, True))
CONTENDERS = [f"{tool}{label}" for label, _, _ in SETUPS for tool in (THEIRS, OURS)]
RUN_DEADLINE = 600.0  # seconds one trainer run may take (then its process group is killed)
SUMMARY = re.compile(r"Step: (\d+)\. Time Elapsed")


class TrainerResult(ScenarioResult):
    """A ``ScenarioResult`` with CPU seconds per 1,000 steps and ratios against ``mlagents-learn``."""

    def __init__(self, scenario: Scenario, steps: int, repeats: int) -> None:
        super().__init__(scenario, steps, repeats)
        self.cpu: dict[str, list[float]] = {}  # contender -> CPU s per 1,000 steps, per repeat
        self.notes: list[str] = []

    def ratios(self) -> dict[str, dict[str, float]]:
        m = {k: v.median for k, v in self.measurements.items()}
        speed, cpu = {}, {}
        for label, _, _ in SETUPS:
            ours, theirs = f"{OURS}{label}", f"{THEIRS}{label}"
            if ours in m and theirs in m:
                speed[ours] = m[ours] / m[theirs]
            if self.cpu.get(ours) and self.cpu.get(theirs):
                cpu[ours] = statistics.median(self.cpu[ours]) / statistics.median(self.cpu[theirs])
        return {k: v for k, v in (("vs mlagents-learn", speed), ("CPU vs mlagents-learn", cpu)) if v}

    def targets(self) -> list[Target]:
        r = self.ratios().get("vs mlagents-learn", {})
        return [Target(self.name, "steps/s x mlagents-learn", k, v, 1.0) for k, v in r.items()]

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "cpu_seconds_per_1000_steps": self.cpu, "notes": self.notes}


def run(scenario: Scenario, steps: int, repeats: int, progress: Any = None, seed: int = 0) -> TrainerResult:
    """Measure every contender ``repeats`` times (interleaved), ``steps`` agent steps per run."""
    result = TrainerResult(scenario, steps, repeats)
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="envmanager-bench-trainer-") as tmp:
        directory = Path(tmp)
        config = _write_config(directory, steps)
        launchers = {uneven: _write_launcher(directory, uneven) for uneven in (False, True)}
        for r in range(repeats):
            for label, n_env, uneven in SETUPS:
                for tool in (THEIRS, OURS):
                    name = f"{tool}{label}"
                    if name in result.failed:
                        continue
                    try:
                        n, seconds, cpu = measure(bin_dir / tool, config, launchers[uneven], n_env, directory, seed)
                    except Exception as exc:
                        logger.warning("unity-trainer: %s failed: %r", name, exc)
                        result.failed[name] = f"{type(exc).__name__}: {exc}"
                        continue
                    result.measurements.setdefault(name, Measurement(name, scenario.name, n_env)).add(n, seconds)
                    result.cpu.setdefault(name, []).append(1000.0 * cpu / n)
                    logger.info("unity-trainer: %s repeat %d: %.0f steps/s, %.2f CPU s per 1000 steps",
                                name, r + 1, n / seconds, 1000.0 * cpu / n)
    for name in CONTENDERS:
        if result.cpu.get(name):
            result.notes.append(f"{name}: {statistics.median(result.cpu[name]):.2f} CPU s per 1,000 steps (median)")
    result.notes.append(
        f"PPO (32 units), fake players with {AGENTS} agents, {LATENCY * 1e3:g} ms per step; uneven: odd workers "
        f"{SLOW:g}x slower; measured between the trainer's first and last summary (start-up and export left out)")
    return result


def measure(tool: Path, config: Path, launcher: str, n_env: int, directory: Path, seed: int) -> tuple[int, float, float]:
    """One trainer run: ``(steps, seconds, CPU seconds)`` between its first and last summary."""
    from envmanager.testing.fake_unity import free_base_port

    base_port = free_base_port(n_env + 1)
    base_port += base_port % 2  # even: a worker's parity is its port's (uneven players)
    command = [str(tool), str(config), f"--env={launcher}", f"--num-envs={n_env}", "--run-id=bench", "--force",
               f"--results-dir={directory / 'results'}", f"--base-port={base_port}", f"--seed={seed + 1}"]
    marks: list[tuple[int, float, float]] = []
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
        assert proc.stdout is not None
        for line in proc.stdout:  # the trainer prints a summary line every summary_freq steps
            tail = [*tail, line][-20:]
            found = SUMMARY.search(line)
            if found:
                marks.append((int(found.group(1)), time.perf_counter(), tree_cpu(proc.pid)))
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
    (n0, t0, c0), (n1, t1, c1) = marks[0], marks[-1]
    return n1 - n0, t1 - t0, c1 - c0


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


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process below it (0 for those gone)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in processes:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _write_config(directory: Path, steps: int) -> Path:
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
    path = directory / "trainer.yaml"
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

