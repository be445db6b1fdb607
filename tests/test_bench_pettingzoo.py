"""``envmanager bench --scenario pettingzoo``: ParallelVectorEnv against SuperSuit's vector envs
and in-process stepping. Tiny step counts, never a timing assertion: the scenarios run end to
end, every contender is measured or skipped with the reason, and the targets are evaluated."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from envmanager import cli
from envmanager.bench import SCENARIOS, Measurement, run_scenario, targets
from envmanager.bench import pettingzoo_bench as pz
from envmanager.bench.report import format_table, format_targets
from envmanager.bench.scenarios import GROUPS
from test_bench import PNG_MAGIC, check_measured, run_cli

pytest.importorskip("pettingzoo", minversion="1.24", reason="needs the pettingzoo extra")

SUPERSUIT = importlib.util.find_spec("supersuit") is not None
SUPERSUIT_MISSING = "needs SuperSuit (pip install 'supersuit==3.11.*'), the peer these scenarios compare with"


def test_the_group_and_its_scenarios():
    names = ["pettingzoo-spread", "pettingzoo-pistonball", "pettingzoo-200us"]
    assert GROUPS["pettingzoo"] == names + [f"pinned-{n}" for n in names]
    for name in GROUPS["pettingzoo"]:
        s = SCENARIOS[name]
        assert s.kind == "pettingzoo" and s.measure_limit and s.pin == name.startswith("pinned-")
    args = cli.build_parser().parse_args(["bench", "--scenario", "pettingzoo", "--targets"])
    assert args.scenario == ["pettingzoo"] and args.targets


def test_the_action_table_is_seeded_and_shaped():
    spread, piston = SCENARIOS["pettingzoo-spread"], SCENARIOS["pettingzoo-pistonball"]
    table = pz.actions_table(spread, 3, 240, seed=0)
    assert table.shape == (240 // 24 + 16, 8, 3) and table.dtype.kind == "i"
    assert table.min() >= 0 and table.max() < 5
    assert np.array_equal(table, pz.actions_table(spread, 3, 240, seed=0))
    boxes = pz.actions_table(piston, 20, 1600, seed=1)
    assert boxes.shape == (1600 // 160 + 16, 8, 20, 1) and boxes.dtype == np.float32
    assert np.abs(boxes).max() <= 1


def test_the_burning_env_is_a_parallel_env():
    from pettingzoo.test import parallel_api_test

    from envmanager.bench.pettingzoo_envs import BurnParallelEnv

    parallel_api_test(BurnParallelEnv(0.0, n_agents=3, max_cycles=20), num_cycles=50)


@pytest.mark.skipif(not SUPERSUIT, reason=SUPERSUIT_MISSING)
def test_runs_end_to_end_against_supersuit(tmp_path):
    plot = importlib.util.find_spec("matplotlib") is not None  # the bench extra: a bar panel in agent-steps/s
    stdout, data, png = run_cli(tmp_path, "--scenario", "pettingzoo-200us", "--steps", "96", "--targets", plot=plot,
                                timeout=120)
    assert png is None or png.startswith(PNG_MAGIC)
    result = check_measured(data, "pettingzoo-200us", list(pz.CONTENDERS))
    assert result["unit"] == "agent-steps" and result["num_agents"] == 4
    assert result["skipped"] == {}
    for column in ("vs ss.proc", "vs ss.concat", "vs in-process", "vs limit"):
        assert set(result["ratios"][column]) == set(pz.CONTENDERS)
    assert result["limit"]["cores"] >= 1 and result["env_step_us"][0] > 0
    assert result["auto_envs_per_worker"] >= 1
    for name in pz.CONTENDERS:
        assert sum(result["measurements"][name]["env_steps"]) >= 96
    found = [t for t in data["targets"] if t["scenario"] == "pettingzoo-200us"]
    assert found and all(t["what"] == "x supersuit num_cpus=2" and t["threshold"] == 1.5 for t in found)
    assert "== pettingzoo-200us:" in stdout and "agent-steps/s (4 agents per env" in stdout
    assert "x supersuit num_cpus=2" in stdout


@pytest.mark.skipif(not SUPERSUIT, reason=SUPERSUIT_MISSING)
@pytest.mark.skipif(not importlib.util.find_spec("mpe2"), reason="needs mpe2 (MPE)")
def test_pinned_with_a_real_env(tmp_path):
    """MPE's simple_spread, pinned; the limit on the worker cores."""
    from envmanager.bench import pinning

    if pinning.unavailable():
        pytest.skip(pinning.unavailable())
    _stdout, data, _ = run_cli(tmp_path, "--scenario", "pinned-pettingzoo-spread", "--steps", "48", "--no-warmup",
                               timeout=120)
    result = check_measured(data, "pinned-pettingzoo-spread", list(pz.CONTENDERS))
    assert result["pinned"] and result["limit"]["cores"] == data["meta"]["cores"] - 1


def test_without_supersuit_its_contenders_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "supersuit", None)  # ``import supersuit`` now fails
    pz.supersuit_unavailable.cache_clear()
    try:
        result = run_scenario(SCENARIOS["pettingzoo-200us"], [], steps=32, repeats=1, warmup=False)
    finally:
        pz.supersuit_unavailable.cache_clear()
    assert set(result.skipped) == {pz.SS_PROC, pz.SS_CONCAT}
    assert all(why.startswith("supersuit cannot be imported") for why in result.skipped.values())
    assert set(result.measurements) == set(pz.CONTENDERS) - set(result.skipped) and not result.failed
    assert "skipped supersuit-proc, supersuit-concat: supersuit cannot be imported" in format_table(result)
    assert "vs ss.proc" not in result.ratios() and targets([result]) == []  # no peer, no target


def fake(name: str, rates: dict[str, float], one_env: float, step_s: float) -> pz.PettingZooResult:
    result = pz.PettingZooResult(SCENARIOS[name], steps=100, repeats=1, num_agents=4)
    for backend, rate in rates.items():
        result.measurements[backend] = Measurement(backend, name, 8)
        result.measurements[backend].add(100, 100 / rate)
    result.single_env_rate.append(one_env)
    result.env_step_s.append(step_s)
    return result


def test_targets():
    rates = {pz.OURS_K: 300.0, pz.OURS_AUTO: 240.0, pz.OURS_DB: 280.0, pz.SS_PROC: 200.0, pz.IN_PROCESS: 100.0}
    shared = fake("pettingzoo-200us", rates, 200.0, 250e-6)
    found = {(t.what, t.backend): t for t in targets([shared])}
    assert set(found) == {("x supersuit num_cpus=2", pz.OURS_K), ("x supersuit num_cpus=2", pz.OURS_AUTO)}
    assert found["x supersuit num_cpus=2", pz.OURS_K].value == pytest.approx(1.5)
    assert found["x supersuit num_cpus=2", pz.OURS_K].met and not found["x supersuit num_cpus=2", pz.OURS_AUTO].met
    pinned = fake("pinned-pettingzoo-200us", rates, 310.0, 250e-6)
    limit = [t for t in targets([pinned]) if "limit" in t.what]
    assert [t.backend for t in limit] == [pz.OURS_K, pz.OURS_AUTO]
    assert limit[0].threshold == 0.9 and limit[0].value == pytest.approx(300 / pinned.limit)
    assert all("supersuit" not in t.what for t in targets([pinned]))  # pinned: the limit's target only
    cheap = fake("pinned-pettingzoo-spread", rates, 310.0, 150e-6)
    assert targets([cheap]) == []  # under 200 us per env step: no target
    assert "x supersuit num_cpus=2" in format_targets(targets([shared]))
