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


# ------------------------------------------------------------------ the README and the docs

README_QUICK_STARTS = {  # snippet section of README.md -> what it needs beyond the core
    "gymnasium": (),
    "sb3": ("stable_baselines3", "torch"),
    "mlagents": ("mlagents_envs",),
    "pettingzoo": ("stable_baselines3", "torch", "pettingzoo", "supersuit", "pygame", "pymunk"),
}


def readme_section(name: str) -> str:
    """The text between ``<!-- --8<-- [start:name] -->`` and ``[end:name]`` in README.md (the
    sections the docs site includes), without its code fence."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    found = re.search(rf"\[start:{name}\] -->\n(.*?)\n<!-- --8<-- \[end:{name}\]", text, re.S)
    assert found, f"README.md has no snippet section {name!r}"
    block = re.fullmatch(r"```python\n(.*)\n```", found.group(1), re.S)
    assert block, f"README section {name!r} is not one python block"
    return block.group(1) + "\n"


@pytest.mark.timeout(600)  # the SB3 one trains PPO for 10k steps: slow on a loaded 2-core machine
@pytest.mark.parametrize("name", sorted(README_QUICK_STARTS))
def test_readme_quick_start_runs_as_written(name, tmp_path):
    """Each quick start of the README, copied into a file and run as a script from elsewhere."""
    for module in README_QUICK_STARTS[name]:
        pytest.importorskip(module)
    script = tmp_path / f"quickstart_{name}.py"
    script.write_text(readme_section(name), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=540,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    if name in ("sb3", "pettingzoo"):
        assert "mean episode reward:" in done.stdout
    if name == "mlagents":
        assert re.search(r"worker \d rewards \[", done.stdout), done.stdout


def test_the_readme_is_a_front_page_and_its_test_command_leaves_the_slow_tests_to_ci():
    """The house rule (contributing guide): README.md is a front page of at most 250 lines (the
    guides hold the rest). Its second set-up command is the one ``.ci/run`` runs as written: the
    suite but the tests marked ``slow`` (``.ci/run`` runs those after it)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    lines = text.count("\n")
    assert lines <= 250, f"README.md is {lines} lines; the front page keeps to 250 (move the detail to docs/guide)"
    commands = re.findall(r"^```bash\n(.*?)\n```", text, re.M | re.S)
    assert len(commands) >= 2 and "-m pytest" in commands[1], commands
    assert '-m "not slow"' in commands[1], commands[1]


def documented_paths() -> dict[str, set[str]]:
    """Every dotted ``envmanager.x.y`` path, and every name a ``from envmanager... import``
    takes, in README.md and docs/ (not CHANGELOG.md: it names removed paths on purpose)."""
    files = [os.path.join(REPO, "README.md")]
    for root, _, names in os.walk(os.path.join(REPO, "docs")):
        files += [os.path.join(root, n) for n in names if n.endswith(".md")]
    paths: dict[str, set[str]] = {}
    for file in files:
        with open(file, encoding="utf-8") as f:
            text = f.read()
        where = os.path.relpath(file, REPO)
        for path in re.findall(r"(?<![\w/.-])envmanager(?:\.[A-Za-z_]\w*)+", text):
            if not path.endswith(".md"):  # a link to the API page envmanager.md
                paths.setdefault(path, set()).add(where)
        for module, names in re.findall(r"^\s*from (envmanager(?:\.\w+)*) import ([\w, ]+)", text, re.M):
            for name in names.split(","):
                paths.setdefault(f"{module}.{name.strip()}", set()).add(where)
    return paths


def test_docs_name_only_real_modules_and_names():
    """A module path or name the README or a docs page teaches exists (a stale path such as
    ``envmanager.vector`` after a move fails here). Paths behind a missing optional dependency
    are skipped."""
    import importlib

    stale = []
    for path, where in sorted(documented_paths().items()):
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError as exc:
                if exc.name and not exc.name.startswith("envmanager"):
                    break  # an optional dependency (ray, mlagents_envs, ...) is not installed
                continue
            except ImportError as exc:
                if "needs the extra" in str(exc):
                    break  # an optional dependency too old for it (pettingzoo 1.15 beside mlagents-envs 1.1.0)
                raise
            try:
                for part in parts[i:]:
                    obj = getattr(obj, part)
            except AttributeError:
                stale.append(f"{path} ({', '.join(sorted(where))})")
            break
    assert not stale, "the docs name what does not exist: " + "; ".join(stale)


def test_fake_unity_player_script_launches(tmp_path):
    """``examples/fake_unity_player.sh`` is a "build" UnityEnvironment can launch (it pointed at
    a module path that had moved, unnoticed)."""
    pytest.importorskip("mlagents_envs")
    script = tmp_path / "launch.py"
    script.write_text(
        "from mlagents_envs.environment import UnityEnvironment\n"
        "from mlagents_envs.side_channel.stats_side_channel import StatsSideChannel\n"
        "from envmanager.testing.fake_unity import free_base_port\n"
        "env = UnityEnvironment('examples/fake_unity_player.sh', base_port=free_base_port(1), timeout_wait=30,\n"
        "                       side_channels=[StatsSideChannel()], additional_args=['--agents', '4', '--discrete', '3'])\n"
        "env.reset()\n"
        "name = next(iter(env.behavior_specs))\n"
        "print(name, len(env.get_steps(name)[0]), env.behavior_specs[name].action_spec.discrete_branches)\n"
        "env.close()\n",
        encoding="utf-8",
    )
    env = {**os.environ, "FAKE_UNITY_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1:] == ["4", "(3,)"], done.stdout
