"""ML-Agents backend for envmanager (optional extra: ``pip install envmanager[mlagents]``).

:class:`MLAgentsEnvManager` runs ``mlagents_envs`` environments (``UnityEnvironment`` or any
``BaseEnv``) in envmanager worker processes behind ML-Agents' trainer ``EnvManager`` contract
(an example: docs/guide/mlagents.md, "The trainer's contract").

Names are imported lazily, so ``import envmanager.mlagents`` stays light (and the fake player,
``envmanager.testing.fake_unity``, does not pull in the core). Taking one without
``mlagents_envs`` installed raises an ``ImportError`` naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from envmanager.extras import check_extra

_EXPORTS = {
    "MLAgentsEnvManager": "envmanager.mlagents.env_manager",
    "EnvironmentStep": "envmanager.mlagents.steps",
    "ActionInfo": "envmanager.mlagents.steps",
    "MLAgentsWorkerEnv": "envmanager.mlagents.worker_env",
    "WorkerEnvFactory": "envmanager.mlagents.worker_env",
    "UnityEnvironmentFactory": "envmanager.mlagents.worker_env",
    "UnityPortInUseError": "envmanager.mlagents.worker_env",
    "AttachedUnityFactory": "envmanager.mlagents.attach",
    "PlayerLostError": "envmanager.mlagents.attach",
    "normalize_env_parameters": "envmanager.mlagents.settings",
    "normalize_engine_config": "envmanager.mlagents.settings",
    "BatchedInferenceError": "envmanager.mlagents.batched",
    "BatchedPolicy": "envmanager.mlagents.batched",
    "RayMLAgentsEnvManager": "envmanager.mlagents.ray_env_manager",  # extra ``ray``
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    check_extra("mlagents_envs", "mlagents", f"{__name__}.{name}")  # else it fails later, in a worker
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
