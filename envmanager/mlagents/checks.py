"""Checks and small helpers of :class:`~envmanager.mlagents.MLAgentsEnvManager` (parent side):
actions against their ``ActionSpec``, a taken port however deep the core wrapped it, and errors
that end a run as ML-Agents' trainer knows them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError
from envmanager.mlagents.worker_env import UnityPortInUseError

__all__ = ["call_if_present", "is_empty", "check_action", "port_errors", "find_port_error", "as_unity_error"]


def call_if_present(obj: Any, name: str, *args: Any) -> None:
    method = getattr(obj, name, None)
    if callable(method):
        method(*args)


def is_empty(env_action: Any) -> bool:
    if env_action is None:
        return True
    try:
        return len(env_action) == 0
    except TypeError:
        return False


def check_action(name: str, worker_id: int, env_action: Any, n_agents: int, spec: Any) -> None:
    """Reject an action that does not fit the behaviour's ActionSpec (before anything is sent)."""
    where = f"the policy of behaviour {name!r} (worker {worker_id})"
    continuous, discrete = getattr(env_action, "continuous", None), getattr(env_action, "discrete", None)
    if continuous is None or discrete is None:
        raise InvalidInputError(f"{where} returned {env_action!r}; env_action must be an mlagents ActionTuple")
    if spec is None:
        return
    action_spec = spec.action_spec
    for kind, array, width in (("continuous", continuous, action_spec.continuous_size),
                               ("discrete", discrete, len(action_spec.discrete_branches))):
        if tuple(array.shape) != (n_agents, width):
            raise InvalidInputError(
                f"{where} returned {kind} actions of shape {tuple(array.shape)}; expected {(n_agents, width)} "
                "(one row per agent that requested a decision)"
            )
    for branch, size in enumerate(action_spec.discrete_branches):
        column = discrete[:, branch]
        if n_agents and (column.min() < 0 or column.max() >= size):
            raise InvalidInputError(f"{where} returned discrete actions outside [0, {size}) on branch {branch}")


@contextmanager
def port_errors(for_trainer: bool = False) -> Iterator[None]:
    """Surface a port clash as :class:`UnityPortInUseError`, however deep the core wrapped it; with
    ``for_trainer``, an error that ends the run is also a ``UnityEnvironmentException``."""
    try:
        yield
    except EnvManagerError as exc:
        error = find_port_error(exc) or exc
        if for_trainer and not isinstance(error, (InvalidInputError, ManagerClosedError)):
            error = as_unity_error(error)
        if error is not exc:
            raise error from exc
        raise


_UNITY_TYPES: dict[type, type] = {}


def as_unity_error(error: EnvManagerError) -> EnvManagerError:
    """``error``, made a ``UnityEnvironmentException`` too (the same object, of a subclass of
    both), so ML-Agents' ``TrainerController`` ends the run as on a player's failure: it joins
    its threads, logs "Learning was interrupted", saves the models and re-raises (exit 1)."""
    from mlagents_envs.exception import UnityEnvironmentException

    kind = type(error)
    if isinstance(error, UnityEnvironmentException):
        return error
    both = _UNITY_TYPES.get(kind)
    if both is None:
        both = _UNITY_TYPES[kind] = type(kind.__name__, (kind, UnityEnvironmentException),
                                         {"__module__": kind.__module__, "__qualname__": kind.__qualname__})
    with suppress(TypeError):  # a layout the subclass cannot share
        error.__class__ = both
    return error


def find_port_error(exc: BaseException) -> UnityPortInUseError | None:
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is s for s in seen) or len(seen) > 20:
            continue
        seen.append(e)
        if isinstance(e, UnityPortInUseError):
            return e
        todo += [getattr(e, "cause", None), getattr(e, "failure", None), e.__cause__, e.__context__]
    return None
