"""The exceptions envmanager raises, all under :class:`EnvManagerError`.

Every error about a worker names it (``worker_id``) and, when the failure happened inside the
worker, carries the worker's formatted traceback, so nothing is lost crossing the process line.
A hang or a death names the env and the call its process was in, when it was in one (``slot``,
``call``: read from the process's record, ``envmanager.wire.marks``), as in
``worker 3 (process 1, slots 2–3) hung in step()``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "EnvManagerError",
    "WorkerError",
    "RemoteAttributeError",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "RestartLimitError",
    "NodeError",
    "NodeRestartLimitError",
    "InvalidInputError",
    "ManagerClosedError",
    "SpaceMismatchError",
]


class EnvManagerError(Exception):
    """Base class of every error raised by envmanager."""


def failed_slots(error: BaseException) -> list[int]:
    """The slots an envmanager error names (every slot of a process given up)."""
    ids = getattr(error, "worker_ids", None)
    if ids:
        return [int(s) for s in ids]
    slot = getattr(error, "worker_id", None)
    return [int(slot)] if isinstance(slot, int) and slot >= 0 else []


def who(worker_id: int, slots: tuple[int, ...] | list[int] | None = None, process: int | None = None) -> str:
    """How an error names a worker: ``worker 4 (process 1, slots 4–7)``; just ``worker 3``
    when the process hosts that one slot (``envs_per_worker=1``)."""
    slots = tuple(slots) if slots else (worker_id,)
    if process is None or (slots == (worker_id,) and process == worker_id):
        return f"worker {worker_id}"
    if len(slots) == 1:
        return f"worker {worker_id} (process {process})"
    contiguous = slots == tuple(range(slots[0], slots[0] + len(slots)))
    listed = f"{slots[0]}–{slots[-1]}" if contiguous else ", ".join(map(str, slots))
    return f"worker {worker_id} (process {process}, slots {listed})"


class WorkerError(EnvManagerError):
    """An environment raised inside a worker.

    ``exc_type`` is the qualified name of the remote exception, ``remote_traceback`` its
    formatted traceback, and ``cause`` the exception object itself when it could be pickled.
    """

    def __init__(
        self,
        worker_id: int,
        exc_type: str,
        message: str,
        remote_traceback: str,
        cause: BaseException | None = None,
        process: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.worker_ids = [worker_id]
        self.process = process
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.cause = cause
        super().__init__(
            f"{who(worker_id, None, process)} raised {exc_type}: {message}\n\n"
            f"Traceback in worker {worker_id}:\n{remote_traceback}"
        )

    def __reduce__(self):  # keep the extra fields when pickled
        return (
            type(self),
            (self.worker_id, self.exc_type, self.message, self.remote_traceback, self.cause, self.process),
        )


class RemoteAttributeError(WorkerError, AttributeError):
    """An env attribute or method that does not exist (raised in the worker).

    Both a :class:`~envmanager.WorkerError` (with the worker's traceback) and an
    ``AttributeError``, so SB3 code that probes attributes keeps working.
    """


class remote_attribute_errors:
    """Re-raise an env's ``AttributeError`` (a :class:`WorkerError` from its worker) as
    :class:`RemoteAttributeError`: what ``get_attr`` / ``env_method`` raise in SB3's and
    gymnasium's vector envs."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, WorkerError) and not isinstance(exc, RemoteAttributeError) and (
            isinstance(exc.cause, AttributeError) or exc.exc_type == "builtins.AttributeError"
        ):
            raise RemoteAttributeError(
                exc.worker_id, exc.exc_type, exc.message, exc.remote_traceback, exc.cause, exc.process
            ) from None


def _in(call: str | None) -> str:
    return "" if call is None else f" in {call}()"


class WorkerDiedError(EnvManagerError):
    """A worker process ended without being asked to (killed, crashed, ``os._exit``).

    ``call`` is the call (``"step"``, ``"reset"``, ``"render"``, ...) the env ``slot`` (then
    also ``worker_id``) was in when its process died; both ``None`` when the process was
    between its envs' calls, or where no record is kept (then ``worker_id`` is its first slot).
    """

    def __init__(
        self, worker_id: int, exitcode: int | None, detail: str = "",
        slots: tuple[int, ...] | list[int] | None = None, process: int | None = None, call: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.worker_ids = list(slots) if slots else [worker_id]
        self.process = process
        self.exitcode = exitcode
        self.detail = detail
        self.call: str | None = call
        self.slot: int | None = None if call is None else worker_id
        super().__init__(f"{who(worker_id, slots, process)} died ({describe_exitcode(exitcode)}){_in(call)}{detail}")

    def __reduce__(self):
        return (type(self), (self.worker_id, self.exitcode, self.detail, self.worker_ids, self.process, self.call))


class RestartLimitError(WorkerDiedError):
    """A worker failed and restarting it would exceed the configured restart limits.

    ``reason`` says which limit; ``failure`` is the error that made the restart necessary;
    ``cause`` and ``remote_traceback`` are the failure's (what the env or the node raised where
    it ran, and that traceback), else ``None``; ``slot`` and ``call`` are the failure's (a
    hang's or a death's), else ``None``. A node past the limits raises one too
    (:class:`NodeRestartLimitError`, with ``node``): one shape for every supervised unit. The
    supervisor builds every one (``envmanager.core.supervisor``).
    """

    def __init__(
        self, worker_id: int, reason: str, failure: BaseException | None = None,
        slots: tuple[int, ...] | list[int] | None = None, process: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.worker_ids = list(slots) if slots else [worker_id]
        self.process = process
        self.reason = reason
        self.failure = failure
        self.cause: BaseException | None = getattr(failure, "cause", None)
        self.remote_traceback: str | None = getattr(failure, "remote_traceback", None)
        self.exitcode = getattr(failure, "exitcode", None)
        self.call = getattr(failure, "call", None)
        self.slot = getattr(failure, "slot", None)
        EnvManagerError.__init__(
            self, f"{who(worker_id, slots, process)} failed and was not restarted: {reason}. The failure: {failure}"
        )

    def __reduce__(self):
        return (type(self), (self.worker_id, self.reason, self.failure, self.worker_ids, self.process))


class NodeError(EnvManagerError):
    """A node of remote work (a Ray sampler node, a Ray node of Unity players) failed and was not
    restarted, could not start, or raised. ``node``: its index; ``worker_ids``: its slots (the
    trainer's worker ids); ``cause``: what it raised there, if it did (naming the slots);
    ``remote_traceback``: that traceback. ``RayNodeError`` and ``RayPlayerError`` are its names
    in ``envmanager.ray`` and ``envmanager.mlagents``."""

    def __init__(self, node: int, worker_ids: Sequence[int], message: str, cause: BaseException | None = None,
                 remote_traceback: str | None = None) -> None:
        self.node, self.worker_ids, self.message = node, list(worker_ids), message
        self.cause, self.remote_traceback = cause, remote_traceback
        EnvManagerError.__init__(self, message + (f"\n\nnode traceback:\n{remote_traceback}" if remote_traceback else ""))

    def __reduce__(self):
        return (type(self), (self.node, self.worker_ids, self.message, self.cause, self.remote_traceback))


class NodeRestartLimitError(NodeError, RestartLimitError):
    """A node failed past the restart limits: the ``RestartLimitError`` a process past them raises
    (``reason``; ``failure``: the node's fault, a :class:`NodeError`; its ``cause`` and
    ``remote_traceback``), as a :class:`NodeError` (``node``, ``worker_ids``).
    ``RayNodeRestartLimitError`` and ``RayPlayerRestartLimitError`` are its names there."""

    def __init__(self, reason: str, failure: NodeError) -> None:
        NodeError.__init__(self, failure.node, failure.worker_ids, f"{failure.message}; not restarted: {reason}",
                           failure.cause, failure.remote_traceback)
        self.reason, self.failure, self.worker_id, self.process = reason, failure, failure.worker_ids[0], None
        self.exitcode = self.call = self.slot = None

    def __reduce__(self):
        return (type(self), (self.reason, self.failure))


class WorkerTimeoutError(EnvManagerError, TimeoutError):
    """Workers did not answer before a deadline. ``worker_ids`` lists the late ones.

    ``hung`` tells which deadline: the manager's per-answer ``timeout`` (the worker is
    considered hung, and was killed or restarted), or, when ``False``, the caller's own wait,
    after which the request is still in flight and a later wait may still get its answer.
    ``call`` is the call (``"step"``, ...) the env ``slot`` (then also ``worker_id``) of a hung
    process was in; both ``None`` when it was between its envs' calls, when several processes
    are late, or where no record is kept. ``hint``: a likely cause, ending the message.
    """

    def __init__(
        self, worker_ids: list[int], timeout: float, what: str = "a result", hung: bool = True,
        processes: list[int] | None = None, slot: int | None = None, call: str | None = None, hint: str = "",
    ) -> None:
        self.worker_ids = list(worker_ids)
        self.processes = sorted(set(processes)) if processes else []
        self.timeout = timeout
        self.what = what
        self.hung = hung
        known = slot is not None and call is not None
        self.slot: int | None = slot if known else None
        self.call: str | None = call if known else None
        self.worker_id = self.slot if self.slot is not None else self.worker_ids[0] if self.worker_ids else -1
        self.hint = hint
        if self.slot is not None:  # one process, and the env it hung in
            process = self.processes[0] if len(self.processes) == 1 else None
            message = (f"{who(self.slot, self.worker_ids, process)} hung in {call}(): "
                       f"did not deliver {what} within {timeout:g} s")
        else:
            where = f" (process{'es' if len(self.processes) > 1 else ''} {', '.join(map(str, self.processes))})" if (
                self.processes and self.processes != self.worker_ids) else ""
            message = f"worker(s) {self.worker_ids}{where} did not deliver {what} within {timeout:g} s"
        super().__init__(f"{message}. {hint}" if hint else message)

    def __reduce__(self):
        return (type(self), (self.worker_ids, self.timeout, self.what, self.hung, self.processes, self.slot, self.call,
                             self.hint))


class InvalidInputError(EnvManagerError, ValueError):
    """Bad input, rejected before any worker was sent anything."""


class SpaceMismatchError(EnvManagerError, RuntimeError):
    """The envs' spaces disagree where they must agree (a RuntimeError, as in gymnasium)."""


class ManagerClosedError(EnvManagerError, RuntimeError):
    """The manager was used after ``close()``."""


class ConcurrentCallError(EnvManagerError, RuntimeError):
    """A thread waited for a manager's workers while another thread was waiting for them.

    A manager, and a drop-in built on it, serves one thread at a time, as gymnasium's
    ``AsyncVectorEnv`` and SB3's ``SubprocVecEnv`` do (they interleave two threads' calls
    unchecked). The second wait is refused before it takes anything: the other thread's call
    goes on unharmed. ``thread``: the name of the thread waiting; ``caller``: the refused one's.
    Calls one after the other from different threads are fine, and ``close()`` from another
    thread ends a wait under way (``ManagerClosedError`` there).
    """

    def __init__(self, thread: str, caller: str) -> None:
        self.thread, self.caller = thread, caller
        super().__init__(
            f"thread {caller!r} waited for the manager's workers while thread {thread!r} waits for them: a manager "
            "serves one thread at a time. Refused before anything was taken; the call in the other thread goes on. "
            "Use the manager from one thread, or hold a lock of your own around every call to it."
        )

    def __reduce__(self):
        return (type(self), (self.thread, self.caller))


def thread_name(ident: int | None) -> str:
    """The name of the thread with ``threading.get_ident()`` ``ident`` (for an error's words)."""
    import threading

    return next((t.name for t in threading.enumerate() if t.ident == ident), f"thread {ident}")


def describe_exitcode(exitcode: int | None) -> str:
    """A readable account of a process exit code, naming the signal if there was one."""
    import signal

    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def with_slot_offset(error: BaseException, offset: int) -> BaseException:
    """``error`` naming its slots ``offset`` higher: how a Ray node, whose sampler numbers its
    slots from 0, names them among all the cluster's slots. Other errors are returned as is."""
    if not offset or not isinstance(error, EnvManagerError):
        return error
    shift = [s + offset for s in getattr(error, "worker_ids", [])]
    if isinstance(error, RestartLimitError):
        out: BaseException = RestartLimitError(error.worker_id + offset, error.reason,
                                               with_slot_offset(error.failure, offset) if error.failure else None,
                                               shift, error.process)
    elif isinstance(error, WorkerDiedError):
        out = WorkerDiedError(error.worker_id + offset, error.exitcode, error.detail, shift, error.process, error.call)
    elif isinstance(error, WorkerError):
        out = WorkerError(error.worker_id + offset, error.exc_type, error.message, error.remote_traceback, error.cause,
                          error.process)
    elif isinstance(error, WorkerTimeoutError):
        slot = None if error.slot is None else error.slot + offset
        out = WorkerTimeoutError(shift, error.timeout, error.what, error.hung, error.processes, slot, error.call,
                                 error.hint)
    else:
        return error
    out.__traceback__ = error.__traceback__
    return out
