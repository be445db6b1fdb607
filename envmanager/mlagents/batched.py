"""One inference per behaviour for every idle worker (batched inference): a policy's own
``get_actions`` (:class:`BatchedPolicy`), or for ML-Agents' ``TorchPolicy`` :class:`TorchPolicyBatch`,
which reproduces ``get_action`` in the versions of :data:`SUPPORTED_MLAGENTS` only;
:func:`batched_call` decides, per policy. See docs/guide/mlagents.md, "Batched inference".
"""

from __future__ import annotations

import importlib.metadata
import itertools
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from envmanager.errors import EnvManagerError

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_MLAGENTS", "BatchedInferenceError", "BatchedPolicy", "TorchPolicyBatch", "batched_call",
           "join_decision_steps", "split_rows", "mlagents_version"]

#: ML-Agents (``mlagents``, the trainer package) versions whose ``TorchPolicy.get_action`` this
#: module's :class:`TorchPolicyBatch` reproduces (``evaluate``, ``save_memories``,
#: ``check_nan_action``, the outputs' layout). Tested with 1.1.0.
SUPPORTED_MLAGENTS = ("1.1.0",)

#: ``requests -> {worker_id: ActionInfo}``: a behaviour's batched call.
BatchedCall = Callable[[Mapping[int, Any]], Mapping[int, Any]]


class BatchedInferenceError(EnvManagerError):
    """Batched inference was required (``batched_inference=True``) for a policy that cannot
    have it: no batched call, or ML-Agents' torch policy of a version this module does not know."""


@runtime_checkable
class BatchedPolicy(Protocol):
    """A policy that acts for every ready worker of a behaviour in one call."""

    def get_actions(self, requests: Mapping[int, Any]) -> Mapping[int, Any]:
        """``{worker_id: DecisionSteps}`` -> ``{worker_id: ActionInfo}`` (one per request, its
        rows in the request's order, as ``get_action(decision_steps, worker_id)`` returns)."""
        ...


def mlagents_version() -> str | None:
    """The installed ``mlagents`` (trainer) version, ``None`` if it is not installed."""
    try:
        return importlib.metadata.version("mlagents")
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_policy_type() -> type | None:
    """ML-Agents' ``TorchPolicy`` if its module is loaded (a TorchPolicy exists only then: this
    never imports torch)."""
    module = sys.modules.get("mlagents.trainers.policy.torch_policy")
    found = getattr(module, "TorchPolicy", None)
    return found if isinstance(found, type) else None


def batched_call(policy: Any, behavior_name: str, required: bool) -> BatchedCall | None:
    """The batched call for ``policy``: its own ``get_actions``, or :class:`TorchPolicyBatch` for
    ML-Agents' ``TorchPolicy`` (not a subclass overriding ``get_action``) with a supported
    ``mlagents``; else ``None`` (one ``get_action`` per worker), or with ``required`` a
    :class:`BatchedInferenceError` saying why."""
    if isinstance(policy, BatchedPolicy):
        return policy.get_actions
    torch_policy = _torch_policy_type()
    is_torch = torch_policy is not None and isinstance(policy, torch_policy)
    why = f"{type(policy).__qualname__} has no batched call get_actions(requests)"
    if is_torch and getattr(type(policy), "get_action", None) is not getattr(torch_policy, "get_action", None):
        why = (f"{type(policy).__qualname__} overrides TorchPolicy.get_action, which one batched "
               "TorchPolicy.evaluate would bypass")
    elif is_torch:
        version = mlagents_version()
        if version in SUPPORTED_MLAGENTS:
            return TorchPolicyBatch(policy).get_actions
        why = (f"it relies on the internals of ML-Agents' TorchPolicy.get_action in mlagents "
               f"{', '.join(SUPPORTED_MLAGENTS)}, and mlagents {version} is installed")
    if required:
        raise BatchedInferenceError(
            f"batched inference for behaviour {behavior_name!r} is not available: {why} "
            "(pass batched_inference=None to fall back to one call per player, or False)"
        )
    if is_torch:
        logger.warning("batched inference off for behaviour %r: %s; one inference per player", behavior_name, why)
    return None


def join_decision_steps(parts: Sequence[Any]) -> Any:
    """One ``DecisionSteps`` holding every row of ``parts``, in order (the joined agent ids may
    repeat across parts: ids are per player). A part without action masks, beside parts with
    some, gets "nothing masked" (what a policy reads for no mask)."""
    if len(parts) == 1:
        return parts[0]
    kind = type(parts[0])
    obs = [np.concatenate([p.obs[i] for p in parts]) for i in range(len(parts[0].obs))]
    masked = [p.action_mask for p in parts if p.action_mask is not None]
    action_mask = None
    if masked:
        widths = [m.shape[1] for m in masked[0]]
        action_mask = [
            np.concatenate([p.action_mask[b] if p.action_mask is not None else np.zeros((len(p), w), dtype=bool)
                            for p in parts])
            for b, w in enumerate(widths)
        ]

    def column(name: str) -> Any:
        return np.concatenate([getattr(p, name) for p in parts])

    return kind(obs, column("reward"), column("agent_id"), action_mask, column("group_id"), column("group_reward"))


def split_rows(value: Any, bounds: Sequence[tuple[int, int]], n_rows: int) -> list[Any]:
    """``value`` (an output for ``n_rows`` rows) cut into one piece per ``(start, stop)``.

    Arrays and tensors whose first dimension is ``n_rows`` are sliced; ML-Agents' ``ActionTuple``
    and ``LogProbsTuple`` field by field; dicts, lists and tuples item by item; anything else (a
    scalar such as a learning rate) is the same object in every piece."""
    if isinstance(value, dict):
        pieces = {key: split_rows(item, bounds, n_rows) for key, item in value.items()}
        return [{key: pieces[key][i] for key in value} for i in range(len(bounds))]
    if _is_action_tuple(value):
        continuous = split_rows(value.continuous, bounds, n_rows)
        discrete = split_rows(value.discrete, bounds, n_rows)
        return [type(value)(continuous=c, discrete=d) for c, d in zip(continuous, discrete, strict=True)]
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 1 and shape[0] == n_rows and hasattr(value, "__getitem__"):
        return [value[start:stop] for start, stop in bounds]
    if isinstance(value, (list, tuple)) and len(value) == n_rows and n_rows > 0:
        return [type(value)(value[start:stop]) for start, stop in bounds]
    return [value for _ in bounds]


def _is_action_tuple(value: Any) -> bool:
    return any(c.__name__ == "_ActionTupleBase" and c.__module__.startswith("mlagents_envs")
               for c in type(value).__mro__)


class TorchPolicyBatch:
    """``get_actions`` for ML-Agents' ``TorchPolicy``: what its ``get_action(decision_steps,
    worker_id)`` does per worker (``evaluate``, ``save_memories`` keyed by global agent id,
    ``check_nan_action``), done once on the joined rows, then split into one ``ActionInfo`` per
    worker (``ActionInfo.empty()`` for one with no decision requested, as ``get_action``)."""

    def __init__(self, policy: Any) -> None:
        from mlagents.trainers.action_info import ActionInfo
        from mlagents.trainers.behavior_id_utils import get_global_agent_id

        self.policy = policy
        self._action_info = ActionInfo
        self._global_id = get_global_agent_id

    def get_actions(self, requests: Mapping[int, Any]) -> dict[int, Any]:
        out: dict[int, Any] = {w: self._action_info.empty() for w, steps in requests.items() if len(steps) == 0}
        workers = [w for w, steps in requests.items() if len(steps) > 0]
        if not workers:
            return out
        parts = [requests[w] for w in workers]
        joined = join_decision_steps(parts)
        global_ids = [self._global_id(w, int(agent_id)) for w, steps in zip(workers, parts, strict=True)
                      for agent_id in steps.agent_id]
        run_out = self.policy.evaluate(joined, global_ids)
        self.policy.save_memories(global_ids, run_out.get("memory_out"))
        self.policy.check_nan_action(run_out.get("action"))
        ends = list(itertools.accumulate(len(p) for p in parts))
        pieces = split_rows(run_out, list(zip([0, *ends[:-1]], ends, strict=True)), len(global_ids))
        for w, steps, outputs in zip(workers, parts, pieces, strict=True):
            out[w] = self._action_info(action=outputs.get("action"), env_action=outputs.get("env_action"),
                                       outputs=outputs, agent_ids=list(steps.agent_id))
        return {w: out[w] for w in requests}
