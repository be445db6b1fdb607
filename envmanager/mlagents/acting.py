"""The actions of one ``get_steps`` for every idle worker (parent side of
:class:`~envmanager.mlagents.MLAgentsEnvManager`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envmanager.errors import InvalidInputError
from envmanager.mlagents.batched import BatchedCall
from envmanager.mlagents.checks import check_action, is_empty
from envmanager.mlagents.steps import SentActions

__all__ = ["InferenceCounts", "choose_actions"]


@dataclass
class InferenceCounts:
    """Per behaviour: policy calls made and the worker requests they served."""

    calls: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, requests: int) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.requests[name] = self.requests.get(name, 0) + requests


def choose_actions(
    results: Mapping[int, Mapping[str, tuple[Any, Any]]],
    policies: Mapping[str, Any],
    batched: Mapping[str, BatchedCall],
    specs: Mapping[int, Mapping[str, Any]],
) -> tuple[dict[int, SentActions], dict[str, list[int]]]:
    """``worker_id -> SentActions`` (with the ``ActionInfo`` of the worker's own rows) for every
    worker of ``results``, and per behaviour how many workers each policy call served; checked
    before anything is sent. Behaviours in ``batched`` are asked once for all workers."""
    infos: dict[int, dict[str, Any]] = {w: {} for w in results}
    served: dict[str, list[int]] = {}
    for name in dict.fromkeys(n for result in results.values() for n in result):
        policy = policies.get(name)
        if policy is None:
            continue
        asking = {w: result[name][0] for w, result in results.items() if name in result}
        call = batched.get(name)
        if call is None:
            answers: Mapping[int, Any] = {w: policy.get_action(steps, w) for w, steps in asking.items()}
            served[name] = [1] * len(asking)
        else:
            answers = call(asking)
            served[name] = [len(asking)]
            missing = sorted(set(asking) - set(answers))
            if missing:
                raise InvalidInputError(f"the batched policy of behaviour {name!r} gave no ActionInfo for "
                                        f"worker(s) {missing}")
        for w in asking:
            infos[w][name] = answers[w]
    sent: dict[int, SentActions] = {}
    for w, result in results.items():
        env_actions: dict[str, Any] = {}
        for name, action_info in infos[w].items():
            n = len(result[name][0])
            env_action = getattr(action_info, "env_action", action_info)
            if n == 0 or (is_empty(env_action) and not len(getattr(action_info, "agent_ids", ()) or ())):
                continue
            check_action(name, w, env_action, n, specs[w].get(name))
            env_actions[name] = env_action
        sent[w] = SentActions(env_actions, infos[w])
    return sent, served
