"""Every message between the parent and a worker process: one named type per request and
per answer, and how each is encoded.

=========  ==========================================  =====================================
command    request (parent -> worker, own pipe)        answer (worker -> parent, step queue)
=========  ==========================================  =====================================
STEP       :class:`Step` (raw when actions are in      :class:`Stepped` (raw: env times only,
           shared memory: local env indices only)      when nothing else needs to travel)
RESET      :class:`Reset`                              :class:`Stepped`
CALL       :class:`Call`                               :class:`Values`
GET_ATTR   :class:`GetAttr`                            :class:`Values`
SET_ATTR   :class:`SetAttr`                            :class:`Values`
ATTACH     :class:`Attach` (map the shared arrays)     :class:`Values`
REBUILD    :class:`Rebuild` (remake envs that raised)  :class:`Stepped` (their fresh resets)
CLOSE      (no payload)                                CLOSED, once the envs are closed
(startup)  ``WorkerSpec`` at process start             READY with a :class:`Ready`
(failure)  --                                          ENV_FAILED with a :class:`RemoteException`
=========  ==========================================  =====================================

The worker's handler for each request is in ``envmanager.worker.main.HANDLERS``; the parent's
for each answer in ``envmanager.core.pool.WorkerPool`` (transport) and
``envmanager.core.batch`` (what a step or reset answer means for the env slots).

On the wire a message is a fixed binary header, then a payload whose form the header names:
pickled, pickled but sent on the worker's own pipe (too big for one atomic notice), or raw
(no pickle at all: the hot path when observations, rewards and actions are in shared memory
and the envs' infos are empty). The header always decodes, so a payload that fails to pickle
or unpickle becomes an error naming the request and the worker.
"""

from __future__ import annotations

import enum
import pickle
import struct
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "EnvironmentCommand",
    "EnvironmentRequest",
    "EnvironmentResponse",
    "RemoteException",
    "Step",
    "Reset",
    "Call",
    "GetAttr",
    "SetAttr",
    "Attach",
    "Rebuild",
    "Ready",
    "Stepped",
    "StepsAnswer",
    "Values",
    "EnvFunction",
]


class EnvironmentCommand(enum.IntEnum):
    """The commands of the worker protocol (see the table in this module's docstring).

    ``ENV_FAILED`` answers a request that raised as a whole (the worker lives on);
    ``ENV_EXITED`` is its old name.
    """

    STEP = 1
    RESET = 2
    CALL = 3
    GET_ATTR = 4
    SET_ATTR = 5
    ATTACH = 6
    CLOSE = 7
    READY = 8
    ENV_FAILED = 9
    CLOSED = 10
    REBUILD = 11
    ENV_EXITED = 9  # old name of ENV_FAILED


Cmd = EnvironmentCommand
_COMMANDS = {int(cmd): cmd for cmd in EnvironmentCommand}


# ---------------------------------------------------------------------------------------------
# Requests: parent -> worker


class Step(NamedTuple):
    """Step the envs at these local indices; ``actions`` is ``None`` when they wait in
    shared memory (then the request is raw: no pickle)."""

    locals: tuple[int, ...]
    actions: list[Any] | None = None


class Reset(NamedTuple):
    """Reset the envs at ``locals`` with one seed and one options dict each."""

    locals: tuple[int, ...]
    seeds: tuple[Any, ...]
    options: tuple[Any, ...]


class Rebuild(NamedTuple):
    """Remake the envs at ``locals`` (they raised in ``step`` or ``reset``) from the process's
    factory, call ``calls`` on each (``(method, args, kwargs)``: what a restart replays) and
    reset each with one seed and one options dict, as :class:`Reset` does; ``generations``: each
    remade env's generation from now on (the parent's supervisor decided it), as its answers say.
    Sent when restarts are on and the process is otherwise healthy; the parent's half is
    ``envmanager.core.rebuild``, the worker's ``WorkerEnvs.rebuild``. If it raises, the process
    is restarted."""

    locals: tuple[int, ...]
    seeds: tuple[Any, ...]
    options: tuple[Any, ...]
    calls: tuple[tuple[str, tuple, dict], ...] = ()
    generations: tuple[int, ...] = ()


class EnvFunction(bytes):
    """A cloudpickled ``fn(env, *args, **kwargs)`` to run on an env in its worker (CALL)."""


class Call(NamedTuple):
    """Call ``env.<target>(*args, **kwargs)`` (or read it if not callable), or run
    ``target(env, *args, **kwargs)`` when it is an :class:`EnvFunction`."""

    locals: tuple[int, ...]
    target: str | EnvFunction
    args: tuple = ()
    kwargs: dict | None = None


class GetAttr(NamedTuple):
    locals: tuple[int, ...]
    name: str


class SetAttr(NamedTuple):
    locals: tuple[int, ...]
    name: str
    values: tuple[Any, ...]


class Attach(NamedTuple):
    """Map the shared-memory buffers described by ``layout`` (a ``BufferLayout``)."""

    layout: Any


# ---------------------------------------------------------------------------------------------
# Answers: worker -> parent


class Ready(NamedTuple):
    """A worker's first answer: what its envs are (spaces, metadata, ...).

    ``order_enforced``: per env, whether stepping it before a reset raises gymnasium's
    ``ResetNeeded`` in the env itself (an ``OrderEnforcing`` wrapper not reset yet);
    ``generations``: per env, its generation (as the process was told it at its start);
    ``family``: the processes its envs started, ``(pid, start time)`` each (killed with the
    worker even once it has died by itself: ``envmanager.worker.family``).
    """

    env_ids: tuple[int, ...]
    observation_spaces: tuple[Any, ...]
    action_spaces: tuple[Any, ...]
    metadata: dict[str, Any]
    render_mode: str | None
    spec: Any
    order_enforced: tuple[bool, ...] = ()
    generations: tuple[int, ...] = ()
    family: tuple[tuple[int, float], ...] = ()


class Stepped(NamedTuple):
    """The answer to STEP or RESET: one entry per local env of the request, in its order.

    ``env_times``: seconds inside each env. ``infos``: the non-empty info dicts, by slot (so the
    parent files them with one ``dict.update``).
    ``failures``: the envs that raised, by position (the others stepped fine and deliver).
    ``observations``: each env's observation, when observations are not in shared memory;
    ``scalars``: each env's ``(reward, terminated, truncated)`` as it returned them (``None``: a
    reset's zeros), when those are not in shared memory either (``envmanager.wire.returns``);
    ``info_columns``: every env's info as columns, instead of ``infos``, where they fit
    (``envmanager.wire.info_columns``); ``generations``: each env's generation, stamped by the
    worker (how often the env was replaced, as the process was told at its start and on each
    rebuild): the answer is born with it.
    """

    env_times: list[float] | tuple[float, ...]
    infos: dict[int, dict] | None = None
    failures: dict[int, RemoteException] | None = None
    observations: list[Any] | None = None
    scalars: list[tuple[Any, Any, Any] | None] | None = None
    info_columns: Any = None
    generations: tuple[int, ...] | None = None

    @property
    def raw(self) -> bool:
        """Nothing but env times and generations: the answer travels with no pickle."""
        return (not self.infos and not self.failures and self.observations is None and self.scalars is None
                and self.info_columns is None and self.generations is not None)


class StepsAnswer(NamedTuple):
    """A worker's notice for steps the step board asked for (``envmanager.wire.mailbox``) whose
    answer is more than shared memory holds (infos that do not fit its info rows, failures), or
    that first use an info schema: the envs (local indices) and the ordinals they were asked at,
    the rest as a :class:`Stepped` (one entry per env, in that order), and the info ``schemas``
    the board's info rows use from now on (``(id, keys, dtypes)``). Its answer words go up after
    it, negated: the parent files the steps from this."""

    locals: tuple[int, ...]
    ordinals: tuple[int, ...]
    stepped: Stepped
    schemas: tuple[tuple[int, tuple[str, ...], tuple[str, ...]], ...] = ()


class Values(NamedTuple):
    """The answer to CALL, GET_ATTR, SET_ATTR and ATTACH: one value per local env."""

    values: list[Any]


class RemoteException(NamedTuple):
    """An exception raised in a worker, in a form that always survives pickling."""

    env_index: int
    exc_type: str
    message: str
    traceback: str
    exception: BaseException | None


# ---------------------------------------------------------------------------------------------
# Encoding

# Request: cmd, seq, form; then the payload.
REQUEST_HEADER = struct.Struct("<BqB")
# Answer notice on the step queue: cmd, process index, seq, posted at, form; then the payload.
NOTICE_HEADER = struct.Struct("<Biqdb")
PICKLED, ON_PIPE, RAW = 0, 1, 2  # payload forms
_LOCALS = np.dtype("<u2")
_TIMES = np.dtype("<f8")


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def raw_locals(locals_: tuple[int, ...]) -> bytes:
    """The body of a raw STEP request: the local env indices."""
    return np.asarray(locals_, _LOCALS).tobytes()


def encode_raw_step(seq: int, body: bytes) -> bytes:
    """A STEP whose actions are in shared memory (``body`` from ``raw_locals``): no pickle."""
    return REQUEST_HEADER.pack(Cmd.STEP, seq, RAW) + body


def encode_request(cmd: Cmd, seq: int, message: Any = None) -> bytes:
    """A request as bytes; a STEP whose actions are in shared memory goes raw."""
    if cmd is Cmd.STEP and message.actions is None:
        return encode_raw_step(seq, raw_locals(message.locals))
    return REQUEST_HEADER.pack(cmd, seq, PICKLED) + (b"" if message is None else dumps(message))


def decode_request_header(data: bytes) -> tuple[Cmd, int, int]:
    cmd, seq, form = REQUEST_HEADER.unpack_from(data)
    return _COMMANDS[cmd], seq, form


#: Raw STEP requests by body: a worker sees the same few (its lanes) over and over.
_RAW_STEPS: dict[bytes, Step] = {}


def decode_request(cmd: Cmd, form: int, data: bytes) -> Any:
    if form == RAW:
        body = data[REQUEST_HEADER.size :]
        step = _RAW_STEPS.get(body)
        if step is None:
            if len(_RAW_STEPS) >= 64:
                _RAW_STEPS.clear()
            step = _RAW_STEPS[body] = Step(tuple(np.frombuffer(body, _LOCALS).tolist()))
        return step
    view = memoryview(data)[REQUEST_HEADER.size :]
    return pickle.loads(view) if len(view) else None


def _raw_struct(n: int) -> struct.Struct:
    """A raw answer's payload for ``n`` envs: each one's env time (float64), then its generation (int32)."""
    packer = _RAW_STRUCTS.get(n)
    if packer is None:
        packer = _RAW_STRUCTS[n] = struct.Struct(f"<{n}d{n}i")
    return packer


def encode_answer(cmd: Cmd, index: int, seq: int, posted_at: float, message: Any) -> tuple[bytes, bytes]:
    """``(header, payload)`` for an answer; a :class:`Stepped` with nothing but env times and
    generations is raw, any other pickled as a plain tuple (a NamedTuple pickles ~1.5 µs slower,
    by its class)."""
    if type(message) is Stepped:
        if (not message[1] and not message[2] and message[3] is None and message[4] is None and message[5] is None
                and message[6] is not None):  # raw
            times = message[0]
            return NOTICE_HEADER.pack(cmd, index, seq, posted_at, RAW), _raw_struct(len(times)).pack(*times, *message[6])
        message = tuple(message)
    return NOTICE_HEADER.pack(cmd, index, seq, posted_at, PICKLED), dumps(message)


#: The sequence number of a notice answering board steps (requests start at 1; READY is 0 too).
BOARD_SEQ = 0


def encode_steps_answer(index: int, posted_at: float, answer: StepsAnswer) -> tuple[bytes, bytes]:
    """``(header, payload)`` of a :class:`StepsAnswer` notice: a STEP with :data:`BOARD_SEQ`,
    its payload the envs and ordinals, then the rest pickled apart (see ``open_steps_answer``)."""
    locals_, ordinals, stepped, schemas = answer
    return (NOTICE_HEADER.pack(Cmd.STEP, index, BOARD_SEQ, posted_at, PICKLED),
            dumps((locals_, ordinals, dumps((tuple(stepped), schemas)))))


def open_steps_answer(payload: memoryview | bytes) -> tuple[tuple[int, ...], tuple[int, ...], bytes]:
    """A :class:`StepsAnswer` notice's envs and ordinals, and its rest still pickled: the parent
    takes the steps even where the rest cannot be unpickled here (an info of a class it cannot
    import), failing them then."""
    return pickle.loads(payload)


def decode_steps_rest(rest: bytes) -> tuple[Stepped, tuple[tuple[int, tuple[str, ...], tuple[str, ...]], ...]]:
    """A :class:`StepsAnswer`'s results and info schemas; raises whatever unpickling raises."""
    stepped, schemas = pickle.loads(rest)
    return _new(Stepped, stepped), schemas


class EnvironmentResponse(NamedTuple):
    """An answer as taken off the step queue; ``payload`` is still encoded (see ``decode_answer``)."""

    cmd: Cmd
    process: int
    seq: int
    posted_at: float
    form: int
    payload: memoryview | bytes


_NOTICE_UNPACK = NOTICE_HEADER.unpack_from
_NOTICE_SIZE = NOTICE_HEADER.size
_new = tuple.__new__
_RAW_STRUCTS: dict[int, struct.Struct] = {}
_RAW_ANSWERS: dict[int, tuple[Any, int]] = {}  # by payload size: its unpack, the number of envs


def _decode_raw(payload: memoryview | bytes) -> Stepped:
    """A raw answer: its envs' times and generations (``_raw_struct``)."""
    size = len(payload)
    known = _RAW_ANSWERS.get(size)
    if known is None:
        known = _RAW_ANSWERS[size] = (_raw_struct(size // 12).unpack, size // 12)
    values = known[0](payload)
    n = known[1]  # (a NamedTuple made with tuple.__new__: half the cost of its constructor)
    return _new(Stepped, (values[:n], None, None, None, None, None, values[n:]))


def decode_notice(data: bytes, offset: int = 0, end: int | None = None) -> EnvironmentResponse:
    """The notice in ``data[offset:end]``."""
    cmd, index, seq, posted_at, form = _NOTICE_UNPACK(data, offset)
    return _new(EnvironmentResponse, (_COMMANDS[cmd], index, seq, posted_at, form, data[offset + _NOTICE_SIZE : end]))


def decode_answer(form: int, payload: memoryview | bytes) -> Any:
    """The answer object; raises whatever unpickling raises."""
    if form == RAW:
        return _decode_raw(payload)
    answer = pickle.loads(payload)
    return _new(Stepped, answer) if type(answer) is tuple else answer  # only a Stepped is a bare tuple


def on_pipe_notice(header: bytes) -> bytes:
    """The same notice header, saying that the payload follows on the worker's own pipe."""
    cmd, index, seq, posted_at, _ = NOTICE_HEADER.unpack(header)
    return NOTICE_HEADER.pack(cmd, index, seq, posted_at, ON_PIPE)


def lanes_of(envs_per_process: list[int], double_buffer: bool) -> list[int]:
    """Each slot's lane as a bit mask: 1; double buffered, 1 for the first half of its
    process's envs and 2 for the second."""
    return [1 << (local * 2 // k) if double_buffer else 1 for k in envs_per_process for local in range(k)]


class EnvironmentRequest(NamedTuple):
    """A request in flight to one worker process: what was sent, to answer or replay it.

    ``slots`` are the env slots (public ``worker_id``s) it concerns; ``data`` the encoded
    request, kept so a restart can send it again.
    """

    cmd: Cmd
    seq: int
    slots: tuple[int, ...] = ()
    data: bytes = b""
    message: Any = None
