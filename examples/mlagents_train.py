"""Train a tiny policy on fake Unity players through MLAgentsEnvManager (4 workers).

Each fake player (a stand-in for a Unity build that speaks the real ML-Agents gRPC protocol)
runs 4 agents of ``FakeBehavior?team=0``: the observation shows a target as a one-hot vector,
choosing it pays 1, anything else 0. A softmax policy over a 3x3 table, trained with the
gradient-bandit rule, learns to pick the target: the mean reward climbs from ~0.33 towards 1,
and the episode returns the players report on their StatsSideChannel climb with it.

    python examples/mlagents_train.py        # needs: pip install "envmanager[mlagents]"

With a real build, replace the launcher by its path: UnityEnvironmentFactory("MyGame.x86_64").
"""

from __future__ import annotations

import tempfile

import numpy as np
from mlagents_envs.base_env import ActionTuple

from envmanager.mlagents import ActionInfo, MLAgentsEnvManager, UnityEnvironmentFactory
from envmanager.testing.fake_unity import free_base_port, write_launcher

BEHAVIOR = "FakeBehavior?team=0"
N = 3  # targets = actions


class SoftmaxPolicy:
    """ML-Agents' policy shape: ``get_action(decision_steps, worker_id) -> ActionInfo``."""

    def __init__(self, lr: float = 0.05, seed: int = 0) -> None:
        self.prefs = np.zeros((N, N))
        self.baseline, self.lr = 0.0, lr
        self.rng = np.random.default_rng(seed)
        self.pending: dict[tuple[int, int], tuple[int, int]] = {}  # (worker, agent) -> (state, action)

    def probs(self, state: int) -> np.ndarray:
        z = np.exp(self.prefs[state] - self.prefs[state].max())
        return z / z.sum()

    def get_action(self, decision_steps, worker_id: int) -> ActionInfo:
        states = np.argmax(decision_steps.obs[0], axis=1)
        actions = np.array([self.rng.choice(N, p=self.probs(s)) for s in states], np.int32)
        for agent, s, a in zip(decision_steps.agent_id, states, actions, strict=True):
            self.pending[(worker_id, int(agent))] = (int(s), int(a))
        return ActionInfo.for_steps(decision_steps, ActionTuple(discrete=actions.reshape(-1, 1)))

    def learn(self, step) -> list[float]:
        """Update from one EnvironmentStep; returns the rewards it paid for our actions."""
        if step.interrupted:  # a restarted player: its agents' pending actions are void
            self.pending = {k: v for k, v in self.pending.items() if k[0] != step.worker_id}
        decision, terminal = step.current_all_step_result[BEHAVIOR]
        paid = []
        for steps in (terminal, decision):  # an agent that just finished is in both; terminal first
            for agent, reward in zip(steps.agent_id, steps.reward, strict=True):
                if (step.worker_id, int(agent)) not in self.pending:
                    continue
                s, a = self.pending.pop((step.worker_id, int(agent)))
                grad = -self.probs(s)
                grad[a] += 1.0
                self.prefs[s] += self.lr * (reward - self.baseline) * grad
                self.baseline += 0.05 * (reward - self.baseline)
                paid.append(float(reward))
        return paid


def main(rounds: int = 10, calls_per_round: int = 50) -> None:
    config = {"behaviors": [{"name": BEHAVIOR, "agents": 4, "discrete": [N], "episode_length": 25}]}
    with tempfile.TemporaryDirectory() as tmp:
        factory = UnityEnvironmentFactory(write_launcher(tmp, config), base_port=free_base_port(4), timeout_wait=30)
        with MLAgentsEnvManager(factory, n_env=4) as manager:
            print("behaviours:", {name: spec.action_spec for name, spec in manager.training_behaviors.items()})
            policy = SoftmaxPolicy()
            manager.set_policy(BEHAVIOR, policy)
            manager.reset(config={"reward_scale": 1.0})  # environment parameters, as ML-Agents sends them
            for r in range(rounds):
                rewards, returns, workers = [], [], set()
                for _ in range(calls_per_round):
                    for step in manager.get_steps():  # whichever workers finished first
                        rewards += policy.learn(step)
                        returns += [v for v, _ in step.environment_stats.get("Fake/EpisodeReturn", [])]
                        workers.add(step.worker_id)
                episode = f"{np.mean(returns):5.1f}/25" if returns else "   -   "
                print(f"round {r}: mean reward {np.mean(rewards):.2f} over {len(rewards):4d} decisions, "
                      f"episode return {episode}, workers {sorted(workers)}")


if __name__ == "__main__":  # workers start with forkserver/spawn: keep the guard
    main()
