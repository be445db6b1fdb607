"""What crosses the process line: commands, responses and the results handed to users.

Both halves import this module: the parent (``manager``) and the worker (``worker``).
Observations, rewards and actions travel in shared memory when their spaces allow it
(see ``transport``); the messages here then carry only small notices and infos.
"""

from __future__ import annotations

import enum
import pickle
import struct
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

    An answer too big for one notice on the shared step queue travels on the worker's own pipe.
    """

    cmd: EnvironmentCommand
    worker_index: int
    seq: int
    payload: Any = None
    sent_at: float = 0.0


# On the wire, a message is a fixed binary header followed by its pickled payload. The header
# always decodes, so a payload that fails to pickle or unpickle becomes an error that names the
# request and the worker, and the header costs a struct, not a pickle.
REQUEST_HEADER = struct.Struct("<Bq")  # cmd, seq
NOTICE_HEADER = struct.Struct("<Biqd?")  # cmd, worker_index, seq, sent_at, payload on own pipe
_COMMANDS = {cmd.value: cmd for cmd in EnvironmentCommand}


def encode_payload(payload: Any) -> bytes:
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def encode_request(cmd: EnvironmentCommand, seq: int, payload: bytes) -> bytes:
    return REQUEST_HEADER.pack(cmd.value, seq) + payload


def decode_request_header(data: bytes) -> tuple[EnvironmentCommand, int]:
    cmd, seq = REQUEST_HEADER.unpack_from(data)
    return _COMMANDS[cmd], seq


def request_payload(data: bytes) -> Any:
    return pickle.loads(memoryview(data)[REQUEST_HEADER.size :])


def encode_notice(cmd: EnvironmentCommand, worker_index: int, seq: int, sent_at: float, on_pipe: bool) -> bytes:
    return NOTICE_HEADER.pack(cmd.value, worker_index, seq, sent_at, on_pipe)


def decode_notice(data: bytes) -> tuple[EnvironmentResponse, bool]:
    """The notice as a response whose payload is still pickled bytes, and whether the payload
    waits on the worker's own pipe instead."""
    cmd, index, seq, sent_at, on_pipe = NOTICE_HEADER.unpack_from(data)
    return EnvironmentResponse(_COMMANDS[cmd], index, seq, memoryview(data)[NOTICE_HEADER.size :], sent_at), on_pipe


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
