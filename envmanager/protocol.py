"""Old import path, kept working: messages are in ``envmanager.wire.messages``, results in
``envmanager.core.results``."""

from envmanager.core.results import StepInfo, StepResult, StepTimings
from envmanager.wire.messages import *  # noqa: F403
from envmanager.wire.messages import EnvironmentCommand, EnvironmentRequest, EnvironmentResponse, RemoteException

__all__ = ["EnvironmentCommand", "EnvironmentRequest", "EnvironmentResponse", "RemoteException", "StepInfo", "StepResult", "StepTimings"]
