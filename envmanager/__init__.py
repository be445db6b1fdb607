"""envmanager: run RL environments in worker processes, get results as soon as they are ready."""

from envmanager.errors import (
    EnvManagerError,
    InvalidInputError,
    ManagerClosedError,
    RestartLimitError,
    SpaceMismatchError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from envmanager.manager import SubprocessEnvManager
from envmanager.vector import AsyncVectorEnv
from envmanager.protocol import (
    EnvironmentCommand,
    EnvironmentRequest,
    EnvironmentResponse,
    StepInfo,
    StepResult,
    StepTimings,
)

__version__ = "0.1.0"

__all__ = [
    "SubprocessEnvManager",
    "AsyncVectorEnv",
    "StepInfo",
    "StepResult",
    "StepTimings",
    "EnvironmentCommand",
    "EnvironmentRequest",
    "EnvironmentResponse",
    "EnvManagerError",
    "WorkerError",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "RestartLimitError",
    "InvalidInputError",
    "ManagerClosedError",
    "SpaceMismatchError",
]
