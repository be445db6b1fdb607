"""What to check: a gymnasium id (``CartPole-v1``), ``MODULE:FACTORY``, or a factory object,
turned into a picklable ``factory(worker_id) -> env``.

A factory takes no argument or one (the worker id); a class is called without arguments.
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["TargetError", "EnvFactory", "GymId", "AsEnvZero", "resolve"]


class TargetError(ValueError):
    """The target names nothing that makes an env (the CLI's usage error)."""


class EnvFactory:
    """``factory(worker_id)``, or ``factory()`` for one that takes no argument. Picklable
    whenever the user's callable is (by reference or, through cloudpickle, by value)."""

    def __init__(self, fn: Callable[..., Any], takes_id: bool, label: str) -> None:
        self.fn = fn
        self.takes_id = takes_id
        self.label = label

    def __call__(self, worker_id: int) -> Any:
        return self.fn(worker_id) if self.takes_id else self.fn()

    def __repr__(self) -> str:
        return f"EnvFactory({self.label})"


class GymId:
    """``gymnasium.make(env_id)``; ``module:Env-v0`` imports the module first (in every worker)."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id
        self.label = env_id
        self.fn = self

    def __call__(self, worker_id: int) -> Any:
        import gymnasium

        return gymnasium.make(self.env_id)

    def __repr__(self) -> str:
        return f"GymId({self.env_id!r})"


class AsEnvZero:
    """Build every slot's env as env 0, so two workers hold the same env: what differs between
    them then comes from the process, not from the worker id."""

    def __init__(self, factory: Callable[[int], Any]) -> None:
        self.factory = factory

    def __call__(self, worker_id: int) -> Any:
        return self.factory(0)


def resolve(target: str | Callable[..., Any]) -> EnvFactory | GymId:
    """The factory ``target`` names (see the module doc); ``TargetError`` if none."""
    if callable(target) and not isinstance(target, str):
        if isinstance(target, (EnvFactory, GymId)):
            return target
        return EnvFactory(target, _takes_worker_id(target), _label(target))
    if not isinstance(target, str) or not target.strip():
        raise TargetError(f"expected a gymnasium id, MODULE:FACTORY or a callable, got {target!r}")
    target = target.strip()
    if ":" in target:
        module_name, attr = target.split(":", 1)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise TargetError(f"{target}: cannot import {module_name!r}: {exc}") from exc
        except Exception as exc:  # the module itself raised (or does not compile): its traceback, as a usage error
            where = "".join(traceback.format_exception(exc)[-4:]).rstrip()
            raise TargetError(f"{target}: importing {module_name!r} raised {type(exc).__name__}: {exc}\n{where}") from exc
        obj: Any = module
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            if _registered(attr):  # gymnasium's own MODULE:ID form (importing MODULE registers ID)
                return GymId(target)
            raise TargetError(f"{target}: module {module_name!r} has no attribute {attr!r} "
                              "and no gymnasium id of that name is registered") from None
        if not callable(obj):
            raise TargetError(f"{target}: {type(obj).__name__} {obj!r:.60} is not callable")
        return EnvFactory(obj, _takes_worker_id(obj), target)
    if _registered(target):
        return GymId(target)
    import gymnasium

    try:
        gymnasium.spec(target)  # gymnasium's message says what is close
    except Exception as exc:
        raise TargetError(f"{target}: not a registered gymnasium id ({exc}); for a factory write MODULE:FACTORY") from None
    return GymId(target)


def _registered(env_id: str) -> bool:
    import gymnasium

    return env_id in gymnasium.registry


def _takes_worker_id(fn: Callable[..., Any]) -> bool:
    """Whether to call ``fn(worker_id)`` (one required argument) or ``fn()`` (none)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin with no signature: as envmanager calls factories
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in signature.parameters.values() if p.kind in positional and p.default is p.empty]
    required_kw = [p.name for p in signature.parameters.values()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > 1 or required_kw:
        raise TargetError(f"{_label(fn)} needs arguments {', '.join(required + required_kw)}; "
                          "a factory takes none or one (the worker id)")
    return len(required) == 1


def _label(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}:{name}"
