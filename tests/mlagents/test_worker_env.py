"""MLAgentsWorkerEnv in this process, on a small BaseEnv: what each answer carries."""
from __future__ import annotations

import pickle

import pytest

pytest.importorskip("mlagents_envs")

import numpy as np
from mlagents_envs.base_env import (
    ActionSpec,
    BehaviorSpec,
    DecisionSteps,
    DimensionProperty,
    ObservationSpec,
    ObservationType,
    TerminalSteps,
)

from envmanager.mlagents import MLAgentsWorkerEnv


class GrowingEnv:
    """A BaseEnv with one agent per behaviour; behaviour ``late`` appears at step 3."""

    def __init__(self) -> None:
        obs = ObservationSpec((2,), (DimensionProperty.NONE,), ObservationType.DEFAULT, "obs")
        self.spec = BehaviorSpec([obs], ActionSpec.create_continuous(1))
        self.t = 0

    @property
    def behavior_specs(self):
        names = ["first", "late"] if self.t >= 3 else ["first"]
        return dict.fromkeys(names, self.spec)

    def get_steps(self, name):
        obs = np.full((1, 2), self.t, np.float32)
        decision = DecisionSteps([obs], np.zeros(1, np.float32), np.zeros(1, np.int32), None,
                                 np.zeros(1, np.int32), np.zeros(1, np.float32))
        return decision, TerminalSteps.empty(self.spec)

    def set_actions(self, name, action):
        pass

    def reset(self):
        self.t = 0

    def step(self):
        self.t += 1

    def close(self):
        pass


def test_behavior_specs_travel_only_when_new():
    """The specs go with a reset and when a behaviour appears; a plain step answer carries none
    (they were pickled with every step)."""
    env = MLAgentsWorkerEnv(lambda worker_id, side_channels: GrowingEnv(), 0)
    try:
        _, info = env.reset()
        assert list(info["behavior_specs"]) == ["first"]
        carried = []
        for _ in range(5):
            *_, info = env.step({})
            carried.append(sorted(info.get("behavior_specs", ())))
        assert carried == [[], [], ["first", "late"], [], []]
        _, info = env.reset()  # a reset always says what there is
        assert sorted(info["behavior_specs"]) == ["first"]
        assert len(pickle.dumps(env.step({})[4])) < len(pickle.dumps(info))
    finally:
        env.close()
