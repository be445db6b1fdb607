"""The ``unity-trainer`` bench scenario's measurement, on the real trainers (short runs)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

if os.environ.get("ENVMANAGER_REQUIRE_TRAINER") != "1":
    pytest.importorskip("mlagents.trainers.learn", reason="ML-Agents' trainer (mlagents) is not installed")

from envmanager.bench import unity_trainer

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("tool", [unity_trainer.OURS, unity_trainer.THEIRS])
def test_one_measurement_per_tool(tmp_path, tool):
    """Both trainers run the same config on the same (uneven) players; steps and CPU come back."""
    config = unity_trainer._write_config(tmp_path, 1500)
    launcher = unity_trainer._write_launcher(tmp_path, uneven=True)
    steps, seconds, cpu = unity_trainer.measure(Path(sys.executable).parent / tool, config, launcher, 2, tmp_path, 0)
    assert steps >= 500 and seconds > 0 and cpu > 0
