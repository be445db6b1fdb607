"""What crosses the process line: commands, responses and the results handed to users.

Both halves import this module: the parent (``manager``) and the worker (``worker``).
Observations, rewards and actions travel in shared memory when their spaces allow it
(see ``transport``); the messages here then carry only small notices and infos.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

__all__ = [
    "EnvironmentCommand",
    "EnvironmentRequest",
    "EnvironmentResponse",
    "RemoteException",
    "StepResult",
    "StepTimings",
    "StepInfo",
]


class EnvironmentCommand(enum.Enum):
    """Commands of the worker protocol.

    Parent → worker: ``STEP``, ``RESET``, ``CALL``, ``GET_ATTR``, ``SET_ATTR``, ``ATTACH``
    (map the shared-memory buffers), ``CLOSE``.
    Worker → parent: every command is answered with the same command, or with ``ENV_EXITED``
    (the environment raised; the payload is a :class:`RemoteException`); ``READY`` is sent once
    the environments are built, ``CLOSED`` when the worker is done.
    """

    STEP = 1
    RESET = 2
    CALL = 3
    GET_ATTR = 4
    SET_ATTR = 5
    ATTACH = 6
    CLOSE = 7
    READY = 8
    ENV_EXITED = 9
    CLOSED = 10


class EnvironmentRequest(NamedTuple):
    """A command for one worker process. ``seq`` numbers requests so late answers are dropped."""

    cmd: EnvironmentCommand
    seq: int
    payload: Any = None


class EnvironmentResponse(NamedTuple):
    """A worker's answer. ``worker_index`` is the process index, ``seq`` the request's number.

    ``payload`` is ``ON_PIPE`` when the answer was too big for the shared step queue and waits
    on the worker's own pipe instead.
    """

    cmd: EnvironmentCommand
    worker_index: int
    seq: int
    payload: Any = None
    sent_at: float = 0.0


ON_PIPE = "__envmanager_payload_on_pipe__"

# On the wire, requests and responses travel as plain tuples with the command's number: that
# pickles several times faster than a named tuple holding an enum member.
_COMMANDS = {cmd.value: cmd for cmd in EnvironmentCommand}


def request_to_wire(request: EnvironmentRequest) -> tuple:
    return (request.cmd.value, request.seq, request.payload)


def request_from_wire(wire: tuple) -> EnvironmentRequest:
    return EnvironmentRequest(_COMMANDS[wire[0]], wire[1], wire[2])


def response_to_wire(response: EnvironmentResponse) -> tuple:
    return (response.cmd.value, response.worker_index, response.seq, response.payload, response.sent_at)


def response_from_wire(wire: tuple) -> EnvironmentResponse:
    return EnvironmentResponse(_COMMANDS[wire[0]], wire[1], wire[2], wire[3], wire[4])


class EnvFunction(bytes):
    """A cloudpickled ``fn(env, *args, **kwargs)`` to run on an env in its worker (CALL)."""


class RemoteException(NamedTuple):
    """An exception raised in a worker, in a form that always survives pickling."""

    env_index: int
    exc_type: str
    message: str
    traceback: str
    exception: BaseException | None


class StepResult(NamedTuple):
    """One environment's result, gymnasium style."""

    observation: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class StepTimings(NamedTuple):
    """Where the time went, in seconds.

    ``env``: inside the environment's ``step``/``reset`` in the worker; ``queued``: from the
    worker posting the result until the parent took it; ``round_trip``: from sending the
    command until the result was taken.
    """

    env: float = 0.0
    queued: float = 0.0
    round_trip: float = 0.0


class StepInfo(NamedTuple):
    """One finished environment step, as returned by ``SubprocessEnvManager.step``.

    ``previous_result`` is the result the action was chosen from (``None`` right after a reset),
    ``current_result`` the result it led to. ``interrupted`` marks a result that comes from a
    restarted worker: the episode was cut short and ``current_result`` is a fresh reset.
    """

    worker_id: int
    previous_result: StepResult | None
    current_result: StepResult
    action: Any
    timings: StepTimings = StepTimings()
    interrupted: bool = False
