"""Policies for the ML-Agents tests (a helper module, not collected)."""

from __future__ import annotations

import numpy as np
from mlagents_envs.base_env import ActionTuple

from envmanager.mlagents import ActionInfo


class UniquePolicy:
    """Every agent of every call gets an action no other agent or call gets (so a recorded action
    can be traced to the call that chose it, and a player echoing it to what it received)."""

    def __init__(self) -> None:
        self.calls = 0

    def get_action(self, decision_steps, worker_id):
        self.calls += 1
        n = len(decision_steps)
        values = 100_000 * worker_id + 10 * self.calls + np.arange(n, dtype=np.float32).reshape(n, 1)
        return ActionInfo.for_steps(decision_steps, ActionTuple(continuous=values.astype(np.float32)), {"call": self.calls})
