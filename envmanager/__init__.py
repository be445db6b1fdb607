"""envmanager: run RL environments in worker processes, get results as soon as they are ready.

Layers: ``core`` (the manager: StepInfo and batch levels, the worker pool), ``wire`` (messages,
step queue, shared memory), ``worker`` (the worker process), the drop-ins (``adapters``:
gymnasium's ``AsyncVectorEnv``; ``sb3``: SB3's ``SubprocVecEnv``), ``mlagents`` (ML-Agents'
trainer backend), ``sampler`` and ``ray`` (trajectories for learners), ``check``, ``testing``
(controllable envs, a fake Unity player), ``bench``.
"""

from envmanager.adapters.gymnasium import AsyncVectorEnv
from envmanager.core.manager import SubprocessEnvManager
from envmanager.core.results import StepBatch, StepInfo, StepResult, StepTimings
from envmanager.errors import (
    ConcurrentCallError,
    EnvManagerError,
    InvalidInputError,
    ManagerClosedError,
    NodeError,
    NodeRestartLimitError,
    RestartLimitError,
    SpaceMismatchError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from envmanager.wire.messages import EnvironmentCommand, EnvironmentRequest, EnvironmentResponse

__version__ = "0.2.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = [
    "SubprocessEnvManager",
    "AsyncVectorEnv",
    "StepInfo",
    "StepResult",
    "StepTimings",
    "StepBatch",
    "EnvironmentCommand",
    "EnvironmentRequest",
    "EnvironmentResponse",
    "EnvManagerError",
    "WorkerError",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "RestartLimitError",
    "NodeError",
    "NodeRestartLimitError",
    "InvalidInputError",
    "ConcurrentCallError",
    "ManagerClosedError",
    "SpaceMismatchError",
]
