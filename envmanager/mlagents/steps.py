"""What the ML-Agents backend hands ML-Agents' trainer, and what a step request carries.
:class:`EnvironmentStep` and :class:`ActionInfo` are ML-Agents' own shapes, NamedTuples of the same
fields (so ``mlagents.trainers`` need not be installed)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = ["ActionInfo", "EnvironmentStep", "SentActions", "AllStepResult", "EnvironmentStats"]

#: ``behavior_name -> (DecisionSteps, TerminalSteps)``
AllStepResult = dict[str, tuple[Any, Any]]
#: ``stat key -> [(value, StatsAggregationMethod), ...]``, as ``StatsSideChannel.get_and_reset_stats()``
EnvironmentStats = dict[str, list[tuple[float, Any]]]


class ActionInfo(NamedTuple):
    """ML-Agents' ``ActionInfo``: what a policy's ``get_action(decision_steps, worker_id)`` returns.

    ``env_action`` is the ``ActionTuple`` sent to the environment (one row per agent in
    ``decision_steps``), ``action`` the policy's own form of it, ``outputs`` anything the
    trainer wants back (log-probs...), ``agent_ids`` the agents the rows belong to.
    """

    action: Any
    env_action: Any
    outputs: dict[str, Any]
    agent_ids: list[int]

    @staticmethod
    def empty() -> ActionInfo:
        return ActionInfo([], [], {}, [])

    @staticmethod
    def for_steps(decision_steps: Any, env_action: Any, outputs: dict[str, Any] | None = None) -> ActionInfo:
        """An ActionInfo for ``env_action`` (an ``ActionTuple``) chosen for ``decision_steps``."""
        return ActionInfo(env_action, env_action, dict(outputs or {}), [int(a) for a in decision_steps.agent_id])


class SentActions(dict):
    """``behavior_name -> ActionTuple`` sent to one worker in one step request, with the
    ActionInfos they came from (``infos``). The core hands this very object back as the answer's
    ``StepInfo.action``, so a step's ActionInfos are the ones its env acted on. It pickles as a
    plain ``dict``: the policy's outputs (log-probs, memories...) never go to the worker."""

    __slots__ = ("infos",)

    def __init__(self, actions: dict[str, Any], infos: dict[str, ActionInfo]) -> None:
        super().__init__(actions)
        self.infos = infos

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


class EnvironmentStep(NamedTuple):
    """ML-Agents' ``EnvironmentStep``: one worker's result.

    ``brain_name_to_action_info`` holds the ActionInfos that led to this result (empty after a
    reset). ``interrupted`` (an addition) marks the fresh reset of a restarted worker: its
    episodes were cut short and no action led here.
    """

    current_all_step_result: AllStepResult
    worker_id: int
    brain_name_to_action_info: dict[str, ActionInfo]
    environment_stats: EnvironmentStats
    interrupted: bool = False

    @property
    def name_behavior_ids(self) -> Iterable[str]:
        return self.current_all_step_result.keys()

    @staticmethod
    def empty(worker_id: int) -> EnvironmentStep:
        return EnvironmentStep({}, worker_id, {}, {})
