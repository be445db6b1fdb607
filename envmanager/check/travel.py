"""Why an object cannot be pickled: the chain of what holds what, down to the part that fails.

envmanager sends the factory to every worker with cloudpickle (under ``fork`` too), and infos
and exceptions come back pickled. When that fails, the error names a type (``cannot pickle
'_thread.lock' object``) but not where it sits; :func:`culprit` walks closures, defaults,
globals of functions pickled by value, ``functools.partial``, bound methods, containers and
attributes, and names the path to the innermost part that still fails.
"""

from __future__ import annotations

import functools
import pickle
import sys
import types
from typing import Any

import cloudpickle

__all__ = ["pickle_error", "round_trip_error", "culprit", "describe"]

MAX_DEPTH = 12
MAX_CHILDREN = 200


def pickle_error(obj: Any) -> str | None:
    """Why ``obj`` cannot be cloudpickled, or ``None`` if it can."""
    try:
        cloudpickle.dumps(obj)
    except Exception as exc:  # pickling runs arbitrary __reduce__ code: any error
        return f"{type(exc).__name__}: {exc}"
    return None


def round_trip_error(obj: Any) -> str | None:
    """Why ``obj`` cannot be pickled and unpickled with the standard pickle (as envmanager's
    workers send exceptions and infos), or ``None``."""
    try:
        pickle.loads(pickle.dumps(obj))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def culprit(obj: Any, name: str, dumps_error: Any = None) -> tuple[list[str], Any, str] | None:
    """``(path, part, error)`` for the innermost part of ``obj`` that fails to pickle, where
    ``path`` names each step from ``name`` down; ``None`` if ``obj`` pickles."""
    check = dumps_error or pickle_error
    error = check(obj)
    if error is None:
        return None
    return _walk(obj, [name], error, check, MAX_DEPTH, set())


def describe(obj: Any, name: str, dumps_error: Any = None) -> str | None:
    """The chain from :func:`culprit` as one line: ``factory -> closure variable 'sim'
    (Simulator) -> attribute 'lock' (_thread.lock): TypeError: cannot pickle ...``."""
    found = culprit(obj, name, dumps_error)
    if found is None:
        return None
    path, part, error = found
    return f"{' -> '.join(path)} ({_type_name(part)}): {error}"


def _walk(obj: Any, path: list[str], error: str, check: Any, depth: int, seen: set[int]) -> tuple[list[str], Any, str]:
    if depth == 0 or id(obj) in seen:
        return path, obj, error
    seen.add(id(obj))
    for label, child in _children(obj):
        child_error = check(child)
        if child_error is not None:
            return _walk(child, [*path, label], child_error, check, depth - 1, seen)
    return path, obj, error


def _children(obj: Any) -> list[tuple[str, Any]]:
    """The parts ``obj`` pickles with, each with how to name it."""
    out: list[tuple[str, Any]] = []
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for var, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                out.append((f"closure variable {var!r}", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        for i, value in enumerate(obj.__defaults__ or ()):
            out.append((f"default #{i}", value))
        for key, value in (obj.__kwdefaults__ or {}).items():
            out.append((f"default {key!r}", value))
        if _by_value(obj):
            for var in sorted(_global_names(code)):
                if var in obj.__globals__:
                    out.append((f"global {var!r}", obj.__globals__[var]))
    elif isinstance(obj, functools.partial):
        out.append(("partial function", obj.func))
        out += [(f"partial argument #{i}", a) for i, a in enumerate(obj.args)]
        out += [(f"partial argument {k!r}", v) for k, v in obj.keywords.items()]
    elif isinstance(obj, types.MethodType):
        out += [("bound object", obj.__self__), ("method", obj.__func__)]
    elif isinstance(obj, dict):
        out += [(f"[{key!r}]", value) for key, value in list(obj.items())[:MAX_CHILDREN]]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        out += [(f"item {i}", value) for i, value in enumerate(list(obj)[:MAX_CHILDREN])]
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            out += [(f"attribute {key!r}", value) for key, value in list(state.items())[:MAX_CHILDREN]]
        for slot in _slots(type(obj)):
            if hasattr(obj, slot):
                out.append((f"attribute {slot!r}", getattr(obj, slot)))
    return out


def _by_value(fn: types.FunctionType) -> bool:
    """Whether cloudpickle sends ``fn`` by value (its globals go with it): defined in
    ``__main__``, or in a module that is not importable by its name."""
    module = getattr(fn, "__module__", None)
    return module in (None, "__main__") or module not in sys.modules


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return names


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
