"""The examples run as shipped and show what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, timeout: float = 240, args: tuple[str, ...] = ()) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", name), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart():
    out = run_example("quickstart.py")
    counts = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", out.splitlines()[0])}
    assert counts[0] > counts[1] > counts[2] > counts[3]  # each env at its own pace
    assert "caught: worker 2 raised builtins.ValueError" in out


def test_mlagents_training_reward_rises():
    pytest.importorskip("mlagents_envs")
    out = run_example("mlagents_train.py")
    rewards = [float(r) for r in re.findall(r"mean reward ([0-9.]+)", out)]
    assert len(rewards) >= 2 and rewards[-1] > rewards[0] + 0.2


def test_sb3_ppo_learns_cartpole():
    pytest.importorskip("stable_baselines3")
    out = run_example("sb3_ppo_cartpole.py")
    before = float(re.search(r"before training:\s+([0-9.]+)", out).group(1))
    after = float(re.search(r"after \d+ steps .*?:\s+([0-9.]+)", out).group(1))
    assert after > before * 3


def test_sync_sampler_loop_return_rises():
    out = run_example("sync_reinforce_cartpole.py", args=("--iterations", "10"))
    returns = [float(r) for r in re.findall(r"mean return\s+([0-9.]+)", out)]
    assert len(returns) == 10
    assert max(returns[-3:]) > 2 * returns[0]
    versions = [int(v) for v in re.findall(r"policy version (\d+)", out)]
    assert versions == list(range(1, 11))  # each iteration acted with the update it was handed


def test_async_ppo_with_learner_feed_return_rises():
    pytest.importorskip("torch")
    out = run_example("async_ppo_cartpole.py", args=("--steps", "12000"))
    returns = [float(r) for r in re.findall(r"mean return\s+([0-9.]+)", out)]
    lags = [float(x) for x in re.findall(r"policy lag ([0-9.]+)", out)]
    assert len(returns) >= 10 and max(returns[-3:]) > 2 * returns[0]
    assert max(lags) <= 2  # the bounded queue keeps the lag small
    assert "final mean return" in out
