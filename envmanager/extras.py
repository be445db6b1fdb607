"""Optional dependencies: an import that fails for want of an extra names the extra to install.

The backends (``envmanager.sb3``, ``envmanager.ray``, ``envmanager.mlagents``, the fake Unity
player, the benchmark's plots) import their dependencies only in their own modules, behind
extras. Without the extra, the error says what needs it and the command that installs it, not
a bare ``No module named 'stable_baselines3'``::

    with requires_extra("sb3", __name__):
        from stable_baselines3.common.vec_env.base_vec_env import VecEnv
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["install_command", "missing_extra", "requires_extra", "check_extra"]


def install_command(extra: str) -> str:
    """The command that installs an extra: ``pip install "envmanager[sb3]"``."""
    return f'pip install "envmanager[{extra}]"'


def missing_extra(error: ImportError, extra: str, needed_by: str) -> ImportError:
    """``error`` restated: what needs the extra, the import that failed, the command to install it.

    Of the same class (a ``ModuleNotFoundError`` stays one, so ``except`` clauses and
    ``pytest.importorskip`` see what they saw before) and with the same ``name``.
    """
    cls = ModuleNotFoundError if isinstance(error, ModuleNotFoundError) else ImportError
    message = f'{needed_by} needs the extra "{extra}" ({error}): {install_command(extra)}'
    return cls(message, name=error.name, path=error.path)


@contextmanager
def requires_extra(extra: str, needed_by: str) -> Iterator[None]:
    """Around the imports of an optional dependency: an ``ImportError`` there names ``extra``."""
    try:
        yield
    except ImportError as e:
        raise missing_extra(e, extra, needed_by) from e


def check_extra(module: str, extra: str, needed_by: str) -> None:
    """Raises :func:`missing_extra`'s error if ``module`` cannot be found; imports nothing
    (for lazy modules whose dependency is imported later, in a worker)."""
    if importlib.util.find_spec(module) is None:
        raise missing_extra(ModuleNotFoundError(f"No module named {module!r}", name=module), extra, needed_by)
