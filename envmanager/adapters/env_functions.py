"""Small functions run on an env inside its worker, through ``SubprocessEnvManager.call_on``.

They live apart from the adapters so a worker that unpickles one imports only gymnasium, not
the adapter's framework (Stable-Baselines3 and torch, say).
"""

from __future__ import annotations

from typing import Any

import gymnasium


def is_wrapped(env: Any, wrapper_class: type) -> bool:
    """Whether ``wrapper_class`` wraps ``env`` anywhere (SB3's ``env_util.is_wrapped``)."""
    while isinstance(env, gymnasium.Wrapper):
        if isinstance(env, wrapper_class):
            return True
        env = env.env
    return False


def has_attr(env: Any, name: str) -> bool:
    """Whether ``env`` or one of its wrapped envs has ``name``."""
    try:
        env.get_wrapper_attr(name)
    except AttributeError:
        return False
    return True


def set_outer_attr(env: Any, name: str, value: Any) -> None:
    """``setattr`` on the outermost env object, not through wrappers (as SB3 does)."""
    setattr(env, name, value)
