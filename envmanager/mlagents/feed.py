"""``TrainerFeed``: what passes between the workers and ML-Agents' trainer, for
:class:`~envmanager.mlagents.env_manager.MLAgentsEnvManager` (a mixin of it).

Outward: the newest policies the agent managers published, and their actions for every idle
worker (:mod:`envmanager.mlagents.acting`), checked before anything is sent. Inward: each
worker's result as an ``EnvironmentStep`` (its behaviour specs and player process noted), fed
to the agent managers; a restarted worker's unfinished episodes are cut and counted. Kept apart
from the manager's ``EnvManager`` interface and its workers' life cycle (``env_manager.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from envmanager.core.results import StepInfo
from envmanager.errors import InvalidInputError
from envmanager.mlagents.acting import InferenceCounts, choose_actions
from envmanager.mlagents.batched import BatchedCall
from envmanager.mlagents.checks import call_if_present
from envmanager.mlagents.player_process import PlayerProcesses
from envmanager.mlagents.steps import ActionInfo, EnvironmentStep, SentActions
from envmanager.mlagents.trainer import cut_stats, end_worker_episodes, inference_stats

#: The manager's log: its warnings keep the logger they had before this module was split off.
logger = logging.getLogger("envmanager.mlagents.env_manager")

__all__ = ["TrainerFeed"]


class TrainerFeed:
    """Actions out to the workers, steps in to ML-Agents' agent managers (see the module doc)."""

    # The manager's state this half works on (set by ``MLAgentsEnvManager.__init__``).
    policies: dict[str, Any]
    agent_managers: dict[str, Any]
    inference_counts: InferenceCounts
    cut_agent_episodes: int
    dropped_experiences: int
    _batched: dict[str, BatchedCall]
    _specs: dict[int, dict[str, Any]]
    _last: dict[int, StepInfo]
    _players: PlayerProcesses

    if TYPE_CHECKING:  # the manager's own
        @property
        def training_behaviors(self) -> dict[str, Any]: ...

        def set_policy(self, behavior_name: str, policy: Any) -> None: ...

    def _pull_policies(self) -> None:
        """Take the newest policy an agent manager published (ML-Agents' ``policy_queue``)."""
        for name, agent_manager in self.agent_managers.items():
            queue = getattr(agent_manager, "policy_queue", None)
            if queue is None:
                continue
            latest = None
            while not queue.empty():
                latest = queue.get_nowait()
            if latest is not None:
                self.set_policy(name, latest)

    def _actions_for(self, worker_ids: list[int]) -> dict[int, SentActions]:
        """``behavior_name -> ActionTuple`` for each idle worker, from its latest result the
        trainer was handed, with the ActionInfos they came from (they go with the request): one
        policy call per behaviour for all of them where it is batched, else one per worker
        (:mod:`envmanager.mlagents.acting`). Statistics of the calls go to the agent managers.

        Runs before anything is sent, so a wrong action raises InvalidInputError with no worker
        stepped.
        """
        results = {}
        for w in worker_ids:
            info = self._last.get(w)
            if info is None:
                raise InvalidInputError(f"worker {w} must be reset before it is stepped")
            results[w] = info.current_result.observation
        specs = {w: self._specs.get(w) or self.training_behaviors for w in worker_ids}
        sent, served = choose_actions(results, self.policies, self._batched, specs, self.inference_counts)
        for name, sizes in served.items():
            agent_manager = self.agent_managers.get(name)
            if agent_manager is not None:
                call_if_present(agent_manager, "record_environment_stats", inference_stats(sizes), 0)
        return sent

    def _environment_step(self, info: StepInfo) -> EnvironmentStep:
        worker_id = info.worker_id
        result_info = info.current_result.info or {}
        if "behavior_specs" in result_info:
            self._specs[worker_id] = result_info["behavior_specs"]
        if "player_process" in result_info:
            # A reset; a new player means the old one's worker was restarted (maybe unseen, in a
            # reset's drain): nobody will talk to the old one again.
            self._players.note(worker_id, result_info["player_process"])
            self._players.kill_stale()
        self._last[worker_id] = info
        sent = getattr(info.action, "infos", None) or {}  # the ActionInfos of the request it answers
        action_infos = {} if info.interrupted or info.previous_result is None else sent
        return EnvironmentStep(
            info.current_result.observation,
            worker_id,
            action_infos,
            result_info.get("environment_stats", {}),
            info.interrupted,
        )

    def _cut_episodes(self, worker_id: int) -> None:
        """Worker ``worker_id`` was restarted: its agents' unfinished episodes end here (dropped,
        as ML-Agents drops every worker's when it resets them all); the other workers' go on.
        Counted here, in the log and in each behaviour's trainer statistics."""
        agents = dropped = 0
        for agent_manager in self.agent_managers.values():
            cut, lost = end_worker_episodes(agent_manager, worker_id)
            if cut < 0:
                logger.warning("worker %d restarted: every unfinished episode dropped (end_episode)", worker_id)
                continue
            call_if_present(agent_manager, "record_environment_stats", cut_stats(cut, lost), worker_id)
            agents, dropped = agents + cut, dropped + lost
        self.cut_agent_episodes += agents
        self.dropped_experiences += dropped
        logger.warning("worker %d restarted: %d agents' unfinished episodes cut, %d of their steps dropped",
                       worker_id, agents, dropped)

    def _process_step_infos(self, step_infos: list[EnvironmentStep]) -> int:
        for step in step_infos:
            if step.interrupted and self.agent_managers:
                self._cut_episodes(step.worker_id)
            for name in step.name_behavior_ids:
                agent_manager = self.agent_managers.get(name)
                if agent_manager is None:
                    if self.agent_managers:
                        logger.warning("Agent manager was not created for behavior id %s.", name)
                    continue
                decision_steps, terminal_steps = step.current_all_step_result[name]
                agent_manager.add_experiences(
                    decision_steps,
                    terminal_steps,
                    step.worker_id,
                    step.brain_name_to_action_info.get(name, ActionInfo.empty()),
                )
                call_if_present(agent_manager, "record_environment_stats", step.environment_stats, step.worker_id)
        return len(step_infos)
