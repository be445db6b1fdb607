"""The exceptions envmanager raises, all under :class:`EnvManagerError`.

Every error about a worker names it (``worker_id``) and, when the failure happened inside the
worker, carries the worker's formatted traceback, so nothing is lost crossing the process line.
"""

from __future__ import annotations

__all__ = [
    "EnvManagerError",
    "WorkerError",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "RestartLimitError",
    "InvalidInputError",
    "ManagerClosedError",
    "SpaceMismatchError",
]


class EnvManagerError(Exception):
    """Base class of every error raised by envmanager."""


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
    ) -> None:
        self.worker_id = worker_id
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.cause = cause
        super().__init__(
            f"worker {worker_id} raised {exc_type}: {message}\n\n"
            f"Traceback in worker {worker_id}:\n{remote_traceback}"
        )

    def __reduce__(self):  # keep the extra fields when pickled
        return (
            type(self),
            (self.worker_id, self.exc_type, self.message, self.remote_traceback, self.cause),
        )


class WorkerDiedError(EnvManagerError):
    """A worker process ended without being asked to (killed, crashed, ``os._exit``)."""

    def __init__(self, worker_id: int, exitcode: int | None, detail: str = "") -> None:
        self.worker_id = worker_id
        self.exitcode = exitcode
        super().__init__(f"worker {worker_id} died ({describe_exitcode(exitcode)}){detail}")

    def __reduce__(self):
        return (type(self), (self.worker_id, self.exitcode))


class RestartLimitError(WorkerDiedError):
    """A worker failed and restarting it would exceed the configured restart limits.

    ``reason`` says which limit; ``failure`` is the error that made the restart necessary.
    """

    def __init__(self, worker_id: int, reason: str, failure: BaseException | None = None) -> None:
        self.worker_id = worker_id
        self.reason = reason
        self.failure = failure
        self.exitcode = getattr(failure, "exitcode", None)
        EnvManagerError.__init__(
            self, f"worker {worker_id} failed and was not restarted: {reason}. The failure: {failure}"
        )

    def __reduce__(self):
        return (type(self), (self.worker_id, self.reason, self.failure))


class WorkerTimeoutError(EnvManagerError, TimeoutError):
    """Workers did not answer before a deadline. ``worker_ids`` lists the late ones.

    ``hung`` tells which deadline: the manager's per-answer ``timeout`` (the worker is
    considered hung, and was killed or restarted), or, when ``False``, the caller's own wait,
    after which the request is still in flight and a later wait may still get its answer.
    """

    def __init__(self, worker_ids: list[int], timeout: float, what: str = "a result", hung: bool = True) -> None:
        self.worker_ids = list(worker_ids)
        self.timeout = timeout
        self.what = what
        self.hung = hung
        super().__init__(f"worker(s) {self.worker_ids} did not deliver {what} within {timeout:g} s")

    def __reduce__(self):
        return (type(self), (self.worker_ids, self.timeout, self.what, self.hung))


class InvalidInputError(EnvManagerError, ValueError):
    """Bad input, rejected before any worker was sent anything."""


class SpaceMismatchError(EnvManagerError, RuntimeError):
    """The envs' spaces disagree where they must agree (a RuntimeError, as in gymnasium)."""


class ManagerClosedError(EnvManagerError, RuntimeError):
    """The manager was used after ``close()``."""


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
