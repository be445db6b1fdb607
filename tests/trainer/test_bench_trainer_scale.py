"""The ``unity-trainer`` scenarios with 8 and 16 players and the batched switch, on the real
trainers (a short run: rows and figures come back; no timing is asserted)."""
from __future__ import annotations

import os

import pytest

if os.environ.get("ENVMANAGER_REQUIRE_TRAINER") != "1":
    pytest.importorskip("mlagents.trainers.learn", reason="ML-Agents' trainer (mlagents) is not installed")

from envmanager.bench import SCENARIOS
from envmanager.bench import unity_trainer as ut

pytestmark = pytest.mark.timeout(600)


def test_8_and_16_players_batched_and_unbatched_produce_rows(monkeypatch):
    """Every contender of the 8- and 16-player setups runs (mlagents-learn, envmanager-learn with
    --batched-inference=on and =off): a row each, with the trainer's and the tree's CPU, and the
    ratio columns and issue 32's 16-player targets."""
    scenario = SCENARIOS["unity-trainer-scale"]
    monkeypatch.setitem(ut.SETUPS, scenario.name, (ut.Setup(8, True), ut.Setup(16, True)))
    result = ut.run(scenario, 500, 1)
    names = [c.name for c in ut.contenders_for(ut.SETUPS[scenario.name])]
    assert len(names) == 6 and not result.failed, result.failed
    assert sorted(result.measurements) == sorted(names)
    for name in names:
        assert result.measurements[name].env_steps[0] >= 500
        assert result.cpu[name][0] > 0 and result.tree_cpu[name][0] >= result.cpu[name][0], \
            (name, result.cpu[name], result.tree_cpu[name])
    ratios = result.ratios()
    assert set(ratios) == {"vs mlagents-learn", "CPU saved x", "vs unbatched"}
    assert set(ratios["vs unbatched"]) == {"envmanager-learn 8 envs uneven", "envmanager-learn 16 envs uneven"}
    whats = {t.what for t in result.targets()}
    assert {"16 players: steps/s x mlagents", "16 players: trainer CPU saved x"} <= whats
