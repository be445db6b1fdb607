"""Smoke test of ``benchmarks/profile_step.py``: it profiles, prints a table of numbers, writes
JSON and leaves no process behind. Tiny step counts; no count or timing is asserted."""

from __future__ import annotations

import gc
import importlib.util
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "profile_step.py")


@pytest.fixture(scope="module", autouse=True)
def _prewarm_multiprocessing_heap():
    """gymnasium's shared memory lives in multiprocessing's process-wide heap, whose arenas (open
    fds) last as long as the process: create one up front so ``no_leaks`` does not count it."""
    block = multiprocessing.Array("b", 1 << 20, lock=False)
    del block
    gc.collect()
    yield


@pytest.fixture(scope="module")
def profile_step() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_step"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("profile_step", None)


def table_rows(text: str) -> dict[tuple[str, int], list[str]]:
    """``(config, envs_per_worker) -> cells`` of the markdown table's body."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 7 and cells[1].isdigit():
            rows[cells[0], int(cells[1])] = cells
    return rows


def test_profile_step_prints_calls_per_env_step(profile_step, tmp_path, capsys):
    """Processes, fds and shared memory left behind are caught by conftest's ``no_leaks``."""
    out_json = tmp_path / "calls.json"
    code = profile_step.main([
        "--steps", "48", "--warmup", "16", "--envs-per-worker", "1", "4", "--json", str(out_json),
        "--configs", profile_step.GYM_ASYNC, profile_step.OURS_VECTOR, profile_step.OURS_CORE,
    ])
    out = capsys.readouterr().out
    assert code == 0, out

    rows = table_rows(out)
    assert set(rows) == {("gymnasium.AsyncVectorEnv", 1), ("envmanager.AsyncVectorEnv", 1),
                         ("envmanager.AsyncVectorEnv", 4), ("SubprocessEnvManager.step", 1),
                         ("SubprocessEnvManager.step", 4)}, out
    for (config, _), (_, _, env_steps, per_step, ratio, cpu_per_step, cpu_per_answer) in rows.items():
        assert int(env_steps.replace(",", "")) >= 48
        assert float(per_step) > 0
        assert float(cpu_per_step) > 0  # the parent's CPU per env-step; per answer only where answers are counted
        assert (cpu_per_answer == "-") == (config == "gymnasium.AsyncVectorEnv"), (config, cpu_per_answer)
        if config == "gymnasium.AsyncVectorEnv":
            assert ratio == "reference"
        else:
            assert re.match(r"\d+\.\d\dx gymnasium\.AsyncVectorEnv", ratio), ratio
    assert "envs_per_worker=4:" in out and "(target <= 0.45x)" in out  # the gymnasium drop-in's

    data = json.loads(out_json.read_text())
    assert len(data["rows"]) == 5 and data["failed"] == {} and data["left_behind"] == []
    assert all(r["parent_cpu_us_per_env_step"] > 0 for r in data["rows"])
    assert {(t["config"], t["envs_per_worker"]) for t in data["targets"]} == {
        ("envmanager.AsyncVectorEnv", 1), ("envmanager.AsyncVectorEnv", 4)}  # the core has no peer API
    assert all(r["calls_per_env_step"] > 0 for r in data["rows"])


def test_targets_per_config(profile_step):
    """At 4 envs per worker the SB3 drop-in's target is 0.5x its peer's calls, the gymnasium
    drop-in's 0.45x; at 1, both 1x. The core's rows have no peer with the same API."""
    p = profile_step

    def row(config, k, ratio):
        return p.Row(config, k, 100, 100, reference=p.CONFIGS[config].reference, ratio=ratio)

    found = {(t.config, t.envs_per_worker): (t.threshold, t.met) for t in p.targets([
        row(p.OURS_SB3, 4, 0.48), row(p.OURS_VECTOR, 4, 0.48), row(p.OURS_SB3, 1, 0.99),
        row(p.OURS_VECTOR, 1, 1.01), row(p.OURS_CORE, 4, 0.3)])}
    assert found == {(p.OURS_SB3, 4): (0.5, True), (p.OURS_VECTOR, 4): (0.45, False),
                     (p.OURS_SB3, 1): (1.0, True), (p.OURS_VECTOR, 1): (1.0, False)}


def test_sb3_rows_are_skipped_with_the_reason_without_sb3(profile_step, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "stable_baselines3", None)  # ``import stable_baselines3`` now fails
    assert profile_step.main(["--steps", "8", "--warmup", "8",
                              "--configs", profile_step.SB3_SUBPROC, profile_step.OURS_SB3]) == 0
    out = capsys.readouterr().out
    assert table_rows(out) == {}
    assert "skipped sb3.SubprocVecEnv: stable_baselines3 cannot be imported" in out
    assert "skipped envmanager.sb3.SubprocVecEnv: stable_baselines3 cannot be imported" in out
